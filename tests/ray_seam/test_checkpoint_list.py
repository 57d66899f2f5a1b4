"""raygpt.ray.checkpoint_list against Ray's own CheckpointManager (no cluster): a snapshot that names
deleted checkpoints (retention, a rewind) is refused by a new manager, and accepted once
reconciled; duplicates of a re-trained name, a deleted latest checkpoint and a torn file."""

import asyncio
import json
import logging

import pytest
from ray.train import Checkpoint, CheckpointConfig
from ray.train.v2._internal.exceptions import CheckpointManagerInitializationError
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
from ray.train.v2._internal.execution.storage import StorageContext
from ray.train.v2._internal.execution.training_report import _TrainingReport

from raygpt.checkpointing import protocol as ck
from raygpt.ray import checkpoint_list
from raygpt.ray.checkpoint_list import SNAPSHOT, reconcile_snapshot
from raygpt.storage import open_run_dir


def manager(tmp_path) -> CheckpointManager:
    storage = StorageContext(str(tmp_path), "run")
    return CheckpointManager(CheckpointConfig(num_to_keep=None), storage)


def register(tmp_path, steps) -> None:
    """Ray's controller registering a report per step (its snapshot rewritten each time)."""
    async def go():
        m = manager(tmp_path)
        for s in steps:
            path = tmp_path / "run" / ck.step_dir(s)
            path.mkdir(parents=True, exist_ok=True)
            m.register_checkpoint(_TrainingReport(Checkpoint.from_directory(str(path)),
                                                  {"checkpoint_step": s}, False))
    asyncio.run(go())


def listed(tmp_path) -> list[str]:
    snap = json.loads((tmp_path / "run" / SNAPSHOT).read_text())
    return [r["checkpoint_dir_name"] for r in snap["checkpoint_results"]]


def delete(tmp_path, step) -> None:
    open_run_dir(str(tmp_path / "run")).delete_dir(ck.step_dir(step))


def test_retention_deletes_then_a_new_manager_accepts_the_reconciled_snapshot(tmp_path):
    register(tmp_path, [2, 4, 6, 8])
    delete(tmp_path, 2), delete(tmp_path, 4)  # -nk 2
    with pytest.raises(CheckpointManagerInitializationError, match="does not exist anymore"):
        manager(tmp_path)
    assert reconcile_snapshot(open_run_dir(str(tmp_path / "run"))) == ["step_00000002",
                                                                       "step_00000004"]
    m = manager(tmp_path)
    assert [r.checkpoint.path.rsplit("/", 1)[-1] for r in m._checkpoint_results] == [
        "step_00000006", "step_00000008"]
    assert m.latest_checkpoint_result.checkpoint.path.endswith("step_00000008")
    assert reconcile_snapshot(open_run_dir(str(tmp_path / "run"))) == []  # nothing left to do


def test_a_rewind_deleted_the_latest_and_retrained_a_name(tmp_path):
    register(tmp_path, [2, 4, 6])
    delete(tmp_path, 6)  # a rewind to 4 abandons 6 (Ray's latest) ...
    with pytest.raises(CheckpointManagerInitializationError):
        manager(tmp_path)
    rd = open_run_dir(str(tmp_path / "run"))
    reconcile_snapshot(rd)
    m = manager(tmp_path)
    assert m.latest_checkpoint_result.checkpoint.path.endswith("step_00000004")
    register(tmp_path, [6])  # ... and the re-trained 6 is reported under the same name
    assert listed(tmp_path) == ["step_00000002", "step_00000004", "step_00000006"]


def test_a_name_reported_twice_is_kept_once_with_its_latest_report(tmp_path):
    async def go():
        m = manager(tmp_path)
        for s, tag in ((2, "a"), (4, "old"), (4, "new")):
            path = tmp_path / "run" / ck.step_dir(s)
            path.mkdir(parents=True, exist_ok=True)
            m.register_checkpoint(_TrainingReport(Checkpoint.from_directory(str(path)),
                                                  {"tag": tag}, False))
    asyncio.run(go())
    assert reconcile_snapshot(open_run_dir(str(tmp_path / "run")))
    snap = json.loads((tmp_path / "run" / SNAPSHOT).read_text())
    assert [r["metrics"]["tag"] for r in snap["checkpoint_results"]] == ["a", "new"]
    assert snap["checkpoint_report_indices"] == [0, 2]
    manager(tmp_path)


def test_a_torn_snapshot_is_rebuilt_from_the_complete_checkpoints(tmp_path):
    register(tmp_path, [2, 4])
    rd = open_run_dir(str(tmp_path / "run"))
    for s in (2,):  # 2 complete, 4 without DONE/MANIFEST
        rd.write_bytes_atomic(f"{ck.step_dir(s)}/{ck.done_file(s)}", b"")
        rd.write_bytes_atomic(f"{ck.step_dir(s)}/{ck.MANIFEST}", b"{}")
    path = tmp_path / "run" / SNAPSHOT
    path.write_bytes(path.read_bytes()[:40])  # a crash in Ray's own write
    with pytest.raises(CheckpointManagerInitializationError):
        manager(tmp_path)
    reconcile_snapshot(rd)
    m = manager(tmp_path)
    assert m.latest_checkpoint_result.checkpoint.path.endswith("step_00000002")


def test_no_snapshot_nothing_to_do(tmp_path):
    (tmp_path / "run").mkdir()
    assert reconcile_snapshot(open_run_dir(str(tmp_path / "run"))) == []
    assert not (tmp_path / "run" / SNAPSHOT).exists()


@pytest.fixture
def raygpt_log(caplog):
    """raygpt's logger does not propagate to the root (the console owns it): listen on it."""
    logger = logging.getLogger("raygpt")
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.INFO)
    level, logger.level = logger.level, logging.INFO
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)


def test_before_fit_drops_and_says_so_and_a_failure_stops_the_fit(tmp_path, raygpt_log):
    register(tmp_path, [2, 4])
    delete(tmp_path, 2)
    rd = open_run_dir(str(tmp_path / "run"))
    assert checkpoint_list.before_fit(rd) == ["step_00000002"]
    assert ("named 1 checkpoint(s) no longer in the run directory; dropped: step_00000002"
            in raygpt_log.text)
    (tmp_path / "run" / SNAPSHOT).write_text('{"checkpoint_results": 7}')  # JSON, not Ray's model
    with pytest.raises(ValueError):
        checkpoint_list.before_fit(rd)


def test_after_report_brings_the_list_in_line_and_a_failure_is_only_a_warning(tmp_path,
                                                                             raygpt_log):
    register(tmp_path, [2, 4])
    delete(tmp_path, 4)
    rd = open_run_dir(str(tmp_path / "run"))
    checkpoint_list.after_report(rd)
    assert listed(tmp_path) == ["step_00000002"]
    (tmp_path / "run" / SNAPSHOT).write_text('{"checkpoint_results": 7}')
    assert "could not update" not in raygpt_log.text
    checkpoint_list.after_report(rd)  # on Ray's controller thread: never raises
    assert f"could not update Ray's checkpoint list ({SNAPSHOT})" in raygpt_log.text


def test_rays_list_is_read_and_patched_only_by_checkpoint_list():
    """One owner: no other module of raygpt reconciles or rewrites Ray's checkpoint list."""
    import pathlib

    import raygpt
    root = pathlib.Path(raygpt.__file__).parent
    owners = {root / "ray" / "checkpoint_list.py", root / "ray" / "compat.py"}  # compat: Ray's model
    others = [str(p.relative_to(root)) for p in sorted(root.rglob("*.py")) if p not in owners
              and any(name in p.read_text() for name in ("reconcile_snapshot", "reconciled(",
                                                         "CheckpointManagerState", "SNAPSHOT"))]
    assert others == []
