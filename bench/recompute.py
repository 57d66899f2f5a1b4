"""Activation recomputation (--recompute 0|1|2) on one GPU, without Ray: per depth, the largest
micro-batch B that fits at sequence length T for each level, then tok/s and peak memory at one
fixed B for every level (and at each level's own largest B).

    python bench/recompute.py [--depths 48,24] [--seq 1024] [--levels 0,1,2] [--batch B]
                              [--steps 10] [--warmup 3] [--start 1] [--resolution 1]
                              [--max-batch 512] [--no-time-largest] [--smoke]

The step is raygpt's own (bench/throughput.py's build_step: raygpt.model.gpt.GPT with the level set
as loop.build_model sets it, FlatParameters' bf16 working weights over fp32 masters, raygpt's
AdamW), compiled whole as the loop compiles it (raygpt.train.loop.compile_model: static shapes, so
every B is a compilation of its own), in deterministic mode with the kernels a GPU run picks by
default (raygpt's attention and embedding backward). Tokens are random, from a seeded generator:
the same batches for every level.

Largest B: doubling from --start until a step raises torch.OutOfMemoryError (or --max-batch is
reached), then bisecting between the last B that fit and the first that did not, until they are
--resolution apart; each probe compiles afresh and runs two steps (the second holds everything
the first allocated), and the cache is emptied after an OOM. Each probe costs a compilation, so
at d48 a search takes minutes per level: --start and --resolution bound it (--levels runs some).
Fixed B: --batch, by default the largest B that level 0 fits. Per row: tok/s (median over the
steps after --warmup), peak memory (torch.cuda.max_memory_allocated: weights, optimizer state,
activations), the activation bytes autograd held for the backward pass (saved-tensor hooks on
the first step) and whether the losses equal level 0's as floats at every step (they must: the
levels compute the same function).

--smoke: d2, T=64, B up to 4 (--max-batch: no OOM on a CPU), 2 steps, eager, on the CPU: the
script's own test (tests/test_bench_recompute.py). The table comes last.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

from raygpt.config import TrainConfig
from raygpt.model.gpt import RECOMPUTE_LEVELS, saved_activation_bytes
from raygpt.train.determinism import set_switches
from raygpt.train.loop import compile_model

from throughput import build_step  # bench/throughput.py (bench/ is this script's directory)

VOCAB = 50257


def largest_fitting(fits, *, start: int = 1, limit: int = 512, resolution: int = 1) -> tuple[int, int | None]:
    """The largest B in [1, limit] for which fits(B) holds, assuming it holds up to some B and
    not beyond: doubling from `start` (clamped to limit) until a B does not fit, then bisecting
    between the last B that fit and the first that did not until they are at most `resolution`
    apart (a start that does not fit bisects down from it). Returns (largest B found, the
    smallest B known not to fit, or None when `limit` fits); B = 0 when even 1 does not fit."""
    good, bad, b = 0, None, min(start, limit)
    while True:
        if fits(b):
            good = b
            if b == limit:
                return good, None
            b = min(2 * b, limit)
        else:
            bad = b
            break
    while bad - good > resolution:
        mid = (good + bad) // 2
        if mid == good:
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, bad


def batches(B: int, T: int, step: int, device: torch.device):
    """Step `step`'s random (x, y) (B, T) token batch, the same for every level."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


class Steps:
    """One level's training step (build_step) and what running it measures."""

    def __init__(self, args, depth: int, level: int):
        self.device, self.args = args.device, args
        compile_fn = (lambda m: m) if args.eager else (lambda m: compile_model(m, "default"))
        self.model, self.flat, self.opt, self.fwd, self.update = build_step(
            depth, TrainConfig(recompute=level), self.device, args.dtype, compile_fn)

    def run(self, B: int, T: int, steps: int, measure_held: bool = False):
        """`steps` training steps at (B, T): ([loss as a float], [seconds], held bytes)."""
        import torch._dynamo
        torch._dynamo.reset()  # a new B compiles afresh, never against Dynamo's recompile limit
        losses, times, held = [], [], None
        for step in range(steps):
            x, y = batches(B, T, step, self.device)
            t0 = time.perf_counter()
            self.flat.zero_grad()
            if measure_held and step == 0:
                (loss_sum, _), held = saved_activation_bytes(self.model, lambda: self.fwd(x, y))
            else:
                loss_sum, _ = self.fwd(x, y)
            (loss_sum / (B * T)).backward()
            self.update()
            losses.append(loss_sum.item() / (B * T))  # the step's one sync
            times.append(time.perf_counter() - t0)
        return losses, times, held

    def fits(self, B: int, T: int) -> bool:
        """Whether two steps at (B, T) run without torch.OutOfMemoryError."""
        t0 = time.perf_counter()
        ok = True
        try:
            self.run(B, T, 2)
        except torch.OutOfMemoryError:
            ok = False
        self.flat.zero_grad()
        free_memory(self.device)  # after the except block: its traceback held the activations
        print(f"    B={B:4d} {'fits' if ok else 'OOM '} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        return ok

    def close(self):
        del self.model, self.flat, self.opt, self.fwd, self.update
        free_memory(self.device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def bench_depth(args, depth: int) -> list[tuple]:
    """The rows of one depth: (depth, level, largest B, B timed, tok/s, ms/step, peak GiB,
    held MiB, losses equal to level 0's)."""
    T = args.seq
    largest = {}
    for level in args.levels:
        print(f"d{depth} T={T} --recompute {level}: the largest B", flush=True)
        steps = Steps(args, depth, level)
        largest[level] = largest_fitting(lambda b: steps.fits(b, T), start=args.start,
                                         limit=args.max_batch, resolution=args.resolution)
        steps.close()
        print(f"  largest B {largest[level][0]}" + (f" ({largest[level][1]} does not fit)"
              if largest[level][1] else f" (--max-batch {args.max_batch} fits)"), flush=True)
    fixed = args.batch or largest[args.levels[0]][0]
    if fixed < 1:
        raise SystemExit(f"d{depth} T={T}: B=1 does not fit at --recompute {args.levels[0]}")
    rows, reference = [], None
    for level in args.levels:
        steps = Steps(args, depth, level)
        for B in sorted({fixed, largest[level][0]} if args.time_largest else {fixed}):
            if B < 1:
                continue
            if args.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                losses, times, held = steps.run(B, T, args.steps, measure_held=True)
            except torch.OutOfMemoryError:
                print(f"d{depth} -r {level} B={B}: out of memory when timed", flush=True)
                free_memory(args.device)
                continue
            dt = statistics.median(times[args.warmup:] or times)
            if B == fixed:
                reference = losses if reference is None else reference
            same = "yes" if losses == reference else "NO"
            rows.append((depth, level, largest[level][0], B, B * T / dt, 1000 * dt,
                         peak_gib(args.device), held / 2**20, same if B == fixed else "-"))
            show(rows[-1])
        steps.close()
    return rows


HEADER = (f"{'depth':>5s} {'-r':>2s} {'largest B':>9s} {'B':>4s} {'tok/s':>9s} {'ms/step':>8s} "
          f"{'peak GiB':>8s} {'held MiB':>8s} {'losses = -r 0':>13s}")


def show(row) -> None:
    depth, level, largest, B, tps, ms, peak, held, same = row
    print(f"{'d' + str(depth):>5s} {level:2d} {largest:9d} {B:4d} {tps:9.0f} {ms:8.1f} "
          f"{peak:8.2f} {held:8.1f} {same:>13s}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", default="48,24", help="comma-separated GPT-2 depths")
    p.add_argument("--seq", type=int, default=1024, help="sequence length T")
    p.add_argument("--levels", default="0,1,2", help="comma-separated --recompute levels")
    p.add_argument("--batch", type=int, default=None,
                   help="the fixed B every level is timed at (default: the largest B the first "
                        "level fits)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--start", type=int, default=1, help="the first B the search tries")
    p.add_argument("--resolution", type=int, default=1,
                   help="stop bisecting when the largest B that fits and the smallest that "
                        "does not are this close")
    p.add_argument("--max-batch", type=int, default=512, help="the largest B the search tries")
    p.add_argument("--no-time-largest", dest="time_largest", action="store_false",
                   help="time each level at the fixed B only, not also at its own largest B")
    p.add_argument("--eager", action="store_true",
                   help="no torch.compile: one probe costs a step, not a compilation (eager holds "
                        "more activations than the compiled step, so its largest B is a bound)")
    p.add_argument("--smoke", action="store_true",
                   help="d2, T=64, B up to 4, 2 steps, eager on the CPU (the script's test)")
    args = p.parse_args(argv)
    if args.smoke:
        args.depths, args.seq, args.steps, args.warmup = "2", 64, 2, 0
        args.max_batch = min(args.max_batch, 4)
    args.depths = [int(d) for d in args.depths.split(",")]
    args.levels = [int(v) for v in args.levels.split(",")]
    bad = [v for v in args.levels if v not in RECOMPUTE_LEVELS]
    if bad:
        raise SystemExit(f"--levels: expected levels in {RECOMPUTE_LEVELS}, found {bad}")
    args.eager = args.smoke or args.eager
    args.device = torch.device("cpu" if args.smoke else "cuda")
    args.dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/recompute.py needs a CUDA GPU (--smoke runs on the CPU)")
        set_switches(True)  # a GPU run's default: deterministic, raygpt's kernels, TF32
    where = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU (--smoke)"
    rows = []
    for depth in args.depths:
        rows += bench_depth(args, depth)
    print(f"\n{where} | T={args.seq} | {args.steps} steps per row, median after {args.warmup} | "
          f"largest B: doubling from {args.start}, bisecting to {args.resolution}, at most "
          f"{args.max_batch}" + (f" | CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}"
                                 if os.environ.get("CUBLAS_WORKSPACE_CONFIG") else ""))
    print(HEADER)
    for row in rows:
        show(row)


if __name__ == "__main__":
    main()
