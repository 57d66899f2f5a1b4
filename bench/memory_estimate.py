"""raygpt.model.memory's estimate of a worker's peak against the peak of real training steps.

    python bench/memory_estimate.py            # on a GPU: d12 B=8/16/32, d24 B=8, d48 B=4, T=1024
    python bench/memory_estimate.py --cpu      # d2 B=8 T=64, d2 B=64 T=256, d4 B=16 T=256
    python bench/memory_estimate.py --shapes d12:8:1024,d24:16:1024 [--recompute 1]

Each shape runs in a child process of its own: the real loop (raygpt.train.loop.train under a
LocalSession, no Ray) for two steps with a checkpoint after the first, so the second step runs
with the checkpoint snapshot's buffers alive, as every step of a run after its first
checkpoint does. Measured: on a GPU torch.cuda.max_memory_allocated (what the tensors hold,
compared with the estimate less its runtime term) and max_memory_reserved (the caching
allocator's pool); on a CPU the child's peak resident set (VmHWM, compared with the whole
estimate). A shape that runs out of memory is a row saying so. The table comes last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

GPU_SHAPES = "d12:8:1024,d12:16:1024,d12:32:1024,d24:8:1024,d48:4:1024"
CPU_SHAPES = "d2:8:64,d2:64:256,d4:16:256"
GiB = 1 << 30


def child(model: str, batch: int, seq: int, device: str, recompute: int) -> dict:
    """Two real training steps of `model` at (batch, seq); the peak they reached."""
    import torch

    from raygpt.config import TrainConfig
    from raygpt.storage import open_run_dir
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession

    torch.set_num_threads(1 if device == "cpu" else torch.get_num_threads())
    run_dir = tempfile.mkdtemp(prefix="raygpt-memory-")
    fields = dict(model=model, batch_size=batch, seq_len=seq, max_steps=2, checkpoint_every=1,
                  val_every=0, sample_every=0, output_dir=run_dir, device=device, num_workers=1,
                  warmup_steps=0)
    if recompute:
        fields["recompute"] = recompute
    cfg = TrainConfig(**fields).resolve(1 if device == "gpu" else 0)
    out = dict(model=model, batch=batch, seq=seq)
    try:
        train(cfg, LocalSession(open_run_dir(run_dir),
                                torch.device("cuda" if device == "gpu" else "cpu")))
    except torch.OutOfMemoryError:
        out["oom"] = True
    if device == "gpu":
        out.update(allocated=torch.cuda.max_memory_allocated(),
                   reserved=torch.cuda.max_memory_reserved(),
                   gpu_total=torch.cuda.get_device_properties(0).total_memory)
    else:
        # VmHWM, not ru_maxrss: that would count the parent's resident set at the fork
        out["rss"] = [int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                      if l.startswith("VmHWM:")][0]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="measure CPU workers (peak RSS)")
    p.add_argument("--shapes", default=None, help="MODEL:B:T,... (default: by device)")
    p.add_argument("--recompute", type=int, default=0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    device = "cpu" if args.cpu else "gpu"
    if args.child:
        model, b, t = args.child.split(":")
        print("RESULT " + json.dumps(child(model, int(b), int(t), device, args.recompute)))
        return

    from raygpt.model.memory import estimate, shape_of

    rows = []
    for spec in (args.shapes or (CPU_SHAPES if args.cpu else GPU_SHAPES)).split(","):
        model, b, t = spec.split(":")
        cmd = [sys.executable, __file__, "--child", spec, "--recompute", str(args.recompute)]
        proc = subprocess.run(cmd + (["--cpu"] if args.cpu else []), capture_output=True,
                              text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not result:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            rows.append((spec, None, None, None, f"child failed (exit {proc.returncode})"))
            continue
        r = json.loads(result[0][len("RESULT "):])
        est = estimate(shape_of(model), device=device, batch_size=int(b), seq_len=int(t),
                       recompute=args.recompute)
        if args.cpu:
            rows.append((spec, est.total, r["rss"], None, est.line()))
        else:
            rows.append((spec, est.allocated, r["allocated"], r["reserved"],
                         ("OOM " if r.get("oom") else "") + est.line()))
        print(json.dumps(r), flush=True)

    what = "peak RSS" if args.cpu else "max_memory_allocated (reserved)"
    print(f"\nestimate vs measured, {device}, recompute {args.recompute}: {what}, GiB")
    print(f"{'shape':<16}{'estimate':>10}{'measured':>10}{'est/meas':>10}{'reserved':>10}"
          f"  breakdown")
    for spec, est, meas, reserved, note in rows:
        if est is None:
            print(f"{spec:<16}{'':>40}  {note}")
            continue
        print(f"{spec:<16}{est / GiB:>10.2f}{meas / GiB:>10.2f}{est / meas:>10.2f}"
              f"{'' if reserved is None else f'{reserved / GiB:.2f}':>10}  {note}")


if __name__ == "__main__":
    main()
