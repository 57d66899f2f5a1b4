"""The Ray side of a checkpoint's life; everything else about it is raygpt.checkpointing's.

- Upload (each worker): `report` hands a rank's staged files to Ray Train with the hashes its
  writer computed; Ray stores them on its own upload thread, by a rename (`store_by_rename`)
  where the run directory is on the staging directory's filesystem, else by its own copy.
- Finalize (the controller): `CheckpointFinalizer.after_report` runs once Ray has every rank's
  report for a checkpoint and hands it to raygpt.checkpointing.finalize's queue (DONE, MANIFEST,
  retention, off the controller's thread); `FinalizerDrain` holds the controller's end until
  the queue is empty. Doing it there, rather than on rank 0 after a barrier, means no worker can
  mark a checkpoint done whose other ranks' files Ray has not stored yet.
- Ray's own list of the run's checkpoints is brought back to what exists after every report
  (raygpt.ray.checkpoint_list, its one owner): raygpt's retention and rewinds delete behind
  Ray's back.
- A lost worker group is recorded in the run's loss history (`after_exception`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import ray
import ray.train
from ray.train import Checkpoint, UserCallback

from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing.finalize import (CommitFacts, drain_finalize_queues, finalize_queue,
                                           queued_run_dirs)
from raygpt.ray import memory_kill
from raygpt.ray import checkpoint_list
from raygpt.ray.compat import ControllerCallback, storage_marker_name
from raygpt.runlog.history import append_record
from raygpt.storage import RunDir, open_run_dir
from raygpt.storage.atomic_file import fsync_directory, make_dirs_below, move_local_file

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- upload (each worker)

def report(run_dir: RunDir, metrics: dict, local_dir: str, dir_name: str, file_hashes: dict,
           manifest_meta: dict | None, times: dict | None = None) -> None:
    """Report a rank's checkpoint to Ray Train: its staged files in `local_dir`, to be stored as
    `dir_name` in the run directory, with the hashes its writer computed (and, from rank 0, the
    manifest's metadata) for the finalizer."""
    metrics = {**metrics, "raygpt_files": file_hashes}
    if manifest_meta is not None:
        metrics["raygpt_manifest"] = manifest_meta
    # The files are already written (on our background thread). Ray stores them on its own
    # upload thread and registers the checkpoint when all ranks are in: by a rename when the
    # run directory is on this machine's filesystem with the staging directory (the files
    # were fsynced where they were written: nothing is copied or flushed again), else by
    # Ray's copy (pyarrow; the finalizer makes the copies durable before DONE).
    dest = rename_destination(run_dir, local_dir, dir_name)
    upload = None if dest is None else functools.partial(store_by_rename, dest=dest, times=times)
    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(local_dir),
                     checkpoint_dir_name=dir_name,
                     checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                     checkpoint_upload_fn=upload,
                     delete_local_checkpoint_after_upload=True)


def rename_destination(run_dir, local_dir: str, dir_name: str) -> Path | None:
    """Where a rank's staged checkpoint files can be stored by renaming them (`store_by_rename`):
    `<run dir>/<dir_name>` when the run directory is local, is the driver's one as seen from
    this node (it holds the marker Ray's driver wrote into it, which Ray's own copy checks for
    too: a path that exists on this node only is never written to), and is on the same
    filesystem as the staging directory `local_dir`; else None (Ray copies them)."""
    if not (run_dir.caps.local_paths and run_dir.caps.atomic_rename):
        return None
    root = run_dir.local_path()
    marker = storage_marker_name()
    if marker is None:  # another Ray layout: its own copy
        return None
    try:
        if not (root / marker).is_file():
            return None
        if os.stat(root).st_dev != os.stat(local_dir).st_dev:
            return None
    except OSError:
        return None
    return root / dir_name


def store_by_rename(checkpoint, dir_name: str, *, dest: Path, times: dict | None = None):
    """Ray's `checkpoint_upload_fn`: move this rank's staged files into `dest` (the step
    directory in the run directory; the ranks of one node share it) by rename, and make the
    names durable. Each file appears whole under its final name (a rename), and the checkpoint
    is complete only once the finalizer writes DONE and MANIFEST."""
    src = Path(checkpoint.path)
    make_dirs_below(dest.parent, dest)  # a link planted at the step directory is refused
    for name in sorted(os.listdir(src)):
        move_local_file(src / name, dest / name, root=dest.parent)  # a rename (or a copy)
    fsync_directory(dest)
    fsync_directory(dest.parent)
    if times is not None:
        times["stored"] = time.time()
    return Checkpoint(str(dest), filesystem=checkpoint.filesystem)


# ---------------------------------------------------------------------- finalize (the controller)

class CheckpointFinalizer(UserCallback):
    """Writes DONE and MANIFEST once Ray has registered a checkpoint all ranks reported, applies
    retention (the policy from the driver's config), and records every worker-group failure in the run's loss history.

    `after_report` runs on Ray's controller thread, which waits for it: it only collects what the
    ranks reported (their files' names, sizes and sha256, hashed while writing) and hands the
    checkpoint to a `FinalizeQueue` thread, which checks presence and sizes in storage and writes
    DONE then MANIFEST (never reading the data back). `FinalizerDrain` makes the controller wait
    for the queue before it ends, so the last checkpoint is complete when fit() returns."""

    def __init__(self, cfg, crash_before_done_steps=()):
        self.output_dir = cfg.output_dir  # a string: Ray pickles the finalizer to its controller
        self._run_dir: RunDir | None = None
        self.facts = CommitFacts(cfg)  # fingerprints, identity, retention: the driver's config
        self.crash_before_done_steps = set(crash_before_done_steps)
        self.failures = 0

    @property
    def run_dir(self) -> RunDir:
        """The run directory, opened once in the process the finalizer runs in (the controller)."""
        if self._run_dir is None:
            self._run_dir = open_run_dir(self.output_dir)
        return self._run_dir

    def __getstate__(self):
        return {**self.__dict__, "_run_dir": None}  # opened again where it is unpickled

    def after_report(self, run_context, metrics, checkpoint):
        if checkpoint is None:
            return
        run_dir = self.run_dir
        step = ck.step_of_dir(Path(checkpoint.path).name)
        if step in self.crash_before_done_steps:
            # fault injection: act as if the driver died between Ray's registration and DONE
            log.info(f"raygpt | fault injection: leaving checkpoint {step} without DONE/MANIFEST")
            self.crash_before_done_steps.discard(step)
            checkpoint_list.after_report(run_dir)
            return
        rank_hashes = {}
        for m in metrics:
            rank_hashes.update(m.get("raygpt_files", {}))
        reported = next(m["raygpt_manifest"] for m in metrics if "raygpt_manifest" in m)
        finalize_queue(run_dir).submit(step, rank_hashes, reported, self.facts.complete)
        # Ray wrote its snapshot just before this call; what the previous checkpoint's retention
        # deleted (on the queue's thread) goes out of it here, the last deletions at the drain
        checkpoint_list.after_report(run_dir)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for this run's pending finalizations (the controller's end, tests, benches)."""
        ok = finalize_queue(self.run_dir).drain(timeout_s)
        checkpoint_list.after_report(self.run_dir)
        return ok

    def after_exception(self, run_context, worker_exceptions):
        # the restarted workers pick the newest complete checkpoint: let the ones the lost
        # group reported be completed first (a few small writes each), as a synchronous
        # finalizer would have
        finalize_queue(self.run_dir).drain()
        self.failures += 1
        causes = {rank: f"{type(e).__name__}: {e}"[:500] for rank, e in worker_exceptions.items()}
        # a memory kill's cause in one line; Ray's whole account (~6 KB) goes to the record only
        ray_text = {}
        for rank, e in worker_exceptions.items():
            text = memory_kill.kill_text(e)
            if text is not None:
                causes[rank] = memory_kill.summary_line(text)
                ray_text[rank] = text[:memory_kill.MAX_TEXT]
        with RunDir(self.run_dir.store) as run_dir:  # stored on return (its own segment)
            append_record(run_dir, {"kind": "failure", "failure": self.failures, "causes": causes,
                                    **({"ray_text": ray_text} if ray_text else {}),
                                    "time": time.time(), "attempt": None})
        if not ray_text:  # a memory kill's one line is the failure policy's (its verdict)
            log.info(f"raygpt | FAILURE {self.failures}: "
                     + "; ".join(f"rank {r}: {c}" for r, c in causes.items()))


class FinalizerDrain(ControllerCallback):
    """Holds Ray's controller at its end until every checkpoint handed to a `FinalizeQueue`
    has its DONE and MANIFEST (or was left incomplete), then brings Ray's snapshot in line with
    what retention deleted. On an abort (Ctrl-C) it waits at most ABORT_DRAIN_S: a checkpoint
    not finished by then simply stays without DONE/MANIFEST."""

    ABORT_DRAIN_S = 30.0

    def after_controller_finish(self, result) -> None:
        drain_finalize_queues()
        for run_dir in queued_run_dirs():
            checkpoint_list.after_report(run_dir)

    def before_controller_abort(self) -> None:
        if not drain_finalize_queues(self.ABORT_DRAIN_S):
            log.warning("raygpt | WARNING: a checkpoint was still being finalized at the abort; it "
                        "stays without DONE/MANIFEST")

