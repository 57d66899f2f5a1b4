"""The driver side of the Ray seam: one raygpt run as a Ray Train `TorchTrainer`. What each
worker runs is raygpt.ray.worker's; the checkpoints' Ray side raygpt.ray.checkpoints'.

- `run(cfg)` (a `raygpt train`, and each sweep trial) checks every input on the driver first
  (`raygpt.config.preflight`: shards, model file, resume compatibility, the run directory's
  filesystem), claims the run directory (`train.run_dir.claimed_run_dir`: never overwrite a run
  silently, never delete what is not a marked run, one writer at a time through its lease,
  armed faults announced), records
  the launch in its `config.json`, starts its own Ray (or joins the one RAY_ADDRESS names; never
  whatever /tmp/ray names), and runs
  `train_func` on `cfg.num_workers` workers (NCCL on GPUs, gloo on CPUs) with
  `FailureConfig(max_failures, max_preemption_failures)`: after a worker or node is lost, Ray
  restarts the worker group and each worker resumes from the newest verified checkpoint.
- The run directory is Ray's experiment directory (`storage_path/name`), so the step
  directories Ray merges from the ranks' reports are raygpt's `step_XXXXXXXX/` checkpoints.
- Each checkpoint is finalized (DONE, MANIFEST, retention: raygpt.checkpointing.finalize) by
  the controller-side callbacks of raygpt.ray.checkpoints once every rank has reported it. Ray's
  own CheckpointConfig keeps every checkpoint; raygpt's retention and rewinds alone delete, and
  Ray's list of checkpoints (its snapshot file) is brought back to what exists after every
  report and before every fit() (raygpt.ray.checkpoint_list).
- SIGTERM / SIGUSR1 to the driver (e.g. `ray job stop`) are forwarded through a small control
  actor that rank 0 polls (raygpt.ray.driver_signals); on the workers the handlers are
  installed on each actor's main thread by the backend hook (Python runs handlers on the main
  thread only). A first Ctrl-C (SIGINT) is a SIGTERM; a second aborts at once. Ray Train
  installs its own SIGINT handler when `fit()` starts its controller (it aborts the run without
  a checkpoint), so `RaygptTrainer` puts raygpt's in its place.
- A compiled run's workers get the user's signing key for the compiled artifacts they keep in
  the run directory (raygpt.artifacts.signed_file: read on this machine, or made on the first compiled
  run) in Ray Train's train_loop_config, which Ray keeps in memory: never in the TrainConfig
  (config.json is in the run directory) nor in the runtime environment (Ray's dashboard shows
  its variables).
- Errors a restart would meet again (bad input, a stop raygpt decided: `raygpt.train.errors`) end
  the run at once: the worker raises `RunStopped`, and `StopOnRunStopped`, the controller's
  failure policy, answers RAISE instead of spending the retry budget on them (`RunFailed.final`
  tells a sweep's Tune not to re-run it either).
- A normal run prints no error-level line and no traceback from Ray's helper actors: Ray
  Train's State-API PlacementGroupCleaner is replaced by raygpt.ray.pg_cleanup's, and the driver
  starts the AutoscalingCoordinator before the controller's 5 s request (`start_train_helpers`),
  except for a fixed-size run on a Ray it started itself: no autoscaler, so its controller asks
  the coordinator nothing (`RaygptTrainer.scaling_policy`) and that Ray has no dashboard.
  What of Ray's private API this needs is raygpt.ray.compat's.
"""

from __future__ import annotations

import logging
import os
import time

import pyarrow.fs as pafs
import ray
import ray.train
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, UserCallback
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raygpt.artifacts import signed_file
from raygpt.checkpointing import local_copy
from raygpt.config import TrainConfig, absolute_paths
from raygpt.config import preflight
from raygpt.model.memory import estimate_for, out_of_memory_line
from raygpt.ray import capacity, checkpoint_list, compat, memory_kill
from raygpt.ray.connect import init_ray, starts_its_own_ray  # noqa: F401 (re-exported)
from raygpt.ray.controller_logs import QuietMemoryKills
from raygpt.ray.checkpoints import CheckpointFinalizer, FinalizerDrain
from raygpt.train.run_dir import claimed_run_dir
from raygpt.train.errors import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_FAILED, RunStopped
from raygpt.train.faults import parse_spec
from raygpt.ray.compat import (DefaultFailurePolicy, FailureDecision, PreemptionWatcherCallback,
                               TrainerHooks, autoscaling_coordinator)
from raygpt.ray.driver_signals import DriverSignals
from raygpt.ray.pg_cleanup import CleanupOnControllerDeath
from raygpt.ray.worker import RAY_POLL_ENV, RaygptTorchConfig, RunControl, train_func
from raygpt.runlog import tracking
from raygpt.runlog.history import read_history, summarize_run
from raygpt.runlog.run_config import CONFIG_FILE, write_launch
from raygpt.storage import RunDir, open_run_dir, redact

log = logging.getLogger(__name__)


# Ray Train's switch for its own preemption watcher (propagated from the driver to the controller),
# and the user's own setting of it, read before raygpt sets it
RAY_PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
_USER_PREEMPTION_WATCHER = os.environ.get(RAY_PREEMPTION_WATCHER_ENV)


# Ray Train's controller polls the workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by
# default; propagated from the driver to the controller and the workers) and takes at most one
# report per rank per poll: a checkpoint's DONE waits for the poll after the last rank stored
# its files (half a poll on average, plus one more when a metrics report is queued before it).
# raygpt polls 4 times as often unless the user set the variable. The cost is one small actor
# call per worker per poll (a few hundred a second on the head at 64 workers).
CONTROLLER_POLL_S = 0.5


def set_controller_poll() -> float:
    """The controller's poll interval for this process's runs: the user's setting of
    RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, else raygpt's CONTROLLER_POLL_S (set in the environment
    Ray hands to the controller and the workers)."""
    return float(os.environ.setdefault(RAY_POLL_ENV, str(CONTROLLER_POLL_S)))


def preemption_callbacks() -> list:
    """raygpt's watcher in place of Ray Train's own (turned off for this process's runs through
    its environment switch, which Ray hands to the controller); none when the user turned Ray's
    off before raygpt did."""
    if (_USER_PREEMPTION_WATCHER or "1").lower() not in ("1", "true"):
        return []
    os.environ[RAY_PREEMPTION_WATCHER_ENV] = "0"
    return [PreemptionWatcherCallback()]


class StopOnRunStopped(DefaultFailurePolicy):
    """Ray Train's failure policy, except that a worker group in which any worker raised
    `RunStopped`, or one Ray's memory monitor killed while raygpt held the memory (over its
    estimate, or the node's largest holder: raygpt.ray.memory_kill), is not restarted: the run
    ends at once with that error (see raygpt.train.errors; the same micro-batch would outgrow the
    node again). A kill for memory something else held, a lost process, node or collective and
    preemptions keep Ray's budgets. `estimate_bytes`: a worker's memory estimate (None: unknown);
    `own_pids`: the driver's processes, not "something else". A passing kill that is retried is
    told in one line (`output_dir`: the run whose history gives the step; None: no step)."""

    def __init__(self, failure_config, estimate_bytes: int | None = None, own_pids=(),
                 output_dir: str | None = None):
        super().__init__(failure_config)
        self.estimate_bytes, self.own_pids = estimate_bytes, tuple(own_pids)
        self.output_dir, self.since = output_dir, time.time()  # made as fit() starts

    def make_decision(self, training_failed_error):
        if run_stopped(training_failed_error) is not None:
            return FailureDecision.RAISE
        killed = memory_kill.killed_for_memory(training_failed_error)
        verdict = None if killed is None else self.verdict(killed[1])
        if verdict is not None and not verdict.passing:
            return FailureDecision.RAISE
        decision = super().make_decision(training_failed_error)
        if verdict is not None and decision == FailureDecision.RETRY:
            # the one line of a retried kill (the finalizer records Ray's text, and prints none)
            # (the policy runs in Ray's controller: it carries the run's string, opened here)
            step = (None if self.output_dir is None
                    else _next_step(open_run_dir(self.output_dir), self.since))
            log.warning("raygpt | " + memory_kill.passing_line(
                memory_kill.parse(killed[1]), verdict, killed[0], step) + "; restarting from "
                f"the newest verified checkpoint (failure {compat.worker_group_failures(self)} of "
                f"--max-failures {self.failure_config.max_failures})")
        return decision

    def verdict(self, ray_text: str) -> memory_kill.Verdict:
        return memory_kill.judge(memory_kill.parse(ray_text), self.estimate_bytes, self.own_pids)


def run_stopped(error) -> RunStopped | None:
    """The RunStopped a worker raised, found in a Ray Train error (WorkerGroupError's
    worker_failures, by rank), else None."""
    failures = getattr(error, "worker_failures", None) or {}
    for rank in sorted(failures):
        if isinstance(failures[rank], RunStopped):
            return failures[rank]
    return None


class RaygptTrainer(TrainerHooks):
    """TorchTrainer with raygpt's failure policy, raygpt's placement-group cleanup and the
    checkpoint finalizer's drain on the controller, no Ray Data actor when there are no datasets
    (raygpt's never has any) and, when `on_sigint` is set, raygpt's Ctrl-C (the hooks:
    raygpt.ray.compat.TrainerHooks)."""

    estimate_bytes: int | None = None  # a worker's memory estimate, for memory kills' verdicts

    output_dir: str | None = None  # the run's, for the step a memory kill's line names

    def failure_policy(self, failure_config):
        return StopOnRunStopped(failure_config, self.estimate_bytes, own_pids=(os.getpid(),),
                                output_dir=self.output_dir)

    # set for a run on a Ray it started itself, with a fixed number of workers: no autoscaler
    # to ask for nodes (compat.FixedPolicyWithoutAutoscaler)
    without_autoscaler = False

    def controller_callbacks(self) -> list:
        return [CleanupOnControllerDeath(), FinalizerDrain(), QuietMemoryKills()]

    def scaling_policy(self, policy):
        if self.without_autoscaler and type(policy).__name__ == "FixedScalingPolicy":
            return compat.FixedPolicyWithoutAutoscaler(scaling_config=policy.scaling_config)
        return policy


class RunFailed(RuntimeError):
    """The run ended without finishing; `exit_code` is what the command line exits with
    (EXIT_FAILED, or EXIT_BAD_INPUT when a worker met a bad input). `final`: a worker's error
    was one a restart would meet again (raygpt.train.errors), so no one should retry the run as it
    is (a sweep's Tune does not)."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED, final: bool = False):
        super().__init__(message)
        self.exit_code, self.final = exit_code, final


def fit_or_raise(trainer, cfg: TrainConfig, run_dir: RunDir, since: float):
    """trainer.fit(), with Ray's error turned into RunFailed: `final` with the worker's message
    when a worker raised RunStopped, else what each attempt died of (`run_dir`'s history)."""
    try:
        return trainer.fit()
    except Exception as e:  # a worker's RunStopped, or Ray's retry budget spent
        stopped = run_stopped(e)
        if stopped is not None:
            raise RunFailed(f"raygpt run {redact(cfg.output_dir)} stopped (not retried, it "
                            f"would fail again): {stopped.message}", stopped.exit_code,
                            final=True) from e
        killed = memory_kill.killed_for_memory(e)
        if killed is not None:
            rank, text = killed
            kill = memory_kill.parse(text)
            verdict = trainer.failure_policy(trainer.run_config.failure_config).verdict(text)
            if verdict.passing:  # retried within the budget, or the controller itself was lost
                raise RunFailed(f"raygpt run {redact(cfg.output_dir)} failed after "
                                f"{_attempts(run_dir, since)} attempt(s) (--max-failures "
                                f"{cfg.max_failures}): " + memory_kill.passing_line(
                                    kill, verdict, rank, _next_step(run_dir, since))
                                + "; -y 1 resumes once that memory is free") from e
            raise RunFailed(f"raygpt run {redact(cfg.output_dir)} stopped (not retried, it "
                            f"would fail again): " + memory_kill_line(cfg, run_dir, since, rank, kill),
                            EXIT_BAD_INPUT, final=True) from e
        raise RunFailed(_failure_report(cfg, run_dir, since, e)) from e


class RunAborted(KeyboardInterrupt):
    """A second Ctrl-C: the run was aborted without a final checkpoint (EXIT_ABORTED)."""

    exit_code = EXIT_ABORTED


def _split_storage(run_dir: RunDir) -> tuple[pafs.FileSystem | None, str, str]:
    """(filesystem, storage path, name) for Ray's RunConfig: the run directory is Ray's
    experiment directory. An object store's filesystem is the one raygpt opened (its endpoint
    and bounded timeouts: `storage.open_run_dir`) and Ray gets it as `storage_filesystem` with
    the plain path; splitting the URI string instead would leave its ?endpoint_override=...
    options in the name and give Ray the store's default endpoint."""
    if not run_dir.caps.local_paths:
        parent, _, name = run_dir.root.rstrip("/").rpartition("/")
        return run_dir.fs, parent, name
    p = run_dir.local_path().resolve()
    return None, str(p.parent), p.name


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


def build_trainer(cfg: TrainConfig, run_dir: RunDir, *, control_name: str, callbacks: tuple = (),
                  artifact_key: signed_file.ArtifactKey | None = None,
                  startup: dict | None = None) -> RaygptTrainer:
    """The TorchTrainer of one raygpt run (a single job or a sweep trial): `train_func` on
    cfg.num_workers workers (a (min, max) range when elastic), FailureConfig from the config,
    Ray keeping every checkpoint (raygpt's retention deletes), the DONE/MANIFEST finalizer and
    any extra controller callbacks. `artifact_key` reaches the workers' sessions (None: they
    neither load nor store compiled artifacts), `startup` (the driver's start-up marks,
    raygpt.runlog.startup) rank 0's first start record.

    Called right before fit() (driver and sweep trial alike): an existing run directory's Ray
    snapshot is first brought back to the checkpoints that exist (raygpt.ray.checkpoint_list),
    or Ray's controller would refuse the directory after retention or a rewind deleted some."""
    checkpoint_list.before_fit(run_dir)
    storage_fs, storage_path, name = _split_storage(run_dir)
    set_controller_poll()  # read by Ray when the trainer is made (get_env_vars_to_propagate)
    faults = [f for f in _parse_faults(cfg.fault) if f.kind == "crash_before_done"]
    use_gpu = cfg.device == "gpu"
    trainer = RaygptTrainer(
        train_func,
        train_loop_config={"cfg": cfg.to_dict(), "control_name": control_name,
                           "artifact_key": artifact_key, "startup": dict(startup or {})},
        torch_config=RaygptTorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=(cfg.num_workers if cfg.min_workers is None
                                                  else (cfg.min_workers, cfg.num_workers)),
                                     use_gpu=use_gpu,
                                     resources_per_worker=None if use_gpu else {"CPU": 1}),
        run_config=RunConfig(
            name=name, storage_path=storage_path, storage_filesystem=storage_fs,
            failure_config=FailureConfig(max_failures=cfg.max_failures,
                                         max_preemption_failures=cfg.max_preemption_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            # Ray Train's INFO lines repeat every report's metrics; raygpt prints its own
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            # Ray Train's print patch tees every print to its logger as well: each line twice;
            # the driver's W&B / MLflow settings (WANDB_MODE=offline, ...) reach rank 0
            worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
                                             **tracking.worker_env()}},
            callbacks=[CheckpointFinalizer(cfg, [f.step for f in faults]),
                       *preemption_callbacks(), *callbacks]),
    )
    # the estimate is of host memory on a CPU worker only (a GPU worker's is the GPU's)
    est = estimate_for(cfg) if not use_gpu else None
    trainer.estimate_bytes = None if est is None else est.total
    trainer.output_dir = cfg.output_dir
    return trainer


class _StopAtStep(UserCallback):
    """Asks the workers to checkpoint and stop (the driver's SIGTERM path) once a report from
    step >= `step` arrives (a sweep's WSD stable phase ends at the branches' shared step)."""

    def __init__(self, step: int, control):
        self.step, self.control, self.sent = step, control, False

    def after_report(self, run_context, metrics, checkpoint):
        if not self.sent and any(m.get("step", -1) >= self.step for m in metrics):
            self.control.request.remote("stop")
            self.sent = True


def run(cfg: TrainConfig, *, ray_address: str | None = None, adapted: list[str] = (),
        plan: list[str] | None = None, callbacks: tuple = (), stop_at_step: int | None = None,
        control_name: str | None = None, lineage: str | None = None,
        what: str = "raygpt train", argv: list[str] | None = None,
        cwd: str | None = None, artifact_key: signed_file.ArtifactKey | None = None,
        marks: dict | None = None) -> dict:
    """Run one training job under Ray Train and return rank 0's summary: a `raygpt train`, and
    each sweep trial and WSD stable phase (raygpt.ray.sweep) alike. `cfg` is resolved; `adapted`
    are resolve()'s notes on defaults it fitted to the data (printed and recorded). Every input
    is checked before Ray starts (`raygpt.config.preflight`, ConfigError in one line), unless the caller
    did so already and passes what it found as `plan`.

    A sweep adds: `callbacks` on the controller, `stop_at_step` (checkpoint and stop once a
    report from that step arrives), `control_name` (the run's control actor, which a scheduler
    finds by name), `lineage`/`what` (the run directory's lease: a retry of the same trial takes
    it over at once, any other job is refused), `argv`/`cwd` (the command config.json records:
    the sweep driver's), `artifact_key` (the sweep driver's: a trial's driver may run on
    another machine; by default a compiled run reads this machine's,
    `signed_file.load_or_create_key`). Raises ConfigError for a bad input, RunFailed once the
    run's own retry budget (cfg.max_failures) is spent or at once when a worker's error would
    only recur (`final`), RunAborted on a second Ctrl-C."""
    marks = dict(marks or {})  # wall times of this launch's start-up (raygpt.runlog.startup)
    marks.setdefault("cli_started", time.time())  # a sweep trial's run starts here
    cfg = absolute_paths(cfg)  # the workers' working directory is not this process's
    if plan is None:  # a Ray this run starts itself holds only this machine's GPUs and CPUs
        plan = preflight.check(cfg, machine=capacity.this_machine(cfg)
                               if starts_its_own_ray(ray_address) else None)
    marks.setdefault("checked", time.time())
    if cfg.compile and artifact_key is None:
        artifact_key = signed_file.load_or_create_key()
    stop_requests: list = []  # the control actor, once there is one; the lease may be lost before
    with claimed_run_dir(cfg, lineage=lineage, what=what,
                         on_lost=lambda why: [c.request.remote("stop") for c in stop_requests]
                         ) as (cfg, run_dir):
        launch = write_launch(run_dir, cfg, argv=argv, cwd=cwd, adapted=adapted, plan=plan,
                              cluster=ray.cluster_resources() if ray.is_initialized() else None)
        log.info(f"raygpt | launch {launch['launch']} of {redact(run_dir.uri())} ({CONFIG_FILE}) | "
                 f"{cfg.num_workers} x {cfg.device} | {cfg.model} | B={cfg.batch_size} "
                 f"T={cfg.seq_len} | {cfg.total_batch_size:,} tokens/step | " + " | ".join(plan))
        for note in adapted:
            log.info(f"raygpt | adapted to the data and the machine: {note}")
        marks["run_dir_claimed"] = time.time()
        # a Ray of its own has no autoscaler to tell what a fixed-size run needs
        without_autoscaler = starts_its_own_ray(ray_address) and cfg.min_workers is None
        init_ray(ray_address)
        marks["ray_started"] = time.time()
        if not without_autoscaler:
            start_train_helpers()
        control_name = control_name or f"raygpt-control-{os.getpid()}-{time.time_ns()}"
        control = create_control(control_name)
        stop_requests.append(control)
        driver_signals = DriverSignals(control)  # a no-op in a sweep trial's thread
        extra = list(callbacks)
        if stop_at_step is not None:
            extra.append(_StopAtStep(stop_at_step, control))
        marks["helpers_started"] = time.time()
        trainer = build_trainer(cfg, run_dir, control_name=control_name, callbacks=tuple(extra),
                                artifact_key=artifact_key, startup=marks)
        trainer.on_sigint = driver_signals.on_sigint
        trainer.without_autoscaler = without_autoscaler
        t0 = time.time()
        try:
            fit_or_raise(trainer, cfg, run_dir, t0)
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
            # the job is over: its workers' fast-resume copies on this node go (a clean end
            # removes them anyway; a failed or aborted one would leave them until the sweep)
            local_copy.remove_run(run_dir.uri())
    records = read_history(run_dir)
    report = summarize_run(records, since=t0)
    log.info(f"raygpt | {report['line']}")
    # rank 0's own summary is the run's last "end" record (Ray's Result.metrics belong to the
    # newest checkpoint's report, not necessarily the last one)
    ends = [r for r in records if r.get("kind") == "end" and r.get("time", 0) >= t0]
    final = {k: v for k, v in ends[-1].items() if k not in ("kind", "time")} if ends else {}
    final.update(report)
    return final


def cluster_resources(address: str | None = None) -> dict | None:
    """The resources ({"GPU": 2.0, "CPU": 32.0, ...}) of the Ray cluster this process is in or
    joins (the argument or RAY_ADDRESS: that Ray is up already), without starting a Ray of its
    own; None when there is no cluster to join (count this machine's, as the local Ray will).
    Under `ray job submit` the driver runs on the head node, which often has no GPU of its own."""
    if starts_its_own_ray(address):
        return None
    init_ray(address)  # a no-op when this process is in a Ray already
    return ray.cluster_resources()


def start_train_helpers(timeout_s: float = 120.0) -> None:
    """Start Ray Data's AutoscalingCoordinator, the detached actor with which Ray Train's
    controller registers each run's resources, and wait for it. The controller creates it on
    first use and gives the call 5 s (AUTOSCALING_REQUESTS_GET_TIMEOUT_S in Ray Train's
    autoscaling_coordinator_client.py): a cold actor start on a busy machine takes longer, and
    the run begins with a WARNING and a GetTimeoutError traceback. Started here first (the
    controller then finds it by name), the call is answered at once."""
    coordinator = autoscaling_coordinator()
    if coordinator is None:  # another Ray layout: the controller starts its own
        return
    try:
        ray.get(coordinator.__ray_ready__.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        pass  # the controller's own request will say so, if it still cannot reach it


def memory_kill_line(cfg: TrainConfig, run_dir: RunDir, since: float, rank: int | None,
                     kill: memory_kill.MemoryKill) -> str:
    """The one line for a kill whose memory raygpt held: the node's memory as Ray saw it, the
    step (after the run's last train record of this launch), the estimate and -b."""
    who = "the run's controller" if rank is None else f"rank {rank}"
    node = ("" if kill.used_gib is None
            else f", the node at {kill.used_gib:.2f}GB used / {kill.limit_gib:.2f}GB limit")
    where = f"in host memory ({who} killed by Ray's memory monitor{node})"
    return out_of_memory_line(cfg, where, None, step=_next_step(run_dir, since),
                              workers=cfg.num_workers if cfg.device == "cpu" else 1)


def _next_step(run_dir: RunDir, since: float) -> int | None:
    """The step being trained: one past this launch's last train record (None: before step 0)."""
    steps = [r["step"] for r in read_history(run_dir)
             if r.get("kind") == "train" and r.get("time", 0) >= since]
    return steps[-1] + 1 if steps else None


def _attempts(run_dir: RunDir, since: float) -> int:
    """This launch's attempts: one per failure the finalizer recorded (at least one)."""
    return max(1, sum(1 for r in read_history(run_dir)
                      if r.get("kind") == "failure" and r.get("time", 0) >= since))


def _failure_report(cfg, run_dir: RunDir, since: float, error) -> str:
    """What each attempt of this job died of (the finalizer records failures as they happen)."""
    records = read_history(run_dir)
    failures = [r for r in records if r.get("kind") == "failure" and r.get("time", 0) >= since]
    lines = [f"raygpt run {cfg.output_dir} failed after {max(len(failures), 1)} attempt(s) "
             f"(--max-failures {cfg.max_failures}):"]
    for r in failures:
        lines.append(f"  failure {r['failure']}: " + "; ".join(f"rank {k}: {v}" for k, v in r["causes"].items()))
    lines.append(f"  final error: {type(error).__name__}: {str(error)[:500]}")
    return redact("\n".join(lines))


def _parse_faults(spec: str):
    return parse_spec(spec)  # cfg.fault holds every armed fault (claimed_run_dir folded them in)
