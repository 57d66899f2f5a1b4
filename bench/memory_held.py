"""python3 bench/memory_held.py cuda 12   (needs llm.c's file in .anchors/; `cpu 2,4` is a dry run)

Memory held after a compiled forward pass (what backward will read) and the step's peak:
raygpt's GPT (bf16 weights; det = raygpt's attention + embedding kernels, flash = PyTorch's
SDPA) against llm.c's GPT (fp32 weights, bf16 autocast, flash), at two depths so the slope
gives bytes a layer."""
import importlib.util
import os
import sys
import torch
from raygpt.model import GPT, GPTConfig

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
B, T = (8, 1024) if dev == "cuda" else (2, 64)
depths = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "6,12").split(",")]
comp = dev == "cuda"
spec = importlib.util.spec_from_file_location("llmc", os.path.join(".anchors", "llmc_train_gpt2.py"))
llmc = importlib.util.module_from_spec(spec); spec.loader.exec_module(llmc)
llmc.FLASH = int(comp)
MiB = 1 << 20

def measure(name, d, build, step):
    torch._dynamo.reset()
    if dev == "cuda":
        torch.cuda.empty_cache()
    model = build(d)
    m = torch.compile(model) if comp else model
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 50257, (B, T), generator=g).to(dev)
    tgt = torch.randint(0, 50257, (B, T), generator=g).to(dev)
    out = []
    for it in range(3):
        for p in model.parameters():
            p.grad = None
        if dev == "cuda":
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        loss = step(m, idx, tgt)
        if dev == "cuda":
            torch.cuda.synchronize(); held = torch.cuda.memory_allocated() - base
            fpeak = torch.cuda.max_memory_allocated() - base
        else:
            held = fpeak = 0
        loss.backward()
        if dev == "cuda":
            torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated()
        else:
            peak = 0
        out = (held, fpeak, peak, base if dev == "cuda" else 0)
    del model, m, loss
    print(f"{name:10s} d{d:<3d} held after fwd {out[0]/MiB:9.1f} MiB | fwd peak over base {out[1]/MiB:9.1f} | step peak {out[2]/MiB:9.1f} | base {out[3]/MiB:9.1f}", flush=True)
    return out

def raygpt_build(kernels):
    def build(d):
        m = GPT(GPTConfig.from_depth(d), init_seed=1, sdpa_backend=kernels[0], embedding_impl=kernels[1])
        return m.to(dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    return build

def raygpt_step(m, idx, tgt):
    loss, _ = m(idx, tgt)
    return loss / tgt.numel()

def llmc_build(d):
    c = GPTConfig.from_depth(d); C, nh = c.n_embd, c.n_head
    return llmc.GPT(llmc.GPTConfig(block_size=1024, vocab_size=50257, n_layer=d, n_head=nh, n_embd=C)).to(dev)

def llmc_step(m, idx, tgt):
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=dev == "cuda"):
        _, loss = m(idx, tgt, return_logits=False)
    return loss

rows = {}
impls = [("raygpt-det", raygpt_build(("raygpt", "raygpt")) if dev == "cuda" else raygpt_build(("default", "torch")), raygpt_step),
         ("raygpt-fl", raygpt_build(("flash" if dev == "cuda" else "default", "torch")), raygpt_step),
         ("llm.c", llmc_build, llmc_step)]
for name, build, step in impls:
    for d in depths:
        rows[name, d] = measure(name, d, build, step)
BTC = lambda d: B * T * GPTConfig.from_depth(d).n_embd
print(f"\nB={B} T={T}; held after forward, per layer (slope between d{depths[0]} and d{depths[-1]}), in bytes per B*T*C:")
for name, *_ in impls:
    a, b = rows[name, depths[0]], rows[name, depths[-1]]
    # per layer: held(d2) - held(d1) over layers, per BTC (C differs by depth: use each depth's C)
    pa, pb = a[0] / depths[0] / BTC(depths[0]), b[0] / depths[-1] / BTC(depths[-1])
    print(f"{name:10s} held/layer/BTC d{depths[0]} {pa:5.2f} d{depths[-1]} {pb:5.2f} | step peak d{depths[-1]} {b[2]/MiB:9.1f} MiB")
