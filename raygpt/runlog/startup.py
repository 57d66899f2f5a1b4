"""Where a run's seconds before its first step go: the start-up marks of one launch, from the
`raygpt train` process's start to the first trained step, as consecutive phases.

The marks are wall times (time.time()) set where each thing happens: the command line (its
process start, config and preflight), the driver (run directory, Ray, Ray Train's helpers,
fit), Ray Train's controller (the worker group up, the process group formed: raygpt.ray.worker's
backend), the worker (its process start, train function, imports, model, loaders, restore) and
the reporter (the loop's start, the validation before step 1, the first step). `phases` turns
whichever of them a run has into consecutive intervals, so they add up to the time from the
first mark to the first step exactly; the reporter writes them once per launch as a "startup"
record in loss_history.jsonl and a `raygpt | startup:` line (bench/first_step.py tabulates them).
Clocks of different nodes are as close as NTP keeps them.
"""

from __future__ import annotations

import math
import os
import time

# (mark, what happened between the previous mark and it), in the order they happen. The marks
# live in the start record's "startup" dict: the driver's under "driver", the worker's own under
# "setup", the controller's and the restore's at the top (history.STARTUP_MARKS).
CHAIN = (
    ("driver.process_started", None),
    ("driver.cli_started", "python and raygpt's imports"),
    ("driver.checked", "config and preflight"),
    ("driver.run_dir_claimed", "Ray Train imported, run directory claimed"),
    ("driver.ray_started", "Ray started"),
    ("driver.helpers_started", "Ray Train's helpers and the control actor"),
    ("group_up", "trainer, controller and worker processes up"),
    ("process_group", "process group formed"),
    ("setup.train_func", "train function called"),
    ("setup.loop_imported", "raygpt's loop imported"),
    ("setup.model_built", "model and optimizer built"),
    ("setup.loader_built", "data loaders"),
    ("state_loaded", "checkpoint looked up and restored"),
    ("loop_started", "reporter and the loop's components"),
    ("first_val_done", "validation before step 1"),
    ("first_step_done", "first step"),
)


def process_started() -> float | None:
    """The wall time this process was created (Linux's /proc: field 22 of /proc/self/stat is its
    start in clock ticks after boot, /proc/uptime the time since boot now), None where /proc is
    not there."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def _mark(startup: dict, name: str) -> float | None:
    """The mark `name` ("driver.ray_started", "group_up", ...) of a startup dict, None when it
    is missing or not a finite number (the records are read back as untrusted input)."""
    node = startup
    for key in name.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    ok = isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node)
    return float(node) if ok else None


def phases(startup: dict) -> list[tuple[str, float]]:
    """(label, seconds) of each phase between consecutive marks of CHAIN that `startup` has;
    a missing mark folds its phase into the next present one, so the seconds add up to the last
    mark minus the first. A mark earlier than the one before it (another node's clock) counts
    as 0 s and the chain goes on from the later of the two."""
    out: list[tuple[str, float]] = []
    last: float | None = None
    for name, label in CHAIN:
        t = _mark(startup, name)
        if t is None:
            continue
        if last is not None:
            out.append((label, max(0.0, t - last)))
        last = t if last is None else max(last, t)
    return out


def startup_line(startup: dict) -> str:
    """The console's one line: the seconds from the process start to the first step, and each
    phase of a twentieth of a second or more."""
    parts = phases(startup)
    total = sum(s for _, s in parts)
    shown = [f"{label} {s:.1f}" for label, s in parts if s >= 0.05]
    return f"raygpt | startup: {total:.1f} s to the first step = " + " + ".join(shown) + " (s)"
