"""Saving and restoring a running job (the worker side): async save, restore, resharding
across world sizes and ZeRO, rewind; the files and their rules are raygpt.checkpointing.protocol's.

Save (every rank, at the same step):
 1. copy the state at the step boundary (`snapshot.StateSnapshot`: on a GPU a copy straight
    to pinned host memory on a side stream, which the training thread does not wait for and
    the next optimizer update waits for on the device),
 2. write this rank's files (state file; rank 0 also the model file) into a private local staging
    directory on a background thread, hashing them as they are written,
 3. once every rank's write has finished (agreed through the loop's per-step collective), every
    rank publishes its files through the session: under Ray, `ray.train.report` with a
    `Checkpoint`; Ray merges the ranks' files into `<run dir>/step_<N>/` and registers it, and
    a driver-side callback then writes DONE and MANIFEST (`finalize_checkpoint`).
A checkpoint without DONE and a valid MANIFEST is never resumed from, so a crash anywhere in
between costs that checkpoint and nothing else.

Restore follows llm.c's order (train_gpt2.cu: the model file, then load_state): optimizer state
and master weights, working weights re-derived from the master weights with `rng_state_last_update`, then `rng_state`, then the data
loader resumed (never reset) at its saved position with its saved permutation.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing import staging
from raygpt.checkpointing.fingerprints import compatibility, run_fingerprints
from raygpt.checkpointing.local_copy import LocalCopies
from raygpt.checkpointing.reading import (ResumeRead, fetch_verified, files_to_load,
                                          host_tensor, manifest_zero_stage, old_ranks_needed)
from raygpt.checkpointing.snapshot import StateSnapshot
from raygpt.checkpointing.store import CheckpointStore
from raygpt.config import TrainConfig
from raygpt.checkpointing.knobs import CheckpointConfig
from raygpt.data.loader import merge_ranges
from raygpt.llmc.model_file import read_model_file_flat, write_model_file_from_flat
from raygpt.llmc.state_file import read_state_file, write_state_file
from raygpt.model.gpt import GPTConfig
from raygpt.storage import RunDir
from raygpt.storage.atomic_file import fsync_directory
from raygpt.storage.hashing_writer import HashingWriter
from raygpt.train.optim import AdamW, FlatParameters, random_u32, shard_range
from raygpt.train.outlier import rewind_target
from raygpt.train.state import TrainState

log = logging.getLogger(__name__)

# the thread that removes the staging roots dead processes left (staging.sweep_dead_stage_roots)
STAGE_SWEEP_THREAD = "raygpt-stage-sweep"


def may_restore(cfg: CheckpointConfig, hint: int | None) -> bool:
    """Whether Checkpointer.restore_latest will look for a checkpoint: the surroundings restored
    one (`hint`, the session's checkpoint_hint(): a Ray restart) or the config asks (-y 1)."""
    return hint is not None or cfg.resume == 1


# How long a rewind waits for the driver to complete a checkpoint this attempt reported.
REWIND_WAIT_S = 120.0


def choose_rewind_target(published, verified_steps, completed, spike_start: int,
                         safety_steps: int, wait_s: float, *, clock=time.monotonic,
                         sleep=time.sleep) -> int | None:
    """The newest verified checkpoint a rewind may go back to (outlier.rewind_target over
    `verified_steps()`). Under Ray a reported checkpoint becomes verified only once the driver
    has written its DONE and MANIFEST, a moment after the report: when `published` (the steps
    this attempt reported) holds an eligible step, wait up to `wait_s` until `completed(step)`
    (a cheap look for DONE and MANIFEST, not a verification, which hashes every file), then
    verify once and settle for what is verified."""
    wanted = rewind_target(published, spike_start, safety_steps)
    if wanted is not None:
        deadline = clock() + wait_s
        while not completed(wanted):
            if clock() > deadline:
                log.warning(f"raygpt | WARNING: checkpoint {wanted} was reported but not completed "
                            f"within {wait_s:.0f} s; rewinding to the newest verified one")
                break
            sleep(0.1)
    return rewind_target(verified_steps(), spike_start, safety_steps)


class Checkpointer:
    def __init__(self, cfg: TrainConfig, session, flat: FlatParameters, opt: AdamW,
                 model_config: GPTConfig, max_steps: int, marks: dict | None = None,
                 resume_read: ResumeRead | None = None):
        self.cfg, self.session, self.flat, self.opt = cfg, session, flat, opt
        self.resume_read = resume_read  # the resume checkpoint's files, read early (or None)
        # wall times of the restore's parts (the recovery bench's split of a worker's setup)
        self.marks = marks if marks is not None else {}
        self.model_config = model_config
        self.run_dir: RunDir = session.run_dir
        self.store = CheckpointStore(self.run_dir)  # every listing and deletion goes through it
        session.configure(cfg)  # a session that commits itself takes the config's facts from it
        self.rank, self.world = session.rank, session.world
        self.max_steps = max_steps
        self.fingerprints = run_fingerprints(cfg)
        self.marks["fingerprints"] = time.time()
        # this node's copies of the files its ranks wrote: a restarted rank loads from them
        self.local = LocalCopies(self.run_dir.uri())
        self.load_sources: dict[str, str] = {}  # {file name: "local" | "storage"}, last load
        self.stalls: list[tuple[int, float]] = []  # (step, training time lost to host copies)
        self.write_seconds: list[float] = []  # background serialisation, per checkpoint
        self.load_seconds = 0.0
        self._pending = None  # (step, stage_dir, thread, result dict)
        self.published: list[int] = []  # steps this attempt reported, on the live trajectory
        # the checkpoint the state was last loaded from (a resume, a rewind): it exists, so
        # the loop does not write it again at that step
        self.loaded_step: int | None = None
        self._stage_root: Path | None = None  # private to this user and run (made at first save)
        # the tensors' copy at a checkpoint's step, into host buffers pinned from now on beside
        # the build and the restore; every write to those tensors waits for the copy first
        self._snapshot = StateSnapshot(cfg.checkpoint_snapshot)
        self._snapshot.reserve_in_background(self._checkpointed())
        opt.before_write = self._snapshot.before_write
        # per checkpoint, wall times: saved (captured), written (files staged), published
        # (reported), and what the session adds (e.g. stored: in storage, Ray's upload done)
        self.timeline: list[dict] = []
        self.waits: list[tuple[int, float]] = []  # (step, training time waiting on the last one)
        # this attempt's trajectory; a rewind starts a new one (see checkpoint.ABANDONED)
        self.trajectory = uuid.uuid4().hex

    # ------------------------------------------------------------------ policy
    @property
    def stall_seconds(self) -> float:
        return sum(s for _, s in self.stalls)

    def due(self, step: int, last_step: bool) -> bool:
        """-n's schedule and the last step; never step 0 or the step just loaded."""
        if step == 0 or step == self.loaded_step:
            return False
        return last_step or (self.cfg.checkpoint_every > 0 and step % self.cfg.checkpoint_every == 0)

    def rewind_target(self, spike_start: int, safety_steps: int,
                      wait_s: float = REWIND_WAIT_S) -> int | None:
        """Where a rewind goes back to: `choose_rewind_target` over this attempt's published
        steps and the run directory's verified ones. Rank 0's answer is the one the loop uses
        (it broadcasts it)."""
        # the quick check (DONE, MANIFEST, sizes; not hashed: `load` hashes what it reads)
        return choose_rewind_target(self.published, self.store.complete_steps,
                                    self.store.complete, spike_start, safety_steps, wait_s)

    def manifest_meta(self, step: int, trajectory: str | None = None) -> dict:
        """Rank 0's report of a checkpoint: what only the workers know (the world, the
        parameters, the trajectory, the run's length in steps); the committing side adds the
        config's fingerprints, identity and retention (raygpt.checkpointing.finalize.CommitFacts)."""
        c = self.cfg
        meta = {"step": step, "world_size": self.world, "num_parameters": self.flat.num_parameters,
                "max_steps": self.max_steps,
                "extra": {"zero_stage": c.zero_stage, "precision": c.precision,
                          "model_version": 5 if c.precision == "bf16" else 3}}
        if trajectory is not None:
            meta["extra"]["trajectory"] = trajectory
        return meta

    # ------------------------------------------------------------------ save
    def save(self, state: TrainState, loader, *, blocking: bool) -> None:
        writing = self._pending is not None and self.ready() == 0.0
        t0 = time.perf_counter()
        self.wait_and_publish()  # at most one checkpoint in flight (its buffers are reused)
        waited = time.perf_counter() - t0
        if writing:  # the previous checkpoint's writer was still busy: training waited for it
            self.waits.append((state.step, waited))
            if len(self.waits) == 1 and self.rank == 0:
                log.warning(f"raygpt | WARNING: checkpoint {state.step}: the previous checkpoint "
                            f"was still being written; training waited {waited:.2f} s for it "
                            f"(checkpoints come faster than they are written: raise "
                            f"--checkpoint-every)")
        t0 = time.perf_counter()
        snap = self._host_snapshot(state, loader)
        self.stalls.append((state.step, time.perf_counter() - t0))
        if self._stage_root is None:
            self._stage_root = staging.private_stage_root(f"r{self.rank}")
            # what Ray has not removed after its upload goes when this process ends
            atexit.register(shutil.rmtree, self._stage_root, True)
            # and the roots dead workers left on this node (Ray ends its workers without exit
            # handlers) go now, beside training: a root can hold whole state files
            threading.Thread(target=staging.sweep_dead_stage_roots, args=(self._stage_root.parent,),
                             name=STAGE_SWEEP_THREAD, daemon=True).start()
        stage = staging.stage_dir(self._stage_root, state.step)
        result: dict = {"trajectory": self.trajectory}  # as of the step saved
        result["times"] = {"step": state.step, "saved": time.time()}  # checkpoint_timeline's row
        if blocking or not self.cfg.async_checkpoint:
            self._write_files(snap, stage, result)
            self._pending = (state.step, stage, None, result)
            self.wait_and_publish()
        else:
            thread = threading.Thread(target=self._write_files, args=(snap, stage, result),
                                      name=f"raygpt-ckpt-{state.step}", daemon=True)
            thread.start()
            self._pending = (state.step, stage, thread, result)

    def _host_snapshot(self, state: TrainState, loader) -> dict:
        """The state at this step: the small values copied here, the tensors captured by
        `StateSnapshot` (on a GPU a copy to pinned host memory on a side stream that the
        training thread does not wait for; the writer thread waits for it, `_write_files`)."""
        self.opt.params_ready()  # ZeRO-1's overlapped gather: never half-gathered weights
        self._snapshot.capture(self._checkpointed())
        return {"step": state.step, "rng_state": state.rng_state,
                "rng_state_last_update": state.rng_state_last_update,
                "loader_state": loader.state_dict(), "extras": state.extras()}

    def _checkpointed(self) -> dict:
        """The tensors a checkpoint holds: m, v, the master weights (None in fp32) and, on rank
        0 (the model file), the working weights."""
        opt = self.opt
        return {"m": opt.m, "v": opt.v, "master": opt.master,
                "params": self.flat.params[:self.flat.num_parameters] if self.rank == 0 else None}

    def _write_files(self, snap: dict, stage: Path, result: dict) -> None:
        """Background thread: serialise this rank's files into `stage`, hashing them."""
        t0 = time.perf_counter()
        try:
            snap = {**snap, **self._snapshot.to_host()}  # the tensors as of the step
            result["times"]["host_copy_s"] = time.perf_counter() - t0
            step = snap["step"]
            # rank 0's model file is written on a helper thread while the state file is written
            # here; each of its pieces is hashed on one of a few threads (a resume checks them in
            # parallel) and the whole-file sha256 follows the writes on a thread of its own (the
            # snapshot's buffers stay unchanged until this thread is done)
            with ThreadPoolExecutor(1, thread_name_prefix=f"raygpt-ckpt-{step}-model") as pool, \
                    ThreadPoolExecutor(ck.PIECE_THREADS,
                                       thread_name_prefix=f"raygpt-ckpt-{step}-pieces") as pieces:
                model = (pool.submit(self._write_model_file, snap, stage)
                         if snap["params"] is not None else None)
                name = ck.state_file(step, self.rank)
                with open(stage / name, "wb") as f:
                    hw = HashingWriter(f, pieces=pieces, borrow=True)
                    write_state_file(
                        hw, step=step, num_processes=self.world, process_rank=self.rank,
                        rng_state=snap["rng_state"],
                        rng_state_last_update=snap["rng_state_last_update"],
                        m=snap["m"].numpy(), v=snap["v"].numpy(),
                        master=snap["master"].numpy() if snap["master"] is not None else None,
                        loader_state=snap["loader_state"], extras=snap["extras"])
                    f.flush()
                    os.fsync(f.fileno())  # durable before it is reported (the model file's
                    # writer fsyncs its own file and its rename)
                hashes = {name: {"sha256": hw.hexdigest(), "size": hw.size,
                                 "piece_bytes": hw.piece_bytes,
                                 "piece_sha256": hw.piece_digests()}}
                if model is not None:
                    hashes.update(model.result())
            fsync_directory(stage)  # the staged names too
            self.local.keep(step, stage, list(hashes))  # links: nothing more is written
            result["hashes"] = hashes
            self.write_seconds.append(time.perf_counter() - t0)
            result["times"]["written"] = time.time()
        except BaseException as e:  # reported by the training thread, never swallowed
            result["error"] = e

    def _write_model_file(self, snap: dict, stage: Path) -> dict:
        """Rank 0's model file of the snapshot into `stage`; {name: sha256 and size}."""
        name = ck.model_file(snap["step"])
        dtype = torch.bfloat16 if self.cfg.precision == "bf16" else torch.float32
        h = hashlib.sha256()  # fed while writing: the file is never read back
        write_model_file_from_flat(stage / name, self.model_config, snap["params"], dtype, hasher=h)
        return {name: {"sha256": h.hexdigest(), "size": (stage / name).stat().st_size}}

    def ready(self) -> float:
        """1.0 when no checkpoint is in flight or this rank's files are written (agreed by all)."""
        if self._pending is None:
            return 1.0
        thread = self._pending[2]
        return 0.0 if thread is not None and thread.is_alive() else 1.0

    def publish_pending(self, metrics: dict) -> None:
        """Every rank calls this at the same step once all ranks' writes are done."""
        if self._pending is None:
            return
        step, stage, thread, result = self._pending
        if thread is not None:
            thread.join()
        self._pending = None
        if "error" in result:
            # A failed save never looks complete: nothing is reported for it, the staged files
            # go, and the run goes on to its next checkpoint. Every rank raises together only
            # if the failure is ours, so the others are not left waiting in a collective.
            shutil.rmtree(stage, ignore_errors=True)
            raise RuntimeError(f"checkpoint at step {step} failed on rank {self.rank} while "
                               f"writing {stage}: {result['error']!r}") from result["error"]
        meta = self.manifest_meta(step, result["trajectory"]) if self.rank == 0 else None
        # store the appended history first (an object store's segments are buffered, see
        # runlog.segments): the stored history is then as new as any checkpoint a resume can pick
        self.run_dir.flush()
        times = result["times"]
        times["published"] = time.time()
        self.session.report_checkpoint({**metrics, "checkpoint_step": step}, str(stage),
                                       ck.step_dir(step), result["hashes"], meta, times)
        times["publish_s"] = time.time() - times["published"]
        self.published.append(step)
        self.timeline.append(times)

    def wait_and_publish(self, metrics: dict | None = None) -> None:
        if self._pending is not None:
            self.publish_pending(metrics or {"step": self._pending[0]})

    def finish(self) -> None:
        self.opt.params_ready()  # the run ends with its weights whole
        self.wait_and_publish()
        self._snapshot.close()  # the pinned host buffers
        self.local.remove_all()  # the run is over: its fast-resume copies go

    # ------------------------------------------------------------------ restore
    def restore_latest(self, state: TrainState, loader) -> int | None:
        """Resume from the newest verified checkpoint when the surroundings restored one (a Ray
        restart) or the config asks (-y 1); returns the step resumed from, or None.

        The newest complete checkpoint (DONE, MANIFEST, every file with its listed size: no
        hashing) is the candidate; each rank then reads the files it loads, in parallel, and
        checks their sha256 against MANIFEST from the bytes it holds (`_fetch_verified`), so no
        rank reads another's state. The ranks agree on the verdict (one collective): when any
        rank's file fails, every rank passes over that checkpoint to the next older one."""
        hint = self.session.checkpoint_hint()
        if not may_restore(self.cfg, hint):
            return None
        warn = (lambda m: log.warning(f"raygpt | WARNING: {m}")) if self.rank == 0 else (lambda m: None)
        decisions = ck.read_abandoned_trajectories(self.run_dir)
        before = None
        while True:
            step = self.store.latest_resumable(decisions, warn, before)
            self.marks["checkpoint_chosen"] = time.time()
            files, problem = None, None
            if step is not None:
                t0 = time.perf_counter()
                manifest = ck.read_manifest(self.run_dir, step)
                same_sharding = self._same_sharding(manifest)  # an incompatible config raises
                files, problem = self._fetch_verified(step, manifest, same_sharding)
                self.load_seconds += time.perf_counter() - t0
                self.marks["files_verified"] = time.time()
                if problem is not None:
                    log.warning(f"raygpt | WARNING: rank {self.rank}: checkpoint step {step}: "
                                f"{problem}")
            bad, newest, oldest = self._agree(problem is not None, -1 if step is None else step)
            if newest == -1:  # no rank has a candidate left
                if hint is not None:
                    warn(f"Ray restored checkpoint step {hint} but no verified checkpoint exists "
                         f"in {self.run_dir}; starting from scratch")
                elif self.rank == 0:
                    log.info(f"raygpt | -y 1: no verified checkpoint in {self.run_dir}; starting "
                             f"fresh")
                return None
            if not bad and newest == oldest:
                break
            if bad:
                warn(f"checkpoint step {newest} in {self.run_dir.uri()} failed verification on "
                     f"at least one rank; every rank falls back to an older one")
            else:  # the ranks saw different newest checkpoints (one completed meanwhile)
                warn(f"the ranks found different newest checkpoints ({oldest}..{newest}); "
                     f"every rank passes over step {newest}")
            before = newest
        self.marks["ranks_agreed"] = time.time()
        self.load(step, state, loader, files=files, manifest=manifest)
        self.loaded_step = step
        self._apply_rewind_decision(ck.latest_rewind_decision(decisions), step, state, loader)
        return step

    def _agree(self, bad: bool, step: int) -> tuple[bool, int, int]:
        """(any rank's verdict is bad, the newest and the oldest candidate step over the ranks):
        the resume verdict's one collective, so every rank takes the same decision."""
        if self.world == 1 or not torch.distributed.is_initialized():
            return bad, step, step
        t = torch.tensor([1.0 if bad else 0.0, float(step), -float(step)],
                         dtype=torch.float64, device=self.flat.params.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t[0].item() > 0), int(t[1].item()), int(-t[2].item())

    def _files_to_load(self, step: int, manifest: dict, same_sharding: bool) -> list[str]:
        """The files of checkpoint `step` this rank reads to load it: its own state file, or
        (resharding) rank 0's for the rank-independent state plus the old ranks' files whose
        shards overlap this rank's [lo, hi); the model file where the weights come from it."""
        ranks = [self.rank] if same_sharding else self._old_ranks_needed(manifest)
        return files_to_load(step, ranks, model_file=self.opt.master is None)

    def _old_ranks_needed(self, manifest: dict) -> list[int]:
        return old_ranks_needed(self.flat.num_parameters, manifest["world_size"],
                                manifest_zero_stage(manifest),
                                self.opt.lo, self.opt.hi)

    def _fetch_verified(self, step: int, manifest: dict, same_sharding: bool):
        """({name: bytes}, None) with every file this rank loads read and checked (by the
        early ResumeRead when it read exactly these), or (None, what failed)."""
        names = self._files_to_load(step, manifest, same_sharding)
        early, self.resume_read = self.resume_read, None  # its guess serves the first candidate
        got = early.take(step, manifest, names) if early is not None else None
        if got is not None:
            files, self.load_sources = got
            return files, None
        try:
            self.load_sources = {}
            return fetch_verified(self.run_dir, step, manifest, names, self.local,
                                  self.load_sources), None
        except (ck.CheckpointError, OSError, ValueError) as e:
            return None, f"{type(e).__name__}: {e}"

    def _apply_rewind_decision(self, decision: dict | None, step: int, state: TrainState,
                               loader) -> None:
        """A rewind decided after checkpoint `step` was written (its ledger counts more rewinds
        than the checkpoint's) still holds: its ledger (count, lr_scale) and skip list replace
        and extend the checkpoint's, exactly as the rewind itself left them in memory."""
        if decision is None or decision["ledger"]["rewinds"] <= state.ledger.rewinds:
            return
        state.ledger.load_state_dict(decision["ledger"])
        loader.add_skip_ranges([tuple(r) for r in decision["skip_ranges"]])
        if self.rank == 0:
            log.info(f"raygpt | checkpoint {step} predates rewind {state.ledger.rewinds} (back to "
                     f"step {decision['to_step']}): its skip list and lr_scale "
                     f"{state.ledger.lr_scale:.3f} apply from here")

    def load(self, step: int, state: TrainState, loader, files: dict | None = None,
             manifest: dict | None = None) -> None:
        """Load checkpoint `step`; `files` are bytes `_fetch_verified` already read and checked
        against `manifest` (else each file is read here, from this node's local copy or from
        storage, and checked against MANIFEST before it is used)."""
        t0 = time.perf_counter()
        self._load(step, state, loader, files or {}, manifest)
        self.load_seconds += time.perf_counter() - t0

    def _same_sharding(self, manifest: dict) -> bool:
        """Whether this rank's own state file is its state (same world and ZeRO stage); raises
        CheckpointError naming the fields when the checkpoint cannot be resumed at all."""
        try:
            ck.check_compatible(manifest, config_identity=self.cfg.identity(),
                                world_size=self.world, **compatibility(self.fingerprints))
            return manifest_zero_stage(manifest) == self.cfg.zero_stage
        except ck.WorldSizeMismatch:
            return False

    def _read(self, step: int, name: str, manifest: dict, files: dict) -> bytes:
        if name in files:
            return files[name]
        return fetch_verified(self.run_dir, step, manifest, [name], self.local,
                              self.load_sources)[name]

    def _load(self, step: int, state: TrainState, loader, files: dict,
              manifest: dict | None = None) -> None:
        # the MANIFEST the files were checked against (restore_latest read it), else read here
        manifest = manifest if manifest is not None else ck.read_manifest(self.run_dir, step)
        same_sharding = self._same_sharding(manifest)
        # elastic resume: written by N ranks (or another ZeRO stage), read by this run's M
        sf = (self._read_own_state(step, manifest, files) if same_sharding
              else self._read_resharded_state(step, manifest, files))
        sdir = ck.step_dir(step)
        opt = self.opt
        opt.params_ready()  # no gather still writing the weights this load replaces
        opt.before_write()  # a checkpoint's copy of these tensors may still be reading them
        # 1. optimizer state and master weights
        opt.m.copy_(host_tensor(sf.m))
        opt.v.copy_(host_tensor(sf.v))
        if opt.master is not None:
            if sf.master is None:
                raise ck.CheckpointError(f"{sdir}: state file has no master weights but this run "
                                         f"trains in {self.cfg.precision} with master weights")
            opt.master.copy_(host_tensor(sf.master))
            self.marks["optimizer_state_copied"] = time.time()
            # 2. working weights re-derived from master with the seed of the last update
            seed, _ = random_u32(sf.rng_state_last_update)
            opt.rederive_working_weights(seed)
            self.marks["weights_rederived"] = time.time()
        else:
            # fp32: the working weights are the weights; llm.c reads them from the model file
            name = f"{sdir}/{ck.model_file(step)}"
            _, weights = read_model_file_flat(self._read(step, ck.model_file(step), manifest, files),
                                              name)
            self.flat.params[:self.flat.num_parameters].copy_(weights)
        # 3. then rng_state, 4. then the loader resumed at its position (never reset)
        state.step = sf.step
        state.rng_state_last_update = sf.rng_state_last_update
        state.rng_state = sf.rng_state
        loader.load_state_dict(sf.loader_state)
        for note in state.load_extras(sf.extras):
            if self.rank == 0:
                log.warning(f"raygpt | WARNING: checkpoint {step}: {note}")

    def _read_own_state(self, step: int, manifest: dict, files: dict):
        opt = self.opt
        return read_state_file(self._read(step, ck.state_file(step, self.rank), manifest, files),
                               num_parameters=opt.hi - opt.lo, expect_processes=self.world,
                               expect_rank=self.rank, copy=False)

    def _read_resharded_state(self, step: int, manifest: dict, files: dict):
        """A checkpoint of N ranks resumed on this run's M ranks (llm.c refuses this; raygpt
        re-splits). Everything but the optimizer tensors is rank-independent (the loader state is
        a global cursor, the RNG and policy state are replicated), so it comes from rank 0's file.
        m, v and the master weights are the concatenation of the N shards in rank order (or rank
        0's full copy without ZeRO), sliced to this rank's [lo, hi): only the old shards that
        overlap it are read (`_old_ranks_needed`). The global batch is kept by the config
        (total_batch_size is part of its identity); grad accumulation absorbs M."""
        n_old = manifest["world_size"]
        zero_old = manifest_zero_stage(manifest)
        total = self.flat.num_parameters
        sdir = ck.step_dir(step)
        lo, hi = self.opt.lo, self.opt.hi
        parts = {"m": [], "v": [], "master": []}
        first, base = None, None
        for r in self._old_ranks_needed(manifest):
            name = f"{sdir}/{ck.state_file(step, r)}"
            if ck.state_file(step, r) not in files and not self.run_dir.exists(name):
                raise ck.CheckpointError(f"{self.run_dir.uri(name)}: expected the state file of "
                                         f"rank {r} of {n_old} to reshard from, found none")
            r_lo, r_hi = shard_range(total, r, n_old, zero_old)
            sf = read_state_file(self._read(step, ck.state_file(step, r), manifest, files),
                                 num_parameters=r_hi - r_lo, expect_processes=n_old,
                                 expect_rank=r, copy=False)  # concatenated below
            first = first or sf
            if not (r_lo < hi and r_hi > lo):
                continue  # rank 0's file read for the rank-independent state only
            base = r_lo if base is None else base
            for key in parts:
                if getattr(sf, key) is not None:
                    parts[key].append(getattr(sf, key))
        for key, arrays in parts.items():
            if arrays:
                setattr(first, key, np.concatenate(arrays)[lo - base:hi - base])
            elif getattr(first, key) is not None:  # this rank's shard is empty (padding)
                setattr(first, key, getattr(first, key)[:0])
        if self.rank == 0:
            log.info(f"raygpt | elastic resume: checkpoint {step} of {n_old} rank(s) "
                     f"(ZeRO-{zero_old}) resharded onto {self.world} rank(s) "
                     f"(ZeRO-{self.cfg.zero_stage}); grad accumulation now "
                     f"{self.cfg.grad_accum_steps(self.world)}")
        return first

    def rewind_to(self, step: int, state: TrainState, loader, window) -> None:
        """Reload checkpoint `step` for a spike rewind, keeping the policy's memory (the rewind
        ledger with lr_scale, and the loader's skip list grown by the spike's data `window`)
        from the present.

        The decision (ledger and skip list) is durable before anything else happens: rank 0
        writes it into the abandoned-trajectories record, so a worker lost before the next
        checkpoint resumes from an older one and still applies it (`restore_latest`). The
        other ranks go no further than the next step's collective without rank 0.

        Checkpoints newer than `step` belong to the abandoned trajectory: resuming from one
        would skip the rewind and its skip list, and the re-trained steps will write their own
        checkpoints under the same names. Rank 0 deletes them first, DONE and MANIFEST before
        the files, so none of them can be taken as complete while it goes. It first records
        this trajectory as abandoned: a checkpoint of it that the driver finalizes later (it
        was reported before the rewind) is then refused DONE."""
        skips = merge_ranges([tuple(r) for r in loader.state_dict()["skip_ranges"]]
                             + [tuple(r) for r in window])
        ledger = state.ledger.state_dict()
        if self.rank == 0:
            self.store.abandon_after(step, self.trajectory, ledger=ledger, skip_ranges=skips)
        self.trajectory = uuid.uuid4().hex
        self.published = [s for s in self.published if s <= step]
        self.load(step, state, loader)
        self.loaded_step = step
        state.ledger.load_state_dict(ledger)
        loader.add_skip_ranges(skips)
        state.spike_samples = []

