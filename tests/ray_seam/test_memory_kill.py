"""A worker killed by Ray's memory monitor, told as it was (raygpt.ray.memory_kill).

When raygpt held the memory the run ends at once: exit 2, one line naming -b with the estimate,
no retry. A real driver (`python -m raygpt.cli train`) starts its own local Ray whose monitor
threshold sits a few GiB above what this machine uses now; the `hog` fault grows rank 0's host
memory past it and the monitor kills the worker.

When something else held it, the kill is a fault that may pass (retried within FailureConfig):
a real driver's Ray kills a worker for the memory of a plain process outside Ray
(tests/ray_seam/memory_hog.py), one line names that process, and the run resumes and ends with
an uninterrupted run's losses. The verdict's edges are tested on Ray's own text, captured from
four real kills on this 2-core machine (tests/ray_seam/data): one by the `hog` fault in rank 0
under Ray 2.60's default policy, two in which other programs on the shared machine pushed it
over the line, one of a helper actor (the by-group policy)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raygpt.config import as_command
from raygpt.ray.driver import StopOnRunStopped
from raygpt.ray.memory_kill import killed_for_memory
from raygpt.train.errors import EXIT_BAD_INPUT
from tests.helpers import RAY_LOG_LINE, records, tiny_config, train_losses

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


DATA = Path(__file__).parent / "data"
RAYGPT_OVER = (DATA / "ray_oom_raygpt_over.txt").read_text()  # the hog fault in rank 0 (pid 9008)
OTHERS_HOLD = (DATA / "ray_oom_others_hold.txt").read_text()  # other programs (pid 21708 the most)
HELPER_KILLED = (DATA / "ray_oom_helper_killed.txt").read_text()  # a helper actor, not a worker
# a fourth real kill: two workers within their estimate (0.85, 0.82 GiB) on a machine where
# engineers' test runs held 7 GiB, the largest of them 1.35 GiB (pid 30590)
SHARED_MACHINE = (DATA / "ray_oom_shared_machine.txt").read_text()
TINY_ESTIMATE = int(0.914 * 2**30)  # tiny_config's estimate for a worker (raygpt.model.memory)


def _group_error(text: str, rank: int = 0):
    from ray.exceptions import OutOfMemoryError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    from ray.train.v2.api.exceptions import WorkerGroupError
    return WorkerGroupError("a worker died", {rank: WorkerHealthCheckFailedError(
        "A worker health check failed.", failure=OutOfMemoryError(text))})


def test_rays_text_of_a_kill_is_read_whole():
    from raygpt.ray.memory_kill import Process, parse
    over = parse(RAYGPT_OVER)
    assert (over.used_gib, over.limit_gib) == (7.46, 23.59)
    assert len(over.workers) == 7  # the default policy lists every worker of the raylet
    assert over.train == (Process(9008, 1.08, "RayTrainWorker.__init__"),)
    assert over.top[:2] == (Process(9008, 1.08, "ray::RayTrainWorker"),
                            Process(4856, 0.83, "ray::RayTrainWorker"))
    assert len(over.top) == 10
    others = parse(OTHERS_HOLD)
    assert (others.used_gib, others.limit_gib) == (12.47, 23.59)
    assert others.train == (Process(21461, 0.32, "RayTrainWorker.__init__"),)
    assert others.top[0] == Process(21708, 0.93, "/root/.pyenv/versions/3.11.7/bin/python -c")
    assert parse("no such text") == parse("")  # nothing read, nothing made up
    assert parse("").used_gib is None and parse("").top == ()


def test_a_worker_over_its_estimate_or_the_top_holder_is_raygpts_own():
    from raygpt.ray.memory_kill import judge, parse
    over = parse(RAYGPT_OVER)
    v = judge(over, TINY_ESTIMATE)
    assert v.over_estimate and not v.passing  # 1.08 GiB against 0.91
    # within a larger estimate, the run's worker is still the node's largest process
    v = judge(over, int(1.5 * 2**30))
    assert not v.over_estimate and v.outsider.pid == 4856 and not v.passing
    policy = StopOnRunStopped(_failure_config(), TINY_ESTIMATE)
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    assert policy.make_decision(_group_error(RAYGPT_OVER)) == FailureDecision.RAISE


def test_memory_another_process_holds_is_a_fault_that_may_pass():
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from raygpt.ray.memory_kill import judge, parse
    others = parse(OTHERS_HOLD)
    v = judge(others, TINY_ESTIMATE)
    assert v.passing and v.outsider.pid == 21708 and v.raygpt_gib == 0.32
    assert abs(v.outside_gib - (12.47 - (0.32 + 0.11 + 0.11 + 0.24 + 0.04))) < 1e-6
    # the edges, each side: an estimate below the worker's use, a worker as large as the outsider
    assert not judge(others, int(0.31 * 2**30)).passing
    assert judge(others, int(0.33 * 2**30)).passing
    roomy = int(1.5 * 2**30)  # an estimate no worker here is over
    assert not judge(parse(OTHERS_HOLD.replace("actual memory used=0.32GB",
                                               "actual memory used=0.93GB")), roomy).passing
    assert judge(parse(OTHERS_HOLD.replace("actual memory used=0.32GB",
                                           "actual memory used=0.92GB")), roomy).passing
    # the driver's own process is not "something else"
    assert judge(others, TINY_ESTIMATE, own_pids=(21708,)).outsider.pid == 18776
    policy = StopOnRunStopped(_failure_config(), TINY_ESTIMATE)
    assert policy.make_decision(_group_error(OTHERS_HOLD)) == FailureDecision.RETRY


def test_the_largest_holder_is_judged_process_against_process():
    """Two workers within their estimate hold more together (1.67 GiB) than the node's largest
    other process (1.35 GiB), but neither is the node's largest holder: a fault that may pass."""
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from raygpt.ray.memory_kill import judge, parse
    kill = parse(SHARED_MACHINE)
    assert [(w.pid, w.gib) for w in kill.train] == [(30090, 0.82), (30118, 0.85)]
    v = judge(kill, TINY_ESTIMATE)
    assert v.passing and v.outsider.pid == 30590 and abs(v.raygpt_gib - 1.67) < 1e-9
    assert v.largest_gib == 0.85
    # the edges: an outsider as large as the largest worker is not larger; a worker over the
    # estimate is raygpt's own however large the outsider
    assert not judge(parse(SHARED_MACHINE.replace("30590\t1.35", "30590\t0.85")),
                     TINY_ESTIMATE).passing
    assert judge(parse(SHARED_MACHINE.replace("30590\t1.35", "30590\t0.86")),
                 TINY_ESTIMATE).passing
    assert not judge(kill, int(0.84 * 2**30)).passing
    policy = StopOnRunStopped(_failure_config(), TINY_ESTIMATE)
    assert policy.make_decision(_group_error(SHARED_MACHINE, rank=1)) == FailureDecision.RETRY


def test_a_retried_kill_is_told_in_one_line_by_the_failure_policy(tmp_path):
    """The controller's policy says a kill it retries in one line, with the step from the run's
    history; a kill it does not retry (raygpt's own, or the budget spent) it leaves to the driver."""
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from raygpt.runlog.history import append_record
    from raygpt.storage import open_run_dir
    from tests.helpers import log_lines
    run_dir = tmp_path / "run"
    policy = StopOnRunStopped(_failure_config_of(1), TINY_ESTIMATE, output_dir=str(run_dir))
    with open_run_dir(str(run_dir)) as rd:
        append_record(rd, {"kind": "train", "step": 11, "loss": 5.0, "time": policy.since + 1,
                           "attempt": 1})
    with log_lines("raygpt.ray.driver") as said:
        assert policy.make_decision(_group_error(OTHERS_HOLD, rank=1)) == FailureDecision.RETRY
        assert policy.make_decision(_group_error(OTHERS_HOLD, rank=1)) == FailureDecision.RAISE
        assert policy.make_decision(_group_error(RAYGPT_OVER)) == FailureDecision.RAISE
    assert said == [
        "raygpt | Ray's memory monitor killed rank 1 at step 12: the node held 12.5 of 23.6 GiB, "
        "11.7 GiB of it outside this run, the most by pid 21708 (/root/.pyenv/versions/3.11.7/"
        "bin/python -c, 0.93 GiB); raygpt's workers held 0.32 GiB, estimate 0.9 GiB a worker; "
        "restarting from the newest verified checkpoint (failure 1 of --max-failures 1)"]


def test_rays_account_of_a_kill_goes_to_the_log_and_not_the_terminal(monkeypatch):
    """What the raylet pushes to the driver about a memory kill is diverted; its other messages
    and the workers' own output are printed as Ray prints them."""
    from ray._private import worker
    from raygpt.ray import compat
    from raygpt.ray.memory_kill import is_kill_account
    printed, diverted = [], []
    monkeypatch.setattr(worker, "print_to_stdstream",
                        lambda data, ignore_prefix: printed.append(data["lines"]))
    compat.divert_raylet_messages(is_kill_account, diverted.append)
    compat.divert_raylet_messages(is_kill_account, diverted.append)  # once, however often asked
    died = "A worker died or was killed while executing a task by an unexpected system error."
    # the raylet's periodic count of its kills, as its log lines reach the driver (Ray 2.60.0)
    count = ["[2026-12-06 14:26:44,424 E 14085 14085] (raylet) node_manager.cc:3517: 2 Workers "
             "(tasks / actors) killed due to memory pressure (OOM), 0 Workers crashed due to "
             "other reasons at node (ID: d11c, IP: 192.0.2.2) over the last time period.", "",
             "Refer to the documentation on how to address the out of memory issue: https://..."]
    worker.print_to_stdstream({"pid": "raylet", "lines": [OTHERS_HOLD]}, False)
    worker.print_to_stdstream({"pid": "raylet", "lines": [died]}, False)
    worker.print_to_stdstream({"pid": "raylet", "lines": [HELPER_KILLED]}, False)
    worker.print_to_stdstream({"pid": "raylet", "lines": count}, False)
    worker.print_to_stdstream({"pid": 4242, "lines": [OTHERS_HOLD]}, False)
    assert diverted == [OTHERS_HOLD, HELPER_KILLED, *count]
    assert printed == [[died], [OTHERS_HOLD]]


def _failure_config_of(max_failures: int):
    from ray.train import FailureConfig
    return FailureConfig(max_failures=max_failures)


def _failure_config():
    from ray.train import FailureConfig
    return FailureConfig(max_failures=3)


class _FailingTrainer:
    """What fit_or_raise asks of a trainer, fit() raising Ray Train's error of a kill."""

    def __init__(self, error, estimate):
        from ray.train import RunConfig
        self.error, self.estimate = error, estimate
        self.run_config = RunConfig(failure_config=_failure_config())

    def fit(self):
        raise self.error

    def failure_policy(self, failure_config):
        return StopOnRunStopped(failure_config, self.estimate)


def test_the_driver_says_either_verdict_in_one_line(tmp_path):
    from ray.exceptions import OutOfMemoryError
    from raygpt.ray.driver import RunFailed, fit_or_raise
    from raygpt.runlog.history import append_record
    from raygpt.storage import open_run_dir
    from raygpt.train.errors import EXIT_FAILED
    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, max_failures=3)
    with open_run_dir(str(run_dir)) as rd:
        append_record(rd, {"kind": "train", "step": 6, "loss": 5.0, "time": 100.0, "attempt": 1})
    with pytest.raises(RunFailed) as e:
        fit_or_raise(_FailingTrainer(_group_error(OTHERS_HOLD, rank=1), TINY_ESTIMATE), cfg,
                     open_run_dir(str(run_dir)), 50.0)
    line = str(e.value)
    assert "\n" not in line and e.value.exit_code == EXIT_FAILED and not e.value.final
    assert line == (f"raygpt run {run_dir} failed after 1 attempt(s) (--max-failures 3): Ray's "
                    f"memory monitor killed rank 1 at step 7: the node held 12.5 of 23.6 GiB, "
                    f"11.7 GiB of it outside this run, the most by pid 21708 (/root/.pyenv/"
                    f"versions/3.11.7/bin/python -c, 0.93 GiB); raygpt's workers held 0.32 GiB, "
                    f"estimate 0.9 GiB a worker; -y 1 resumes once that memory is free"), line
    with pytest.raises(RunFailed) as e:
        fit_or_raise(_FailingTrainer(_group_error(RAYGPT_OVER), TINY_ESTIMATE), cfg,
                     open_run_dir(str(run_dir)), 50.0)
    line = str(e.value)
    assert "\n" not in line and e.value.exit_code == EXIT_BAD_INPUT and e.value.final
    assert line.startswith(f"raygpt run {run_dir} stopped (not retried, it would fail again): "
                           f"out of memory in host memory (rank 0 killed by Ray's memory "
                           f"monitor, the node at 7.46GB used / 23.59GB limit) at step 7: "), line
    assert line.endswith("; lower -b (now 4)"), line
    # the monitor killed the controller itself: no rank, the same verdicts
    with pytest.raises(RunFailed) as e:
        fit_or_raise(_FailingTrainer(OutOfMemoryError(OTHERS_HOLD), TINY_ESTIMATE), cfg,
                     open_run_dir(str(run_dir)), 50.0)
    assert "killed the run's controller at step 7" in str(e.value)
    assert e.value.exit_code == EXIT_FAILED


def test_rays_text_goes_to_the_failure_record_and_its_cause_is_one_line(tmp_path):
    from ray.exceptions import OutOfMemoryError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    from raygpt.ray.checkpoints import CheckpointFinalizer
    from tests.helpers import tiny_config
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    CheckpointFinalizer(tiny_config(run_dir)).after_exception(None, {
        0: WorkerHealthCheckFailedError("A worker health check failed.\nWorker info: ...",
                                        failure=OutOfMemoryError(OTHERS_HOLD)),
        1: RuntimeError("gloo: connection closed by peer")})
    (failure,) = [r for r in records(run_dir) if r["kind"] == "failure"]
    assert failure["causes"] == {
        "0": "killed by Ray's memory monitor, the node at 12.5 of 23.6 GiB; largest: pid 21708 "
             "(/root/.pyenv/versions/3.11.7/bin/python -c, 0.93 GiB)",
        "1": "RuntimeError: gloo: connection closed by peer"}
    assert failure["ray_text"] == {"0": OTHERS_HOLD}


def test_the_controllers_repeats_of_rays_text_stay_off_the_terminal():
    import logging
    from raygpt.ray.controller_logs import _CONTROLLER_LOGGERS, QuietMemoryKills
    from ray.exceptions import OutOfMemoryError
    QuietMemoryKills().after_controller_start(None)
    QuietMemoryKills().after_controller_start(None)  # once, however often the controller starts
    for name in _CONTROLLER_LOGGERS:
        logger = logging.getLogger(name)
        assert len(logger.filters) == 1, name
        seen = []
        handler = logging.Handler()
        handler.emit = seen.append
        logger.addHandler(handler)
        try:
            try:
                raise OutOfMemoryError(OTHERS_HOLD)
            except OutOfMemoryError:
                logger.exception("Error shutting down worker group.")
            logger.warning("Another error occurred during shutdown after a training error. "
                           "Error: %s", OTHERS_HOLD)
            logger.warning("Torch process group shutdown timed out after 30 seconds")
        finally:
            logger.removeHandler(handler)
        assert [r.getMessage() for r in seen] == [
            "Torch process group shutdown timed out after 30 seconds"], name


def test_a_helper_actor_killed_is_judged_by_what_the_run_lists():
    """A third real kill: the retry of a kill for the hog's memory was under way when the
    machine's other programs crossed the line again, and the monitor took raygpt's placement-group
    reaper (no training worker listed). The run held 0.41 GiB of 9.2: not raygpt's to fix."""
    from raygpt.ray.memory_kill import parse, judge
    kill = parse(HELPER_KILLED)
    assert kill.train == () and [w.pid for w in kill.workers] == [32239, 31599, 31193]
    v = judge(kill, TINY_ESTIMATE)
    assert abs(v.raygpt_gib - 0.41) < 1e-9 and not v.over_estimate
    assert v.outsider.pid == 18491 and v.passing


def test_the_group_shutdown_forgives_a_worker_killed_for_memory_only(monkeypatch):
    """Ray Train forgives RayActorError in the worker group's shutdown, and a worker the monitor
    killed answers with OutOfMemoryError instead: without raygpt's backend the restart of a
    retried kill failed there (seen on a real kill, Ray 2.60.0)."""
    import ray.train.torch.config as torch_config
    from ray.exceptions import OutOfMemoryError
    from raygpt.ray.worker import RaygptTorchConfig

    class Group:
        def __len__(self):
            return 1

        def execute_async(self, fn, **kwargs):
            return []

    def get(refs, timeout=None):
        raise answer

    monkeypatch.setattr(torch_config.ray, "get", get)
    backend = RaygptTorchConfig(backend="gloo").backend_cls()
    answer = OutOfMemoryError(OTHERS_HOLD)
    backend.on_shutdown(Group(), None)  # forgiven
    answer = RuntimeError("something else")
    with pytest.raises(RuntimeError):
        backend.on_shutdown(Group(), None)


def test_rays_own_start_kills_one_worker_at_a_time_unless_the_user_said(monkeypatch):
    from raygpt.ray import driver
    seen = []
    monkeypatch.setattr(driver.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(driver.ray, "init", lambda **kw: seen.append(
        (kw["address"], os.environ.get("RAY_worker_killing_policy_by_group"))))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_DEDUP_LOGS", raising=False)  # init_ray sets it too: given back
    monkeypatch.delenv("RAY_worker_killing_policy_by_group", raising=False)
    driver.init_ray()
    monkeypatch.setenv("RAY_worker_killing_policy_by_group", "false")
    driver.init_ray()
    monkeypatch.delenv("RAY_worker_killing_policy_by_group")
    driver.init_ray("ray://cluster:10001")  # a cluster's policy is its own
    assert seen == [("local", "true"), ("local", "false"), ("ray://cluster:10001", None)]


HOG = Path(__file__).parent / "memory_hog.py"
STEPS = 200
HOG_HEADROOM = 8 << 30  # above today's use: Ray, the run and the machine's other programs' swings


class _Lines:
    """A process's output lines as they come (a reader thread each for stdout and stderr)."""

    def __init__(self, proc):
        import threading
        self.out, self.err = [], []
        self.threads = [threading.Thread(target=self._read, args=(s, into), daemon=True)
                        for s, into in ((proc.stdout, self.out), (proc.stderr, self.err))]
        for t in self.threads:
            t.start()

    @staticmethod
    def _read(stream, into):
        for line in stream:
            into.append(line.rstrip("\n"))

    def all(self) -> list[str]:
        return self.out + self.err


def _wait_for(what, deadline: float, why, proc=None):
    """what()'s first true answer before the deadline (or before `proc` ends); else fails
    with why()."""
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.02)
    raise AssertionError(why())


def _session_processes(sid: int, name: str) -> list[int]:
    """The pids of session `sid` whose command line starts with `name` (Ray's workers of a
    driver started in its own session)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rpartition(")")[2].split()
            cmd = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if int(stat[3]) == sid and cmd.startswith(name):
            pids.append(int(d.name))
    return pids


def _train_command(cfg, tmp_path: Path, name: str, env: dict):
    fields, flags = as_command(cfg)
    (tmp_path / f"{name}.json").write_text(json.dumps(fields))
    return subprocess.Popen([sys.executable, "-m", "raygpt", "train", "--config",
                             str(tmp_path / f"{name}.json"), *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)


def _end(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver's own Ray, whatever happened
    except ProcessLookupError:
        pass


def _meminfo() -> tuple[int, int]:
    """(total, in use) bytes of this machine's memory as Ray's monitor counts it."""
    kib = {line.split(":")[0]: int(line.split()[1])
           for line in Path("/proc/meminfo").read_text().splitlines()}
    return kib["MemTotal"] << 10, (kib["MemTotal"] - kib["MemAvailable"]) << 10


def test_memory_another_process_holds_is_retried_and_the_run_ends_as_if_uninterrupted(tmp_path):
    """A real kill by Ray's monitor for memory a process outside raygpt and Ray holds (the hog,
    grown once the run has a checkpoint until the monitor kills a worker): one line names that
    process and what it holds, the worker group is restarted within --max-failures (not exit 2),
    and once the hog is gone the run resumes from its checkpoint and ends with the losses of an
    uninterrupted run, as floats. Ray's own account of the kill stays off the terminal."""
    # long enough that the run still trains when the hog is grown (a few s), however busy the
    # machine: the hog starts at the first checkpoint
    cfg = tiny_config(tmp_path / "killed", num_workers=2, max_steps=STEPS, checkpoint_every=20,
                      max_failures=3)
    env = {**{k: v for k, v in os.environ.items()
              if k not in ("RAY_ADDRESS", "RAY_COLOR_PREFIX")}, "PYTHONPATH": str(REPO)}
    whole = _train_command(cfg.with_overrides({"output_dir": str(tmp_path / "whole")}),
                           tmp_path, "whole", env)
    try:
        out, err = whole.communicate(timeout=600)
    finally:
        _end(whole)
    assert whole.returncode == 0, (out + err)[-3000:]

    threshold = memory_threshold(HOG_HEADROOM)
    total, _ = _meminfo()
    env.update({"RAY_memory_usage_threshold": f"{threshold:.4f}",
                "RAY_memory_monitor_refresh_ms": "50"})
    t0 = time.monotonic()
    proc = _train_command(cfg, tmp_path, "killed", env)
    hog = None
    try:
        lines = _Lines(proc)
        tail = lambda: "\n".join(lines.all()[-60:])  # noqa: E731
        _wait_for(lambda: list((tmp_path / "killed").glob("step_*/DONE_*")), t0 + 600,
                  lambda: "no checkpoint:\n" + tail(), proc)
        workers = _session_processes(proc.pid, "ray::RayTrainWorker")
        assert len(workers) == 2, workers
        hog = subprocess.Popen([sys.executable, str(HOG), str(int(threshold * total) - (1 << 29)),
                                *map(str, workers)], stdout=subprocess.PIPE, text=True)
        held = int(hog.stdout.readline().split()[2])  # once the monitor has killed a worker
        said = _wait_for(lambda: [x for x in lines.all() if f"the most by pid {hog.pid} " in x],
                         time.monotonic() + 60, lambda: "no line:\n" + tail(), proc)
        hog.kill()  # the memory is free again: the restarted workers may have it
        proc.wait(timeout=600)
    finally:
        _end(proc)
        if hog is not None:
            hog.kill()
    for t in lines.threads:
        t.join(5)
    (tmp_path / "terminal.txt").write_text("\n".join(lines.all()))  # kept if the test fails
    assert proc.returncode == 0, tail()
    # one line for the kill, the process named with what it held as Ray measured it
    kills = [x for x in lines.all() if "memory monitor" in x]
    assert kills == said, kills
    m = re.search(r"raygpt \| Ray's memory monitor killed rank [01] at step (\d+): the node "
                  r"held [\d.]+ of [\d.]+ GiB, [\d.]+ GiB of it outside this run, the most by "
                  rf"pid {hog.pid} \(\S*python\S* [^,]*, ([\d.]+) GiB\); raygpt's "
                  r"workers held [\d.]+ GiB, estimate [\d.]+ GiB a worker; restarting from the "
                  r"newest verified checkpoint \(failure 1 of --max-failures 3\)$", said[0])
    assert m, said
    assert held / 2**30 - 0.5 < float(m[2]) <= held / 2**30 + 0.05, (held, said)
    # none of Ray's account of it: the raylet's lines, the monitor's dump, a traceback
    noise = [x for x in lines.all() if any(w in x for w in (
        "(raylet)", "low on memory", "Memory on the node", "killing policy", "Top 10 memory",
        "RAY_memory", "OutOfMemory", "Traceback")) or RAY_LOG_LINE.search(x)]
    assert not noise, noise[:5]
    history = records(tmp_path / "killed")
    (failure,) = [r for r in history if r["kind"] == "failure"]
    assert f"\n{hog.pid}\t" in next(iter(failure["ray_text"].values()))
    (resume,) = [r for r in history if r["kind"] == "resume"]
    assert resume["resumed_from"] is not None and resume["resumed_from"] <= int(m[1])
    assert train_losses(tmp_path / "killed") == train_losses(tmp_path / "whole")
    assert sorted(train_losses(tmp_path / "whole")) == list(range(STEPS))
