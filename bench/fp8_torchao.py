"""FP8 block matmuls (torchao's float8 training) against raygpt's bf16 step, side by side on one
GPU: is FP8 worth an opt-in precision at GPT-2 d24 and up?

Each variant trains the same GPT-2 (raygpt.model.gpt.GPT, same init, same batches in the same order)
with raygpt's bf16 working weights over fp32 masters, raygpt's AdamW and torch.compile over the
whole model; `fp8-tensorwise` and `fp8-rowwise` first swap the 4 linears of every block for
torchao's Float8Linear (dynamic scaling, the recipe's casts compiled by Inductor); the
classifier stays bf16, as in every FP8 recipe. Per variant: median tok/s after --warmup steps,
peak GPU memory, and the mean loss over the last half of the steps, minus bf16's. torchao is not
a raygpt dependency: install it beside torch on the GPU machine.

    python bench/fp8_torchao.py --depth 24 --batch 32 --steps 200 [--variants bf16,fp8-tensorwise]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from raygpt.config import TrainConfig
from raygpt.data.loader import DistributedDataLoader
from raygpt.model.gpt import GPT, GPTConfig
from raygpt.train.optim import AdamW, FlatParameters, random_u32

BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def to_float8(model: GPT, recipe: str) -> None:
    """The blocks' linears as torchao Float8Linear (same Parameters: FlatParameters, built
    after, aliases them as usual)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(
        model.transformer.h, config=config,
        module_filter_fn=lambda mod, fqn: any(fqn.endswith(n) for n in BLOCK_LINEARS))


def run(variant: str, args) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_depth(args.depth), init_seed=1337)
    recipe = variant.split("#")[0]  # bf16#2: the same variant again, the run-to-run noise
    if recipe != "bf16":
        to_float8(model, recipe.removeprefix("fp8-"))
    device = torch.device(args.device)
    model = model.to(device)
    flat = FlatParameters(model, device, torch.bfloat16)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    forward = torch.compile(model, dynamic=False)
    loader = DistributedDataLoader(TrainConfig().input_bin, args.batch, args.seq, 0, 1)
    tokens, rng = args.batch * args.seq, 1337
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        t0 = time.perf_counter()
        flat.zero_grad()
        x, y = loader.next_batch(device)
        loss_sum, _ = forward(x, y)
        (loss_sum / tokens).backward()
        norm = opt.grad_norm_squared().sqrt()
        seed, rng = random_u32(rng)
        scale = torch.clamp(1.0 / norm, max=1.0).item()  # clip at 1.0; the step's one sync
        opt.step(lr=3e-4, grad_scale=scale, t=step + 1, seed=seed)
        losses.append((loss_sum / tokens).item())
        times.append(time.perf_counter() - t0)
    loader.close()
    half = losses[len(losses) // 2:]
    return {"tok_s": tokens / statistics.median(times[args.warmup:]),
            "peak_gib": (torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda"
                         else float("nan")),
            "first_s": times[0], "late_loss": statistics.mean(half), "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--variants", default="bf16,fp8-tensorwise,fp8-rowwise,bf16#2")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the bf16 variant")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = {}
    for v in args.variants.split(","):
        rows[v] = run(v, args)
        print(f"{v}: {rows[v]['tok_s']:.0f} tok/s, first step {rows[v]['first_s']:.1f} s, "
              f"peak {rows[v]['peak_gib']:.2f} GiB, loss over the last half "
              f"{rows[v]['late_loss']:.4f}", flush=True)
        torch._dynamo.reset()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    base = rows.get("bf16")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{name} | GPT-2 d{args.depth} | B={args.batch} T={args.seq} | "
          f"{args.steps} steps, median after {args.warmup}")
    print(f"{'variant':18s} {'tok/s':>9s} {'vs bf16':>8s} {'peak GiB':>9s} "
          f"{'loss, last half':>16s} {'minus bf16':>11s}")
    for v, r in rows.items():
        rel = f"{r['tok_s'] / base['tok_s']:.3f}" if base else "n/a"
        dl = f"{r['late_loss'] - base['late_loss']:+.4f}" if base else "n/a"
        print(f"{v:18s} {r['tok_s']:9.0f} {rel:>8s} {r['peak_gib']:9.2f} {r['late_loss']:16.4f} "
              f"{dl:>11s}")


if __name__ == "__main__":
    main()
