"""Checkpoint cost on one GPU: the training stall per async checkpoint, the time to write and to
load one, and the step-time overhead of checkpointing every N steps. Numbers, not a test.

    python bench/checkpoint.py [--depth 12] [--batch 16] [--steps 40] [--every 10]
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
from raygpt.loop import train
from raygpt.session import LocalSession
from raygpt.storage import open_run_dir


def run(args, every: int, resume: int = 0, run_dir: str | None = None):
    run_dir = run_dir or tempfile.mkdtemp(prefix="raygpt-ckpt-bench-")
    cfg = TrainConfig(model=f"d{args.depth}", batch_size=args.batch, seq_len=1024,
                      max_steps=args.steps, val_every=0, sample_every=0, checkpoint_every=every,
                      output_dir=run_dir, device="gpu", num_workers=1, warmup_steps=0,
                      resume=resume).resolve(1)
    t0 = time.perf_counter()
    summary = train(cfg, LocalSession(open_run_dir(run_dir), torch.device("cuda")))
    wall = time.perf_counter() - t0
    recs = [json.loads(l) for l in Path(run_dir, "loss_history.jsonl").read_text().splitlines()]
    dts = [r["dt"] for r in recs if r["kind"] == "train"]
    return summary, dts, wall, run_dir


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()
    base, base_dts, base_wall, _ = run(args, 0)
    ck_sum, ck_dts, ck_wall, run_dir = run(args, args.every)
    n_saves = ck_sum["checkpoints_written"]
    from raygpt import checkpoint as ck
    rd = open_run_dir(run_dir)
    size = sum(rd.size_of(f"{ck.step_dir(args.steps)}/{n}") for n in rd.listdir(ck.step_dir(args.steps)))
    # the time to load: a resume of the finished run's last checkpoint (build + restore + 0 steps)
    resumed, _, _, _ = run(args, args.every, resume=1, run_dir=run_dir)
    load_s = resumed["checkpoint_load_s"]
    skip = 5
    med = lambda xs: statistics.median(xs[skip:])
    mean = lambda xs: statistics.mean(xs[skip:])
    print(f"\n{torch.cuda.get_device_name()} | d{args.depth} B={args.batch} T=1024 | {args.steps} steps,"
          f" checkpoint every {args.every} ({n_saves} saves, {size / 2**30:.2f} GiB each)")
    print(f"step time, no checkpoints:       median {1000 * med(base_dts):.1f} ms, mean {1000 * mean(base_dts):.1f} ms")
    print(f"step time, checkpoint every {args.every}:  median {1000 * med(ck_dts):.1f} ms, mean {1000 * mean(ck_dts):.1f} ms"
          f"  (mean overhead {100 * (mean(ck_dts) / mean(base_dts) - 1):+.2f}%)")
    print(f"training stall per checkpoint (host copy): {1000 * ck_sum['checkpoint_stall_s'] / n_saves:.1f} ms"
          f" vs one step {1000 * med(base_dts):.1f} ms")
    print(f"writing one checkpoint (background thread): {statistics.mean(ck_sum['checkpoint_write_s']):.2f} s")
    print(f"whole run wall time: {base_wall:.1f} s without, {ck_wall:.1f} s with checkpoints")
    print(f"loading a {size / 2**30:.2f} GiB checkpoint (read, verify header, restore in llm.c's order): {load_s:.2f} s")


if __name__ == "__main__":
    main()
