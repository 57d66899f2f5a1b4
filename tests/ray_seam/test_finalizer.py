"""The driver's checkpoint finalizer (raygpt.ray.checkpoints.CheckpointFinalizer, FinalizerDrain):
Ray's controller hands it the ranks' reports; it finalizes off the controller's thread, and the
controller's end waits for it."""

import os

import pytest

from raygpt.checkpointing.protocol import MANIFEST, state_file, step_dir, verify_checkpoint
from raygpt.storage import open_run_dir
from tests.checkpointing.test_protocol import _meta, _upload_without_done


def test_the_finalizer_hands_the_work_off_the_controller_and_the_drain_waits_for_it(
        tmp_path, monkeypatch):
    """Ray's controller calls after_report synchronously: it must return while storage is
    still being written, and FinalizerDrain (the controller's end) must wait for DONE/MANIFEST."""
    import threading

    from raygpt.checkpointing import finalize
    from raygpt.ray import checkpoints, driver

    rd = open_run_dir(tmp_path / "run")
    hashes = _upload_without_done(rd, 30)
    release, started = threading.Event(), threading.Event()
    real = finalize.finalize_checkpoint

    def slow(*a, **kw):  # storage that takes its time
        started.set()
        assert release.wait(30)
        return real(*a, **kw)
    monkeypatch.setattr(finalize, "finalize_checkpoint", slow)

    class Ckpt:
        path = str(tmp_path / "run" / step_dir(30))

    from tests.helpers import tiny_config

    fin = checkpoints.CheckpointFinalizer(tiny_config(tmp_path / "run"))
    # rank 0 reports what only the workers know; the driver's config gives the rest
    reported = {k: _meta(30, "t")[k] for k in ("step", "world_size", "num_parameters", "extra")}
    metrics = [{"raygpt_files": {k: v for k, v in hashes.items() if k != state_file(30, 1)},
                "raygpt_manifest": {**reported, "max_steps": 30}},
               {"raygpt_files": {state_file(30, 1): hashes[state_file(30, 1)]}}]
    fin.after_report(None, metrics, Ckpt())  # returns although the finalization is blocked
    assert started.wait(10) and not rd.exists(f"{step_dir(30)}/{MANIFEST}")
    drain = threading.Thread(target=checkpoints.FinalizerDrain().after_controller_finish, args=(None,))
    drain.start()
    drain.join(0.5)
    assert drain.is_alive()  # the controller's end waits for the pending checkpoint
    release.set()
    drain.join(30)
    assert not drain.is_alive()
    assert verify_checkpoint(rd, 30) == []
    # and the trainer gives the drain to every controller (Ray's own defaults stubbed out)
    base = next(k for k in driver.RaygptTrainer.__mro__[1:]
                if "_create_default_callbacks" in vars(k) and k.__module__.startswith("ray."))
    monkeypatch.setattr(base, "_create_default_callbacks", lambda self: [])
    callbacks = object.__new__(driver.RaygptTrainer)._create_default_callbacks()
    assert any(isinstance(c, checkpoints.FinalizerDrain) for c in callbacks)


def _stage(root, step: int, files: dict):
    """A rank's staged checkpoint directory (what its writer thread left), as a Ray Checkpoint."""
    from ray.train import Checkpoint

    d = root / f"{step_dir(step)}.tmp-x"
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    return Checkpoint.from_directory(str(d))


def test_ranks_store_their_files_by_rename_and_done_waits_for_every_rank(tmp_path):
    """A local run directory (Ray's marker in it) on the staging directory's filesystem: each
    rank's upload is a rename of its staged files into the step directory (no copy, nothing left
    behind); the finalizer still refuses DONE until every rank's files are there."""
    import hashlib

    from ray.train.v2._internal.execution.storage import VALIDATE_STORAGE_MARKER_FILENAME

    from raygpt.checkpointing.finalize import finalize_checkpoint
    from raygpt.checkpointing.protocol import CheckpointError, model_file, published_files
    from raygpt.ray.checkpoints import rename_destination, store_by_rename
    from tests.llmc.test_state_file import state_bytes

    run = tmp_path / "run"
    run.mkdir()
    rd = open_run_dir(run)
    step, dir_name = 30, step_dir(30)
    ranks = [{model_file(step): os.urandom(256),
              state_file(step, 0): state_bytes(rank=0, num_processes=2, step=step)},
             {state_file(step, 1): state_bytes(rank=1, num_processes=2, step=step)}]
    hashes = {n: {"sha256": hashlib.sha256(b).hexdigest(), "size": len(b)}
              for files in ranks for n, b in files.items()}
    staged = [_stage(tmp_path / f"stage{r}", step, files) for r, files in enumerate(ranks)]

    assert rename_destination(rd, staged[0].path, dir_name) is None  # not Ray's run dir (yet)
    (run / VALIDATE_STORAGE_MARKER_FILENAME).write_text("")
    dest = rename_destination(rd, staged[0].path, dir_name)
    assert dest == run / dir_name

    times = {}
    inode = os.stat(os.path.join(staged[0].path, state_file(step, 0))).st_ino
    stored = store_by_rename(staged[0], dir_name, dest=dest, times=times)
    assert stored.path == str(dest) and "stored" in times
    assert os.listdir(staged[0].path) == []  # moved, not copied
    assert os.stat(dest / state_file(step, 0)).st_ino == inode
    with pytest.raises(CheckpointError, match="rank_01|expected"):  # rank 1's file not stored yet
        finalize_checkpoint(rd, step, hashes, _meta(step, "t"))
    assert not rd.exists(f"{dir_name}/{MANIFEST}")
    store_by_rename(staged[1], dir_name, dest=dest)
    assert sorted(published_files(rd, step)) == sorted(hashes)
    finalize_checkpoint(rd, step, hashes, _meta(step, "t"))
    assert verify_checkpoint(rd, step) == []


def test_the_driver_polls_the_workers_more_often_unless_the_user_chose(monkeypatch):
    from raygpt.ray import driver

    monkeypatch.delenv(driver.RAY_POLL_ENV, raising=False)
    assert driver.set_controller_poll() == driver.CONTROLLER_POLL_S < 2.0  # Ray's default: 2 s
    assert os.environ[driver.RAY_POLL_ENV] == str(driver.CONTROLLER_POLL_S)  # what Ray hands on
    monkeypatch.setenv(driver.RAY_POLL_ENV, "3")
    assert driver.set_controller_poll() == 3.0 and os.environ[driver.RAY_POLL_ENV] == "3"
