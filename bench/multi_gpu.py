"""Several GPUs under Ray Train (NCCL): scaling, exact resume after a killed worker, and a resume
on half the GPUs. Numbers and checks printed as a table; not a test.

    NCCL_NVLS_ENABLE=0 python bench/multi_gpu.py [--depth 12] [--batch 16] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on these machines

import ray
import torch

from raygpt.config import TrainConfig
from raygpt.trainer import run


def losses(run_dir):
    out = {}
    for line in Path(run_dir, "loss_history.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "train":
            out[r["step"]] = (r["loss"], r["dt"], r.get("world"))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    gpus = torch.cuda.device_count()
    ray.init(num_gpus=gpus, include_dashboard=False)
    root = tempfile.mkdtemp(prefix="raygpt-multi-")
    rows = []

    # ---- scaling: the same per-GPU micro-batch on 1, 2, 4, ... GPUs
    for n in [w for w in (1, 2, 4, 8) if w <= gpus]:
        cfg = TrainConfig(model=f"d{args.depth}", batch_size=args.batch, seq_len=1024,
                          max_steps=args.steps, val_every=0, sample_every=0, checkpoint_every=0,
                          output_dir=f"{root}/scale{n}", num_workers=n, device="gpu",
                          warmup_steps=0).resolve(gpus)
        run(cfg)
        dts = [dt for _, dt, _ in losses(cfg.output_dir).values()][5:]
        tps = args.batch * 1024 * n / statistics.median(dts)
        rows.append((n, tps, tps / n))
    print(f"\nscaling, GPT-2 d{args.depth}, B={args.batch} T=1024 per GPU, {torch.cuda.get_device_name()}")
    print(f"{'GPUs':>5s} {'tok/s':>10s} {'tok/s/GPU':>10s} {'efficiency':>10s}")
    for n, tps, per in rows:
        print(f"{n:5d} {tps:10.0f} {per:10.0f} {per / rows[0][2]:10.1%}")

    if gpus < 2:
        return
    # ---- exactness on 2 GPUs: a worker SIGKILLed mid-run, deterministic mode, bf16 + master
    base = dict(model="d4", batch_size=8, seq_len=256, max_steps=12, val_every=0, sample_every=0,
                checkpoint_every=4, num_workers=2, device="gpu", deterministic=True,
                compile=False, total_batch_size=8 * 256 * 2)
    full = TrainConfig(output_dir=f"{root}/full", **base).resolve(gpus)
    run(full)
    killed = TrainConfig(output_dir=f"{root}/killed", fault="kill:rank=1,step=6", **base).resolve(gpus)
    summary = run(killed)
    a, b = losses(full.output_dir), losses(killed.output_dir)
    same = all(a[s][0] == b[s][0] for s in a)
    print(f"\n2 GPUs, worker 1 SIGKILLed at step 6: failures {summary['failures']}, recovery "
          f"{summary['recovery_s']} s, losses equal as floats at all {len(a)} steps: {same}")
    # ---- a run stopped on 2 GPUs and resumed on 1 (elastic): within float tolerance
    half = TrainConfig(output_dir=f"{root}/half", fault="sigterm:rank=0,step=6", **base).resolve(gpus)
    run(half)
    run(TrainConfig(output_dir=f"{root}/half", **{**base, "num_workers": 1}, resume=1).resolve(gpus))
    c = losses(half.output_dir)
    worst = max(abs(c[s][0] - a[s][0]) / abs(a[s][0]) for s in a)
    print(f"2 GPUs -> 1 GPU resume at step 7: worlds {sorted({w for _, _, w in c.values()})}, "
          f"largest relative loss difference vs uninterrupted {worst:.2e}")


if __name__ == "__main__":
    main()
