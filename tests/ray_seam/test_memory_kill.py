"""A worker killed by Ray's memory monitor ends the run at once: exit 2, one line naming -b with
the estimate, no retry. A real driver (`python -m raygpt.cli train`) starts its own local Ray
whose monitor threshold sits a few GiB above what this machine uses now; the `hog` fault grows
rank 0's host memory past it and the monitor kills the worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from raygpt.config import as_command
from raygpt.ray.driver import StopOnRunStopped, killed_for_memory
from raygpt.train.errors import EXIT_BAD_INPUT
from tests.helpers import records, tiny_config

REPO = Path(__file__).resolve().parents[2]
HEADROOM = 5 << 30  # above today's use: Ray's processes and the worker fit, the hog does not


def memory_threshold(headroom: int = HEADROOM) -> float:
    """RAY_memory_usage_threshold that puts the monitor's line `headroom` bytes above this
    machine's memory in use now (MemTotal - MemAvailable)."""
    kib = {line.split(":")[0]: int(line.split()[1])
           for line in Path("/proc/meminfo").read_text().splitlines()}
    total, used = kib["MemTotal"] << 10, (kib["MemTotal"] - kib["MemAvailable"]) << 10
    return min(0.95, (used + headroom) / total)


def test_a_worker_killed_by_rays_memory_monitor_ends_the_run_with_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, max_steps=50, checkpoint_every=0, max_failures=3,
                      fault="hog:rank=0,step=2")
    fields, flags = as_command(cfg)
    (tmp_path / "cfg.json").write_text(json.dumps(fields))
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": str(REPO),
           "RAY_memory_usage_threshold": f"{memory_threshold():.4f}",
           "RAY_memory_monitor_refresh_ms": "50"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "raygpt.cli", "train", "--config",
                             str(tmp_path / "cfg.json"), *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver's own Ray, whatever happened
        except ProcessLookupError:
            pass
    assert proc.returncode == EXIT_BAD_INPUT, err[-3000:]
    assert time.monotonic() - t0 < 120
    # Ray's controller logs its own account of the kill around raygpt's one line
    lines = [line for line in err.splitlines() if line.startswith("raygpt:")]
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    assert line.startswith(f"raygpt: error: raygpt run {run_dir} stopped (not retried, it would "
                           f"fail again): out of memory in host memory (rank 0 killed by Ray's "
                           f"memory monitor, the node at "), line
    assert "at step 2: the estimate for this shape is " in line, line
    assert line.endswith("; lower -b (now 4)"), line
    starts = [r for r in records(run_dir) if r["kind"] in ("start", "resume")]
    assert len(starts) == 1, starts  # one attempt: --max-failures 3 was not spent on it


def test_the_failure_policy_raises_on_a_worker_the_memory_monitor_killed():
    """As Ray Train 2.60 delivers the kill: the dead worker's health-check poll met Ray's
    OutOfMemoryError, wrapped in WorkerHealthCheckFailedError; any other death is retried."""
    from ray.exceptions import OutOfMemoryError
    from ray.train import FailureConfig
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    said = ("1 worker(s) were killed due to the node running low on memory. Memory on the node "
            "(IP: 10.0.0.1, ID: fed9) was 6.07GB used / 23.54GB limit (0.257885)")
    killed = WorkerGroupError("rank 1 died", {
        0: RuntimeError("gloo: connection closed by peer"),
        1: WorkerHealthCheckFailedError("A worker health check failed.",
                                        failure=OutOfMemoryError(said))})
    assert killed_for_memory(killed) == (1, said)
    policy = StopOnRunStopped(FailureConfig(max_failures=3))
    assert policy.make_decision(killed) == FailureDecision.RAISE
    lost = WorkerGroupError("rank 1 died", {1: WorkerHealthCheckFailedError(
        "A worker health check failed.", failure=RuntimeError("The actor died unexpectedly"))})
    assert killed_for_memory(lost) is None
    assert policy.make_decision(lost) == FailureDecision.RETRY
