"""What reading shards from a bucket costs a training step: numbers, not a test.

Writes `--shards` llm.c shards of `--tokens` tokens each, to a local directory and to moto's S3
server (tests.helpers.S3Server: the S3 HTTP API in this process, on 127.0.0.1), then drives a
`DistributedDataLoader` over each the way the training loop does: `next_batch()`, the step's
compute (a `--step-ms` wait that holds no GIL, standing in for the GPU), `prefetch()` of the
next batch. A row per source: the loader's own time per step (next_batch + prefetch, the wait
left out), its median once warm, and the slowest step within one step of a shard change against
that median: with the next shard fetched in the background, a shard change of the bucket
should cost what it costs locally. The last row is the stall the background fetch hides: one
shard fetched into an empty cache while the loader waits.

    python bench/shard_loader.py [--shards 6] [--tokens 4000000] [--batch 8] [--seq 1024]
                                 [--step-ms 10] [--changes 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raygpt.data.loader import DistributedDataLoader  # noqa: E402
from raygpt.data.sources import ShardCache, list_shards  # noqa: E402
from raygpt.llmc.shards import write_shard  # noqa: E402
from tests.helpers import S3Server  # noqa: E402


def drive(loader: DistributedDataLoader, steps: int, step_s: float) -> tuple[list[float], list[int]]:
    """Per step: the loader's seconds (next_batch + prefetch), and the steps at a shard change
    (whose batch holds a shard the step before did not)."""
    times, changes, before = [], [], set()
    loader.prefetch()
    for step in range(steps):
        t0 = time.perf_counter()
        loader.next_batch()
        t1 = time.perf_counter()
        time.sleep(step_s)  # the forward and backward on the device
        t2 = time.perf_counter()
        loader.prefetch()  # the loop prefetches during the backward pass
        times.append((t1 - t0) + (time.perf_counter() - t2))
        shards = set(loader.last_global_samples[:, 0].tolist())
        if step and shards - before:
            changes.append(step)
        before = shards
    return times, changes


def summary(times: list[float], changes: list[int], warm: int) -> tuple[float, float]:
    median = statistics.median(times[warm:])
    near = [times[s + d] for s in changes for d in (-1, 0, 1) if warm <= s + d < len(times)]
    return median, max(near) if near else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=4_000_000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--changes", type=int, default=3, help="shard changes to time")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-shard-loader-"))
    local = work / "local"
    local.mkdir()
    rng = np.random.default_rng(0)
    for s in range(args.shards):
        write_shard(local / f"shard_{s:06d}.bin", rng.integers(0, 50257, args.tokens))
    per_shard = (args.tokens - 1) // args.seq // args.batch
    steps = per_shard * (args.changes + 1)
    warm = min(20, per_shard // 2)

    with S3Server() as s3:
        os.environ.update(AWS_ACCESS_KEY_ID=S3Server.KEY, AWS_SECRET_ACCESS_KEY=S3Server.SECRET,
                          AWS_EC2_METADATA_DISABLED="true")
        fs = s3.fs()
        fs.create_dir("bucket")
        for path in sorted(local.iterdir()):
            with fs.open_output_stream(f"bucket/shards/{path.name}") as f:
                f.write(path.read_bytes())
        remote = s3.uri("bucket/shards/shard_*.bin")
        rows = []
        for name, pattern, cache in (
                ("local shards (memory-mapped)", str(local / "shard_*.bin"), None),
                ("s3:// via the node cache", remote, ShardCache(str(work / "cache"), 1 << 40))):
            loader = DistributedDataLoader(pattern, args.batch, args.seq, 0, 1, shuffle=True,
                                           cache=cache)
            times, changes = drive(loader, steps, args.step_ms / 1000)
            loader.close()
            median, worst = summary(times, changes, warm)
            rows.append((name, len(times), len(changes), median * 1e3, worst * 1e3, worst / median))
        cold = ShardCache(str(work / "cold"), 1 << 40)
        source = list_shards(remote)
        t0 = time.perf_counter()
        cold.open(source, 0).close()
        fetch_ms = (time.perf_counter() - t0) * 1e3

    mb = (1024 + 2 * args.tokens) / 1e6
    print(f"{args.shards} shards of {args.tokens:,} tokens ({mb:.1f} MB), B={args.batch} "
          f"T={args.seq}, world 1, shuffled; {args.step_ms:g} ms of device time per step; "
          f"loader time per step (next_batch + prefetch), median after {warm} steps")
    print(f"{'source':<32}{'steps':>7}{'changes':>9}{'median ms':>11}{'slowest at change ms':>22}"
          f"{'ratio':>8}")
    for name, n, c, med, worst, ratio in rows:
        print(f"{name:<32}{n:>7}{c:>9}{med:>11.3f}{worst:>22.3f}{ratio:>8.1f}")
    print(f"one shard fetched while the loader waits (no background fetch): {fetch_ms:.1f} ms")


if __name__ == "__main__":
    main()
