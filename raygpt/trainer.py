"""The Ray driver: one raygpt run as a Ray Train `TorchTrainer`, and the checkpoint bridge.

- `run(cfg)` starts (or joins) Ray, refuses to overwrite a run directory silently, and runs
  `train_func` on `cfg.num_workers` workers (NCCL on GPUs, gloo on CPUs) with
  `FailureConfig(max_failures, max_preemption_failures)`: after a worker or node is lost, Ray
  restarts the worker group and each worker resumes from the newest verified checkpoint.
- The run directory is Ray's experiment directory (`storage_path/name`), so the step
  directories Ray merges from the ranks' reports are raygpt's `step_XXXXXXXX/` checkpoints.
- `CheckpointFinalizer` is a driver-side (controller) `UserCallback`: Ray calls `after_report`
  only once *every* worker has reported and the merged checkpoint is persisted, which is exactly
  the moment DONE and MANIFEST may appear. Doing it there, rather than on rank 0 after a
  barrier, means no worker can ever mark a checkpoint done whose other ranks' files Ray has not
  yet stored. Ray's own CheckpointConfig keeps every checkpoint; raygpt's retention alone
  deletes, so the two never fight.
- SIGTERM / SIGUSR1 to the driver (e.g. `ray job stop`) are forwarded through a small control
  actor that rank 0 polls; on the workers the handlers are installed on each actor's main
  thread by the backend hook (Python runs handlers on the main thread only).
"""

from __future__ import annotations

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
from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
from ray.train.v2._internal.execution.preemption import PreemptionWatcher
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raygpt import signals, tracking
from raygpt.checkpointer import finalize_checkpoint
from raygpt.config import ConfigError, TrainConfig
from raygpt.history import LOSS_HISTORY, read_history, summarize_run
from raygpt.session import Session
from raygpt.storage import RunDir, open_run_dir

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


def train_func(config: dict) -> None:
    """What each Ray Train worker runs."""
    from raygpt.loop import train

    cfg = TrainConfig.from_dict(config["cfg"])
    if cfg.device == "cpu":
        torch.set_num_threads(config.get("threads_per_worker", 1))
    _quiet_report_log()
    summary = train(cfg, RaySession(cfg, config.get("control_name")))
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


class _Backend(_TorchBackend):
    def on_training_start(self, worker_group, backend_config):
        super().on_training_start(worker_group, backend_config)
        worker_group.execute(signals.install)  # runs on each worker actor's main thread


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

class CheckpointFinalizer(UserCallback):
    """Writes DONE and MANIFEST once Ray has registered a checkpoint all ranks reported, applies
    retention, and records every worker-group failure in the run's loss history."""

    def __init__(self, output_dir: str, crash_before_done_step: int | None = None):
        self.output_dir = output_dir
        self.crash_before_done_step = crash_before_done_step
        self.failures = 0

    def after_report(self, run_context, metrics, checkpoint):
        if checkpoint is None:
            return
        run_dir = open_run_dir(self.output_dir)
        step = int(Path(checkpoint.path).name.split("_")[1])
        if self.crash_before_done_step == step:
            # fault injection: act as if the driver died between Ray's registration and DONE
            print(f"raygpt | fault injection: leaving checkpoint {step} without DONE/MANIFEST",
                  flush=True)
            self.crash_before_done_step = None
            return
        rank_hashes = {}
        for m in metrics:
            rank_hashes.update(m.get("raygpt_files", {}))
        meta = next(m["raygpt_manifest"] for m in metrics if "raygpt_manifest" in m)
        try:
            finalize_checkpoint(run_dir, step, rank_hashes, meta)
        except Exception as e:  # noqa: BLE001 - a checkpoint left incomplete must not stop training
            # An exception here would end the whole run (a controller error). The checkpoint
            # simply stays without DONE/MANIFEST, which every reader treats as absent.
            print(f"raygpt | WARNING: checkpoint {step} left incomplete (no DONE/MANIFEST): {e}",
                  flush=True)

    def after_exception(self, run_context, worker_exceptions):
        self.failures += 1
        causes = {rank: f"{type(e).__name__}: {e}"[:500] for rank, e in worker_exceptions.items()}
        with open_run_dir(self.output_dir) as run_dir:  # uploaded at once on object stores
            run_dir.append_text(LOSS_HISTORY, json.dumps(
                {"kind": "failure", "failure": self.failures, "causes": causes,
                 "time": time.time(), "attempt": None}) + "\n")
        print(f"raygpt | FAILURE {self.failures}: " + "; ".join(f"rank {r}: {c}" for r, c in causes.items()),
              flush=True)


class RunFailed(RuntimeError):
    pass


def prepare_run_dir(cfg: TrainConfig) -> RunDir:
    """Never overwrite a run silently: an existing run needs -y 1 (resume) or --overwrite."""
    run_dir = open_run_dir(cfg.output_dir)
    holds_run = run_dir.exists() and any(
        n == LOSS_HISTORY or n.startswith("step_") or n == "main.log" for n in run_dir.listdir())
    if holds_run and cfg.resume != 1:
        if not cfg.overwrite:
            raise ConfigError(f"-o/--output-dir {run_dir.uri()}: expected an empty or new run "
                              f"directory, found an existing run; pass -y 1 to resume it or "
                              f"--overwrite to start fresh over it")
        run_dir.delete_dir("")
    run_dir.makedirs("")
    return run_dir


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


def build_trainer(cfg: TrainConfig, *, control_name: str, callbacks: tuple = ()) -> TorchTrainer:
    """The TorchTrainer of one raygpt run (a single job or a sweep trial): `train_func` on
    cfg.num_workers workers (a (min, max) range when elastic), FailureConfig from the config,
    Ray keeping every checkpoint (raygpt's retention deletes), the DONE/MANIFEST finalizer and
    any extra controller callbacks."""
    storage_path, name = _split_storage(cfg.output_dir)
    faults = [f for f in _parse_faults(cfg.fault) if f.kind == "crash_before_done"]
    use_gpu = cfg.device == "gpu"
    return TorchTrainer(
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
            callbacks=[CheckpointFinalizer(cfg.output_dir, faults[0].step if faults else None),
                       *preemption_callbacks(), *callbacks]),
    )


def run(cfg: TrainConfig, *, ray_address: str | None = None) -> dict:
    """Run one training job under Ray Train and return rank 0's summary."""
    if "://" not in cfg.output_dir:
        cfg = cfg.with_overrides({"output_dir": str(Path(cfg.output_dir).resolve())})
    prepare_run_dir(cfg)
    if not ray.is_initialized():
        # each worker's output once (Ray's dedup would fold the per-step lines of rank 0)
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        ray.init(address=ray_address, ignore_reinit_error=True, log_to_driver=True)
    control_name = f"raygpt-control-{os.getpid()}-{time.time_ns()}"
    control = create_control(control_name)
    restore = _forward_signals_to(control)
    trainer = build_trainer(cfg, control_name=control_name)
    t0 = time.time()
    try:
        trainer.fit()
    except Exception as e:  # Ray raises once the retry budget is spent
        raise RunFailed(_failure_report(cfg, t0, e)) from e
    finally:
        restore()
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


def _failure_report(cfg, since: float, error) -> str:
    """What each attempt of this job died of (the finalizer records failures as they happen)."""
    records = read_history(open_run_dir(cfg.output_dir))
    failures = [r for r in records if r.get("kind") == "failure" and r.get("time", 0) >= since]
    lines = [f"raygpt run {cfg.output_dir} failed after {max(len(failures), 1)} attempt(s) "
             f"(--max-failures {cfg.max_failures}):"]
    for r in failures:
        lines.append(f"  failure {r['failure']}: " + "; ".join(f"rank {k}: {v}" for k, v in r["causes"].items()))
    lines.append(f"  final error: {type(error).__name__}: {str(error)[:500]}")
    return "\n".join(lines)


def _parse_faults(spec: str):
    from raygpt.faults import parse_spec
    return parse_spec(";".join(s for s in (spec, os.environ.get("RAYGPT_FAULT", "")) if s))


def _forward_signals_to(control) -> callable:
    """SIGTERM / SIGUSR1 on the driver become stop / save requests to the workers. `ray.init()`
    installs its own SIGTERM handler in the driver; this takes it over for the run's duration
    and gives it back afterwards. The handlers only set an event; a thread makes the call."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    pending: list[str] = []
    wake = threading.Event()
    done = threading.Event()

    def handler(signum, frame):
        pending.append("stop" if signum == signal.SIGTERM else "save")
        wake.set()

    def forward():
        while not done.is_set():
            wake.wait()
            wake.clear()
            while pending:
                kind = pending.pop(0)
                print(f"raygpt | driver got {'SIGTERM' if kind == 'stop' else 'SIGUSR1'}: "
                      f"asking the workers to checkpoint{' and stop' if kind == 'stop' else ''}",
                      flush=True)
                control.request.remote(kind)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGUSR1)}
    threading.Thread(target=forward, daemon=True, name="raygpt-signal-forwarder").start()

    def restore():
        done.set()
        wake.set()
        for s, h in old.items():
            signal.signal(s, h)
    return restore
