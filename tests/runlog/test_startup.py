"""The launch's start-up phases (raygpt.runlog.startup): the pure chain of marks, and the record
and line a real `python -m raygpt train` writes, as a user runs it (its own local Ray)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from raygpt.runlog import startup
from raygpt.runlog.startup import CHAIN, phases, startup_line

REPO = Path(__file__).resolve().parents[2]
LABELS = [label for _, label in CHAIN[1:]]


def marks_at(times: dict[str, float]) -> dict:
    """A startup dict with the CHAIN marks `times` names ("driver.checked": 103.0, ...)."""
    out: dict = {}
    for name, t in times.items():
        node = out
        *parents, leaf = name.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = t
    return out


def test_phases_are_the_gaps_between_consecutive_marks_in_chain_order():
    # distinct gaps (1, 2, 3, ... s) so a phase paired with the wrong mark shows
    t, times = 1000.0, {}
    for i, (name, _) in enumerate(CHAIN):
        t += i
        times[name] = t
    got = phases(marks_at(times))
    assert [label for label, _ in got] == LABELS
    assert [s for _, s in got] == [float(i) for i in range(1, len(CHAIN))]
    assert sum(s for _, s in got) == times["first_step_done"] - times["driver.process_started"]


def test_a_missing_mark_folds_its_phase_into_the_next_and_the_sum_is_kept():
    times = {"driver.process_started": 10.0, "driver.cli_started": 11.5,
             "driver.ray_started": 20.0,  # no checked / run_dir_claimed marks
             "group_up": 27.0, "setup.train_func": 27.25, "first_step_done": 40.0}
    got = dict(phases(marks_at(times)))
    assert got == {"python and raygpt's imports": 1.5, "Ray started": 8.5,
                   "trainer, controller and worker processes up": 7.0,
                   "train function called": 0.25, "first step": 12.75}
    assert sum(got.values()) == 30.0


def test_a_mark_behind_the_one_before_counts_zero_and_bad_values_are_skipped():
    # another node's clock 2 s behind; a string, a bool and a NaN as a record read back may hold
    times = {"driver.process_started": 100.0, "driver.helpers_started": 105.0,
             "group_up": 103.0, "process_group": 106.0, "setup.train_func": "107",
             "setup.loop_imported": True, "state_loaded": float("nan"),
             "first_step_done": 110.0}
    got = phases(marks_at(times))
    assert got == [("Ray Train's helpers and the control actor", 5.0),
                   ("trainer, controller and worker processes up", 0.0),
                   ("process group formed", 1.0), ("first step", 4.0)]
    assert phases({}) == [] and phases({"driver": "x", "group_up": None}) == []


def test_the_line_gives_the_total_and_the_phases_of_a_twentieth_of_a_second_or_more():
    line = startup_line(marks_at({"driver.process_started": 0.0, "driver.cli_started": 2.25,
                                  "driver.checked": 2.27, "first_step_done": 9.5}))
    assert line == ("raygpt | startup: 9.5 s to the first step = python and raygpt's imports "
                    "2.2 + first step 7.2 (s)")


def test_process_started_is_the_processs_own_start():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5); "
                          "from raygpt.runlog.startup import process_started; "
                          "print(process_started(), time.time())"],
                         capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout.split()
    started, now = float(out[0]), float(out[1])
    # after this process launched it, at least the child's half-second sleep before its "now"
    # (a clock tick, 10 ms, of /proc's resolution either side)
    assert before - 0.02 <= started <= now - 0.5 + 0.02
    assert startup.process_started() < before


def test_a_run_records_its_startup_and_the_phases_add_up_to_no_more_than_step_one(tmp_path):
    """The real command line with its defaults (2 CPU workers, the bundled data, its own Ray),
    a tiny model: rank 0 writes one startup record after the first step, every phase from the
    process start to the first step is there, none negative, and they add up to no more than
    the time from launching the command to the first step's own record."""
    run = tmp_path / "run"
    launched = time.time()
    p = subprocess.run(
        [sys.executable, "-m", "raygpt", "train", "-e", "d1", "-b", "4", "-t", "32", "-x", "2",
         "-m", "1", "-s", "0", "-n", "0", "-o", str(run)],
        capture_output=True, text=True, timeout=540, cwd=REPO,
        env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
             "PYTHONPATH": str(REPO)})
    ended = time.time()
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    records = [json.loads(line) for line in (run / "loss_history.jsonl").read_text().splitlines()]
    found = [r for r in records if r["kind"] == "startup"]
    assert len(found) == 1, [r["kind"] for r in records]
    record = found[0]
    first_step = next(r for r in records if r["kind"] == "train")
    assert record["step"] == first_step["step"] == 0
    assert list(record["phases"]) == LABELS  # every mark of the chain, the driver's included
    assert all(s >= 0 for s in record["phases"].values()), record["phases"]
    total = sum(record["phases"].values())
    assert launched <= record["marks"]["driver"]["process_started"] + 0.02
    assert 0 < total <= first_step["time"] - launched + 0.02
    assert first_step["time"] <= record["time"] <= ended
    # the validation before step 1 (-v's default 20 validates at step 0) has its own phase
    first_val = next(r for r in records if r["kind"] == "val")
    assert record["phases"]["validation before step 1"] > 0
    assert record["marks"]["first_val_done"] >= first_val["time"]
    lines = [re.sub(r"^\S*\((\w+) pid=\d+\)\S* ", "", line) for line in out.splitlines()]
    shown = [line for line in lines if line.startswith("raygpt | startup: ")]
    assert shown == [f"raygpt | startup: {total:.1f} s to the first step = " + " + ".join(
        f"{k} {v:.1f}" for k, v in record["phases"].items() if v >= 0.05) + " (s)"]
