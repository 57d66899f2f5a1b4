"""Where a step of the real loop spends the GPU's time: a torch.profiler trace of a few steady
steps of `raygpt.loop.train` (d12, B=64, T=1024 by default), read back as GPU busy time, idle
gaps and what the host was doing during each gap; plus Python's garbage-collector pauses.

    python bench/profile_step.py [--depth 12] [--batch 64] [--seq 1024] [--steps 30]
                                 [--active 6] [--trace trace.json] [--no-gc-freeze]

The loop runs unchanged under a LocalSession whose once-per-step `poll_requests` also advances
the profiler's schedule. Prints, per profiled step, wall time (start to start of the
steady state), GPU kernel time and idle time; then the largest idle gaps with the host
operations that overlapped them. Numbers for deciding what to change, not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch

import raygpt.loop
from raygpt.loop import train
from raygpt.session import LocalSession
from raygpt.storage import open_run_dir
from throughput import add_loop_args, loop_config  # bench/ is this script's directory


class ProfiledSession(LocalSession):
    def __init__(self, run_dir, prof, device):
        super().__init__(run_dir, device)
        self.prof = prof

    def poll_requests(self):
        self.prof.step()  # once per training step, between backward and the optimizer
        return super().poll_requests()


def gc_pauses() -> list[tuple[int, float, float]]:
    """(generation, wall-clock start, seconds) of every garbage collection from now on."""
    pauses, started = [], {}

    def cb(phase, info):
        if phase == "start":
            started["t"] = (time.time(), time.perf_counter())
        elif "t" in started:
            wall, t = started.pop("t")
            pauses.append((info["generation"], wall, time.perf_counter() - t))
    gc.callbacks.append(cb)
    return pauses


def analyse(trace_path: str, top: int = 12) -> None:
    events = json.load(open(trace_path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation",
                                                   "python_function") and "dur" in e]
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    print(f"{'step':>14s} {'wall ms':>8s} {'GPU busy':>9s} {'GPU idle':>9s}")
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        busy, end = 0.0, t0
        for k in kernels:
            a, b = max(k["ts"], t0), min(k["ts"] + k["dur"], t1)
            if b <= a:
                continue
            a = max(a, end)  # merge overlapping kernels (several streams)
            if b > a:
                busy += b - a
                end = b
        print(f"{s['name']:>14s} {s['dur'] / 1e3:8.2f} {busy / 1e3:9.2f} {(s['dur'] - busy) / 1e3:9.2f}")
    if not steps:
        return
    lo, hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    gaps, end = [], None
    for k in kernels:
        if k["ts"] < lo or k["ts"] > hi:
            continue
        if end is not None and k["ts"] - end > 50:
            gaps.append((k["ts"] - end, end, k["name"]))
        end = max(end or 0, k["ts"] + k["dur"])
    gaps.sort(reverse=True)
    total = sum(g for g, *_ in gaps)
    print(f"\nidle gaps > 50 us over {len(steps)} steps: {len(gaps)}, {total / 1e3:.2f} ms in all "
          f"({total / 1e3 / len(steps):.2f} ms per step); the largest, with the host ops that "
          f"overlap them (longest first):")
    for g, start, after in gaps[:top]:
        stop = start + g
        over = sorted(((min(e["ts"] + e["dur"], stop) - max(e["ts"], start), e["name"]) for e in host
                       if e["ts"] < stop and e["ts"] + e["dur"] > start), reverse=True)
        names = ", ".join(f"{n[:48]} {d / 1e3:.2f}" for d, n in over[:5])
        print(f"  {g / 1e3:6.2f} ms before {after[:40]!r}: {names}")


def main():
    p = argparse.ArgumentParser()
    add_loop_args(p)
    p.add_argument("--active", type=int, default=6)
    p.add_argument("--cpu", action="store_true", help="a dry run of this script without a GPU")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave raygpt.loop.GC_FREEZE_AFTER_FIRST_STEP off (to see what it saves)")
    p.add_argument("--trace", default=os.path.join(os.environ.get("OUT", tempfile.gettempdir()),
                                                   "profile_step.json"))
    args = p.parse_args()
    if args.no_gc_freeze:
        raygpt.loop.GC_FREEZE_AFTER_FIRST_STEP = False
    run_dir = tempfile.mkdtemp(prefix="raygpt-profile-")
    cfg = loop_config(args, run_dir, {"device": "cpu", "compile": False} if args.cpu else None)
    wait = args.steps - args.active - 4
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=wait, warmup=2, active=args.active, repeat=1),
        on_trace_ready=lambda pr: pr.export_chrome_trace(args.trace))
    pauses = gc_pauses()
    with prof:
        train(cfg, ProfiledSession(open_run_dir(run_dir), prof,
                                   torch.device("cpu" if args.cpu else "cuda")))
    recs = [json.loads(l) for l in open(os.path.join(run_dir, "loss_history.jsonl"))]
    train_recs = [r for r in recs if r["kind"] == "train"]
    dts = [r["dt"] * 1e3 for r in train_recs]
    steady = dts[5:]
    since = train_recs[4]["time"]  # the end of step 4: compilation is over
    print(f"loop dt over steps 5..{len(dts) - 1}: median {sorted(steady)[len(steady) // 2]:.2f} ms, "
          f"min {min(steady):.2f}, max {max(steady):.2f}")
    by_gen = {}
    for g, wall, d in pauses:
        if wall >= since:
            by_gen.setdefault(g, []).append(d)
    print("gc pauses after step 4: " + (", ".join(
        f"gen{g}: {len(v)} x, max {max(v) * 1e3:.1f} ms, total {sum(v) * 1e3:.1f} ms"
        for g, v in sorted(by_gen.items())) or "none"))
    analyse(args.trace)


if __name__ == "__main__":
    main()
