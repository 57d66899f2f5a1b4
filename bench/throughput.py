"""Throughput of raygpt's training step against a plain PyTorch baseline, side by side on one GPU.

    python bench/throughput.py [--depth 12] [--batch 64] [--seq 1024] [--steps 30] [--ray]

Both sides train the same GPT-2 (raygpt.model.GPT, same init, same data) in one process:
- baseline: fp32 weights, torch.compile, autocast bf16, SDPA attention,
  torch.optim.AdamW(fused=True), torch.nn.utils.clip_grad_norm_ (what llm.c's train_gpt2.py does);
- raygpt: the real training loop (`raygpt.loop.train` under a LocalSession): bf16 working
  weights over fp32 master weights, raygpt's global-norm and AdamW kernels, data loading and
  logging included; and, with --ray, the same run under Ray Train's TorchTrainer with 1 worker.
Per side: tokens/s and ms/step (median over the steps after warm-up, no syncs between phases),
then a separate pass with syncs that splits a step into forward+backward, norm, optimizer,
other; MFU from raygpt.metrics for the device; peak memory. Numbers, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

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


def baseline(args, loader):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_depth(args.depth), init_seed=1337).cuda()
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
    model = GPT(GPTConfig.from_depth(args.depth), init_seed=1337).cuda()
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
    for _ in range(8):
        split["fwd_bwd"].append(cuda_time(fwd_bwd))
        split["norm"].append(cuda_time(lambda: opt.grad_norm_squared().sqrt()))
        split["opt"].append(cuda_time(step))
    return {k: v[3:] for k, v in split.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--ray", action="store_true", help="also run the loop under TorchTrainer")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = TrainConfig()
    dev = torch.cuda.get_device_name()
    n_params = num_parameters(GPT(GPTConfig.from_depth(args.depth), init_seed=None))
    L, C = GPTConfig.from_depth(args.depth).n_layer, GPTConfig.from_depth(args.depth).n_embd
    tokens = args.batch * args.seq
    rows = []

    def row(name, times, split, peak, losses):
        dt = statistics.median(times[args.warmup:])
        mfu = estimate_mfu(n_params, L, C, args.seq, tokens, dt, dev, "bf16")
        s = {k: statistics.median(v) * 1000 for k, v in split.items()} if split else {}
        rows.append((name, tokens / dt, dt * 1000, s, mfu, peak, losses))

    loader = DistributedDataLoader(cfg.input_bin, args.batch, args.seq, 0, 1)
    torch.cuda.reset_peak_memory_stats()
    b_losses, b_times, b_split, _ = baseline(args, loader)
    row("pytorch baseline", b_times, b_split, torch.cuda.max_memory_allocated() / 2**30, b_losses)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    r_losses, r_times, _, _ = raygpt_loop(args)
    peak = torch.cuda.max_memory_allocated() / 2**30
    loader.reset()
    row("raygpt loop", r_times, raygpt_split(args, loader), peak, r_losses)
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
          f"{tokens} tokens/step | median of steps {args.warmup}..{args.steps - 1}")
    print(f"{'':28s} {'tok/s':>10s} {'ms/step':>8s} {'fwd+bwd':>8s} {'norm':>7s} {'opt':>7s} "
          f"{'MFU':>6s} {'peak GiB':>8s}")
    for name, tps, ms, s, mfu, peak, _ in rows:
        print(f"{name:28s} {tps:10.0f} {ms:8.1f} {s.get('fwd_bwd', float('nan')):8.1f} "
              f"{s.get('norm', float('nan')):7.2f} {s.get('opt', float('nan')):7.2f} "
              f"{100 * mfu if mfu else float('nan'):5.1f}% {peak:8.2f}")
    base = rows[0][1]
    for name, tps, *_ in rows[1:]:
        print(f"ratio {name} / baseline: {tps / base:.3f}")
    # same data, same init: the first losses agree within bf16 noise
    print("first losses baseline:", [round(l, 4) for l in rows[0][6][:5]])
    print("first losses raygpt:  ", [round(l, 4) for l in rows[1][6][:5]])
    print(f"mean loss over the last 10 steps: baseline {statistics.mean(rows[0][6][-10:]):.4f}, "
          f"raygpt {statistics.mean(rows[1][6][-10:]):.4f}")


if __name__ == "__main__":
    main()
