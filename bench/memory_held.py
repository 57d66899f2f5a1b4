"""What a compiled forward pass holds for backward, raygpt's GPT against llm.c's.

    python3 bench/memory_held.py --depths 12        # on a GPU, B=8 T=1024
    python3 bench/memory_held.py --cpu --depths 2   # a dry run: builds and steps, measures nothing

Three models, each compiled and stepped three times (the last one measured): raygpt's GPT in
bf16 with raygpt's deterministic attention and embedding kernels (`raygpt-det`, the GPU
default) and with PyTorch's flash SDPA (`raygpt-fl`), and llm.c's GPT from its own
train_gpt2.py (fp32 weights, bf16 autocast, flash). No optimizer: the rows compare activations
and the loss's memory, not optimizer state. Printed per model and depth: memory allocated after
the forward pass over the memory before it (what backward will read, the loss's gradients
included for raygpt's fused loss), the forward's peak over that base, the step's peak, and the
held bytes a layer per B*T*C. llm.c's file comes from --anchors (bench/anchor.py's folder).
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

import anchor
from raygpt.model.gpt import GPT, GPTConfig

MiB = 1 << 20


def load_llmc(anchors, flash: bool):
    """llm.c's train_gpt2.py as a module (its main() is behind __name__)."""
    path = anchor.runner_path(anchors).parent / "llmc_train_gpt2.py"
    spec = importlib.util.spec_from_file_location("llmc_train_gpt2", path)
    llmc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llmc)
    llmc.FLASH = int(flash)
    return llmc


def measure(build, step, dev: str, B: int, T: int) -> tuple[int, int, int, int]:
    """(held after forward, forward peak over base, step peak, base) in bytes; zeros on a CPU."""
    torch._dynamo.reset()
    model = build()
    compiled = torch.compile(model) if dev == "cuda" else model
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 50257, (B, T), generator=g).to(dev)
    tgt = torch.randint(0, 50257, (B, T), generator=g).to(dev)
    cuda = dev == "cuda"
    for _ in range(3):  # the first compiles; the last is measured
        for p in model.parameters():
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        loss = step(compiled, idx, tgt)
        if cuda:
            torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base if cuda else 0
        forward_peak = torch.cuda.max_memory_allocated() - base if cuda else 0
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        step_peak = torch.cuda.max_memory_allocated() if cuda else 0
    if cuda:
        del model, compiled, loss
        torch.cuda.empty_cache()
    return held, forward_peak, step_peak, base


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depths", default="12")
    p.add_argument("--batch", type=int, default=None, help="default 8 on a GPU, 2 on a CPU")
    p.add_argument("--seq", type=int, default=None, help="default 1024 on a GPU, 64 on a CPU")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--anchors", default=None)
    args = p.parse_args()
    dev = "cpu" if args.cpu else "cuda"
    B = args.batch or (2 if args.cpu else 8)
    T = args.seq or (64 if args.cpu else 1024)
    llmc = load_llmc(args.anchors, flash=not args.cpu)
    dtype = torch.float32 if args.cpu else torch.bfloat16

    def raygpt(d, sdpa, embedding):
        return lambda: GPT(GPTConfig.from_depth(d), init_seed=1, sdpa_backend=sdpa,
                           embedding_impl=embedding).to(dev, dtype)

    def raygpt_step(m, idx, tgt):
        loss_sum, _ = m(idx, tgt)
        return loss_sum / tgt.numel()

    def llmc_model(d):
        c = GPTConfig.from_depth(d)
        return lambda: llmc.GPT(llmc.GPTConfig(block_size=1024, vocab_size=50257, n_layer=d,
                                               n_head=c.n_head, n_embd=c.n_embd)).to(dev)

    def llmc_step(m, idx, tgt):
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=not args.cpu):
            _, loss = m(idx, tgt, return_logits=False)
        return loss

    det = ("default", "torch") if args.cpu else ("raygpt", "raygpt")  # Triton kernels: GPU only
    flash = ("default" if args.cpu else "flash", "torch")
    print(f"B={B} T={T} on {dev}; MiB, and held bytes a layer per B*T*C", flush=True)
    for d in (int(x) for x in args.depths.split(",")):
        btc = B * T * GPTConfig.from_depth(d).n_embd
        for name, build, step in (("raygpt-det", raygpt(d, *det), raygpt_step),
                                  ("raygpt-fl", raygpt(d, *flash), raygpt_step),
                                  ("llm.c", llmc_model(d), llmc_step)):
            held, fpeak, peak, base = measure(build, step, dev, B, T)
            print(f"{name:10s} d{d:<3d} held after fwd {held / MiB:9.1f} | fwd peak over base "
                  f"{fpeak / MiB:9.1f} | step peak {peak / MiB:9.1f} | base {base / MiB:9.1f} | "
                  f"held a layer per BTC {held / d / btc:6.2f}", flush=True)


if __name__ == "__main__":
    main()
