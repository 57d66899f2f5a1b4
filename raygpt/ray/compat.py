"""Every use of Ray's private API in raygpt, in one place: a Ray upgrade is checked here.

raygpt needs a few things Ray Train does not offer publicly: its controller's callback
interfaces, its failure policy, its preemption watcher, its torch backend, the model of its
checkpoint list, three TorchTrainer methods to override, and two helpers. Each hook below says
why raygpt needs it and the Ray versions it was checked on; pyproject.toml pins Ray to them.
No other module of raygpt imports a private Ray name or touches a private Ray attribute
(tests/ray_seam/test_seam.py enforces it).

Importing this module imports none of Ray: each name is resolved on first use (`__getattr__`),
so the light callers (raygpt.ray.capacity, before any run starts) stay light.
"""

from __future__ import annotations

import logging
import signal

CHECKED_ON = "Ray 2.60.0"


# ---------------------------------------------------------------------- helpers

def num_cpus() -> int:
    """Ray's count of this machine's CPUs: a container's CPU quota, not only the host's cores,
    as a Ray started here will hold them (no public API says it without starting Ray).
    Checked on Ray 2.60.0."""
    from ray._private.utils import get_num_cpus
    return int(get_num_cpus())


def storage_marker_name() -> str | None:
    """The marker file Ray Train's driver writes into a run's storage directory (a worker that
    sees it knows the directory is the driver's, not a same-named local one); None on a Ray
    without it. Checked on Ray 2.60.0."""
    try:
        from ray.train.v2._internal.execution.storage import VALIDATE_STORAGE_MARKER_FILENAME
    except ImportError:
        return None
    return VALIDATE_STORAGE_MARKER_FILENAME


def session_logs_dir() -> str | None:
    """The logs directory of the Ray session this process started or joined on this machine
    (`/tmp/ray/session_*/logs`), where Ray's own log files are; None before `ray.init` or when
    the session's node is not this machine's (no public API says it). Checked on Ray 2.60.0."""
    from ray._private import worker
    node = getattr(worker, "_global_node", None)
    return node.get_logs_dir_path() if node is not None else None


def quiet_report_log() -> None:
    """Ray Train logs every ray.train.report at INFO, the checkpoint's whole manifest metadata
    included, through a logger named by its source file, which LoggingConfig's "ray.train" level
    does not reach: set that logger to WARNING (a no-op on another layout). Checked on Ray 2.60.0."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def autoscaling_coordinator():
    """Ray Data's AutoscalingCoordinator actor (made on first use), with which Ray Train's
    controller registers each run's resources, giving the call only 5 s; None on a Ray without
    it (its controller starts its own). Checked on Ray 2.60.0."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator)
    except ImportError:
        return None
    return get_or_create_autoscaling_coordinator()


def divert_raylet_messages(divert, to) -> None:
    """The raylet's messages to the driver (a worker killed for memory: Ray's whole account of
    the node, ~130 lines) are printed by Ray's error-listener thread through
    `ray._private.worker.print_to_stdstream`, which it looks up at each message and no public
    knob quiets, and its log lines (raylet.err, streamed to the driver through the same function,
    bound at ray.init: call this before): a batch of the raylet's lines in which `divert(text)`
    accepts one goes to `to(text)` line by line instead (its blank separators with it).
    Idempotent; workers' own output is untouched. Checked on Ray 2.60.0."""
    from ray._private import worker
    printer = worker.print_to_stdstream
    if getattr(printer, "raygpt_diverts", False):
        return

    def print_to_stdstream(data, ignore_prefix: bool):
        lines = data.get("lines", [])
        if data.get("pid") == "raylet" and any(divert(line) for line in lines):
            for line in lines:
                to(line)
            return
        printer(data, ignore_prefix)

    print_to_stdstream.raygpt_diverts = True
    worker.print_to_stdstream = print_to_stdstream


def worker_group_failures(policy) -> int:
    """The worker-group failures Ray Train's DefaultFailurePolicy has counted against
    max_failures (a retried kill's line says which it is). Checked on Ray 2.60.0."""
    return policy._worker_group_failures


def worker_death_causes(failure: BaseException) -> list[BaseException]:
    """What a Ray Train worker failure is made of: the failure itself and, for a worker whose
    process died, the error its health-check poll met (WorkerHealthCheckFailedError keeps it
    as `health_check_failure`: an ActorDiedError, or an OutOfMemoryError when Ray's memory
    monitor killed the worker). Checked on Ray 2.60.0."""
    causes, seen = [], set()
    while failure is not None and id(failure) not in seen:
        seen.add(id(failure))
        causes.append(failure)
        failure = getattr(failure, "health_check_failure", None) or failure.__cause__
    return causes


# ---------------------------------------------------------------------- names, resolved on first use

def _controller_callback():
    # the interface of hooks on the controller's start, end and abort (FinalizerDrain,
    # pg_cleanup); Ray gives these hooks only to its own callback classes. Checked on Ray 2.60.0.
    from ray.train.v2._internal.execution.callback import ControllerCallback
    return ControllerCallback


def _worker_group_callback():
    # the interface of the hook on a worker group's start (pg_cleanup registers its placement
    # group there). Checked on Ray 2.60.0.
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback
    return WorkerGroupCallback


def _default_failure_policy():
    # Ray Train's failure policy (its retry budgets), which StopOnRunStopped extends: a public
    # FailureConfig cannot say "do not retry this error". Checked on Ray 2.60.0.
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
    return DefaultFailurePolicy


def _failure_decision():
    # the answers a failure policy gives (RAISE, RETRY). Checked on Ray 2.60.0.
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    return FailureDecision


def _torch_backend():
    # Ray Train's torch backend (it forms the process group), which raygpt.ray.worker extends
    # to install raygpt's signal handlers on each worker's main thread and time the group's
    # start; TorchConfig.backend_cls is the public seam that selects it. Checked on Ray 2.60.0.
    from ray.train.torch.config import _TorchBackend
    return _TorchBackend


def _checkpoint_manager_state():
    # the model of Ray Train's checkpoint list (checkpoint_manager_snapshot.json), which
    # raygpt.ray.checkpoint_list rewrites after raygpt's retention and rewinds delete: a new
    # controller refuses a list naming a deleted checkpoint. Checked on Ray 2.60.0.
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        _CheckpointManagerState)
    return _CheckpointManagerState


def _training_result_state():
    # one entry of that list. Checked on Ray 2.60.0.
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        _TrainingResultState)
    return _TrainingResultState


def _preemption_watcher_callback():
    import ray
    from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    class PreemptionWatcherCallback(PreemptionCallback):
        """Ray Train's preemption watcher (the actor behind `ray.train.get_preemption_info()`),
        started without restarts on the controller's node.

        Ray Train starts the watcher with `max_restarts=-1` and the worker actors' handles as
        constructor arguments, and Ray's core worker logs an ERROR for every such actor on every
        run ("has constructor arguments in the object store and max_restarts > 0", issue 53727
        of Ray): a restarted watcher would get handles that may be gone. A restart is never
        needed: every worker-group start makes a fresh watcher (and stops the old one), so this
        one has none, and it lives on the controller's node, which it can only lose with the
        controller itself. Overrides the hook whole, with the callback's private _stop_watcher,
        _watcher and _poll_interval_s. Checked on Ray 2.60.0."""

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

    PreemptionWatcherCallback.__module__ = __name__
    return PreemptionWatcherCallback


def _fixed_policy_without_autoscaler():
    from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

    class FixedPolicyWithoutAutoscaler(FixedScalingPolicy):
        """Ray Train's fixed-size scaling policy, without its resource requests to Ray Data's
        AutoscalingCoordinator: they tell a cluster's autoscaler what to add, and a Ray that the
        run started on this machine has none, so the coordinator (an actor process importing
        Ray Data) would be started for nothing. Checked on Ray 2.60.0."""

        def after_controller_start(self, train_run_context) -> None:
            pass

        def _maybe_send_resource_request(self) -> None:
            pass

        def _cancel_resource_request(self) -> None:
            pass

    FixedPolicyWithoutAutoscaler.__module__ = __name__
    return FixedPolicyWithoutAutoscaler


def _trainer_hooks():
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback)

    class TrainerHooks(TorchTrainer):
        """TorchTrainer with three of its private methods overridden, each turned into a public
        hook a subclass fills in (raygpt.ray.driver.RaygptTrainer):

        - `_initialize_and_run_controller` receives the failure and scaling policies it ships
          to the controller: `failure_policy(failure_config)` replaces the first, and
          `scaling_policy(policy)` may replace the second;
        - `_create_default_callbacks` lists the controller's callbacks: Ray's
          PlacementGroupCleaner is dropped (it polls the State API, which needs a dashboard and
          a single Ray on the machine; raygpt.ray.pg_cleanup does its job), and so is Ray's
          datasets callback when there are no datasets (it starts a Ray Data actor on every
          worker-group start); `controller_callbacks()` come first;
        - `_register_sigint_handler` installs Ctrl-C's handler once the controller exists:
          `on_sigint(controller)` replaces Ray's (which aborts without a checkpoint) when set.

        Checked on Ray 2.60.0; tests/ray_seam/test_run_end.py, test_finalizer.py and
        test_command_output.py fail if one stops being called."""

        on_sigint = None  # callable(controller) installed as the SIGINT handler during fit()

        def failure_policy(self, failure_config):
            raise NotImplementedError

        def controller_callbacks(self) -> list:
            return []

        def scaling_policy(self, policy):
            return policy

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            controller_init_kwargs["failure_policy"] = self.failure_policy(
                self.run_config.failure_config)
            controller_init_kwargs["scaling_policy"] = self.scaling_policy(
                controller_init_kwargs["scaling_policy"])
            return super()._initialize_and_run_controller(**controller_init_kwargs)

        def _create_default_callbacks(self):
            callbacks = [c for c in super()._create_default_callbacks()
                         if not isinstance(c, PlacementGroupCleanerCallback)
                         and not (isinstance(c, DatasetsCallback) and not self.datasets)]
            return [*self.controller_callbacks(), *callbacks]

        def _register_sigint_handler(self, controller):
            if self.on_sigint is None:
                return super()._register_sigint_handler(controller)
            signal.signal(signal.SIGINT, lambda signum, frame: self.on_sigint(controller))

    TrainerHooks.__module__ = __name__
    return TrainerHooks


_RESOLVERS = {
    "ControllerCallback": _controller_callback,
    "WorkerGroupCallback": _worker_group_callback,
    "DefaultFailurePolicy": _default_failure_policy,
    "FailureDecision": _failure_decision,
    "TorchBackend": _torch_backend,
    "CheckpointManagerState": _checkpoint_manager_state,
    "TrainingResultState": _training_result_state,
    "PreemptionWatcherCallback": _preemption_watcher_callback,
    "TrainerHooks": _trainer_hooks,
    "FixedPolicyWithoutAutoscaler": _fixed_policy_without_autoscaler,
}


def __getattr__(name: str):
    resolve = _RESOLVERS.get(name)
    if resolve is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = resolve()
    return value
