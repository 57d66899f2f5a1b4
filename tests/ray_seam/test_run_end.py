"""How a run ends: errors a restart cannot cure end it at once (exit 2 bad input, 1 a stop raygpt
decided) while a lost worker is still retried; Ctrl-C on a real driver process checkpoints and
stops (exit 3, -y 1 resumes bit-exactly) and a second Ctrl-C aborts at once (exit 130); the
default job checkpoints mid-run and --checkpoint-minutes saves on every rank at the same step.
One local Ray (2 CPUs) is shared by the in-process runs; the Ctrl-C tests run their own driver."""

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing.protocol import CheckpointError
from raygpt.config import ConfigError, SpikeConfig, TrainConfig, as_command
from raygpt.llmc.shards import ShardError
from raygpt.llmc.state_file import StateFileError
from raygpt.train.errors import (EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_FAILED, EXIT_STOPPED, RunStopped,
                           TrainingStopped, stop_code)
from raygpt.ray.driver import RunFailed, StopOnRunStopped, run
from raygpt.runlog.tracking import TrackingError
from raygpt.storage import open_run_dir
from raygpt.train.signals import SaveClock
from tests.helpers import records, tiny_config, train_losses

REPO = Path(__file__).resolve().parents[2]
TWO = dict(num_workers=2, max_steps=12, checkpoint_every=4, total_batch_size=4 * 32 * 2)


# ---------------------------------------------------------------------- which errors end a run


def raised_from(error: BaseException, cause: BaseException) -> BaseException:
    """`error` as `raise error from cause` leaves it (its __cause__ set, as stop_code reads it)."""
    try:
        try:
            raise cause
        except BaseException as e:
            raise error from e
    except BaseException as raised:
        return raised

def test_stop_code_tells_bad_input_and_decisions_from_curable_faults():
    assert stop_code(ConfigError("-x: expected ...")) == EXIT_BAD_INPUT
    assert stop_code(CheckpointError("step_00000008/MANIFEST.json: ...")) == EXIT_BAD_INPUT
    # a rank's state file that does not parse: the next attempt would read the same bytes
    assert stop_code(StateFileError("state_00000008_00000.bin: header[0] magic: ...")) == EXIT_BAD_INPUT
    assert stop_code(ShardError("train.bin: magic ...")) == EXIT_BAD_INPUT
    assert stop_code(TrainingStopped("spike policy: ...")) == EXIT_FAILED
    assert stop_code(RunStopped("x", EXIT_BAD_INPUT)) == EXIT_BAD_INPUT
    for curable in (RuntimeError("gloo: connection reset"), OSError("EIO"), ValueError("x")):
        assert stop_code(curable) is None
    # a shard read that failed on a flaky mount may succeed on the next attempt
    assert stop_code(raised_from(ShardError("train.bin: cannot read shard"),
                                 OSError(5, "Input/output error"))) is None
    # a tracker asked for that cannot start (a URI MLflow refuses, a W&B login that is missing,
    # a corrupt tracking.json) is bad input; a tracking server that did not answer may next time
    assert stop_code(TrackingError("--mlflow htp://x: could not start an MLflow run")) == EXIT_BAD_INPUT
    assert stop_code(raised_from(
        TrackingError("--mlflow http://mlflow:5000: could not start an MLflow run"),
        ConnectionRefusedError(111, "Connection refused"))) is None


def test_run_stopped_survives_the_trip_to_the_driver():
    e = pickle.loads(pickle.dumps(RunStopped("ShardError: train.bin: magic", EXIT_BAD_INPUT)))
    assert isinstance(e, RunStopped) and e.exit_code == EXIT_BAD_INPUT
    assert e.message == "ShardError: train.bin: magic"


def test_failure_policy_raises_on_run_stopped_and_retries_the_rest():
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    policy = StopOnRunStopped(FailureConfig(max_failures=3))
    lost = WorkerGroupError("rank 1 died", {1: RuntimeError("actor died")})
    stopped = WorkerGroupError("rank 0 raised", {0: RunStopped("bad shard", EXIT_BAD_INPUT),
                                                 1: RuntimeError("collective aborted")})
    assert policy.make_decision(stopped) == FailureDecision.RAISE
    assert [policy.make_decision(lost) for _ in range(4)] == [FailureDecision.RETRY] * 3 + [
        FailureDecision.RAISE]  # the retry budget still applies to curable faults


# ---------------------------------------------------------------------- in-process runs

def go(cfg):
    return run(cfg.resolve(0))


def test_a_bad_input_met_in_one_worker_ends_the_run_at_once(local_ray, tmp_path):
    # rank 1 raises while rank 0 waits in the step's collective: one attempt, exit 2, its message
    cfg = tiny_config(tmp_path, **TWO, max_failures=3, fault="bad_input:rank=1,step=5")
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as e:
        go(cfg)
    # generous (a loaded 2-core box ran 15 s steps): the one attempt counted below is the proof
    assert time.monotonic() - t0 < 300
    assert e.value.exit_code == EXIT_BAD_INPUT and e.value.final  # a sweep's Tune must not retry it
    assert "not retried" in str(e.value) and "injected bad input at step 5" in str(e.value)
    assert "InjectedBadInput" in str(e.value)
    failures = [r for r in records(tmp_path) if r["kind"] == "failure"]
    starts = [r for r in records(tmp_path) if r["kind"] in ("start", "resume")]
    assert len(failures) == 1 and len(starts) == 1  # exactly one attempt
    assert "InjectedBadInput" in failures[0]["causes"]["1"] or "RunStopped" in failures[0]["causes"]["1"]


def test_spike_escalation_stops_the_run_without_a_retry(local_ray, tmp_path):
    # a NaN rewinds; past --spike-max-rewinds 0 the run needs a human: exit 1, never retried
    spike = SpikeConfig(enabled=True, min_history=4, window=8, max_rewinds=0)
    cfg = tiny_config(tmp_path, **{**TWO, "checkpoint_every": 2}, spike=spike, max_failures=3,
                      fault="nan:rank=0,step=7")
    with pytest.raises(RunFailed) as e:
        go(cfg)
    assert e.value.exit_code == EXIT_FAILED
    assert "exceeds --spike-max-rewinds 0" in str(e.value) and "TrainingStopped" in str(e.value)
    assert len([r for r in records(tmp_path) if r["kind"] in ("start", "resume")]) == 1
    assert len([r for r in records(tmp_path) if r["kind"] == "rewind"]) == 1


def test_a_dead_controllers_placement_group_is_removed_without_the_state_api(local_ray):
    """raygpt.ray.pg_cleanup's reaper on its own, with a stand-in for Ray Train's controller: killed
    for real, its placement group is removed (no State API involved: this test process's Ray has
    no dashboard); stopped in order first (the controller removes its own group), the reaper
    exits and leaves the group alone even when the controller dies later."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from raygpt.ray.pg_cleanup import PlacementGroupReaper

    @ray.remote(num_cpus=0)
    class Controller:
        pass

    def state(pg):
        return placement_group_table(pg).get("state")

    reaper_cls = ray.remote(num_cpus=0)(PlacementGroupReaper)
    for ending in ("killed", "in order"):
        controller = Controller.remote()
        pg = placement_group([{"CPU": 1}])
        ray.get(pg.ready(), timeout=120)
        reaper = reaper_cls.options(lifetime="detached").remote(controller, poll_s=0.2)
        ray.get(reaper.register.remote(pg), timeout=120)
        if ending == "in order":
            with pytest.raises(ray.exceptions.RayActorError):  # stop() ends the actor
                ray.get(reaper.stop.remote(), timeout=60)
        ray.kill(controller)
        deadline = time.monotonic() + 60
        if ending == "killed":
            while state(pg) != "REMOVED":
                assert time.monotonic() < deadline, "the dead controller's group was not removed"
                time.sleep(0.2)
        with pytest.raises(ray.exceptions.RayActorError):  # the reaper is gone either way
            ray.get(reaper.register.remote(None), timeout=60)
        if ending == "in order":
            assert state(pg) == "CREATED"  # and it removed nothing before it went
            remove_placement_group(pg)


# A killed worker is still retried under this failure policy and resumes bit-exactly:
# tests/ray_seam/test_driver.py::test_killed_worker_resumes_with_identical_losses (and test_node_loss.py).

CTRL_C = dict(num_workers=2, max_steps=30, checkpoint_every=10, total_batch_size=4 * 32 * 2)


@pytest.fixture(scope="module")
def uninterrupted(local_ray, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    cfg = tiny_config(run_dir, **CTRL_C)
    summary = go(cfg)
    return run_dir, cfg, summary


def test_checkpoint_minutes_saves_on_every_rank_at_the_same_step(uninterrupted, tmp_path):
    # no step interval: only the clock (rank 0's, through the step's agreement) asks for saves.
    # Every such checkpoint is complete (DONE + MANIFEST need both ranks' files at that step)
    # and the losses are those of the run without them.
    full_dir, cfg, full = uninterrupted
    # about 4 saves over the run, whatever this machine's speed (the uninterrupted run's time)
    minutes = full["elapsed_s"] / 4 / 60
    timed = cfg.with_overrides({"output_dir": str(tmp_path), "checkpoint_every": 0,
                                "checkpoint_minutes": minutes,
                                "checkpoints_keep": 0})  # every one written is counted below
    summary = go(timed)
    rd = open_run_dir(str(tmp_path))
    steps = ck.list_checkpoint_steps(rd)
    assert [s for s in steps if s < 30], steps  # saved before the end: by the clock alone
    assert all(not ck.verify_checkpoint(rd, s) for s in steps)
    assert summary["checkpoints_written"] == len(steps)
    assert train_losses(tmp_path) == train_losses(full_dir)


# ---------------------------------------------------------------------- defaults

def test_the_default_job_checkpoints_before_its_end():
    cpu = TrainConfig().resolve(0)
    assert 0 < cpu.checkpoint_every < cpu.max_steps
    gpu = TrainConfig().resolve(1)
    assert 0 < gpu.checkpoint_every < gpu.max_steps and gpu.checkpoint_every == 100
    assert TrainConfig(checkpoint_every=0).resolve(0).checkpoint_every == 0  # -n 0 still works
    with pytest.raises(ConfigError, match="--checkpoint-minutes"):
        TrainConfig(checkpoint_minutes=-1).resolve(0)
    with pytest.raises(ConfigError, match="--checkpoint-minutes"):
        TrainConfig(checkpoint_minutes=math.inf).resolve(0)


def test_checkpoint_minutes_is_a_flag_and_may_change_on_resume():
    from raygpt.config import parse_args
    cfg = parse_args(["--checkpoint-minutes", "30"])
    assert cfg.checkpoint_minutes == 30.0
    assert cfg.hash() == TrainConfig().hash()  # not part of a checkpoint's identity


def test_save_clock_asks_once_per_interval():
    now = [100.0]
    clock = SaveClock(2.0, clock=lambda: now[0])
    assert not clock.due()
    now[0] += 119.9
    assert not clock.due()
    now[0] += 0.1
    assert clock.due() and clock.due()  # stays due until a checkpoint is written
    clock.saved()
    assert not clock.due()
    assert not SaveClock(0.0, clock=lambda: now[0] + 1e9).due()  # 0: off (and on ranks > 0)


# ---------------------------------------------------------------------- Ctrl-C on a real driver

def start_driver(cfg: TrainConfig, tmp_path, name: str) -> subprocess.Popen:
    """`python -m raygpt.cli train --config cfg.json`, its own local Ray (RAY_ADDRESS=local, so
    it never joins another cluster on this machine), output in tmp_path/name.log."""
    cfg_file = tmp_path / f"{name}.json"
    # where the run writes, resuming, overwriting, faults and the servers it talks to are the
    # command line's to say (a --config file may not set them)
    fields, flags = as_command(cfg)
    cfg_file.write_text(json.dumps(fields))
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": str(REPO),
           "RAY_DEDUP_LOGS": "0"}
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "raygpt.cli", "train", "--config", str(cfg_file),
                             *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def ctrl_c(proc: subprocess.Popen) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the driver's whole process group (the local Ray
    it started included; Ray's own processes block SIGINT)."""
    os.killpg(proc.pid, signal.SIGINT)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    history = run_dir / "loss_history.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the driver exited before training reached the step"
        if history.exists() and any(json.loads(line).get("kind") == "train"
                                    and json.loads(line)["step"] >= step
                                    for line in history.read_text().splitlines() if line.strip()):
            return
        time.sleep(0.05)
    raise AssertionError(f"no train record of step {step} within {timeout_s} s")


def wait_for_text(path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        time.sleep(0.02)
    raise AssertionError(f"{text!r} not in {path} within {timeout_s} s")


def test_ctrl_c_checkpoints_stops_with_exit_3_and_resumes_bit_exactly(uninterrupted, tmp_path):
    full_dir, full_cfg, _ = uninterrupted
    cfg = full_cfg.with_overrides({"output_dir": str(tmp_path / "ctrlc")})
    proc = start_driver(cfg, tmp_path, "ctrlc")
    try:
        wait_for_step(tmp_path / "ctrlc", 2, proc, timeout_s=300)
        ctrl_c(proc)
        rc = proc.wait(timeout=120)
    finally:
        kill_group(proc)
    log = (tmp_path / "ctrlc.log").read_text()
    assert rc == EXIT_STOPPED, log[-3000:]
    assert "driver got Ctrl-C" in log
    rd = open_run_dir(str(tmp_path / "ctrlc"))
    stopped_at = max(train_losses(tmp_path / "ctrlc")) + 1
    assert stopped_at < 30
    assert stopped_at in ck.list_checkpoint_steps(rd) and not ck.verify_checkpoint(rd, stopped_at)
    summary = go(cfg.with_overrides({"resume": 1}))
    assert summary["step"] == 30 and not summary["stopped_early"]
    resumes = [r for r in records(tmp_path / "ctrlc") if r["kind"] == "resume"]
    assert resumes[-1]["resumed_from"] == stopped_at
    assert train_losses(tmp_path / "ctrlc") == train_losses(full_dir)


def test_a_second_ctrl_c_aborts_at_once_with_exit_130(tmp_path):
    # The workers would need a while to stop: the first Ctrl-C's stop request is answered only at
    # a step boundary after the checkpoint a slow run is still writing. A second Ctrl-C must not
    # wait for that.
    cfg = tiny_config(tmp_path / "abort", **{**CTRL_C, "max_steps": 400})
    proc = start_driver(cfg, tmp_path, "abort")
    try:
        wait_for_step(tmp_path / "abort", 3, proc, timeout_s=300)
        ctrl_c(proc)
        wait_for_text(tmp_path / "abort.log", "driver got Ctrl-C", timeout_s=10)
        t0 = time.monotonic()
        ctrl_c(proc)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        kill_group(proc)
    log = (tmp_path / "abort.log").read_text()
    assert rc == EXIT_ABORTED, log[-3000:]
    assert "second Ctrl-C: aborting now" in log and took < 30
