"""Finalization: a stored checkpoint made complete (every rank's file present with the size its
rank wrote, all of it fsynced, DONE, then MANIFEST, then retention), and the queue that does it
off the caller's thread.

Whoever knows that every rank's files are stored calls it: the Ray driver's finalizer
(raygpt.ray.checkpoints, once Ray's controller has every rank's report) through a
`FinalizeQueue`, or a single process after its own upload (raygpt.train.session). A checkpoint whose
finalization fails stays without DONE/MANIFEST, and readers treat it as absent.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor, wait

from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing.retention import apply_retention
from raygpt.storage import RunDir, open_run_dir

log = logging.getLogger(__name__)


def finalize_checkpoint(run_dir: RunDir, step: int, rank_hashes: dict, meta: dict) -> None:
    """Make a stored checkpoint complete: DONE, then MANIFEST (atomically, last), then retention.
    Called by whoever knows that every rank's files are durably stored: a `FinalizeQueue`'s
    thread, fed by the Ray driver's finalizer (raygpt.ray.checkpoints) once Ray registered the
    checkpoint, or the single process after its own upload.

    `rank_hashes` are what the ranks hashed while writing (every byte once, by its writer). They
    must cover every rank's files, and storage must hold each of them with the size its rank
    wrote; MANIFEST takes the ranks' hashes, so nothing is read back here (no cost that grows
    with the world or the state). A corrupted upload that keeps its size is caught by the rank
    that loads the file (`Checkpointer.restore_latest` hashes what it reads)."""
    sdir = ck.step_dir(step)
    trajectory = (meta.get("extra") or {}).get("trajectory")
    hit = ck.abandoned_by(step, trajectory, ck.read_abandoned_trajectories(run_dir))
    if hit is not None:
        raise ck.CheckpointError(f"{run_dir.uri(sdir)}: saved on trajectory {trajectory}, which a "
                                 f"spike rewind abandoned back to step {hit['to_step']}; not "
                                 f"marking DONE")
    unreported = [n for n in ck.expected_files(step, meta["world_size"]) if n not in rank_hashes]
    if unreported:
        raise ck.CheckpointError(f"{run_dir.uri(f'{sdir}/{unreported[0]}')}: no rank reported "
                                 f"writing it ({len(unreported)} file(s)); not marking DONE")
    for name, h in rank_hashes.items():
        stored = run_dir.size_of(f"{sdir}/{name}") if run_dir.exists(f"{sdir}/{name}") else None
        if stored != h["size"]:
            raise ck.CheckpointError(f"{run_dir.uri(f'{sdir}/{name}')}: expected {h['size']} bytes "
                                     f"as written by its rank, found {stored}; not marking DONE")
    # every byte durable before anything declares it complete: the rank files as stored (Ray
    # copied them without an fsync), then their names in the step directory and the step
    # directory's name in the run directory; DONE and MANIFEST are written atomically (fsynced)
    run_dir.make_durable([f"{sdir}/{n}" for n in ck.published_files(run_dir, step)] + [sdir, ""])
    ck.write_done(run_dir, step)
    ck.write_manifest(run_dir, step, written=rank_hashes,
                      **{k: v for k, v in meta.items() if k not in ("retention", "step")})
    apply_retention(run_dir, meta["retention"])


class FinalizeQueue:
    """One thread that finalizes a run's checkpoints in report order (DONE, MANIFEST, retention),
    so that a caller that must not wait on storage (Ray's controller calls its report hooks
    synchronously) only hands them over. A checkpoint whose finalization fails stays without
    DONE/MANIFEST (readers treat it as absent) and training goes on."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="raygpt-finalize")
        self._futures: list = []

    def submit(self, step: int, rank_hashes: dict, meta: dict) -> None:
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(self._pool.submit(self._finalize, step, rank_hashes, meta))

    def _finalize(self, step: int, rank_hashes: dict, meta: dict) -> None:
        try:
            finalize_checkpoint(open_run_dir(self.output_dir), step, rank_hashes, meta)
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


def finalize_queue(output_dir: str) -> FinalizeQueue:
    """The run directory's queue in this process (made on first use)."""
    with _QUEUES_LOCK:
        queue = _QUEUES.get(output_dir)
        if queue is None:
            queue = _QUEUES[output_dir] = FinalizeQueue(output_dir)
        return queue


def drain_finalize_queues(timeout_s: float | None = None) -> bool:
    """Wait for every queue of this process; False if `timeout_s` ran out for one of them."""
    with _QUEUES_LOCK:
        queues = list(_QUEUES.values())
    return all([q.drain(timeout_s) for q in queues])


def queued_run_dirs() -> list[str]:
    """The run directories this process has finalized checkpoints of."""
    with _QUEUES_LOCK:
        return list(_QUEUES)
