"""Reading a checkpoint back (the worker side of a restore): which files a rank loads (its own
state file, or the old ranks' it reshards from, and the model file without master weights),
each fetched from this node's local copy or from storage and checked against MANIFEST from the
bytes read, and the early read a restarted worker starts before its model is built.
`Checkpointer.restore_latest` (raygpt.checkpointing.runtime) loads what these return."""

from __future__ import annotations

import logging
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing.local_copy import LocalCopies
from raygpt.checkpointing.store import CheckpointStore
from raygpt.config import TrainConfig
from raygpt.storage import RunDir
from raygpt.train.optim import shard_range

log = logging.getLogger(__name__)


def old_ranks_needed(total: int, n_old: int, zero_old: int, lo: int, hi: int) -> list[int]:
    """The ranks of an N-rank checkpoint whose state files a rank owning [lo, hi) of the flat
    buffers reads to reshard: rank 0 (the rank-independent state: loader, RNG, policies) and,
    under ZeRO-1, the old ranks whose shards overlap [lo, hi); without ZeRO rank 0's full copy
    is all there is to read."""
    if not (zero_old == 1 and n_old > 1):
        return [0]
    overlap = []
    for r in range(n_old):
        r_lo, r_hi = shard_range(total, r, n_old, zero_old)
        if r_lo < hi and r_hi > lo:
            overlap.append(r)
    return sorted({0, *overlap})


def fetch_verified(run_dir: RunDir, step: int, manifest: dict, names: list[str],
                   local: LocalCopies | None = None, sources: dict | None = None) -> dict:
    """{name: bytes} for the files `names` of checkpoint `step`, read in parallel, each checked
    against MANIFEST's size and sha256 from the bytes read (CheckpointError naming the file).
    With `local`, a file is read from the node's local copy when there is one of MANIFEST's
    size; one whose sha256 differs is dropped with a warning and the file read from storage.
    `sources`, when given, gets {name: "local" | "storage"}."""
    sdir = ck.step_dir(step)

    def fetch(name: str) -> bytes:
        entry = manifest["files"].get(name)
        data = local.read(step, name, entry["size"]) if local is not None and entry else None
        if data is not None:
            try:
                ck.verify_bytes(run_dir, step, name, data, manifest)
                if sources is not None:
                    sources[name] = "local"
                return data
            except ck.CheckpointError as e:
                stored = run_dir.uri(f"{sdir}/{name}")
                what = str(e).removeprefix(f"{stored}: ")  # verify_bytes names storage's file
                log.warning(f"raygpt | WARNING: {local.where(step, name)}: this node's copy of "
                            f"{stored} differs from MANIFEST ({what}); reading storage's")
                local.discard(step, name)
        data = run_dir.read_bytes(f"{sdir}/{name}")
        ck.verify_bytes(run_dir, step, name, data, manifest)
        if sources is not None:
            sources[name] = "storage"
        return data

    with ThreadPoolExecutor(max(1, min(8, len(names)))) as pool:
        return dict(zip(names, pool.map(fetch, names)))


def resume_reads(run_dir: RunDir, *, rank: int, world: int) -> dict:
    """What rank `rank` of an unchanged world reads to choose and verify its resume checkpoint
    (`Checkpointer.restore_latest`'s steps without a model: the newest complete checkpoint, then
    its own state file hashed). For bench/checkpoint.py."""
    step = CheckpointStore(run_dir).latest_verified()
    return fetch_verified(run_dir, step, ck.read_manifest(run_dir, step), [ck.state_file(step, rank)])


def host_tensor(a: np.ndarray) -> torch.Tensor:
    """A state file's array as a CPU tensor over the same memory, to be copied from: the
    restore reads them as read-only views of the file's bytes (torch would warn of that on
    every resume, though nothing writes to them)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def manifest_zero_stage(manifest: dict) -> int:
    """The ZeRO stage the checkpoint was written with (0 for checkpoints that predate it)."""
    return manifest.get("extra", {}).get("zero_stage", 0)


def files_to_load(step: int, ranks: list[int], model_file: bool) -> list[str]:
    """The files of checkpoint `step` a rank loads: the state files of `ranks` (its own, or the
    old world's whose shards overlap its own when resharding), and the model file where the
    weights come from it (no master weights)."""
    return [ck.state_file(step, r) for r in ranks] + ([ck.model_file(step)] if model_file else [])


class ResumeRead:
    """This rank's files of the newest resumable checkpoint, read and checked against MANIFEST
    (`fetch_verified`) on a thread started before the model is built, so that the read and the
    sha256, which release the GIL, overlap the build. The guess is an unchanged world and ZeRO
    stage; `Checkpointer.restore_latest` takes the bytes only when its own first candidate is the
    same checkpoint, MANIFEST and file list, and reads the files itself otherwise (a failure here
    is left for that read to meet and report)."""

    def __init__(self, cfg: TrainConfig, run_dir: RunDir, rank: int, world: int):
        self._args = cfg, run_dir, rank, world
        self._got: tuple | None = None  # (step, manifest, names, files, sources)
        self._thread = threading.Thread(target=self._read, name="raygpt-resume-read", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        cfg, run_dir, rank, world = self._args
        try:
            step = CheckpointStore(run_dir).latest_resumable(
                ck.read_abandoned_trajectories(run_dir), warn=lambda m: None)
            if step is None:
                return
            manifest = ck.read_manifest(run_dir, step)
            if (manifest.get("world_size") != world
                    or manifest_zero_stage(manifest) != cfg.zero_stage):
                return  # resharding: restore_latest reads what the new layout needs
            names = files_to_load(step, [rank], model_file=cfg.precision != "bf16")
            sources: dict[str, str] = {}
            files = fetch_verified(run_dir, step, manifest, names, LocalCopies(run_dir.uri()),
                                   sources)
            self._got = (step, manifest, names, files, sources)
        except Exception as e:  # noqa: BLE001 - restore_latest reads again and reports it
            log.debug(f"raygpt | rank {rank}: early read of the resume checkpoint: "
                      f"{type(e).__name__}: {e}")

    def take(self, step: int, manifest: dict, names: list[str]) -> tuple[dict, dict] | None:
        """({name: bytes}, {name: "local" | "storage"}) when the early read got exactly these
        files of this checkpoint, else None; the bytes are handed over once."""
        self._thread.join()
        got, self._got = self._got, None
        if got is None or (got[0], got[1], got[2]) != (step, manifest, names):
            return None
        return got[3], got[4]
