"""The Ray driver: one raygpt run as a Ray Train `TorchTrainer`, and the checkpoint bridge.

- `run(cfg)` checks every input on the driver first (`raygpt.preflight`: shards, model file,
  resume compatibility, the run directory's filesystem), claims the run directory
  (`claimed_run_dir`: never overwrite a run silently, never delete what is not a marked run, one
  writer at a time through the lease of raygpt/ownership.py, armed faults announced), records
  the launch in its `config.json`, starts its own Ray (or joins the one RAY_ADDRESS names; never
  whatever /tmp/ray names), and runs
  `train_func` on `cfg.num_workers` workers (NCCL on GPUs, gloo on CPUs) with
  `FailureConfig(max_failures, max_preemption_failures)`: after a worker or node is lost, Ray
  restarts the worker group and each worker resumes from the newest verified checkpoint.
- The run directory is Ray's experiment directory (`storage_path/name`), so the step
  directories Ray merges from the ranks' reports are raygpt's `step_XXXXXXXX/` checkpoints.
- `CheckpointFinalizer` is a driver-side (controller) `UserCallback`: Ray calls `after_report`
  only once *every* worker has reported and the merged checkpoint is persisted, which is exactly
  the moment DONE and MANIFEST may appear. It hands the checkpoint to a thread (`FinalizeQueue`:
  sizes checked, the ranks' own hashes written into MANIFEST, nothing read back), so the
  controller never waits on storage; `FinalizerDrain` holds the controller's end until the
  queue is empty. Doing it there, rather than on rank 0 after a
  barrier, means no worker can ever mark a checkpoint done whose other ranks' files Ray has not
  yet stored. Ray's own CheckpointConfig keeps every checkpoint; raygpt's retention and rewinds
  alone delete, and Ray's list of checkpoints (its snapshot file) is brought back to what
  exists after every report and before every fit() (raygpt.ray_snapshot).
- SIGTERM / SIGUSR1 to the driver (e.g. `ray job stop`) are forwarded through a small control
  actor that rank 0 polls; on the workers the handlers are installed on each actor's main
  thread by the backend hook (Python runs handlers on the main thread only). A first Ctrl-C
  (SIGINT) is a SIGTERM; a second aborts at once. Ray Train installs its own SIGINT handler
  when `fit()` starts its controller (it aborts the run without a checkpoint), so
  `RaygptTrainer` puts raygpt's in its place.
- Errors a restart would meet again (bad input, a stop raygpt decided: `raygpt.errors`) end
  the run at once: the worker raises `RunStopped`, and `StopOnRunStopped`, the controller's
  failure policy, answers RAISE instead of spending the retry budget on them (`RunFailed.final`
  tells a sweep's Tune not to re-run it either).
- A normal run prints no error-level line and no traceback from Ray's helper actors: Ray
  Train's State-API PlacementGroupCleaner is replaced by raygpt.pg_cleanup's, and the driver
  starts the AutoscalingCoordinator before the controller's 5 s request (`start_train_helpers`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import ray
import ray.train
import torch
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, UserCallback
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.torch.config import _TorchBackend
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
from ray.train.v2._internal.execution.preemption import PreemptionWatcher
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raygpt import preflight, signals, tracking
from raygpt.checkpointer import finalize_checkpoint
from raygpt.config import ConfigError, TrainConfig, absolute_output_dir
from raygpt.errors import EXIT_ABORTED, EXIT_FAILED, RunStopped, stop_code
from raygpt.faults import announce as announce_faults
from raygpt.faults import armed_spec, parse_spec
from raygpt.history import LOSS_HISTORY, read_history, summarize_run
from raygpt.pg_cleanup import CleanupOnControllerDeath
from raygpt.ownership import (Lease, check_overwrite, is_own_file, read_marker,
                              refused_overwrite_target, write_marker)
from raygpt.ray_snapshot import SNAPSHOT, reconcile_snapshot
from raygpt.run_config import CONFIG_FILE, write_launch
from raygpt.session import Session
from raygpt.storage import RunDir, open_run_dir, redact

# steps between polls of get_preemption_info, a barrier across workers (step-based, so every
# rank polls at the same steps)
PREEMPTION_POLL_EVERY = int(os.environ.get("RAYGPT_PREEMPTION_POLL_STEPS", "10"))


# ---------------------------------------------------------------------- worker side

@ray.remote(num_cpus=0)
class RunControl:
    """Requests from the driver to the workers: stop (checkpoint, exit) or save (and go on)."""

    def __init__(self):
        self.stop, self.save_count = False, 0

    def request(self, kind: str) -> None:
        if kind == "stop":
            self.stop = True
        else:
            self.save_count += 1

    def poll(self) -> tuple[bool, int]:
        return self.stop, self.save_count


class RaySession(Session):
    def __init__(self, cfg: TrainConfig, control_name: str | None):
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device() if cfg.device == "gpu" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.run_dir = open_run_dir(cfg.output_dir)
        self._checkpoint = ray.train.get_checkpoint()
        self._control = None
        if control_name and self.rank == 0:
            try:
                self._control = ray.get_actor(control_name)
            except ValueError:
                self._control = None
        self._control_ref = None
        self._saves_seen = 0
        self._polls = 0
        self._preempt_noticed = False
        # Ray Train's controller takes one report per health-check poll (2 s unless set), from a
        # queue of one on each worker: train metrics two polls apart never wait for a poll
        poll_s = float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2"))
        self.metrics_interval_s = 2 * poll_s

    def checkpoint_hint(self) -> int | None:
        if self._checkpoint is None:
            return None
        name = Path(self._checkpoint.path).name
        return int(name.split("_")[1]) if name.startswith("step_") else -1

    def report_metrics(self, metrics: dict) -> None:
        ray.train.report(metrics)

    def report_checkpoint(self, metrics, local_dir, dir_name, file_hashes, manifest_meta):
        metrics = {**metrics, "raygpt_files": file_hashes}
        if manifest_meta is not None:
            metrics["raygpt_manifest"] = manifest_meta
        # The files are already written (on our background thread); Ray copies them into
        # storage on its own upload thread and registers the checkpoint when all ranks are in.
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(local_dir),
                         checkpoint_dir_name=dir_name,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=True)

    def poll_requests(self) -> tuple[bool, bool]:
        """(stop, save) requested from outside: the driver's control actor (rank 0, without
        blocking) and Ray's preemption notice (every PREEMPTION_POLL_EVERY calls, all ranks)."""
        stop = save = False
        if self._control is not None:
            if self._control_ref is None:
                self._control_ref = self._control.poll.remote()
            ready, _ = ray.wait([self._control_ref], timeout=0)
            if ready:
                try:
                    stop, saves = ray.get(self._control_ref)
                except ray.exceptions.RayError as e:  # the driver is gone: train on without it
                    print(f"raygpt | WARNING: lost the driver's control channel ({type(e).__name__})"
                          f"; signals to the driver no longer reach the workers", flush=True)
                    self._control, stop, saves = None, False, self._saves_seen
                self._control_ref = None
                save = saves > self._saves_seen
                self._saves_seen = saves
        self._polls += 1
        if self._polls % PREEMPTION_POLL_EVERY == 0 and ray.train.get_preemption_info() is not None:
            if not self._preempt_noticed:  # one checkpoint per notice, then keep training
                self._preempt_noticed = save = True
                if self.rank == 0:
                    print("raygpt | preemption notice from Ray: checkpointing now", flush=True)
        return stop, save

    def failure_note(self) -> str | None:
        return None if self._checkpoint is None else f"restarted by Ray from {self._checkpoint.path}"

    def startup_marks(self) -> dict[str, float]:
        return dict(_STARTUP_MARKS)


def train_func(config: dict) -> None:
    """What each Ray Train worker runs."""
    from raygpt.loop import train

    cfg = TrainConfig.from_dict(config["cfg"])
    if cfg.device == "cpu":
        torch.set_num_threads(config.get("threads_per_worker", 1))
    _quiet_report_log()
    try:
        summary = train(cfg, RaySession(cfg, config.get("control_name")))
    except Exception as e:
        code = stop_code(e)  # classified here, where the exception still has its cause
        if code is None:
            raise  # a fault a restart may cure: Ray's retry budget is for these
        raise RunStopped(f"{type(e).__name__}: {e}", code) from e
    ray.train.report({"final": True, **summary})


def _quiet_report_log() -> None:
    """Ray Train 2.60 logs every ray.train.report at INFO, the checkpoint's whole manifest
    metadata included, through a logger named by its source file, which LoggingConfig's
    "ray.train" level does not reach; the console keeps raygpt's own lines instead."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray layout: its own logging applies
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


# This worker process's start-up marks (history.STARTUP_MARKS), set by the controller through
# _Backend before the train function runs here; RaySession.startup_marks reads them.
_STARTUP_MARKS: dict[str, float] = {}


def _note_startup_marks(marks: dict) -> None:
    _STARTUP_MARKS.clear()
    _STARTUP_MARKS.update(marks)


class _Backend(_TorchBackend):
    """Ray Train's torch backend, plus raygpt's signal handlers on each worker and the times of
    the worker group's start-up for the recovery ledger (raygpt.history.recovery_split)."""

    def on_start(self, worker_group, backend_config):
        # called once the group's actors are up and ready; the process group forms inside it
        self._marks = {"group_up": time.time()}
        super().on_start(worker_group, backend_config)
        self._marks["process_group"] = time.time()

    def on_training_start(self, worker_group, backend_config):
        super().on_training_start(worker_group, backend_config)
        worker_group.execute(signals.install)  # runs on each worker actor's main thread
        worker_group.execute(_note_startup_marks, getattr(self, "_marks", {}))


class RaygptTorchConfig(TorchConfig):
    @property
    def backend_cls(self):
        return _Backend


# Ray Train's switch for its own preemption watcher (propagated from the driver to the controller),
# and the user's own setting of it, read before raygpt sets it
RAY_PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
_USER_PREEMPTION_WATCHER = os.environ.get(RAY_PREEMPTION_WATCHER_ENV)


class PreemptionWatcherCallback(PreemptionCallback):
    """Ray Train's preemption watcher (the actor behind `ray.train.get_preemption_info()`),
    started without restarts on the controller's node.

    Ray Train 2.60 starts the watcher with `max_restarts=-1` and the worker actors' handles as
    constructor arguments, and Ray's core worker logs an ERROR for every such actor on every run
    ("has constructor arguments in the object store and max_restarts > 0", issue 53727 of Ray):
    a restarted watcher would get handles that may be gone. A restart is never needed: every
    worker-group start makes a fresh watcher (and stops the old one), so this one has none, and
    it lives on the controller's node, which it can only lose with the controller itself."""

    def after_worker_group_start(self, worker_group) -> None:
        self._stop_watcher()
        node_to_ranks: dict[str, list[int]] = {}
        actors = {}
        for worker in worker_group.get_workers():
            rank = worker.distributed_context.world_rank
            node_to_ranks.setdefault(worker.metadata.node_id, []).append(rank)
            actors[rank] = worker.actor
        here = ray.get_runtime_context().get_node_id()
        self._watcher = ray.remote(PreemptionWatcher).options(
            num_cpus=0, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
        ).remote(node_to_ranks=node_to_ranks, poll_interval_s=self._poll_interval_s,
                 worker_actors_by_rank=actors)


def preemption_callbacks() -> list:
    """raygpt's watcher in place of Ray Train's own (turned off for this process's runs through
    its environment switch, which Ray hands to the controller); none when the user turned Ray's
    off before raygpt did."""
    if (_USER_PREEMPTION_WATCHER or "1").lower() not in ("1", "true"):
        return []
    os.environ[RAY_PREEMPTION_WATCHER_ENV] = "0"
    return [PreemptionWatcherCallback()]


# ---------------------------------------------------------------------- driver side

# The finalizers' work queues in this process (the controller's), by run directory: a
# finalizer hands each checkpoint to its queue's thread, and `FinalizerDrain` waits for them all
# before the controller ends (it is a separate callback object: Ray gives controller hooks only
# to ControllerCallbacks, report hooks only to UserCallbacks).
_QUEUES: dict[str, "FinalizeQueue"] = {}
_QUEUES_LOCK = threading.Lock()


class FinalizeQueue:
    """One thread that finalizes checkpoints in report order (DONE, MANIFEST, retention), so
    that Ray's controller, which calls `after_report` synchronously, never waits on storage.
    A checkpoint whose finalization fails stays without DONE/MANIFEST (readers treat it as
    absent) and training goes on."""

    def __init__(self, output_dir: str):
        from concurrent.futures import ThreadPoolExecutor
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
            print(f"raygpt | WARNING: checkpoint {step} left incomplete (no DONE/MANIFEST): {e}",
                  flush=True)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted checkpoint is finalized; False if `timeout_s` ran out."""
        from concurrent.futures import wait
        _, pending = wait(list(self._futures), timeout=timeout_s)
        return not pending


def finalize_queue(output_dir: str) -> FinalizeQueue:
    with _QUEUES_LOCK:
        queue = _QUEUES.get(output_dir)
        if queue is None:
            queue = _QUEUES[output_dir] = FinalizeQueue(output_dir)
        return queue


def drain_finalize_queues(timeout_s: float | None = None) -> bool:
    with _QUEUES_LOCK:
        queues = list(_QUEUES.values())
    return all([q.drain(timeout_s) for q in queues])


class CheckpointFinalizer(UserCallback):
    """Writes DONE and MANIFEST once Ray has registered a checkpoint all ranks reported, applies
    retention, and records every worker-group failure in the run's loss history.

    `after_report` runs on Ray's controller thread, which waits for it: it only collects what the
    ranks reported (their files' names, sizes and sha256, hashed while writing) and hands the
    checkpoint to a `FinalizeQueue` thread, which checks presence and sizes in storage and writes
    DONE then MANIFEST (never reading the data back). `FinalizerDrain` makes the controller wait
    for the queue before it ends, so the last checkpoint is complete when fit() returns."""

    def __init__(self, output_dir: str, crash_before_done_steps=()):
        self.output_dir = output_dir
        self.crash_before_done_steps = set(crash_before_done_steps)
        self.failures = 0

    def after_report(self, run_context, metrics, checkpoint):
        if checkpoint is None:
            return
        run_dir = open_run_dir(self.output_dir)
        step = int(Path(checkpoint.path).name.split("_")[1])
        if step in self.crash_before_done_steps:
            # fault injection: act as if the driver died between Ray's registration and DONE
            print(f"raygpt | fault injection: leaving checkpoint {step} without DONE/MANIFEST",
                  flush=True)
            self.crash_before_done_steps.discard(step)
            self._reconcile(run_dir)
            return
        rank_hashes = {}
        for m in metrics:
            rank_hashes.update(m.get("raygpt_files", {}))
        meta = next(m["raygpt_manifest"] for m in metrics if "raygpt_manifest" in m)
        finalize_queue(self.output_dir).submit(step, rank_hashes, meta)
        # Ray wrote its snapshot just before this call; what the previous checkpoint's retention
        # deleted (on the queue's thread) goes out of it here, the last deletions at the drain
        self._reconcile(run_dir)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for this run's pending finalizations (the controller's end, tests, benches)."""
        ok = finalize_queue(self.output_dir).drain(timeout_s)
        self._reconcile(open_run_dir(self.output_dir))
        return ok

    @staticmethod
    def _reconcile(run_dir: RunDir) -> None:
        """Ray's CheckpointManager wrote its snapshot just before this callback (same thread):
        take out what retention just deleted and what a rewind deleted since the last report."""
        try:
            reconcile_snapshot(run_dir)
        except Exception as e:  # noqa: BLE001 - the next fit() reconciles again before starting
            print(f"raygpt | WARNING: could not update Ray's checkpoint list ({SNAPSHOT}): "
                  f"{type(e).__name__}: {e}", flush=True)

    def after_exception(self, run_context, worker_exceptions):
        # the restarted workers pick the newest complete checkpoint: let the ones the lost
        # group reported be completed first (a few small writes each), as a synchronous
        # finalizer would have
        finalize_queue(self.output_dir).drain()
        self.failures += 1
        causes = {rank: f"{type(e).__name__}: {e}"[:500] for rank, e in worker_exceptions.items()}
        with open_run_dir(self.output_dir) as run_dir:  # uploaded at once on object stores
            run_dir.append_text(LOSS_HISTORY, json.dumps(
                {"kind": "failure", "failure": self.failures, "causes": causes,
                 "time": time.time(), "attempt": None}) + "\n")
        print(f"raygpt | FAILURE {self.failures}: " + "; ".join(f"rank {r}: {c}" for r, c in causes.items()),
              flush=True)


class FinalizerDrain(ControllerCallback):
    """Holds Ray's controller at its end until every checkpoint handed to a `FinalizeQueue`
    has its DONE and MANIFEST (or was left incomplete), then brings Ray's snapshot in line with
    what retention deleted. On an abort (Ctrl-C) it waits at most ABORT_DRAIN_S: a checkpoint
    not finished by then simply stays without DONE/MANIFEST."""

    ABORT_DRAIN_S = 30.0

    def after_controller_finish(self, result) -> None:
        drain_finalize_queues()
        with _QUEUES_LOCK:
            dirs = list(_QUEUES)
        for d in dirs:
            CheckpointFinalizer._reconcile(open_run_dir(d))

    def before_controller_abort(self) -> None:
        if not drain_finalize_queues(self.ABORT_DRAIN_S):
            print("raygpt | WARNING: a checkpoint was still being finalized at the abort; it "
                  "stays without DONE/MANIFEST", flush=True)


class StopOnRunStopped(DefaultFailurePolicy):
    """Ray Train's failure policy, except that a worker group in which any worker raised
    `RunStopped` is not restarted: the run ends at once with that error (see raygpt.errors).
    Everything else (a lost process, node or collective, preemptions) keeps Ray's budgets."""

    def make_decision(self, training_failed_error):
        if run_stopped(training_failed_error) is not None:
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)


def run_stopped(error) -> RunStopped | None:
    """The RunStopped a worker raised, found in a Ray Train error (WorkerGroupError's
    worker_failures, by rank), else None."""
    failures = getattr(error, "worker_failures", None) or {}
    for rank in sorted(failures):
        if isinstance(failures[rank], RunStopped):
            return failures[rank]
    return None


class RaygptTrainer(TorchTrainer):
    """TorchTrainer with raygpt's failure policy, raygpt's placement-group cleanup and, when
    `on_sigint` is set, raygpt's Ctrl-C. The hooks are Ray Train 2.60's own seams
    (`_initialize_and_run_controller` receives the failure policy it ships to the controller;
    `_register_sigint_handler` installs Ctrl-C's handler once the controller exists;
    `_create_default_callbacks` lists the controller's callbacks); test_run_end.py and
    test_console.py fail if one stops being called."""

    on_sigint = None  # callable(controller) installed as the SIGINT handler during fit()

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        controller_init_kwargs["failure_policy"] = StopOnRunStopped(self.run_config.failure_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    def _create_default_callbacks(self):
        # Ray's PlacementGroupCleaner polls the State API, which needs a dashboard and a
        # single Ray on the machine, and logs a line a second (or a traceback) without them:
        # raygpt.pg_cleanup does its job through the controller's actor handle instead
        callbacks = [c for c in super()._create_default_callbacks()
                     if not isinstance(c, PlacementGroupCleanerCallback)]
        return [CleanupOnControllerDeath(), FinalizerDrain(), *callbacks]

    def _register_sigint_handler(self, controller):
        if self.on_sigint is None:
            return super()._register_sigint_handler(controller)
        signal.signal(signal.SIGINT, lambda signum, frame: self.on_sigint(controller))


class RunFailed(RuntimeError):
    """The run ended without finishing; `exit_code` is what the command line exits with
    (EXIT_FAILED, or EXIT_BAD_INPUT when a worker met a bad input). `final`: a worker's error
    was one a restart would meet again (raygpt.errors), so no one should retry the run as it
    is (a sweep's Tune does not)."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED, final: bool = False):
        super().__init__(message)
        self.exit_code, self.final = exit_code, final


def fit_or_raise(trainer, cfg: TrainConfig, since: float):
    """trainer.fit(), with Ray's error turned into RunFailed: `final` with the worker's message
    when a worker raised RunStopped, else what each attempt died of."""
    try:
        return trainer.fit()
    except Exception as e:  # a worker's RunStopped, or Ray's retry budget spent
        stopped = run_stopped(e)
        if stopped is not None:
            raise RunFailed(f"raygpt run {redact(cfg.output_dir)} stopped (not retried, it "
                            f"would fail again): {stopped.message}", stopped.exit_code,
                            final=True) from e
        raise RunFailed(_failure_report(cfg, since, e)) from e


class RunAborted(KeyboardInterrupt):
    """A second Ctrl-C: the run was aborted without a final checkpoint (EXIT_ABORTED)."""

    exit_code = EXIT_ABORTED


def prepare_run_dir(cfg: TrainConfig, lease: Lease | None = None) -> RunDir:
    """Never overwrite a run silently, never delete what is not a run. A directory that holds a
    run needs -y 1 (resume) or --overwrite (start fresh: only over a directory raygpt marked as
    a run, never `/`, the home or current directory, a bucket root or an empty -o); a directory
    that holds anything else is refused. `lease` (not yet held) is taken after the checks and
    before anything is deleted, so a live run is never deleted. A new run directory is marked
    (`ownership.MARKER`); a pre-marker run resumed with -y 1 is marked then."""
    if not cfg.output_dir.strip():
        raise ConfigError(f"-o/--output-dir {cfg.output_dir!r}: refused, "
                          f"{refused_overwrite_target(cfg.output_dir)}")
    run_dir = open_run_dir(cfg.output_dir)
    names = [n for n in run_dir.listdir() if not is_own_file(n)] if run_dir.exists() else []
    holds_run = any(n == LOSS_HISTORY or n.startswith("step_") or n == "main.log" for n in names)
    marker = read_marker(run_dir)
    fresh_over_run = holds_run and cfg.resume != 1
    if fresh_over_run:
        if not cfg.overwrite:
            raise ConfigError(f"-o/--output-dir {redact(run_dir.uri())}: expected an empty or new "
                              f"run directory, found an existing run; pass -y 1 to resume it or "
                              f"--overwrite to start fresh over it")
        check_overwrite(run_dir, "run", cfg.output_dir)
    elif names and not holds_run and marker is None:
        raise ConfigError(f"-o/--output-dir {redact(run_dir.uri())}: expected an empty or new run "
                          f"directory, found {len(names)} entries that are not a raygpt run "
                          f"(e.g. {', '.join(repr(n) for n in names[:3])}); name a new directory")
    if lease is not None:
        lease.acquire()  # RunDirBusy (a ConfigError) when another job holds it
    if fresh_over_run:
        print(f"raygpt | --overwrite: deleting the run in {redact(run_dir.uri())}", flush=True)
        run_dir.delete_dir("")
        marker = None
        if lease is not None:
            lease.renew()  # the delete took the lease file with it
    run_dir.makedirs("")
    if marker is None:
        write_marker(run_dir, "run", adopted=holds_run and not fresh_over_run)
    return run_dir


@contextlib.contextmanager
def claimed_run_dir(cfg: TrainConfig, *, lineage: str | None = None, what: str = "raygpt train",
                    on_lost=None):
    """`prepare_run_dir` under this job's lease, renewed by a heartbeat while inside, released
    on the way out (so `-y 1` right after works at once). Armed faults (--fault, and
    RAYGPT_FAULT only with --allow-fault-injection) are folded into the config it yields,
    printed and recorded in the run directory."""
    spec, sources = armed_spec(cfg.fault, os.environ, cfg.allow_fault_injection)
    cfg = cfg.with_overrides({"fault": spec})
    lease = Lease(open_run_dir(cfg.output_dir), lineage=lineage, what=what)
    try:
        run_dir = prepare_run_dir(cfg, lease)
        announce_faults(run_dir, spec, sources)
        lease.start_heartbeat(on_lost)
        yield cfg, run_dir
    finally:
        lease.release()


def _split_storage(output_dir: str) -> tuple[str, str]:
    if "://" in output_dir:
        parent, _, name = output_dir.rstrip("/").rpartition("/")
        return parent, name
    p = Path(output_dir).resolve()
    return str(p.parent), p.name


def create_control(name: str, timeout_s: float = 60.0):
    """The run's RunControl actor, on the caller's node (the control channel must not die with a
    worker node). A re-run (e.g. a retried Tune trial) may reuse a name that Ray frees only once
    its predecessor is gone, so a taken name is retried for a while."""
    here = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return RunControl.options(
                name=name,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)).remote()
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def build_trainer(cfg: TrainConfig, *, control_name: str, callbacks: tuple = ()) -> RaygptTrainer:
    """The TorchTrainer of one raygpt run (a single job or a sweep trial): `train_func` on
    cfg.num_workers workers (a (min, max) range when elastic), FailureConfig from the config,
    Ray keeping every checkpoint (raygpt's retention deletes), the DONE/MANIFEST finalizer and
    any extra controller callbacks.

    Called right before fit() (driver and sweep trial alike): an existing run directory's Ray
    snapshot is first brought back to the checkpoints that exist (see raygpt.ray_snapshot), or
    Ray's controller would refuse the directory after retention or a rewind deleted some."""
    dropped = reconcile_snapshot(open_run_dir(cfg.output_dir))
    if dropped:
        print(f"raygpt | Ray's checkpoint list ({SNAPSHOT}) named {len(dropped)} checkpoint(s) "
              f"no longer in the run directory; dropped: {', '.join(dropped)}", flush=True)
    storage_path, name = _split_storage(cfg.output_dir)
    faults = [f for f in _parse_faults(cfg.fault) if f.kind == "crash_before_done"]
    use_gpu = cfg.device == "gpu"
    return RaygptTrainer(
        train_func,
        train_loop_config={"cfg": cfg.to_dict(), "control_name": control_name},
        torch_config=RaygptTorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=(cfg.num_workers if cfg.min_workers is None
                                                  else (cfg.min_workers, cfg.num_workers)),
                                     use_gpu=use_gpu,
                                     resources_per_worker=None if use_gpu else {"CPU": 1}),
        run_config=RunConfig(
            name=name, storage_path=storage_path,
            failure_config=FailureConfig(max_failures=cfg.max_failures,
                                         max_preemption_failures=cfg.max_preemption_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            # Ray Train's INFO lines repeat every report's metrics; raygpt prints its own
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            # Ray Train's print patch tees every print to its logger as well: each line twice;
            # the driver's W&B / MLflow settings (WANDB_MODE=offline, ...) reach rank 0
            worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
                                             **tracking.worker_env()}},
            callbacks=[CheckpointFinalizer(cfg.output_dir, [f.step for f in faults]),
                       *preemption_callbacks(), *callbacks]),
    )


def run(cfg: TrainConfig, *, ray_address: str | None = None, adapted: list[str] = (),
        plan: list[str] | None = None) -> dict:
    """Run one training job under Ray Train and return rank 0's summary. `cfg` is resolved;
    `adapted` are resolve()'s notes on defaults it fitted to the data (printed and recorded).
    Every input is checked before Ray starts (`raygpt.preflight`, ConfigError in one line),
    unless the caller did so already and passes what it found as `plan`."""
    if cfg.output_dir.strip():  # an empty -o is refused by validate(), never made the cwd
        cfg = cfg.with_overrides({"output_dir": absolute_output_dir(cfg.output_dir)})
    if plan is None:
        plan = preflight.check(cfg)
    stop_requests: list = []  # the control actor, once there is one; the lease may be lost before
    with claimed_run_dir(cfg, on_lost=lambda why: [c.request.remote("stop") for c in stop_requests]
                         ) as (cfg, run_dir):
        launch = write_launch(run_dir, cfg, adapted=adapted, plan=plan)
        print(f"raygpt | launch {launch['launch']} of {redact(run_dir.uri())} ({CONFIG_FILE}) | "
              f"{cfg.num_workers} x {cfg.device} | {cfg.model} | B={cfg.batch_size} "
              f"T={cfg.seq_len} | {cfg.total_batch_size:,} tokens/step | " + " | ".join(plan),
              flush=True)
        for note in adapted:
            print(f"raygpt | adapted to the data: {note}", flush=True)
        init_ray(ray_address)
        start_train_helpers()
        control_name = f"raygpt-control-{os.getpid()}-{time.time_ns()}"
        control = create_control(control_name)
        stop_requests.append(control)
        driver_signals = DriverSignals(control)
        trainer = build_trainer(cfg, control_name=control_name)
        trainer.on_sigint = driver_signals.on_sigint
        t0 = time.time()
        try:
            fit_or_raise(trainer, cfg, t0)
        except KeyboardInterrupt:
            # Ray's get() turns an exception raised by a signal handler into a plain
            # KeyboardInterrupt, so the second Ctrl-C is recognised by its count
            if driver_signals.aborted:
                raise RunAborted(f"raygpt run {redact(cfg.output_dir)} aborted by a second "
                                 f"Ctrl-C; -y 1 resumes from the last verified checkpoint") from None
            raise
        finally:
            driver_signals.restore()
            ray.kill(control)
    records = read_history(open_run_dir(cfg.output_dir))
    report = summarize_run(records, since=t0)
    print(f"raygpt | {report['line']}", flush=True)
    # rank 0's own summary is the run's last "end" record (Ray's Result.metrics belong to the
    # newest checkpoint's report, not necessarily the last one)
    ends = [r for r in records if r.get("kind") == "end" and r.get("time", 0) >= t0]
    final = {k: v for k, v in ends[-1].items() if k not in ("kind", "time")} if ends else {}
    final.update(report)
    return final


def init_ray(address: str | None = None) -> None:
    """Start or join Ray, unless this process already did. Without an address (the argument,
    else RAY_ADDRESS) this starts a Ray of its own (address="local"): a bare `ray.init()` would
    join whatever cluster /tmp/ray names on this machine, perhaps another user's."""
    if ray.is_initialized():
        return
    # each worker's output once (Ray's dedup would fold the per-step lines of rank 0)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=True)


def start_train_helpers(timeout_s: float = 120.0) -> None:
    """Start Ray Data's AutoscalingCoordinator, the detached actor with which Ray Train's
    controller registers each run's resources, and wait for it. The controller creates it on
    first use and gives the call 5 s (AUTOSCALING_REQUESTS_GET_TIMEOUT_S in Ray Train's
    autoscaling_coordinator_client.py): a cold actor start on a busy machine takes longer, and
    the run begins with a WARNING and a GetTimeoutError traceback. Started here first (the
    controller then finds it by name), the call is answered at once."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator)
    except ImportError:  # another Ray layout: the controller starts its own
        return
    try:
        ray.get(get_or_create_autoscaling_coordinator().__ray_ready__.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        pass  # the controller's own request will say so, if it still cannot reach it


def _failure_report(cfg, since: float, error) -> str:
    """What each attempt of this job died of (the finalizer records failures as they happen)."""
    records = read_history(open_run_dir(cfg.output_dir))
    failures = [r for r in records if r.get("kind") == "failure" and r.get("time", 0) >= since]
    lines = [f"raygpt run {cfg.output_dir} failed after {max(len(failures), 1)} attempt(s) "
             f"(--max-failures {cfg.max_failures}):"]
    for r in failures:
        lines.append(f"  failure {r['failure']}: " + "; ".join(f"rank {k}: {v}" for k, v in r["causes"].items()))
    lines.append(f"  final error: {type(error).__name__}: {str(error)[:500]}")
    return redact("\n".join(lines))


def _parse_faults(spec: str):
    return parse_spec(spec)  # cfg.fault holds every armed fault (claimed_run_dir folded them in)


class DriverSignals:
    """The driver's signals while a run trains: SIGTERM and the first Ctrl-C become a stop
    request (every rank checkpoints at the next step boundary and exits; -y 1 resumes), SIGUSR1
    a save request, forwarded to the workers through the control actor. A second Ctrl-C aborts
    at once: Ray Train's controller is told to abort (it kills the workers) and the driver raises
    RunAborted. `ray.init()` installs its own SIGTERM handler in the driver; this takes it over
    for the run's duration and `restore()` gives every handler back. The handlers only record
    the request; a thread makes the remote call (no Ray calls inside a handler), except for the
    abort, which must happen before the handler returns."""

    ABORT_WAIT_S = 10.0  # how long a second Ctrl-C waits for the controller to abort

    def __init__(self, control):
        self.control = control
        self.sigints = 0
        self.aborted = False
        self._pending: list[str] = []
        self._wake = threading.Event()
        self._done = threading.Event()
        self._old = {}
        if threading.current_thread() is not threading.main_thread():
            return  # a sweep trial's thread: signals belong to the sweep's driver
        self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGTERM, signal.SIGUSR1)}
        self._old[signal.SIGINT] = signal.getsignal(signal.SIGINT)
        threading.Thread(target=self._forward, daemon=True, name="raygpt-signal-forwarder").start()

    def _handler(self, signum, frame):
        self._pending.append("stop" if signum == signal.SIGTERM else "save")
        self._wake.set()

    def on_sigint(self, controller) -> None:
        """Ctrl-C while fit() runs (installed by RaygptTrainer in place of Ray Train's)."""
        self.sigints += 1
        if self.sigints == 1:
            self._pending.append("ctrl-c")
            self._wake.set()
            return
        print("raygpt | second Ctrl-C: aborting now, without a checkpoint; -y 1 resumes from "
              "the last verified checkpoint", flush=True)
        self.aborted = True
        try:
            ray.get(controller.abort.remote(), timeout=self.ABORT_WAIT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass  # the controller exits inside abort(): its actor error is the expected answer
        raise KeyboardInterrupt  # out of fit(); run() turns it into RunAborted

    def _forward(self):
        while not self._done.is_set():
            self._wake.wait()
            self._wake.clear()
            while self._pending:
                kind = self._pending.pop(0)
                what = {"stop": "SIGTERM", "save": "SIGUSR1",
                        "ctrl-c": "Ctrl-C (press it again to abort at once)"}[kind]
                print(f"raygpt | driver got {what}: asking the workers to checkpoint"
                      f"{'' if kind == 'save' else ' and stop'}", flush=True)
                self.control.request.remote("save" if kind == "save" else "stop")

    def restore(self) -> None:
        self._done.set()
        self._wake.set()
        for s, h in self._old.items():
            signal.signal(s, h)
