"""raygpt.config.flag_hints: an unknown flag answered with the flags its user meant, one line,
exit 2, through the real command line; and the knobs' `hints` as declared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raygpt.config import build_parser, knob_hints
from raygpt.config.flag_hints import nearest_flags, shown_flags

REPO = Path(__file__).resolve().parents[2]
KNOWN = {"--learning-rate": "-l/--learning-rate", "-l": "-l/--learning-rate",
         "--max-steps": "-x/--max-steps", "--warmup-steps": "-u/--warmup-steps",
         "--temperature": "--temperature"}
HINTS = {"--lr": "-l/--learning-rate", "--max-iters": "-x/--max-steps"}


def raygpt(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "raygpt", *argv], capture_output=True,
                          text=True, env=env, timeout=120, cwd=REPO)


@pytest.mark.parametrize("typed, expected", [
    ("--lr", ["-l/--learning-rate"]),              # another tool's name, declared as a hint
    ("--LR=3e-4", ["-l/--learning-rate"]),         # case and a value do not count
    ("--max_iters", ["-x/--max-steps"]),           # underscores (nanoGPT's spelling)
    ("--max_steps", ["-x/--max-steps"]),           # raygpt's own flag, spelled with _
    ("--learning-rat", ["-l/--learning-rate"]),    # a typo: difflib
    ("--max-iter", ["-x/--max-steps"]),            # a typo of a hint: its flag
    ("--temprature", ["--temperature"]),
    ("--frobnicate", []),                          # nothing near: no guess
])
def test_nearest_flags(typed, expected):
    assert nearest_flags(typed, KNOWN, HINTS) == expected


def test_a_hint_or_a_respelled_flag_is_the_one_answer_among_raygpts_real_flags():
    known, hints = shown_flags(build_parser()), knob_hints()
    # difflib alone would add --eps and --val-max-steps, --val-batch-size and --total-batch-size
    assert nearest_flags("--steps", known, hints) == ["-x/--max-steps"]
    assert nearest_flags("--batch_size", known, hints) == ["-b/--batch-size"]
    # a typo: the nearest first, each flag once (--val-max-steps is -m's hint)
    assert nearest_flags("--max-step", known, hints) == ["-x/--max-steps", "-m/--val-batches"]


def test_the_knobs_hints_are_other_names_never_raygpts_own_flags():
    hints = knob_hints()
    flags = shown_flags(build_parser())
    assert hints["--lr"] == "-l/--learning-rate" and hints["--steps"] == "-x/--max-steps"
    assert hints["--block-size"] == "-t/--seq-len" and hints["--out-dir"] == "-o/--output-dir"
    assert all(h.startswith("--") and h == h.lower() and "_" not in h for h in hints)
    assert not set(hints) & set(flags)  # a hint that is a flag would never be reached
    assert set(hints.values()) <= set(flags.values())  # each names a flag that exists


@pytest.mark.parametrize("argv, line", [
    (["train", "--lr", "1e-3"], "raygpt: error: --lr: expected a flag of raygpt train, found an "
                                "unknown one (did you mean -l/--learning-rate?)"),
    (["train", "--steps", "3"], "raygpt: error: --steps: expected a flag of raygpt train, found "
                                "an unknown one (did you mean -x/--max-steps?)"),
    (["train", "--batch_size=4"], "raygpt: error: --batch_size: expected a flag of raygpt "
                                  "train, found an unknown one (did you mean -b/--batch-size?)"),
    (["train", "--frobnicate"], "raygpt: error: --frobnicate: expected a flag of raygpt train, "
                                "found an unknown one (raygpt train --help lists every flag)"),
    # the sweep's own flags are known beside train's
    (["sweep", "--gird", "scheduler=wsd"], "raygpt sweep: error: --gird: expected a flag of "
                                           "raygpt sweep, found an unknown one (did you mean "
                                           "--grid?)"),
    (["sample", "runs/none", "--temprature", "0"],
     "raygpt sample: error: --temprature: expected a flag of raygpt sample, found an unknown "
     "one (did you mean --temperature?)"),
])
def test_an_unknown_flag_is_one_line_with_the_way_out_and_exit_2(argv, line):
    out = raygpt(*argv)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")
