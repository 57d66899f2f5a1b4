"""ASHA's rungs for a sweep: early stopping that asks a trial's run to stop.

Early stopping is ASHA on validation loss against step (`GracefulASHA`), with one change: a trial
ASHA stops is asked to checkpoint and stop through its run's control actor (what a driver's
SIGTERM does), rather than having Tune kill its actor. A killed trial takes its Ray Train
controller down with it and leaves the workers' placement group to Ray Train's best-effort
cleaner, which on a machine running more than one Ray instance never frees it; the graceful
stop frees everything and leaves a resumable run directory.
"""

from __future__ import annotations

import logging
import math

import ray
from ray.tune.schedulers import ASHAScheduler

from raygpt.eval.knobs import EvalConfig
from raygpt.ray.sweep_plan import STOPPED_KEY

log = logging.getLogger(__name__)

def trial_control_name(trial_id: str) -> str:
    return f"raygpt-sweep-control-{trial_id}"


def request_stop(control_name: str) -> bool:
    """Ask a run to checkpoint and stop; False when its control actor does not exist (yet)."""
    try:
        ray.get_actor(control_name).request.remote("stop")
    except ValueError:
        return False
    return True


class GracefulASHA(ASHAScheduler):
    """ASHA on validation loss whose STOP is a request to the trial's run to checkpoint and stop
    (the path a driver's SIGTERM takes) instead of Tune killing the trial actor. A killed trial
    would take its Ray Train controller with it, leave its workers' placement group to Ray
    Train's best-effort cleaner (which can hold the CPUs or GPUs for good) and end the run
    without a final checkpoint; a stopped run ends like any run stopped by its operator and can
    be continued later with -y 1. Tune sees the trial finish on its own a step or two later.

    ASHA's bookkeeping keys a trial by its sweep name (`_ByName`), which a resumed sweep's new
    Tune experiment keeps, so `replay` can rebuild the rungs from the trials' own histories."""

    def __init__(self, *, time_attr: str, max_t: int, **kwargs):
        super().__init__(time_attr=time_attr, max_t=max_t, **kwargs)
        self.time_key, self.max_t = time_attr, max_t
        self.stopping: set = set()  # trial ids whose run was asked to stop

    def replay(self, curves: dict) -> None:
        """Record {trial name: [(step, val_loss)]} in the rungs as if Tune had reported them,
        deciding nothing: a resumed sweep's ASHA compares each trial with every result so far."""
        for name, curve in curves.items():
            key = _ByName(name)
            super().on_trial_add(None, key)
            for step, loss in curve:
                super().on_trial_result(None, key, {self.time_key: step, self.metric: loss})

    def on_trial_add(self, tune_controller, trial):
        super().on_trial_add(tune_controller, _ByName.of(trial))

    def on_trial_complete(self, tune_controller, trial, result):
        super().on_trial_complete(tune_controller, _ByName.of(trial), result)

    def on_trial_remove(self, tune_controller, trial):
        super().on_trial_remove(tune_controller, _ByName.of(trial))

    def on_trial_result(self, tune_controller, trial, result):
        if trial.trial_id in self.stopping or STOPPED_KEY in result:
            # decided already (results until it stops are late), or raygpt's stop verdict,
            # which is not a validation result: the trial's error follows it
            return self.CONTINUE
        decision = super().on_trial_result(tune_controller, _ByName.of(trial), result)
        if decision != self.STOP:
            return decision
        if result.get(self.time_key, 0) >= self.max_t:
            return self.CONTINUE  # ASHA's STOP at max_t: the run is ending on its own
        if request_stop(trial_control_name(trial.trial_id)):
            self.stopping.add(trial.trial_id)
            log.info(f"raygpt sweep | early stop: {trial} at step {result.get('step')} "
                     f"(val loss {result.get('val_loss', float('nan')):.4f}); asked its run to "
                     f"checkpoint and stop")
        return self.CONTINUE


class _ByName:
    """A trial as ASHA's bookkeeping sees it: `trial_id` is the trial's sweep name (the "trial"
    of its Tune config), the same in every Tune experiment of the sweep."""

    def __init__(self, name: str):
        self.trial_id = name

    @classmethod
    def of(cls, trial) -> "_ByName":
        return cls(getattr(trial, "config", {}).get("trial", trial.trial_id))


def _default_grace(base: EvalConfig, max_t: int) -> int:
    """A quarter of the run, rounded up to a validation step (the only steps Tune hears of)."""
    every = max(1, base.val_every)
    return max(every, math.ceil(max_t / 4 / every) * every)
