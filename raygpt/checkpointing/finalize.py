"""Finalization: a stored checkpoint made complete (the store's commit: every rank's file
present with the size its rank wrote, all of it fsynced, DONE, then MANIFEST), then retention;
the queue that does it off the caller's thread.

Whoever knows that every rank's files are stored calls it, where the run's config is: the Ray
driver's finalizer (raygpt.ray.checkpoints, once Ray's controller has every rank's report)
through a `FinalizeQueue`, or a single process after its own upload (raygpt.train.session).
Rank 0 reports only what the workers alone know (world size, parameters, the trajectory, the
run's length in steps); `CommitFacts` adds what the config says (fingerprints, identity, the
retention policy), computed there. A checkpoint whose finalization fails stays without
DONE/MANIFEST, and readers treat it as absent.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

from raygpt.checkpointing.fingerprints import run_fingerprints
from raygpt.checkpointing.retention import RetentionPolicy, policy_for
from raygpt.checkpointing.store import CheckpointStore
from raygpt.storage import RunDir

log = logging.getLogger(__name__)


class CommitFacts:
    """What the committing side adds to rank 0's report, from the run's config: the fingerprints
    and identity a MANIFEST carries and the retention policy. The fingerprints (a few reads per
    shard) are computed once, on first use, on the one thread that commits (a `FinalizeQueue`'s,
    off Ray's controller thread). Plain data: Ray ships the finalizer to its controller."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._prints: dict | None = None

    def complete(self, reported: dict) -> dict:
        """finalize_checkpoint's meta: `reported` (rank 0's "step", "world_size",
        "num_parameters", "extra", "max_steps") with the config's facts and "retention"."""
        from raygpt.train.schedule import wsd_decay_start
        if self._prints is None:
            self._prints = run_fingerprints(self.cfg)
        c, steps = self.cfg, reported["max_steps"]
        policy = policy_for(keep_last=c.checkpoints_keep, keep_every=c.major_checkpoint_every,
                            checkpoint_every=c.checkpoint_every, max_steps=steps,
                            wsd_decay_start=wsd_decay_start(steps) if c.scheduler == "wsd" else None)
        return {**self._prints, "config_identity": c.identity(), **reported,
                "retention": policy.as_dict()}


def finalize_checkpoint(run_dir: RunDir, step: int, rank_hashes: dict, meta: dict) -> None:
    """Commit a stored checkpoint (`CheckpointStore.commit`: DONE, then MANIFEST), then apply
    the retention policy `meta["retention"]` (`CheckpointStore.retain`). A corrupted upload
    that keeps its size is caught by the rank that loads the file (the restore hashes what it
    reads)."""
    store = CheckpointStore(run_dir)
    store.commit(step, rank_hashes, meta)
    store.retain(RetentionPolicy.from_dict(meta["retention"]))


class FinalizeQueue:
    """One thread that finalizes a run's checkpoints in report order (DONE, MANIFEST, retention),
    so that a caller that must not wait on storage (Ray's controller calls its report hooks
    synchronously) only hands them over. A checkpoint whose finalization fails stays without
    DONE/MANIFEST (readers treat it as absent) and training goes on."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="raygpt-finalize")
        self._futures: list = []

    def submit(self, step: int, rank_hashes: dict, reported: dict,
               complete: Callable[[dict], dict]) -> None:
        """Finalize checkpoint `step` on the queue's thread, with `complete(reported)` as its
        meta (`CommitFacts.complete`: computed there, not on the caller's thread)."""
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(self._pool.submit(self._finalize, step, rank_hashes, reported,
                                               complete))

    def _finalize(self, step: int, rank_hashes: dict, reported: dict, complete) -> None:
        try:
            finalize_checkpoint(self.run_dir, step, rank_hashes, complete(reported))
        except Exception as e:  # noqa: BLE001 - a checkpoint left incomplete must not stop training
            log.warning(f"raygpt | WARNING: checkpoint {step} left incomplete (no DONE/MANIFEST): {e}")

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted checkpoint is finalized; False if `timeout_s` ran out."""
        _, pending = wait(list(self._futures), timeout=timeout_s)
        return not pending


# This process's queues, by run directory: the Ray driver's finalizer hands each checkpoint to
# its run's queue, and the controller's end waits for them all (`drain_finalize_queues`).
_QUEUES: dict[str, FinalizeQueue] = {}
_QUEUES_LOCK = threading.Lock()


def finalize_queue(run_dir: RunDir) -> FinalizeQueue:
    """The run directory's queue in this process (made on first use, holding `run_dir`)."""
    with _QUEUES_LOCK:
        queue = _QUEUES.get(run_dir.uri())
        if queue is None:
            queue = _QUEUES[run_dir.uri()] = FinalizeQueue(run_dir)
        return queue


def drain_finalize_queues(timeout_s: float | None = None) -> bool:
    """Wait for every queue of this process; False if `timeout_s` ran out for one of them."""
    with _QUEUES_LOCK:
        queues = list(_QUEUES.values())
    return all([q.drain(timeout_s) for q in queues])


def queued_run_dirs() -> list[RunDir]:
    """The run directories this process has finalized checkpoints of."""
    with _QUEUES_LOCK:
        return [q.run_dir for q in _QUEUES.values()]
