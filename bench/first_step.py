"""Where the seconds before a run's first step go: the main job's command, run N times, each
run's "startup" record (raygpt.runlog.startup: the phases from the `raygpt train` process's
start to its first step) tabulated with the median, beside two figures measured from outside:
the wall time from launching the command to the first step's record, and the CPU seconds the
run's processes (the driver, Ray's, the workers: the launched process's tree in Linux's
/proc, sampled every 0.5 s) used until then, which a machine shared with other work inflates less than wall time.

    python bench/first_step.py                       # 3 runs of experiments/shakespeare.py -x 2
    python bench/first_step.py --runs 5 -- -x 2 --gpu    # flags after -- go to the command

On a GPU machine the same command runs the GPU defaults (GPT-2 124M in bf16, torch.compile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, str(REPO / "experiments" / "shakespeare.py")]


def startup_record(history: Path) -> dict | None:
    """The run's "startup" record, None until rank 0 wrote it (after its first step)."""
    if not history.exists():
        return None
    for line in history.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line being written
        if r.get("kind") == "startup":
            return r
    return None


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds: user + system) of a process from Linux's /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int, seen: dict[int, float]) -> None:
    """Add the CPU seconds of process `root` and its descendants to `seen`, by pid (a process
    that has ended keeps its last sample)."""
    stats = {int(pid): st for pid in os.listdir("/proc") if pid.isdigit()
             if (st := _stat(pid)) is not None}
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, (ppid, _) in stats.items() if ppid in tree and pid not in tree}
        tree |= more
        grew = bool(more)
    for pid in tree & stats.keys():
        seen[pid] = max(seen.get(pid, 0.0), stats[pid][1])


def one_run(args: list[str], run_dir: Path, log: Path, timeout_s: float) -> dict:
    """Launch the command, sample its tree's CPU until the startup record appears, wait for it to
    end; the record's phases, the wall time to the first step and the CPU seconds until then."""
    history = run_dir / "loss_history.jsonl"
    cpu: dict[int, float] = {}
    launched = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen([*COMMAND, *args, "-o", str(run_dir)], stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + timeout_s
        record = None
        while record is None and proc.poll() is None and time.monotonic() < deadline:
            tree_cpu_seconds(proc.pid, cpu)
            record = startup_record(history)
            time.sleep(0.5)
        cpu_to_first_step = sum(cpu.values())
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    record = record or startup_record(history)
    if record is None:  # e.g. Ray's node timing out on a machine loaded by other work
        return {"rc": rc, "failed": f"no startup record in {history}; see {log}"}
    first_step = record["marks"]["first_step_done"]
    return {"phases": record["phases"], "to_first_step_s": first_step - launched,
            "cpu_to_first_step_s": cpu_to_first_step, "rc": rc}


def table(runs: list[dict]) -> str:
    labels = list(runs[0]["phases"])
    for r in runs[1:]:
        labels += [k for k in r["phases"] if k not in labels]
    head = f"{'seconds':48s}" + "".join(f"{'run ' + str(i + 1):>9s}" for i in range(len(runs)))
    lines = [head + f"{'median':>9s}"]

    def row(name: str, values: list[float | None]) -> str:
        present = [v for v in values if v is not None]
        cells = "".join(f"{v:9.2f}" if v is not None else f"{'-':>9s}" for v in values)
        return f"{name:48s}{cells}{statistics.median(present) if present else float('nan'):9.2f}"

    for label in labels:
        lines.append(row("  " + label, [r["phases"].get(label) for r in runs]))
    lines.append(row("sum of the phases", [sum(r["phases"].values()) for r in runs]))
    lines.append(row("launch to the first step (outside)", [r["to_first_step_s"] for r in runs]))
    lines.append(row("CPU seconds of the run until then", [r["cpu_to_first_step_s"] for r in runs]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    p.add_argument("--keep", default=None, help="a directory for the runs and their logs "
                   "(default: a temporary one, removed)")
    p.add_argument("args", nargs="*", help="flags for the command, after --")
    a = p.parse_args(argv)
    args = a.args or ["-x", "2"]
    with tempfile.TemporaryDirectory(prefix="first_step_") as tmp:
        where = Path(a.keep or tmp)
        where.mkdir(parents=True, exist_ok=True)
        print(f"# {' '.join(COMMAND[1:])} {' '.join(args)} | {a.runs} runs | "
              f"{os.cpu_count()} CPUs | load {os.getloadavg()[0]:.1f} at the start", flush=True)
        runs, tries = [], 0
        while len(runs) < a.runs and tries < 2 * a.runs:  # a failed run is said and retried
            tries += 1
            r = one_run(args, where / f"run{tries}", where / f"run{tries}.log", a.timeout)
            if "failed" in r:
                print(f"# try {tries}: exit {r['rc']}, {r['failed']}", flush=True)
                continue
            runs.append(r)
            print(f"# try {tries}: exit {r['rc']}, {r['to_first_step_s']:.1f} s to the first "
                  f"step, load {os.getloadavg()[0]:.1f}", flush=True)
        if runs:
            print(table(runs))
    return 0 if len(runs) == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
