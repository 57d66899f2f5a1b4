"""What a person sees: the default job's command, run as a user runs it (its own local Ray, the
driver's output captured whole), tiny. No Ray of the test process: two local Ray instances on
one machine make Ray's own state-API clients ask which one to use."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raygpt.storage import open_run_dir
from tests.helpers import RAY_LOG_LINE

REPO = Path(__file__).resolve().parents[2]
# a C++ log line of any Ray process at ERROR or FATAL level ("[time E pid tid] file.cc:N: ...")
RAY_CORE_ERROR = re.compile(r"\[\d{4}-\d\d-\d\d [\d:,]+ [EF] \d+ \d+\]")


def test_the_default_command_prints_one_screen_and_no_noise(tmp_path):
    """The default job as a user runs it, stdout and stderr redirected (not a terminal): raygpt's
    lines only. No colour codes, none of Ray's WARNING or INFO lines (the token-auth WARNING,
    "Started a local Ray instance": they are in Ray's session logs), no MFU column on a CPU,
    an ETA on every step line but the first, validation and the sample."""
    started = time.time()
    p = subprocess.Popen(
        [sys.executable, "experiments/shakespeare.py", "-e", "d2", "-b", "4", "-t", "32",
         "--num-workers", "1", "-x", "4", "-s", "2", "-g", "12", "-v", "2", "-m", "1", "-n", "0",
         "-o", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**{k: v for k, v in os.environ.items()
                if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_COLOR_PREFIX")},
             "PYTHONPATH": str(REPO)})
    stdout, stderr = p.communicate(timeout=300)
    out = stdout + stderr
    assert p.returncode == 0, out[-3000:]
    noise = [line for line in out.splitlines() if RAY_LOG_LINE.search(line)]
    assert not noise, noise
    assert "\x1b" not in out, [line for line in out.splitlines() if "\x1b" in line][:3]
    assert "MFU" not in out
    lines = [re.sub(r"^\((\w+) pid=\d+\) ", "", line) for line in out.splitlines()]
    # no error-level line from Ray's processes or raygpt's actors (PreemptionWatcher's was one)
    # and no Python traceback at all: not Ray Train's PlacementGroupCleaner's (its State API
    # queries fail without a dashboard, or with two Rays on the machine: raygpt.ray.pg_cleanup
    # replaces it), not the controller's resource request timing out on a busy machine (the
    # driver starts the AutoscalingCoordinator first: driver.start_train_helpers)
    bad = [i for i, line in enumerate(lines) if RAY_CORE_ERROR.search(line) or " ERROR " in line
           or "max_restarts" in line or "Traceback (most recent call last)" in line
           or re.search(r'File ".*\.py", line \d+', line) or "PlacementGroupCleaner" in line
           or "Failed to query Ray Train Controller" in line]
    assert not bad, "\n".join(lines[bad[0]:bad[0] + 40])
    steps = [line for line in lines if re.match(r"step +\d+/4 \|", line)]
    assert len(steps) == 4 and all(" | eta " in line for line in steps[1:]), steps
    assert all(re.search(r"\| [\d.]+ ms \| \d+ tok/s( \||$)", line) for line in steps), steps
    assert [line for line in lines if " | val loss " in line][0].startswith("step     0 | val loss")
    at = lines.index("step     2 | sample:")
    assert lines[at + 1].startswith("  | ") and "sample: '" not in out
    assert any(re.match(r"raygpt \| done at step 4/4 \| val loss \d+\.\d{4} \|", line)
               for line in lines)
    # what Ray said is in its session's logs, in the driver's own file there
    held = {f.resolve() for f in Path("/tmp/ray").glob(f"session_*/logs/raygpt-driver-{p.pid}.log")
            if f.stat().st_mtime >= started}  # a pid of an earlier session's driver is reused;
    held = list(held)  # session_latest is a link to the newest session: the same file once
    assert len(held) == 1 and "Started a local Ray instance" in held[0].read_text(), held


def test_every_run_gets_raygpts_placement_group_cleanup_in_place_of_rays(tmp_path):
    """Ray Train's PlacementGroupCleaner (State API polling) is dropped from the controller's
    default callbacks and raygpt's (the controller's actor handle) takes its place."""
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback)

    from raygpt.ray import driver
    from raygpt.ray.pg_cleanup import CleanupOnControllerDeath
    from tests.helpers import tiny_config

    cfg = tiny_config(tmp_path / "run").resolve(0)
    built = driver.build_trainer(cfg, open_run_dir(cfg.output_dir), control_name="c")
    kinds = [type(c) for c in built._create_default_callbacks()]
    assert CleanupOnControllerDeath in kinds
    assert not any(issubclass(k, PlacementGroupCleanerCallback) for k in kinds)


def test_every_run_gets_raygpts_preemption_watcher_in_place_of_rays(monkeypatch):
    """Ray Train's own watcher is switched off through the environment Ray hands its controller,
    and raygpt's (no restarts, so no core-worker ERROR line) is in every run's callbacks, the
    second run of a process too; a user who switched Ray's off gets none."""
    from raygpt.ray import driver

    monkeypatch.delenv(driver.RAY_PREEMPTION_WATCHER_ENV, raising=False)
    for _ in range(2):
        assert [type(c) for c in driver.preemption_callbacks()] == [
            driver.PreemptionWatcherCallback]
        assert os.environ[driver.RAY_PREEMPTION_WATCHER_ENV] == "0"
    monkeypatch.setattr(driver, "_USER_PREEMPTION_WATCHER", "0")
    assert driver.preemption_callbacks() == []


def test_a_fixed_size_run_on_its_own_ray_sends_no_autoscaler_requests(tmp_path, monkeypatch):
    """On a Ray the run started itself (no autoscaler) a fixed-size run's controller sends Ray
    Data's AutoscalingCoordinator nothing, so no coordinator actor is started; on a joined Ray,
    or an elastic run, Ray Train's own policy is kept."""
    from ray.train.v2._internal.execution.scaling_policy import fixed, scaling_policy

    from raygpt.ray import compat, driver
    from tests.helpers import tiny_config

    def no_coordinator(*args, **kwargs):
        raise AssertionError("the AutoscalingCoordinator was asked")

    monkeypatch.setattr(scaling_policy, "TrainAutoscalingCoordinatorClient", no_coordinator)
    cfg = tiny_config(tmp_path / "run").resolve(0)
    trainer = driver.build_trainer(cfg, open_run_dir(cfg.output_dir), control_name="c")
    ray_policy = fixed.FixedScalingPolicy(trainer.scaling_config)
    assert trainer.scaling_policy(ray_policy) is ray_policy  # the default: Ray Train's
    trainer.without_autoscaler = True
    policy = trainer.scaling_policy(ray_policy)
    assert type(policy) is compat.FixedPolicyWithoutAutoscaler
    assert policy.scaling_config is trainer.scaling_config
    policy.after_controller_start(None)  # Ray Train's would register the run's resources
    policy._maybe_send_resource_request()
    policy._cancel_resource_request()
    elastic = object()  # any other policy (the elastic one queries the coordinator) is kept
    assert trainer.scaling_policy(elastic) is elastic
    with pytest.raises(AssertionError, match="AutoscalingCoordinator was asked"):
        ray_policy.after_controller_start(type("Ctx", (), {"run_id": "r"})())


def test_a_ray_of_its_own_starts_without_the_dashboard_and_a_joined_one_is_asked_nothing(
        monkeypatch):
    from raygpt.ray import driver

    calls = []
    monkeypatch.setattr(driver.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(driver.ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    driver.init_ray()
    driver.init_ray("ray://head:10001")
    assert calls == [{"address": "local", "ignore_reinit_error": True, "log_to_driver": True,
                      "include_dashboard": False},
                     {"address": "ray://head:10001", "ignore_reinit_error": True,
                      "log_to_driver": True}]
