"""Throughput of raygpt's training step against a plain PyTorch baseline, side by side on one GPU.

    python bench/throughput.py [--depth 12] [--batch 64] [--seq 1024] [--steps 30] [--ray]
                               [--variants ref,fused,fused+cudnn] [--split-only]

Both sides train the same GPT-2 (raygpt.model.GPT, same init, same data) in one process:
- baseline: fp32 weights, torch.compile, autocast bf16, SDPA attention, the textbook loss
  (loss_impl="reference": full logits, fp32 cross-entropy), torch.optim.AdamW(fused=True),
  torch.nn.utils.clip_grad_norm_ (what llm.c's train_gpt2.py does). It is pinned: raygpt's
  model options never change it, so the ratio measures them;
- raygpt: the real training loop (`raygpt.loop.train` under a LocalSession): bf16 working
  weights over fp32 master weights, raygpt's global-norm and AdamW kernels, data loading and
  logging included; and, with --ray, the same run under Ray Train's TorchTrainer with 1 worker
  (the module defaults of raygpt.model, whatever the variants).
Per side: tokens/s and ms/step (median over the steps after warm-up, no syncs between phases),
the first step's time (compilation included), then a separate pass with syncs that splits a
step into forward+backward, norm, optimizer; MFU from raygpt.metrics for the device; peak
memory. Numbers, not a test.

--variants runs the raygpt side once per variant, one row each. A variant is tokens joined by
"+" (see VARIANT_TOKENS): `ref` / `fused` / `fused@ROWS` pick the loss, `cudnn` prefers cuDNN
attention, `autotune` / `coord` turn on Inductor's GEMM autotuning (what
mode="max-autotune-no-cudagraphs" does) / coordinate-descent tuning of its own kernels;
`default` is raygpt.model's module defaults. The loop builds its own model, so a variant sets
raygpt.model's module defaults (and Inductor's config) for its run and restores them after.
--split-only skips the loop (one compile per variant instead of two): forward+backward, norm
and optimizer times only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import raygpt.model
from raygpt.config import TrainConfig
from raygpt.data import DistributedDataLoader
from raygpt.metrics import estimate_mfu
from raygpt.model import GPT, GPTConfig, num_parameters
from raygpt.optim import AdamW, FlatParameters, random_u32


def cuda_time(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


VARIANT_TOKENS = {
    "default": "raygpt.model's module defaults",
    "ref": 'loss_impl="reference" (full logits, fp32 cross-entropy)',
    "fused": 'loss_impl="fused" (chunked, gradients in forward); fused@ROWS sets ce_chunk_rows',
    "cudnn": 'sdpa_backend="cudnn" (cuDNN attention first)',
    "autotune": "Inductor max_autotune (GEMM templates autotuned against cuBLAS)",
    "coord": "Inductor coordinate_descent_tuning (its reduction / pointwise kernels)",
}


def parse_variant(spec: str) -> tuple[dict, dict]:
    """'fused@8192+cudnn' -> (raygpt.model module defaults, Inductor config) for that run."""
    model, inductor = {}, {}
    for token in spec.split("+"):
        name, _, arg = token.partition("@")
        if name not in VARIANT_TOKENS or (arg and name != "fused"):
            raise SystemExit(f"--variants: unknown token {token!r} in {spec!r}; expected "
                             f"{', '.join(VARIANT_TOKENS)} (fused@ROWS), joined by '+'")
        if name == "ref":
            model["DEFAULT_LOSS_IMPL"] = "reference"
        elif name == "fused":
            model["DEFAULT_LOSS_IMPL"] = "fused"
            if arg:
                model["DEFAULT_CE_CHUNK_ROWS"] = int(arg)
        elif name == "cudnn":
            model["DEFAULT_SDPA_BACKEND"] = "cudnn"
        elif name == "autotune":
            inductor.update(max_autotune=True, max_autotune_gemm=True)
        elif name == "coord":
            inductor["coordinate_descent_tuning"] = True
    return model, inductor


@contextlib.contextmanager
def variant_settings(spec: str):
    """raygpt.model's module defaults and Inductor's config as the variant says, restored after;
    Dynamo's caches are reset so each variant compiles afresh (and never hits the recompile
    limit, past which Dynamo silently runs eager)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    model, inductor = parse_variant(spec)
    saved = {k: getattr(raygpt.model, k) for k in model}
    torch._dynamo.reset()
    try:
        for k, v in model.items():
            setattr(raygpt.model, k, v)
        with inductor_config.patch(inductor):
            yield
    finally:
        for k, v in saved.items():
            setattr(raygpt.model, k, v)
        torch._dynamo.reset()


def describe(model: GPT) -> str:
    return (f"loss={model.loss_impl}" + (f"@{model.ce_chunk_rows}" if model.loss_impl == "fused" else "")
            + f" attn={model.transformer.h[0].attn.sdpa_backend}")


def baseline(args, loader):
    torch.manual_seed(0)
    # pinned to the textbook loss and PyTorch's attention choice, whatever raygpt's defaults
    model = GPT(GPTConfig.from_depth(args.depth), init_seed=1337, loss_impl="reference",
                sdpa_backend="default").cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=True)
    fwd = torch.compile(model)
    tokens = args.batch * args.seq
    losses, times, split = [], [], {"fwd_bwd": [], "norm": [], "opt": []}

    def fwd_bwd():
        x, y = loader.next_batch()
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_sum, _ = fwd(x, y)
        (loss_sum / tokens).backward()
        return loss_sum

    for step in range(args.steps):
        t0 = time.perf_counter()
        loss_sum = fwd_bwd()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((loss_sum / tokens).item())  # the one host sync per step
        norm.item()
        times.append(time.perf_counter() - t0)
    for _ in range(5):
        split["fwd_bwd"].append(cuda_time(fwd_bwd))
        split["norm"].append(cuda_time(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        split["opt"].append(cuda_time(lambda: (opt.step(), opt.zero_grad(set_to_none=True))))
    return losses, times, split, model


def raygpt_loop(args, cfg_overrides=None):
    """The real loop: returns per-step (loss, dt) from its loss history."""
    from raygpt.loop import train
    from raygpt.session import LocalSession
    from raygpt.storage import open_run_dir

    run_dir = tempfile.mkdtemp(prefix="raygpt-bench-")
    cfg = TrainConfig(model=f"d{args.depth}", batch_size=args.batch, seq_len=args.seq,
                      max_steps=args.steps, val_every=0, sample_every=0, checkpoint_every=0,
                      output_dir=run_dir, device="gpu", num_workers=1, shuffle=False,
                      warmup_steps=0, learning_rate=3e-4, final_lr_frac=1.0, scheduler="constant",
                      compile=True, **(cfg_overrides or {})).resolve(1)
    summary = train(cfg, LocalSession(open_run_dir(run_dir), torch.device("cuda")))
    recs = [json.loads(l) for l in Path(run_dir, "loss_history.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["kind"] == "train"]
    return [r["loss"] for r in train_recs], [r["dt"] for r in train_recs], summary, run_dir


def raygpt_split(args, loader):
    model = GPT(GPTConfig.from_depth(args.depth), init_seed=1337).cuda()  # the variant's defaults
    flat = FlatParameters(model, torch.device("cuda"), torch.bfloat16)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    fwd = torch.compile(model)
    tokens = args.batch * args.seq
    rng = 13371337

    def fwd_bwd():
        flat.zero_grad()
        x, y = loader.next_batch()
        loss_sum, _ = fwd(x.cuda(non_blocking=True), y.cuda(non_blocking=True))
        (loss_sum / tokens).backward()

    def step():
        nonlocal rng
        seed, rng = random_u32(rng)
        opt.step(lr=3e-4, grad_scale=1.0, t=1, seed=seed)

    split = {"fwd_bwd": [], "norm": [], "opt": []}
    t0 = time.perf_counter()
    for _ in range(8):
        split["fwd_bwd"].append(cuda_time(fwd_bwd))
        split["norm"].append(cuda_time(lambda: opt.grad_norm_squared().sqrt()))
        split["opt"].append(cuda_time(step))
        if len(split["fwd_bwd"]) == 1:
            first = time.perf_counter() - t0  # compilation included
    return {k: v[3:] for k, v in split.items()}, first, describe(model)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--ray", action="store_true", help="also run the loop under TorchTrainer")
    p.add_argument("--variants", default="default",
                   help="comma-separated raygpt variants, one row each; tokens joined by '+': "
                        + "; ".join(f"{k}: {v}" for k, v in VARIANT_TOKENS.items()))
    p.add_argument("--split-only", action="store_true",
                   help="raygpt variants: only the forward+backward / norm / optimizer split")
    args = p.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        parse_variant(v)  # fail on a typo before minutes of compiling
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = TrainConfig()
    dev = torch.cuda.get_device_name()
    n_params = num_parameters(GPT(GPTConfig.from_depth(args.depth), init_seed=None))
    L, C = GPTConfig.from_depth(args.depth).n_layer, GPTConfig.from_depth(args.depth).n_embd
    tokens = args.batch * args.seq
    rows = []

    def row(name, times, split, peak, losses, first_s=float("nan")):
        dt = statistics.median(times[args.warmup:]) if times else float("nan")
        s = {k: statistics.median(v) * 1000 for k, v in split.items()} if split else {}
        if args.split_only and s:  # like for like: every row's step is the sum of its parts
            dt = sum(s.values()) / 1000
        mfu = estimate_mfu(n_params, L, C, args.seq, tokens, dt, dev, "bf16")
        first = times[0] if times else first_s
        rows.append((name, tokens / dt, dt * 1000, s, mfu, peak, losses, first))

    loader = DistributedDataLoader(cfg.input_bin, args.batch, args.seq, 0, 1)
    torch.cuda.reset_peak_memory_stats()
    b_losses, b_times, b_split, _ = baseline(args, loader)
    row("pytorch baseline", b_times, b_split, torch.cuda.max_memory_allocated() / 2**30, b_losses)
    for spec in variants:
        with variant_settings(spec):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            r_losses, r_times = [], []
            if not args.split_only:
                r_losses, r_times, _, _ = raygpt_loop(args)
            loader.reset()
            split, first_s, what = raygpt_split(args, loader)
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"variant {spec}: {what}", flush=True)
            row(f"raygpt {spec}", r_times, split, peak, r_losses, first_s)
    if args.ray:
        import ray
        from raygpt.trainer import run
        run_dir = tempfile.mkdtemp(prefix="raygpt-bench-ray-") + "/run"
        ray.init(num_gpus=1, include_dashboard=False)
        c = TrainConfig(model=f"d{args.depth}", batch_size=args.batch, seq_len=args.seq,
                        max_steps=args.steps, val_every=0, sample_every=0, checkpoint_every=0,
                        output_dir=run_dir, device="gpu", num_workers=1, shuffle=False,
                        warmup_steps=0, scheduler="constant", learning_rate=3e-4,
                        final_lr_frac=1.0).resolve(1)
        run(c)
        recs = [json.loads(l) for l in Path(run_dir, "loss_history.jsonl").read_text().splitlines()]
        t = [r["dt"] for r in recs if r["kind"] == "train"]
        row("raygpt under TorchTrainer", t, None, float("nan"), [r["loss"] for r in recs if r["kind"] == "train"])

    print(f"\n{dev} | GPT-2 d{args.depth} ({n_params / 1e6:.1f}M) | B={args.batch} T={args.seq} | "
          f"{tokens} tokens/step | median of steps {args.warmup}..{args.steps - 1}"
          + (" | --split-only: ms/step = fwd+bwd + norm + opt" if args.split_only else ""))
    print(f"{'':28s} {'tok/s':>10s} {'ms/step':>8s} {'fwd+bwd':>8s} {'norm':>7s} {'opt':>7s} "
          f"{'MFU':>6s} {'peak GiB':>8s} {'1st step s':>10s}")
    for name, tps, ms, s, mfu, peak, _, first in rows:
        print(f"{name:28s} {tps:10.0f} {ms:8.1f} {s.get('fwd_bwd', float('nan')):8.1f} "
              f"{s.get('norm', float('nan')):7.2f} {s.get('opt', float('nan')):7.2f} "
              f"{100 * mfu if mfu else float('nan'):5.1f}% {peak:8.2f} {first:10.1f}")
    base = rows[0][1]
    for name, tps, *_ in rows[1:]:
        print(f"ratio {name} / baseline: {tps / base:.3f}")
    # same data, same init: the first losses agree within bf16 noise
    for name, *_, losses, _ in rows:
        if losses:
            print(f"{name:28s} first losses {[round(l, 4) for l in losses[:5]]} | mean of the "
                  f"last 10 {statistics.mean(losses[-10:]):.4f}")


if __name__ == "__main__":
    main()
