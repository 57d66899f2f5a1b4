"""The worker side of the Ray seam: what each Ray Train worker runs (`train_func`), the `Session`
the loop talks to Ray through (`RaySession`), the driver's control actor the workers poll
(`RunControl`), and the backend hook that installs raygpt's signal handlers on each worker.

The loop (raygpt.train.loop) knows nothing of Ray: everything it needs (rank, device, the checkpoint
Ray restored, reporting metrics and checkpoints, requests from the driver, Ray's preemption
notice, the driver's key for the compiled artifacts) comes through `RaySession`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import ray
import ray.train
import torch
from ray.train.torch import TorchConfig

from raygpt.artifacts.signed_file import ArtifactKey
from raygpt.checkpointing import protocol as ck
from raygpt.config import TrainConfig
from raygpt.ray import checkpoints, compat
from raygpt.runlog.startup import process_started
from raygpt.storage import open_run_dir
from raygpt.train import signals
from raygpt.train.errors import RunStopped, stop_code
from raygpt.train.session import Session

log = logging.getLogger(__name__)

# Ray Train's controller poll (its variable, its default); raygpt's driver sets it
# (driver.set_controller_poll) unless the user did, and the environment reaches the workers.
RAY_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
RAY_DEFAULT_POLL_S = "2"


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
    def __init__(self, cfg: TrainConfig, control_name: str | None,
                 artifact_key: ArtifactKey | None = None, driver_marks: dict | None = None):
        self.driver_marks = driver_marks or {}  # the launch's start-up on the driver
        self.artifact_key = artifact_key  # the driver's (train_loop_config), never the run dir's
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device() if cfg.device == "gpu" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.run_dir = open_run_dir(cfg.output_dir)  # the worker's entry: -o came pickled as a string
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
        self._preemption_poll_steps = cfg.preemption_poll_steps
        # Ray Train's controller takes one report per health-check poll (2 s unless set; raygpt's
        # driver sets 0.5 s: driver.set_controller_poll), from a queue of one on each worker:
        # train metrics two polls apart never wait for a poll
        poll_s = float(os.environ.get(RAY_POLL_ENV, RAY_DEFAULT_POLL_S))
        self.metrics_interval_s = 2 * poll_s

    def checkpoint_hint(self) -> int | None:
        if self._checkpoint is None:
            return None
        step = ck.step_of_dir(Path(self._checkpoint.path).name)
        return -1 if step is None else step

    def report_metrics(self, metrics: dict) -> None:
        ray.train.report(metrics)

    def report_checkpoint(self, metrics, local_dir, dir_name, file_hashes, manifest_meta,
                          times=None):
        self.last_checkpoint_report = time.monotonic()  # train metrics keep their distance
        checkpoints.report(self.run_dir, metrics, local_dir, dir_name, file_hashes, manifest_meta,
                           times)

    def poll_requests(self) -> tuple[bool, bool]:
        """(stop, save) requested from outside: the driver's control actor (rank 0, without
        blocking) and Ray's preemption notice (every cfg.preemption_poll_steps calls, all ranks:
        the poll is a barrier across workers, so it is step-based and every rank polls at the
        same steps)."""
        stop = save = False
        if self._control is not None:
            if self._control_ref is None:
                self._control_ref = self._control.poll.remote()
            ready, _ = ray.wait([self._control_ref], timeout=0)
            if ready:
                try:
                    stop, saves = ray.get(self._control_ref)
                except ray.exceptions.RayError as e:  # the driver is gone: train on without it
                    log.warning(f"raygpt | WARNING: lost the driver's control channel ({type(e).__name__})"
                                f"; signals to the driver no longer reach the workers")
                    self._control, stop, saves = None, False, self._saves_seen
                self._control_ref = None
                save = saves > self._saves_seen
                self._saves_seen = saves
        self._polls += 1
        if self._polls % self._preemption_poll_steps == 0 and ray.train.get_preemption_info() is not None:
            if not self._preempt_noticed:  # one checkpoint per notice, then keep training
                self._preempt_noticed = save = True
                if self.rank == 0:
                    log.info("raygpt | preemption notice from Ray: checkpointing now")
        return stop, save

    def failure_note(self) -> str | None:
        return None if self._checkpoint is None else f"restarted by Ray from {self._checkpoint.path}"

    def startup_marks(self) -> dict[str, float]:
        marks = {**_STARTUP_MARKS, "setup": {**_process_marks(), **_WORKER_MARKS}}
        # the driver's marks belong to the launch's first worker group only (a restarted
        # group's start-up is the recovery ledger's)
        if self.driver_marks and _STARTUP_MARKS.get("group") == 1:
            marks["driver"] = dict(self.driver_marks)
        return marks


def train_func(config: dict) -> None:
    """What each Ray Train worker runs."""
    _WORKER_MARKS["train_func"] = time.time()
    from raygpt.train.loop import train

    _WORKER_MARKS["loop_imported"] = time.time()

    cfg = TrainConfig.from_dict(config["cfg"])
    if cfg.device == "cpu":
        torch.set_num_threads(config.get("threads_per_worker", 1))
    compat.quiet_report_log()
    try:
        summary = train(cfg, RaySession(cfg, config.get("control_name"),
                                        config.get("artifact_key"), config.get("startup")))
    except Exception as e:
        code = stop_code(e)  # classified here, where the exception still has its cause
        if code is None:
            raise  # a fault a restart may cure: Ray's retry budget is for these
        raise RunStopped(f"{type(e).__name__}: {e}", code) from e
    ray.train.report({"final": True, **summary})


# This worker process's start-up marks (history.STARTUP_MARKS), set by the controller through
# _Backend before the train function runs here; RaySession.startup_marks reads them.
_STARTUP_MARKS: dict[str, float] = {}


# Wall times of this worker's own start-up before the loop runs (the recovery bench's finer
# split, kept in the start record's startup["setup"] beside the loop's): the train function
# entered, raygpt.train.loop imported.
_WORKER_MARKS: dict[str, float] = {}


def _process_marks() -> dict[str, float]:
    """{"process_started": wall time this worker process was created}, {} where /proc is not
    there (raygpt.runlog.startup.process_started)."""
    started = process_started()
    return {} if started is None else {"process_started": started}


def _note_startup_marks(marks: dict) -> None:
    _STARTUP_MARKS.clear()
    _STARTUP_MARKS.update(marks)


class _Backend(compat.TorchBackend):
    """Ray Train's torch backend, plus raygpt's signal handlers on each worker, the times of
    the worker group's start-up for the recovery ledger (raygpt.runlog.history.recovery_split),
    and a shutdown that survives a worker Ray's memory monitor killed."""

    def on_shutdown(self, worker_group, backend_config):
        # a killed worker answers the group's shutdown with OutOfMemoryError, not the
        # RayActorError Ray Train forgives there: the restart itself would fail (Ray 2.60.0)
        try:
            super().on_shutdown(worker_group, backend_config)
        except ray.exceptions.OutOfMemoryError:
            log.debug("raygpt | process group shutdown skipped: a worker was killed for memory")

    def on_start(self, worker_group, backend_config):
        # called once the group's actors are up and ready; the process group forms inside it
        self._groups = getattr(self, "_groups", 0) + 1  # this fit's worker groups, 1 first
        self._marks = {"group_up": time.time(), "group": self._groups}
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
