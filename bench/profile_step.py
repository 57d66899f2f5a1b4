"""Where a step of the real loop spends the GPU's time: a torch.profiler trace of a few steady
steps of `raygpt.train.loop.train` (d12, B=64, T=1024 by default), read back as GPU busy time, idle
gaps and what the host was doing during each gap; plus Python's garbage-collector pauses.

    python bench/profile_step.py [--depth 12] [--batch 64] [--seq 1024] [--steps 30]
                                 [--active 6] [--trace trace.json] [--no-gc-freeze]
                                 [--variant det+flash]   (throughput.py's variant tokens)

The loop runs unchanged under a LocalSession whose once-per-step `poll_requests` also advances
the profiler's schedule. Prints, per profiled step, its span on the GPU's timeline, GPU kernel
time and idle time; the idle time in gaps of 50 us and less (launch latency) and the largest
gaps with the host operations that overlapped them; then the GPU time per step by kernel class
(matmul, attention, Inductor's kernels, raygpt's kernels) and the kernels that take the most.
Numbers for deciding what to change, not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch

from raygpt.storage import open_run_dir
from raygpt.train.loop import train
from raygpt.train.session import LocalSession
from throughput import add_loop_args, loop_config, variant_settings  # bench/ is this script's directory


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


# Kernel classes by name (lower case), first match wins: what a step's GPU time is spent on.
KERNEL_CLASSES = [
    ("attention (raygpt)", ("attn_fwd", "attn_bwd")),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("embedding backward", ("embedding_backward_rows", "indexing_backward", "embedding_backward")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm80_", "ampere_", "cublas")),
    ("cross-entropy (raygpt)", ("cross_entropy_rows",)),
    ("adamw (raygpt)", ("adamw",)),
    ("grad norm (raygpt)", ("sumsq_partials", "sum_partials")),
    ("inductor reduction", ("triton_red", "triton_per")),
    ("inductor pointwise", ("triton_poi",)),
    ("memcpy / memset", ("memcpy", "memset")),
]


def kernel_class(name: str) -> str:
    low = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return label
    return "other"


def kernel_table(kernels, lo: float, hi: float, n_steps: int, top: int = 20) -> None:
    """GPU time per step by kernel class, and the kernels that take most of it, over the
    profiled steps' span on the GPU [lo, hi]."""
    inside = [k for k in kernels if lo <= k["ts"] < hi]
    by_class, by_name = {}, {}
    for k in inside:
        c = kernel_class(k["name"])
        by_class[c] = by_class.get(c, 0.0) + k["dur"]
        n, d = by_name.get(k["name"], (0, 0.0))
        by_name[k["name"]] = (n + 1, d + k["dur"])
    total = sum(by_class.values())
    print(f"\nGPU time per step by kernel class ({total / 1e3 / n_steps:.2f} ms per step in all):")
    for c, d in sorted(by_class.items(), key=lambda kv: -kv[1]):
        print(f"  {c:28s} {d / 1e3 / n_steps:8.2f} ms  {d / total:6.1%}")
    print(f"the {top} kernels with the most time (per step: calls, ms, class):")
    for name, (n, d) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {n / n_steps:6.1f} x {d / 1e3 / n_steps:7.2f} ms  {kernel_class(name):22s} "
              f"{name[:90]}")


def analyse(trace_path: str, top: int = 12) -> None:
    events = json.load(open(trace_path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation",
                                                   "python_function") and "dur" in e]
    # a step's span on the GPU's timeline (Kineto's gpu_user_annotation), from its first kernel
    # to its last; the host's span of the same step (user_annotation) runs ahead of it
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
                    and e.get("cat") == "gpu_user_annotation"), key=lambda e: e["ts"])
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
    n_steps = len(steps)
    # gaps of 50 us and less are launch latency between back-to-back kernels; longer ones are
    # listed with what the host was doing meanwhile
    gaps, small, end = [], 0.0, None
    for k in kernels:
        if k["ts"] < lo or k["ts"] > hi:
            continue
        if end is not None and k["ts"] - end > 50:
            gaps.append((k["ts"] - end, end, k["name"]))
        elif end is not None and k["ts"] > end:
            small += k["ts"] - end
        end = max(end or 0, k["ts"] + k["dur"])
    gaps.sort(reverse=True)
    total = sum(g for g, *_ in gaps)
    print(f"\nidle gaps of 50 us or less: {small / 1e3 / n_steps:.2f} ms per step")
    print(f"\nidle gaps > 50 us over {n_steps} steps: {len(gaps)}, {total / 1e3:.2f} ms in all "
          f"({total / 1e3 / n_steps:.2f} ms per step); the largest, with the host ops that "
          f"overlap them (longest first):")
    for g, start, after in gaps[:top]:
        stop = start + g
        over = sorted(((min(e["ts"] + e["dur"], stop) - max(e["ts"], start), e["name"]) for e in host
                       if e["ts"] < stop and e["ts"] + e["dur"] > start), reverse=True)
        names = ", ".join(f"{n[:48]} {d / 1e3:.2f}" for d, n in over[:5])
        print(f"  {g / 1e3:6.2f} ms before {after[:40]!r}: {names}")
    kernel_table(kernels, lo, hi, n_steps)


def main():
    p = argparse.ArgumentParser()
    add_loop_args(p)
    p.add_argument("--active", type=int, default=6)
    p.add_argument("--cpu", action="store_true", help="a dry run of this script without a GPU")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="the loop's --no-gc-freeze (to see what gc.freeze saves)")
    p.add_argument("--trace", default=os.path.join(os.environ.get("OUT", tempfile.gettempdir()),
                                                   "profile_step.json"))
    p.add_argument("--variant", default="default",
                   help="a bench/throughput.py variant, e.g. det or det+flash: see which kernels it swaps")
    args = p.parse_args()
    run_dir = tempfile.mkdtemp(prefix="raygpt-profile-")
    with variant_settings(args.variant) as loop_overrides:
        profile(args, run_dir, {**loop_overrides, **({"gc_freeze": False} if args.no_gc_freeze else {})})


def profile(args, run_dir: str, loop_overrides: dict) -> None:
    cfg = loop_config(args, run_dir, {**loop_overrides, **({"device": "cpu", "compile": False}
                                                            if args.cpu else {})})
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
