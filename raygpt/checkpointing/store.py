"""The checkpoint store: the one owner of a run's checkpoints in storage, over the protocol's
names and sentinels (raygpt.checkpointing.protocol). Every listing, commit and deletion goes
through a `CheckpointStore`:

    steps / complete_steps / sealed_steps / latest_verified / latest_resumable   what there is
    commit    a stored checkpoint made complete: every rank's file present with its written
              size, all of it durable, DONE, then MANIFEST (llm.c's barrier-then-DONE)
    delete    MANIFEST and DONE first, then the files: never half a checkpoint that looks whole
    abandon_after   a spike rewind's: its decision recorded, then every newer checkpoint deleted
    retain    the retention policy (raygpt.checkpointing.retention, pure) applied

Who calls what: the driver's finalizer (raygpt.ray.checkpoints) or the single process
(raygpt.train.session) commits and retains; rank 0 abandons on a rewind; the restore, the
preflight, `raygpt status` and the trained-model readers list.
"""

from __future__ import annotations

from typing import Callable

from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing.retention import RetentionPolicy, to_delete
from raygpt.storage import RunDir


class CheckpointStore:
    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir

    # ------------------------------------------------------------------ listing
    def steps(self) -> list[int]:
        """Every checkpoint directory's step, complete or not, ascending."""
        return ck.list_checkpoint_steps(self.run_dir)

    def complete(self, step: int) -> bool:
        """DONE, MANIFEST and every listed file with its size (not hashed: a loading rank
        hashes what it reads)."""
        return not ck.verify_checkpoint(self.run_dir, step, hashes=False)

    def complete_steps(self) -> list[int]:
        return [s for s in self.steps() if self.complete(s)]

    def sealed_steps(self) -> list[int]:
        """The checkpoints with DONE and MANIFEST written (their files not checked), ascending:
        the ones a commit finished, which Ray's list may name."""
        return [s for s in self.steps() if self.run_dir.exists(ck.done_path(s))
                and self.run_dir.exists(f"{ck.step_dir(s)}/{ck.MANIFEST}")]

    def latest_verified(self, *, before: int | None = None, hashes: bool = False,
                        warn: Callable[[str], None] | None = None) -> int | None:
        """The newest complete checkpoint below `before` (hashed too with `hashes`); `warn` gets
        each newer one passed over (None: silently)."""
        return ck.find_latest_verified(self.run_dir, before_step=before, hashes=hashes,
                                       warn=warn or (lambda m: None))

    def latest_resumable(self, decisions: list[dict], warn: Callable[[str], None],
                         before: int | None = None) -> int | None:
        """The newest complete checkpoint (below `before`) that no rewind abandoned (a crash can
        come between a rewind's record and its deletion of the abandoned checkpoints)."""
        while (step := self.latest_verified(before=before, warn=warn)) is not None:
            trajectory = ck.read_manifest(self.run_dir, step).get("extra", {}).get("trajectory")
            hit = ck.abandoned_by(step, trajectory, decisions)
            if hit is None:
                return step
            warn(f"checkpoint step {step} belongs to a trajectory a spike rewind abandoned "
                 f"back to step {hit['to_step']}; passing over it")
            before = step
        return None

    # ------------------------------------------------------------------ commit
    def commit(self, step: int, rank_hashes: dict, meta: dict) -> None:
        """Make a stored checkpoint complete: DONE, then MANIFEST (atomically, last). Called by
        whoever knows every rank's files are durably stored.

        `rank_hashes` are what the ranks hashed while writing (every byte once, by its writer).
        They must cover every rank's files, and storage must hold each of them with the size its
        rank wrote; MANIFEST takes the ranks' hashes, so nothing is read back here. `meta` is
        write_manifest's keywords (the driver's fingerprints and identity, rank 0's world size,
        parameters and "extra"); other keys are ignored."""
        run_dir, sdir = self.run_dir, ck.step_dir(step)
        trajectory = (meta.get("extra") or {}).get("trajectory")
        hit = ck.abandoned_by(step, trajectory, ck.read_abandoned_trajectories(run_dir))
        if hit is not None:
            raise ck.CheckpointError(f"{run_dir.uri(sdir)}: saved on trajectory {trajectory}, "
                                     f"which a spike rewind abandoned back to step "
                                     f"{hit['to_step']}; not marking DONE")
        unreported = [n for n in ck.expected_files(step, meta["world_size"]) if n not in rank_hashes]
        if unreported:
            raise ck.CheckpointError(f"{run_dir.uri(f'{sdir}/{unreported[0]}')}: no rank reported "
                                     f"writing it ({len(unreported)} file(s)); not marking DONE")
        for name, h in rank_hashes.items():
            stored = run_dir.size_of(f"{sdir}/{name}") if run_dir.exists(f"{sdir}/{name}") else None
            if stored != h["size"]:
                raise ck.CheckpointError(f"{run_dir.uri(f'{sdir}/{name}')}: expected {h['size']} "
                                         f"bytes as written by its rank, found {stored}; not "
                                         f"marking DONE")
        # every byte durable before anything declares it complete: the rank files as stored
        # (Ray copied them without an fsync), their names, the step directory's name
        run_dir.make_durable([f"{sdir}/{n}" for n in ck.published_files(run_dir, step)] + [sdir, ""])
        ck.write_done(run_dir, step)
        ck.write_manifest(run_dir, step, written=rank_hashes,
                          **{k: v for k, v in meta.items() if k in MANIFEST_KEYS})

    # ------------------------------------------------------------------ deletion
    def delete(self, step: int) -> None:
        """Delete checkpoint `step`: MANIFEST and DONE first, so that no reader takes it as
        complete while its files go."""
        sdir = ck.step_dir(step)
        for name in (ck.MANIFEST, ck.done_file(step)):
            if self.run_dir.exists(f"{sdir}/{name}"):
                self.run_dir.delete_file(f"{sdir}/{name}")
        self.run_dir.delete_dir(sdir)

    def abandon_after(self, step: int, trajectory: str, *, ledger: dict,
                      skip_ranges) -> list[int]:
        """A spike rewind back to `step`: its decision (the ledger, the whole skip list) and the
        abandoned `trajectory` recorded durably first (a checkpoint of it finalized later is
        refused DONE; a resume from an older one still applies the decision), then every newer
        checkpoint deleted (the re-trained steps write their own under the same names).
        Returns the deleted steps."""
        ck.record_abandoned_trajectory(self.run_dir, trajectory, step, ledger=ledger,
                                       skip_ranges=skip_ranges)
        doomed = [s for s in self.steps() if s > step]
        for s in doomed:
            self.delete(s)
        return doomed

    def retain(self, policy: RetentionPolicy) -> list[int]:
        """Delete the checkpoints `policy` lets go (never the newest complete one). Returns the
        deleted steps."""
        steps = self.steps()
        if not steps:
            return []
        doomed = to_delete(policy, steps, self.latest_verified())
        for s in doomed:
            self.delete(s)
        return doomed


# write_manifest's keywords a commit's meta may carry
MANIFEST_KEYS = ("world_size", "num_parameters", "config_hash", "tokenizer_hash", "data_hash",
                 "config_identity", "extra", "val_data_hash", "model_source")
