"""What the training loop needs from its surroundings, without importing Ray.

A `Session` says who this worker is (rank, world, device), where the run directory is, which
checkpoint the surroundings want it to resume from, how to publish a checkpoint, and the key
that signs the compiled code this run keeps in its run directory. Under Ray
Train that is `raygpt.ray.worker.RaySession` (ray.train.report with a Checkpoint, a driver-side
callback writes DONE and MANIFEST); `LocalSession` is the same protocol for a single process
without Ray, which publishes a checkpoint by copying it into the run directory itself.
"""

from __future__ import annotations

import shutil
import time

import torch

from raygpt.artifacts.signed_file import ArtifactKey
from raygpt.storage import RunDir


class Session:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    run_dir: RunDir
    # the user's key for the compiled artifacts in the run directory (raygpt.artifacts.signed_file); None:
    # none are loaded or stored, a compiled run compiles on every node
    artifact_key: ArtifactKey | None = None

    @property
    def device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "cpu"

    @property
    def local_run_dir(self) -> str | None:
        """The run directory as a local path, or None on remote storage."""
        return self.run_dir.local_path("") if self.run_dir.caps.local_paths else None

    def checkpoint_hint(self) -> int | None:
        """The step of the checkpoint the surroundings restored (Ray's get_checkpoint), if any."""
        return None

    # the least time between two reports of train metrics (raygpt.runlog.reporter); 0: at every log step
    metrics_interval_s: float = 0.0
    # time.monotonic() of this rank's last checkpoint report (a metrics report waits behind it)
    last_checkpoint_report: float = float("-inf")

    def report_metrics(self, metrics: dict) -> None:
        """Publish metrics (every rank calls this at the same steps)."""

    def configure(self, cfg) -> None:
        """The run's config, for a session that commits its checkpoints itself (the fingerprints,
        identity and retention policy come from it: raygpt.checkpointing.finalize.CommitFacts);
        under Ray the driver has its own copy."""

    def report_checkpoint(self, metrics: dict, local_dir: str, dir_name: str,
                          file_hashes: dict, manifest_meta: dict | None,
                          times: dict | None = None) -> None:
        """Publish the files of one checkpoint that this rank staged in `local_dir`; every rank
        calls this at the same step. Must leave DONE and MANIFEST to whoever knows all ranks'
        files are stored; `manifest_meta` is rank 0's report (what only the workers know). `times` (the checkpoint's timeline row) may get the wall time at which
        this rank's files were stored ("stored"), for bench/checkpoint.py."""
        raise NotImplementedError

    def poll_requests(self) -> tuple[bool, bool]:
        """(stop, save) asked for from outside the process: the driver's signals, a preemption
        notice. Called once per step by every rank; the loop agrees on the answer."""
        return False, False

    def failure_note(self) -> str | None:
        """Why this attempt exists, if the surroundings know (e.g. the previous failure)."""
        return None

    def startup_marks(self) -> dict[str, float]:
        """Wall times of this attempt's start-up that the surroundings saw before the loop ran
        (`history.STARTUP_MARKS`: its worker group up, its process group formed); none here."""
        return {}


class LocalSession(Session):
    """One process, no Ray: rank 0 of 1, publishing checkpoints straight into the run dir (its
    files moved in by rename when the run dir is local, on the staging directory's filesystem)."""

    def __init__(self, run_dir: RunDir, device: torch.device | None = None,
                 artifact_key: ArtifactKey | None = None):
        self.run_dir = run_dir
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.artifact_key = artifact_key
        self._facts = None

    def configure(self, cfg) -> None:
        from raygpt.checkpointing.finalize import CommitFacts
        self._facts = CommitFacts(cfg)

    def report_checkpoint(self, metrics, local_dir, dir_name, file_hashes, manifest_meta,
                          times=None):
        from raygpt.checkpointing.finalize import finalize_checkpoint

        self.run_dir.move_dir_in(local_dir, dir_name)  # a rename where it can be
        if times is not None:
            times["stored"] = time.time()
        shutil.rmtree(local_dir, ignore_errors=True)
        if self._facts is None:
            raise RuntimeError("LocalSession.report_checkpoint: configure(cfg) was not called")
        finalize_checkpoint(self.run_dir, manifest_meta["step"], file_hashes,
                            self._facts.complete(manifest_meta))
