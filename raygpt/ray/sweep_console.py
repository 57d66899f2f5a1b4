"""What a sweep prints while it runs: one line per trial event, each trial named with its
hyperparameters, in place of Tune's own console.

Tune's console (its experiment banner, a trial's start box, the status table every 30 s)
names a trial by its grid key ("trial: trial_000", raygpt's grid is over the trial names) and
counts only what Tune itself reserved ("0/2 CPUs": a trial's driver holds no CPU, its Ray Train
workers hold them outside Tune's view). A sweep runs Tune silent (`TUNE_VERBOSE`) and prints
these lines through `TrialConsole`, a Tune callback on the sweep's driver:

    raygpt sweep | trial_000 (learning_rate=0.001) | started
    raygpt sweep | trial_000 (learning_rate=0.001) | step 5 | val loss 10.7380
    raygpt sweep | trial_000 (learning_rate=0.001) | ended

Each trial's own run prints its step lines as a single run does. The table at the end is
results.txt's (raygpt.ray.sweep_results); `raygpt status SWEEP_DIR` shows it at any time.
"""

from __future__ import annotations

import logging
import math

from ray import tune

from raygpt.ray.sweep_plan import STOPPED_KEY
from raygpt.runlog.terminal import printable

log = logging.getLogger(__name__)

TUNE_VERBOSE = 0  # Tune's AirVerbosity.SILENT: no banner, boxes or status table of Tune's


def trial_label(name: str, overrides: dict) -> str:
    """A trial's name and its hyperparameters: "trial_000 (learning_rate=0.001 scheduler=wsd)"."""
    pairs = " ".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    return printable(f"{name} ({pairs})" if pairs else name)


class TrialConsole(tune.Callback):
    """One line per trial start, validation result and end, on the sweep driver's console.
    `labels`: {trial name: its label} (`trial_label` of the plan's trials)."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels

    def _say(self, trial, text: str) -> None:
        name = trial.config["trial"]
        log.info(f"raygpt sweep | {self.labels.get(name, printable(name))} | {text}")

    def on_trial_start(self, iteration, trials, trial, **info):
        self._say(trial, "started")

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._say(trial, "failed; Tune runs it again (it resumes its run directory)")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get(STOPPED_KEY) is not None:
            return  # its error follows
        loss = result.get("val_loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            self._say(trial, f"step {result.get('step')} | val loss {loss:.4f}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._say(trial, "ended")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._say(trial, "failed (its error: raygpt status on its run directory)")
