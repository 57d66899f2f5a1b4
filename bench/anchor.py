"""llm.c's own PyTorch trainer (`train_gpt2.py`) as the throughput baseline of record.

The anchor is not part of raygpt: `../shared/anchors/` (or --anchors DIR) holds llm.c's file,
unchanged, and `run_llmc_reference.py`, which runs it offline. This module builds its command
for the same model, batch and schedule as a raygpt bench row, runs it in a child process (one
GPU), or under `torchrun --standalone` (several), and reads its per-step lines back:

    step    3/40 | train loss 9.123456 | norm 1.2345 | lr 3.00e-04 | (123.45 ms | 530000 tok/s)

Its time per step is llm.c's own (host clock around the step, after a CUDA synchronize).
Matched to the raygpt rows: GPT-2 d{depth} from scratch, bf16 autocast, torch.compile, flash
SDPA, fused AdamW, a constant learning rate without warm-up, weight decay 0.1, clipping at 1.0,
real data (`--overfit_single_batch 0`, llm.c's default is to repeat one batch) from raygpt's
bundled training shard. What differs and stays: llm.c keeps fp32 weights under autocast (raygpt
keeps bf16 working weights over fp32 masters) and reads the shard in order.

    python bench/anchor.py --smoke      # a CPU dry run: d12 at B=1 T=32 for 3 steps, parsed
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ANCHORS = REPO_ROOT.parent / "shared" / "anchors"
RUNNER = "run_llmc_reference.py"

PEAK_LINE = re.compile(r"^peak memory consumption: (\d+) MiB")
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+) \| train loss ([-+0-9.naif]+) \| .*"
                       r"\(([0-9.]+) ms \| ([0-9.]+) tok/s\)")


@dataclass
class AnchorRun:
    """What one llm.c run printed: per-step loss, seconds and tokens/s (all ranks together)."""
    command: list[str]
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    tok_per_s: list[float] = field(default_factory=list)
    output: str = ""
    peak_gib: float = float("nan")  # torch.cuda.max_memory_allocated, as llm.c prints it at its end

    def median_tok_per_s(self, warmup: int) -> float:
        timed = self.tok_per_s[warmup:]
        return statistics.median(timed) if timed else float("nan")


def runner_path(anchors: Path | str | None = None) -> Path:
    """The offline runner in the anchors folder, or SystemExit naming what is missing."""
    folder = Path(anchors or os.environ.get("RAYGPT_ANCHORS") or DEFAULT_ANCHORS)
    path = folder / RUNNER
    if not path.is_file() or not (folder / "llmc_train_gpt2.py").is_file():
        raise SystemExit(f"--anchors {folder}: expected llm.c's llmc_train_gpt2.py and {RUNNER} "
                         f"there (../shared/anchors; copy it beside the repo on a GPU machine), "
                         f"or run the bench with --no-llmc")
    return path


def command(*, depth: int, batch: int, seq: int, steps: int, gpus: int = 1,
            input_bin: str | None = None, anchors: Path | str | None = None,
            device: str = "cuda") -> list[str]:
    """llm.c's command line for a bench row's model, batch and schedule (see the docstring)."""
    from raygpt.config import DEFAULT_TRAIN
    on_gpu = device == "cuda"
    args = ["--input_bin", input_bin or str(DEFAULT_TRAIN), "--model", f"d{depth}",
            "--batch_size", str(batch), "--sequence_length", str(seq),
            "--total_batch_size", str(batch * seq * gpus), "--num_iterations", str(steps),
            "--learning_rate", "3e-4", "--warmup_iters", "0", "--learning_rate_decay_frac", "1.0",
            "--weight_decay", "0.1", "--grad_clip", "1.0", "--overfit_single_batch", "0",
            "--val_loss_every", "0", "--sample_every", "0", "--write_tensors", "0",
            "--dtype", "bfloat16" if on_gpu else "float32", "--compile", str(int(on_gpu)),
            "--flash", str(int(on_gpu)), "--tensorcores", str(int(on_gpu)), "--device", device]
    runner = str(runner_path(anchors))
    if gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={gpus}", runner, *args]
    return [sys.executable, runner, *args]


def parse(output: str) -> tuple[list[float], list[float], list[float]]:
    """(losses, seconds per step, tokens/s) from llm.c's step lines, in step order."""
    losses, times, rates = [], [], []
    for line in output.splitlines():
        m = STEP_LINE.match(line.strip())
        if m:
            losses.append(float(m.group(3)))
            times.append(float(m.group(4)) / 1000)
            rates.append(float(m.group(5)))
    return losses, times, rates


def run(cmd: list[str], timeout: float = 900) -> AnchorRun:
    """Run llm.c's trainer; SystemExit with its output's tail if it fails or prints no steps."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = proc.stdout + proc.stderr
    result = AnchorRun(cmd, *parse(proc.stdout), output=out)
    peaks = [int(m.group(1)) for m in map(PEAK_LINE.match, proc.stdout.splitlines()) if m]
    if peaks:
        result.peak_gib = max(peaks) / 1024
    if proc.returncode != 0 or not result.losses:
        raise SystemExit(f"llm.c's train_gpt2.py failed (exit {proc.returncode}, "
                         f"{len(result.losses)} step lines): {' '.join(cmd)}\n{out[-4000:]}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU dry run: d12, B=1, T=32, 3 steps")
    p.add_argument("--anchors", default=None, help="folder with llm.c's file and the runner")
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    if args.smoke:
        args.batch, args.seq, args.steps, args.warmup = 1, 32, 3, 1
    cmd = command(depth=args.depth, batch=args.batch, seq=args.seq, steps=args.steps,
                  gpus=args.gpus, anchors=args.anchors, device="cpu" if args.smoke else "cuda")
    print(" ".join(cmd), flush=True)
    r = run(cmd)
    print(f"llm.c train_gpt2.py: {len(r.losses)} steps, losses {[round(x, 4) for x in r.losses[:5]]}"
          f", median {r.median_tok_per_s(args.warmup):,.0f} tok/s over steps "
          f"{args.warmup}..{len(r.losses) - 1}")


if __name__ == "__main__":
    main()
