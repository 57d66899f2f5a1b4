"""Ray Tune sweeps over raygpt runs: every trial is a full raygpt run in its own run directory.

A search space is a dict of `TrainConfig` overrides (`{"scheduler": tune.grid_search([...]),
"spike.soft_z": tune.choice([...]), "learning_rate": tune.loguniform(...)}`): each trial's config
is `base.with_overrides(trial_config)`, so there is no second config system.

A sweep directory holds

    sweep.json             the plan (format "raygpt-sweep", version 2): base config, mode,
                           settings, and every trial by name with its overrides
    ledger.json            the sweep driver's record of each trial's Tune outcome (status,
                           failures, raygpt's stop verdict), written as Tune reports them
    tune/, tune.2/ ...     Ray Tune's experiments: the first fit's, then one per resume
    trials/<trial name>/   one raygpt run directory per trial: checkpoints, main.log, loss history
    stable/                WSD branch mode only: the shared stable phase, trained once
    results.txt, results.json, best_config.json, val_loss.png    written when the sweep ends

The directory is shared storage that others may write, so nothing read from it runs as code:
raygpt never reads Tune's own state back (tuner.pkl, params.pkl, error.pkl and
basic-variant-state-*.json are cloudpickles, experiment_state-*.json embeds them), and every
config it reads back is checked like a --config file (`config.config_read_back`: fault
injection, the storage endpoint and the MLflow server come only from the command line). Status,
plot and resume read sweep.json, ledger.json and the trials' own loss histories, bounded.

How a trial runs (Ray Train V2's documented Train-inside-Tune pattern): the Tune trial is a small
driver (`raygpt_trial`) that builds the same `TorchTrainer` a single run builds (`train_func`,
`CheckpointFinalizer`, `FailureConfig(cfg.max_failures)`, the run directory as Ray's experiment
directory) and forwards the loop's validation reports to Tune (`TuneReportCallback`). The trial
driver reserves no CPU or GPU (only a token amount of memory, because a Tune bundle cannot be
empty), so the cluster's CPUs or GPUs go to the training workers, and `max_concurrent_trials` is
the number of trials whose workers fit at once.

The trials are concrete before Tune starts (`trials.expand_trials`: the grid crossed, each random
domain drawn from an RNG seeded with the base's seed) and stored in sweep.json; Tune gets a
grid over their names (`{"trial": grid_search([...])}`), each name its trial's Tune and run
directory name, so which trials exist and where each one's run lives is known from raygpt's JSON.

Early stopping is ASHA on validation loss against step (`GracefulASHA`), with one change: a trial
ASHA stops is asked to checkpoint and stop through its run's control actor (what a driver's
SIGTERM does), rather than having Tune kill its actor. A killed trial takes its Ray Train
controller down with it and leaves the workers' placement group to Ray Train's best-effort
cleaner, which on a machine running more than one Ray instance never frees it; the graceful
stop frees everything and leaves a resumable run directory.

Before Ray starts (raygpt/trials.py holds the configs and the command line, and imports no
Ray), every trial config that can be known up front (the base, and every combination of grid
values and choice categories, the bounds of numeric ranges) goes through the single run's
driver-side checks (`raygpt.config.preflight`: model file, shards against B, T and
the world size, trackers) and the sweep directory must be writable: a bad value is one line
naming the trial's overrides and the flag, exit 2, before anything trains. Each trial writes
its `config.json` like a single run (`run_config.write_launch`, with the sweep's command line).

Fault tolerance has two levels. A lost worker is raygpt's own business: Ray Train restarts the
worker group inside the trial and the loop resumes from the newest verified checkpoint. A trial
whose driver died (or whose Ray Train retry budget ran out) is re-run by Tune
(`tune.FailureConfig`); every trial runs with `resume=1`, so a re-run continues its run directory
instead of refusing it. A trial that raygpt stopped because a restart would meet the same error
(bad input, a stop raygpt decided: `raygpt.train.errors`) is not re-run: Tune has no per-error retry
policy (its controller re-runs any failed trial while `num_failures <= max_failures`), so the
trial reports the verdict as its last result and `_NoRetryOfStoppedTrials`, a Tune callback on
the sweep's driver, sets that trial's budget to zero before its error arrives. When the sweep's
own driver dies, `resume_sweep` (-y 1) starts a new Tune experiment over the trials that have
not finished (judged from each trial's run directory and the ledger: a trial whose run wrote its
end record is done or stopped, one Tune gave up on stays an error unless --retry-errored), each
continuing its run directory from its newest verified checkpoint. Tune's ASHA state is not
restored; its rungs are rebuilt from every trial's validation curve (`GracefulASHA.replay`), so a
resumed trial is still compared with all the sweep's results, the finished trials' included.

WSD branches (`run_wsd_branches`): llm.c's WSD holds the peak LR until step
`int(0.8f * max_steps)` and then decays, so the steps before the shortest branch's decay start S
are the same in every branch. The stable phase is trained once (scheduler wsd, max_steps = the
shortest branch total) and asked to stop once its checkpoint at S exists (the request lands a
few steps later, or the run ends at that total, which is the shortest branch's own schedule).
Every trial then copies checkpoint S (rank files, DONE, MANIFEST) into its own run directory and
resumes from it with its own `max_steps`: stable until int(0.8 * max_steps), then its decay.
Only fields a checkpoint lets change on resume (`config.RESUME_MUTABLE_FIELDS`) may differ
between branches; anything else would fail the checkpoint's compatibility check, so it is
refused before anything runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler

from raygpt.artifacts import signed_file
from raygpt.checkpointing import protocol as ck
from raygpt.config import (RESUME_MUTABLE_FIELDS, ConfigError, TrainConfig, command_line_only,
                           config_read_back, shards_with_endpoint, stored_fields,
                           without_command_line_only)
from raygpt.ray import capacity
from raygpt.ray.driver import RunFailed, cluster_resources, init_ray, run, starts_its_own_ray
from raygpt.storage.ownership import Lease, check_claim, claim_dir
from raygpt.train.errors import EXIT_BAD_INPUT
from raygpt.ray.trials import (DEFAULT_SCHEDULERS, PLACEMENT_FIELDS, TRIAL_NAME_RE,
                               _branch_totals, _plain, check_space, check_trials, expand_trials,
                               pin_for_trials, preflight_sweep, space_items, trial_config)
from raygpt.artifacts.signed_file import ArtifactKey
from raygpt.runlog.history import iter_history
from raygpt.storage import RunDir, join_uri, open_run_dir, read_json_bounded, redact, store_png
from raygpt.train.schedule import wsd_decay_start

log = logging.getLogger(__name__)

PLAN_FILE = "sweep.json"
PLAN_FORMAT = "raygpt-sweep"
PLAN_VERSION = 2
LEDGER_FILE, LEDGER_FORMAT, LEDGER_VERSION = "ledger.json", "raygpt-sweep-ledger", 1
TUNE_DIR = "tune"
TRIALS_DIR = "trials"
STABLE_DIR = "stable"
RESULTS_TXT, RESULTS_JSON = "results.txt", "results.json"
BEST_CONFIG = "best_config.json"
PLOT = "val_loss.png"

# What the loop reports at every validation (loop.py: session.report_metrics); Tune sees these.
VAL_KEYS = ("step", "val_loss", "skips", "rewinds")
# A Tune trial is only the driver of its Ray Train run: it needs no CPU or GPU of its own, but a
# Tune bundle may not be empty, so it reserves a token 1 MiB of memory.
TRIAL_DRIVER_RESOURCES = {"memory": 1 << 20}
# The last result of a trial raygpt stopped: its exit code (2 bad input, 1 raygpt decided) and
# message, sent to Tune just before the trial raises (see _NoRetryOfStoppedTrials).
STOPPED_KEY, STOPPED_MESSAGE_KEY = "raygpt_stopped", "raygpt_error"


# ====================================================================== the plan (sweep.json)

@dataclass
class SweepPlan:
    """Everything a trial and `resume_sweep` need besides Tune's own state."""

    sweep_dir: str
    """Absolute path (or URI) of the sweep directory."""
    mode: str
    """"grid" (any search space) or "wsd_branch" (branches from one stable-phase checkpoint)."""
    user_base: dict
    """The base config as the user gave it (unresolved); best_config.json is relative to it."""
    base: dict
    """The base every trial overrides: hardware defaults resolved on the driver, paths absolute."""
    settings: dict = field(default_factory=dict)
    """num_samples, max_concurrent, early_stop, grace_period, reduction_factor, trial_retries."""
    shared_step: int | None = None
    """WSD branch mode: the step S of the stable-phase checkpoint every trial starts from."""
    stable_max_steps: int | None = None
    """WSD branch mode: max_steps of the stable-phase run (its decay starts at S)."""
    command: list = field(default_factory=list)
    """The sweep driver's command line (argv), recorded in every trial's config.json."""
    cwd: str = ""
    """The sweep driver's working directory, likewise."""
    trials: list = field(default_factory=list)
    """Every trial, [{"name": "trial_000", "overrides": {field: value}}] (`trials.expand_trials`):
    its Tune trial name, its run directory under trials/, and its config over `base`."""

    def to_dict(self) -> dict:
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, **dataclasses.asdict(self)}


def write_plan(sweep: RunDir, plan: SweepPlan) -> None:
    """sweep.json, with every credential a URI in it carries redacted (`storage.redact`): the
    plan's paths are only for people to read; `read_plan` takes the sweep directory from its
    caller, and the trials get the plan from the driver's memory, not from this file. The
    plan's configs hold no COMMAND_LINE_ONLY field (`config.without_command_line_only`):
    `read_plan` refuses one."""
    d = plan.to_dict()
    for key in ("base", "user_base"):  # read back by check_plan: URIs without their options
        d[key] = stored_fields(d[key])
    d["trials"] = [{**t, "overrides": stored_fields(t["overrides"])} for t in d["trials"]]
    text = json.dumps(d, indent=1, sort_keys=True)
    sweep.write_bytes_atomic(PLAN_FILE, redact(text).encode())


def read_plan(sweep: RunDir, sweep_dir: str | None = None) -> SweepPlan:
    """The plan in sweep.json, with `sweep_dir` (the caller's own spelling of the directory,
    credentials included) in place of the stored, redacted one."""
    where = sweep.uri(PLAN_FILE)
    if not sweep.exists(PLAN_FILE):
        raise ConfigError(f"{where}: no such file (expected a raygpt sweep directory)")
    try:
        d = read_json_bounded(sweep, PLAN_FILE)
    except ValueError as e:
        raise ConfigError(f"{where}: expected JSON, found unreadable content ({e})") from e
    if isinstance(d, dict) and sweep_dir is not None:
        d["sweep_dir"] = sweep_dir
    if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
        raise ConfigError(f"{where}: format: expected {PLAN_FORMAT!r}, found "
                          f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r}")
    if d.get("version") != PLAN_VERSION:
        older = (" (an earlier raygpt's sweep, which lists no trials: its status and resume "
                 "needed Tune's pickled state; run it again with --overwrite)"
                 if d.get("version") == 1 else "")
        raise ConfigError(f"{where}: version: expected {PLAN_VERSION}, found "
                          f"{d.get('version')!r}{older}")
    fields = {f.name for f in dataclasses.fields(SweepPlan)}
    plan = SweepPlan(**{k: v for k, v in d.items() if k in fields})
    check_plan(plan, where)
    return plan


# settings key -> the types its value may have (sweep.json is read back from shared storage)
_SETTING_TYPES = {"num_samples": (int,), "max_concurrent": (int, type(None)),
                  "early_stop": (str,), "grace_period": (int, type(None)),
                  "reduction_factor": (int, float), "trial_retries": (int,),
                  "max_t": (int, type(None))}


def check_plan(plan: SweepPlan, where: str) -> None:
    """A plan read back from a sweep directory, checked as untrusted input (anyone who can write
    the directory could have written it): its configs as a --config file's would be (no fault
    injection, storage endpoint or MLflow server: `config.config_read_back`), its trials' names
    and overrides (`trials.check_trials`), its settings' types. ConfigError naming the field."""
    if plan.mode not in ("grid", "wsd_branch"):
        raise ConfigError(f"{where}: mode: expected 'grid' or 'wsd_branch', found {plan.mode!r}")
    base = config_read_back(plan.base, f"{where}: base")
    config_read_back(plan.user_base, f"{where}: user_base")
    check_trials(base, plan.trials, f"{where}: trials")
    if not isinstance(plan.settings, dict):
        raise ConfigError(f"{where}: settings: expected an object, found {plan.settings!r}")
    for key, types in _SETTING_TYPES.items():
        value = plan.settings.get(key)
        if key in plan.settings and (not isinstance(value, types) or isinstance(value, bool)):
            raise ConfigError(f"{where}: settings.{key}: expected "
                              f"{' or '.join(t.__name__ for t in types)}, found {value!r}")
    if plan.settings.get("early_stop", "none") not in ("asha", "none"):
        raise ConfigError(f"{where}: settings.early_stop: expected 'asha' or 'none', found "
                          f"{plan.settings['early_stop']!r}")
    for key in ("shared_step", "stable_max_steps"):
        value = getattr(plan, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{where}: {key}: expected an int or null, found {value!r}")
    if not (isinstance(plan.command, list) and all(isinstance(a, str) for a in plan.command)
            and isinstance(plan.cwd, str)):
        raise ConfigError(f"{where}: command, cwd: expected a list of strings and a string")


# ====================================================================== the ledger (ledger.json)

# A trial's Tune outcome as the sweep driver last heard it: "pending" (not started, or waiting
# to be re-run), "running", "terminated" (its trainable returned) or "error" (Tune gave up).
TUNE_STATUSES = ("pending", "running", "terminated", "error")


def ledger_entry(status: str = "pending") -> dict:
    """`failures`: the trial's failed attempts; `stopped`, `error`: raygpt's stop verdict (exit
    code and message) when raygpt stopped the trial; `trial_id`: Tune's id of its last attempt."""
    return {"status": status, "failures": 0, "stopped": None, "error": "", "trial_id": ""}


def write_ledger(sweep: RunDir, entries: dict) -> None:
    doc = {"format": LEDGER_FORMAT, "version": LEDGER_VERSION, "trials": entries}
    sweep.write_bytes_atomic(LEDGER_FILE, redact(json.dumps(doc, indent=1, sort_keys=True)).encode())


def read_ledger(sweep: RunDir) -> dict:
    """{trial name: entry} from ledger.json ({} before the driver wrote one), every entry
    checked as untrusted input; ConfigError naming the file and the field."""
    where = sweep.uri(LEDGER_FILE)
    if not sweep.exists(LEDGER_FILE):
        return {}
    try:
        d = read_json_bounded(sweep, LEDGER_FILE)
    except ValueError as e:
        raise ConfigError(f"{where}: expected JSON, found unreadable content ({e})") from e
    if not isinstance(d, dict) or d.get("format") != LEDGER_FORMAT or d.get("version") != LEDGER_VERSION:
        raise ConfigError(f"{where}: expected format {LEDGER_FORMAT!r} version {LEDGER_VERSION}")
    trials = d.get("trials")
    if not isinstance(trials, dict):
        raise ConfigError(f"{where}: trials: expected an object of trial entries")
    out = {}
    for name, e in trials.items():
        ok = (TRIAL_NAME_RE.match(name) and isinstance(e, dict)
              and e.get("status") in TUNE_STATUSES
              and isinstance(e.get("failures"), int) and not isinstance(e.get("failures"), bool)
              and (e.get("stopped") is None or type(e.get("stopped")) is int)
              and isinstance(e.get("error"), str) and isinstance(e.get("trial_id"), str))
        if not ok:
            raise ConfigError(f"{where}: trials.{name}: expected an entry like "
                              f"{ledger_entry()}, found {str(e)[:200]}")
        out[name] = {k: e[k] for k in ledger_entry()}
    return out


class TrialLedger(tune.Callback):
    """Writes ledger.json as Tune reports each trial's start, failure, end and raygpt's stop
    verdict: what `raygpt status` and `resume_sweep` know of a trial besides its run directory,
    in raygpt's JSON rather than in Tune's (pickled) experiment state."""

    def __init__(self, sweep_dir: str, entries: dict):
        self.sweep_dir, self.entries = sweep_dir, entries

    def _update(self, trial, **changes) -> None:
        entry = self.entries.setdefault(trial.config["trial"], ledger_entry())
        entry.update(changes, trial_id=trial.trial_id)
        write_ledger(open_run_dir(self.sweep_dir), self.entries)

    def on_trial_start(self, iteration, trials, trial, **info):
        self._update(trial, status="running")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        entry = self.entries.get(trial.config["trial"], {})
        if result.get(STOPPED_KEY) is not None and entry.get("stopped") is None:
            self._update(trial, stopped=int(result[STOPPED_KEY]),
                         error=str(result.get(STOPPED_MESSAGE_KEY, "")))

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._update(trial, status="pending", failures=self._failures(trial) + 1)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._update(trial, status="error", failures=self._failures(trial) + 1)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._update(trial, status="terminated")

    def _failures(self, trial) -> int:
        return self.entries.get(trial.config["trial"], {}).get("failures", 0)


# ====================================================================== configs (pure)

def max_concurrent_trials(cluster: dict, per_trial: TrainConfig) -> int:
    """Trials whose workers fit at once: GPUs (or CPUs, one per CPU worker) // workers per trial."""
    kind = "GPU" if per_trial.device == "gpu" else "CPU"
    return max(1, int(cluster.get(kind, 0) // per_trial.num_workers))


def _upper(value) -> float | None:
    """The largest value a search-space entry can take (grid, choice, range), or None."""
    if isinstance(value, dict) and "grid_search" in value:
        return max(value["grid_search"])
    if hasattr(value, "categories"):
        return max(value.categories)
    if hasattr(value, "upper"):
        return value.upper
    if isinstance(value, (int, float)):
        return value
    return None


def shared_stable_step(branch_totals: list[int]) -> int:
    """S: the decay start of the shortest branch, where every branch is still in its stable
    phase (wsd_decay_start grows with max_steps), so checkpoint S is valid for all of them."""
    step = wsd_decay_start(min(branch_totals))
    if step < 1:
        raise ConfigError(f"--wsd-branches {branch_totals}: the shortest branch's decay starts at "
                          f"step {step}; expected max_steps >= 2 so there is a stable phase")
    return step


def check_branch_space(space: dict) -> None:
    """Branches resume one checkpoint, so they may differ only where a resume may differ."""
    for key in space:
        top = key.split(".", 1)[0]
        if top not in RESUME_MUTABLE_FIELDS:
            raise ConfigError(
                f"WSD branch space key {key!r}: branches resume the shared stable-phase "
                f"checkpoint, whose compatibility check requires every field outside "
                f"config.RESUME_MUTABLE_FIELDS to match; expected one of "
                f"{sorted(RESUME_MUTABLE_FIELDS)}, found {key!r}")


# ====================================================================== one run under Ray Train

class _ValReportsToTune(TuneReportCallback):
    """Forwards the loop's validation reports, and only those, to the Tune trial: checkpoint
    reports and the final summary carry other keys, and Tune's scheduler needs val_loss in
    every result it sees."""

    def after_report(self, run_context, metrics, checkpoint):
        m = metrics[0]
        if "val_loss" not in m or "checkpoint_step" in m or m.get("final"):
            return
        super().after_report(run_context, [{k: m[k] for k in VAL_KEYS if k in m}], None)


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


def seed_branch(plan: SweepPlan, run_dir: RunDir) -> bool:
    """Give a branch trial the shared stable-phase checkpoint, unless its run directory already
    has a verified checkpoint of its own (a retried or resumed trial continues from that).
    Returns True when it copied."""
    if ck.find_latest_verified(run_dir, warn=lambda m: None) is not None:
        return False
    stable = open_run_dir(join_uri(plan.sweep_dir, STABLE_DIR))
    ck.copy_checkpoint(stable, run_dir, plan.shared_step)
    return True


def raygpt_trial(config: dict, plan: dict, command_line: dict, lineage: str | None = None,
                 artifact_key: ArtifactKey | None = None) -> None:
    """The Tune trainable: one trial = one raygpt run in <sweep>/trials/<trial name>/, its config
    the plan's base + the command line's own fields (`config.command_line_only`) + the trial's
    overrides from the plan (`config` is {"trial": its name}); its compiled artifacts signed with
    the sweep driver's `artifact_key` (a trial's own driver may run on another machine, whose key
    would not verify another trial's or a resumed sweep's).

    A run that failed in a way a re-run would repeat (a bad input, a stop raygpt decided) sends
    Tune its verdict as a last result before raising, so the sweep's driver does not re-run
    the trial (`_NoRetryOfStoppedTrials`); any other failure is Tune's to retry."""
    plan = SweepPlan(**{k: v for k, v in plan.items() if k not in ("format", "version")})
    name = config["trial"]
    overrides = next(t["overrides"] for t in plan.trials if t["name"] == name)
    run_dir = join_uri(plan.sweep_dir, f"{TRIALS_DIR}/{name}")
    try:
        adapted: list[str] = []
        base = TrainConfig.from_dict(plan.base).with_overrides(command_line)
        cfg = trial_config(base, overrides, run_dir, notes=adapted)
        if plan.mode == "wsd_branch":
            seed_branch(plan, open_run_dir(run_dir))
        trial_id = tune.get_context().get_trial_id()
        run(cfg, callbacks=(_ValReportsToTune(),), control_name=trial_control_name(trial_id),
            lineage=f"{lineage}/{trial_id}" if lineage else None, what="raygpt sweep trial",
            argv=list(plan.command) or None, cwd=plan.cwd or None, adapted=adapted,
            artifact_key=artifact_key)
    except (ConfigError, RunFailed) as e:
        code = EXIT_BAD_INPUT if isinstance(e, ConfigError) else e.exit_code if e.final else None
        if code is not None:
            tune.report({STOPPED_KEY: code, STOPPED_MESSAGE_KEY: redact(str(e))[:2000],
                         "val_loss": float("nan")})
        raise


class _NoRetryOfStoppedTrials(tune.Callback):
    """Tune re-runs a failed trial while its failures are within `max_failures`, whatever the
    error. A trial raygpt stopped reports STOPPED_KEY as its last result, and Tune's function
    trainable delivers that result (this callback runs on it) before the trial's error, so the
    trial's budget is zero when Tune decides: it ends in ERROR, not re-run. A trial that (re)starts
    gets the sweep's budget back (a resumed sweep's --retry-errored re-runs such trials)."""

    def __init__(self, trial_retries: int):
        self.trial_retries = trial_retries

    def on_trial_start(self, iteration, trials, trial, **info):
        trial.max_failures = self.trial_retries

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get(STOPPED_KEY) is not None:
            trial.max_failures = 0


def _tune_storage(sweep_dir: str) -> tuple:
    """(storage_filesystem, storage_path) for Tune: for a URI, the filesystem raygpt opens (its
    endpoint and bounded timeouts) and the plain path, as the single-run driver gives Ray Train
    (`driver._split_storage`); Tune would open a URI string with the store's defaults."""
    if "://" not in sweep_dir:
        return None, sweep_dir
    rd = open_run_dir(sweep_dir)
    return rd.fs, rd.root


# ====================================================================== the sweep driver

@dataclass
class TrialRow:
    name: str
    trial_id: str
    """Tune's id of the trial's last attempt ("" before it started)."""
    status: str
    """done (reached max_steps) | stopped (ended early: the scheduler, an operator) | error |
    pending | running | unreadable (its history could not be read: `error` says why)"""
    overrides: dict
    val_loss: float
    step: int | None
    skips: int
    rewinds: int
    retries: int
    """Times Tune re-ran the trial after its driver failed."""
    run_dir: str
    val_curve: list
    """[(step, val_loss)], the latest record of each step."""
    stopped: int | None = None
    """raygpt's exit code when raygpt stopped the trial and Tune did not re-run it (2: a bad
    input, 1: a stop raygpt decided), else None."""
    error: str = ""
    """That stop's message (or why the history is unreadable)."""


@dataclass
class SweepReport:
    sweep_dir: str
    rows: list
    """TrialRow, sorted by final validation loss (NaN last)."""
    best: TrialRow | None
    best_config_path: str | None
    plot_path: str | None
    table: str
    max_concurrent: int


def run_sweep(base: TrainConfig, space: dict, sweep_dir: str, *, num_samples: int = 1,
              early_stop: str = "asha", grace_period: int | None = None,
              reduction_factor: float = 2.0, max_concurrent: int | None = None,
              trial_retries: int = 2, ray_address: str | None = None) -> SweepReport:
    """Sweep `space` (TrainConfig overrides with Tune domains) over raygpt runs.

    early_stop: "asha" (ASHAScheduler on val_loss against step) or "none".
    max_concurrent: default, the trials whose workers fit the cluster's GPUs (or CPUs) at once.
    Every input is checked before Ray starts (`preflight_sweep`; ConfigError in one line)."""
    check_space(base, space)
    settings = dict(num_samples=num_samples, early_stop=early_stop, grace_period=grace_period,
                    reduction_factor=reduction_factor, max_concurrent=max_concurrent,
                    trial_retries=trial_retries)
    trials = expand_trials(space, num_samples, base.seed)
    pinned = _checked_before_ray(base, space, sweep_dir, settings, ray_address)
    _ensure_ray(ray_address)
    with _sweep_lease(sweep_dir) as lease:
        plan = _new_plan("grid", without_command_line_only(base), without_command_line_only(pinned),
                         sweep_dir, settings, lease=lease, trials=trials)
        return _fit(plan, [t["name"] for t in trials], experiment=TUNE_DIR,
                    command_line=command_line_only(base), lineage=lease.token)


def run_wsd_branches(base: TrainConfig, branch_totals: list[int], sweep_dir: str, *,
                     space: dict | None = None, max_concurrent: int | None = None,
                     trial_retries: int = 2, ray_address: str | None = None) -> SweepReport:
    """WSD decay branches from one shared stable phase: one trial per max_steps in
    `branch_totals` (times the grid of `space`, resume-mutable fields only). The scheduler is
    wsd. The stable phase is trained once up to S = wsd_decay_start(min(branch_totals)). No early
    stopping: at the same step the branches are in different phases (stable or decaying), so
    ASHA would compare them unfairly."""
    totals = sorted({int(n) for n in branch_totals})
    if not totals or totals[0] < 2:
        raise ConfigError(f"--wsd-branches: expected branch totals (max_steps) >= 2, found "
                          f"{branch_totals!r}")
    space = dict(space or {})
    if "max_steps" in space:
        raise ConfigError("WSD branch space: max_steps is given by the branch totals "
                          "(--wsd-branches), expected it absent from the space")
    check_branch_space(space)
    base = base.with_overrides({"scheduler": "wsd"})
    space["max_steps"] = tune.grid_search(totals)
    check_space(base, space)
    shared = shared_stable_step(totals)
    settings = dict(num_samples=1, early_stop="none", grace_period=None, reduction_factor=2.0,
                    max_concurrent=max_concurrent, trial_retries=trial_retries)
    trials = expand_trials(space, 1, base.seed)
    # the stable phase is the shortest branch's config: among the trials checked
    pinned = _checked_before_ray(base, space, sweep_dir, settings, ray_address)
    _ensure_ray(ray_address)
    with _sweep_lease(sweep_dir) as lease:
        plan = _new_plan("wsd_branch", without_command_line_only(base),
                         without_command_line_only(pinned), sweep_dir, settings,
                         shared_step=shared, stable_max_steps=totals[0], lease=lease, trials=trials)
        return _fit(plan, [t["name"] for t in trials], experiment=TUNE_DIR,
                    command_line=command_line_only(base), lineage=lease.token)


def resume_sweep(sweep_dir: str, *, command_line: dict | None = None,
                 ray_address: str | None = None, retry_errored: bool = False) -> SweepReport:
    """Continue a sweep whose driver died (-y 1): a new Tune experiment (`next_experiment`) over
    the trials that have not finished (`needs_resume`), each continuing its own run directory
    from its newest verified checkpoint; finished trials are not run again. Nothing of Tune's
    earlier experiments is read (their state is pickled); ASHA's rungs are rebuilt from every
    trial's validation curve. `command_line`: this command's COMMAND_LINE_ONLY fields (fault
    injection, storage endpoint, MLflow server), which sweep.json never holds. The plan's base
    config is checked before Ray starts (its files may have changed since); each trial checks
    its own checkpoint when it resumes."""
    command_line = dict(command_line or {})
    # this user's sweep only: another's (or a directory raygpt did not mark) is refused unread
    check_claim(open_run_dir(_abs(sweep_dir)), "sweep", sweep_dir, holds=_holds_sweep, resume=True)
    plan = read_plan(open_run_dir(_abs(sweep_dir)), _abs(sweep_dir))
    preflight_sweep(TrainConfig.from_dict(plan.base).with_overrides(command_line), {}, sweep_dir,
                    on_this_machine=starts_its_own_ray(ray_address))
    _ensure_ray(ray_address)
    with _sweep_lease(sweep_dir) as lease:
        sweep = open_run_dir(_abs(sweep_dir))
        plan = _with_endpoints(read_plan(sweep, _abs(sweep_dir)), command_line)
        ledger = read_ledger(sweep)
        rows = trial_rows(plan, ledger)
        todo = [r.name for r in rows if needs_resume(r.status, retry_errored)]
        experiment = next_experiment(sweep)
        log.info(f"raygpt sweep | {plan.sweep_dir} | resuming {len(todo)} of {len(rows)} "
                 f"trial(s) as Tune experiment {experiment}/" + (
                     "; ASHA's rungs rebuilt from every trial's validation curve"
                     if plan.settings.get("early_stop") == "asha" else ""))
        if not todo:
            return summarize(plan.sweep_dir)
        for name in todo:  # a re-run errored trial starts with a clean verdict, its count kept
            ledger[name] = {**ledger.get(name, ledger_entry()), "status": "pending",
                            "stopped": None, "error": ""}
        return _fit(plan, todo, experiment=experiment, command_line=command_line,
                    lineage=lease.token, ledger=ledger,
                    replay={r.name: r.val_curve for r in rows})


def _with_endpoints(plan: SweepPlan, command_line: dict) -> SweepPlan:
    """A plan read back (its shard URIs stored plain) with this driver's storage endpoint
    (--storage-endpoint, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL) in its shard URIs again,
    as a fresh sweep's are: the trials, on other machines, open the same store."""
    endpoint = command_line.get("storage_endpoint", "")
    base = dict(plan.base)
    for key, flag in (("input_bin", "-i/--input-bin"), ("input_val_bin", "-j/--input-val-bin")):
        if isinstance(base.get(key), str):
            base[key] = shards_with_endpoint(flag, base[key], endpoint)
    return dataclasses.replace(plan, base=base)


def needs_resume(status: str, retry_errored: bool) -> bool:
    """Whether a resumed sweep runs a trial again: one that has not finished (pending, running
    when the driver died, its history unreadable), and with --retry-errored one Tune gave up on."""
    return status not in ("done", "stopped", "error") or (status == "error" and retry_errored)


def next_experiment(sweep: RunDir) -> str:
    """The Tune experiment directory of this fit: tune/ for the sweep's first, tune.2/, tune.3/
    ... for each resume. A new one each time: raygpt never restores one of Tune's."""
    name, n = TUNE_DIR, 1
    while sweep.exists(name):
        n += 1
        name = f"{TUNE_DIR}.{n}"
    return name


def _ensure_ray(address: str | None) -> None:
    init_ray(address)  # address="local" unless one is given: never a stranger's /tmp/ray cluster


def _checked_before_ray(base: TrainConfig, space: dict, sweep_dir: str, settings: dict,
                        ray_address: str | None) -> TrainConfig:
    """The base pinned for the trials, with the settings and every known trial config checked
    (`preflight_sweep`), all before this process starts a Ray of its own; sets settings['max_t']."""
    # the sweep directory first: one that is not this user's is refused before anything is written
    check_claim(open_run_dir(_abs(sweep_dir)), "sweep", sweep_dir, holds=_holds_sweep,
                overwrite=base.overwrite)
    if settings["early_stop"] not in ("asha", "none"):
        raise ConfigError(f"--early-stop: expected asha or none, found {settings['early_stop']!r}")
    pinned = pin_for_trials(base, *capacity.for_resolve(cluster_resources(ray_address)))
    upper = _upper(space["max_steps"]) if "max_steps" in space else pinned.max_steps
    settings["max_t"] = int(upper) if upper is not None and upper > 0 else None
    if settings["early_stop"] == "asha" and settings["max_t"] is None:
        raise ConfigError("--early-stop asha: expected -x/--max-steps >= 1 (ASHA needs the "
                          "trials' length), found -1 (one epoch)")
    preflight_sweep(pinned, space, sweep_dir, on_this_machine=starts_its_own_ray(ray_address))
    return pinned


@contextlib.contextmanager
def _sweep_lease(sweep_dir: str):
    """The sweep directory's lease, held by this sweep driver (a second driver on the same
    directory is refused) and renewed while the sweep runs; its token is the lineage of the
    trials' own leases."""
    lease = Lease(open_run_dir(_abs(sweep_dir)), what="raygpt sweep")
    lease.acquire()
    try:
        lease.start_heartbeat()
        yield lease
    finally:
        lease.release()


def _abs(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


def _new_plan(mode: str, base: TrainConfig, pinned: TrainConfig, sweep_dir: str,
              settings: dict, lease: Lease | None = None, **wsd) -> SweepPlan:
    """Claim the sweep directory (new or empty, or this user's sweep with --overwrite: a run's
    own rule, `ownership.claim_dir`), write sweep.json (`pinned`: the checked base)."""
    sweep = open_run_dir(_abs(sweep_dir))
    claim_dir(sweep, "sweep", sweep_dir, holds=_holds_sweep, overwrite=base.overwrite, lease=lease)
    plan = SweepPlan(sweep_dir=_abs(sweep_dir), mode=mode, user_base=base.to_dict(), base=pinned.to_dict(),
                     settings=settings, command=list(getattr(sys, "orig_argv", sys.argv)),
                     cwd=os.getcwd(), **wsd)
    write_plan(sweep, plan)
    return plan


def _holds_sweep(sweep: RunDir) -> bool:
    return sweep.exists(PLAN_FILE) or sweep.exists(TUNE_DIR)


def _fit(plan: SweepPlan, names: list[str], *, experiment: str, command_line: dict,
         lineage: str | None = None, ledger: dict | None = None,
         replay: dict | None = None) -> SweepReport:
    """Run the plan's trials `names` as Tune experiment `experiment` (a grid over the names),
    recording their outcomes in ledger.json; `replay`: {trial name: val curve} for ASHA's
    rungs (a resumed sweep)."""
    base = TrainConfig.from_dict(plan.base).with_overrides(command_line)
    s = plan.settings
    concurrent = s.get("max_concurrent") or max_concurrent_trials(ray.cluster_resources(), base)
    if plan.mode == "wsd_branch":
        run_stable_phase(plan, command_line, lineage)
    # this machine's key, for every trial wherever Tune places its driver: with_parameters
    # keeps it in Ray's object store (Tune's tuner.pkl leaves the trainable out)
    compiled = base.compile or any(t["overrides"].get("compile") for t in plan.trials)
    key = signed_file.load_or_create_key() if compiled else None
    trainable = tune.with_resources(tune.with_parameters(raygpt_trial, plan=plan.to_dict(),
                                                         command_line=command_line,
                                                         lineage=lineage, artifact_key=key),
                                    TRIAL_DRIVER_RESOURCES)
    tune_fs, tune_root = _tune_storage(plan.sweep_dir)
    scheduler = None
    if s["early_stop"] == "asha":
        grace = s.get("grace_period") or _default_grace(base, s["max_t"])
        scheduler = GracefulASHA(
            time_attr="step", max_t=s["max_t"], grace_period=min(grace, s["max_t"]),
            reduction_factor=s["reduction_factor"], metric="val_loss", mode="min")
        scheduler.replay(replay or {})
    tuner = tune.Tuner(
        trainable, param_space={"trial": tune.grid_search(list(names))},
        tune_config=tune.TuneConfig(
            # a scheduler that names its metric must be the only one to (Tune refuses both)
            metric=None if scheduler else "val_loss", mode=None if scheduler else "min",
            scheduler=scheduler, num_samples=1, max_concurrent_trials=concurrent,
            trial_name_creator=_trial_name, trial_dirname_creator=_trial_name),
        run_config=tune.RunConfig(
            name=experiment, storage_path=tune_root, storage_filesystem=tune_fs,
            failure_config=tune.FailureConfig(max_failures=s["trial_retries"]),
            callbacks=[_NoRetryOfStoppedTrials(s["trial_retries"]),
                       TrialLedger(plan.sweep_dir, ledger if ledger is not None else {})]))
    log.info(f"raygpt sweep | {plan.sweep_dir} | mode {plan.mode} | {len(names)} trial(s), up to "
             f"{concurrent} concurrent | early stop {s['early_stop']} | Tune experiment {experiment}/")
    tuner.fit()
    return summarize(plan.sweep_dir, max_concurrent=concurrent)


def _trial_name(trial) -> str:
    """A trial's Tune name and directory: its sweep name, which is also its run directory's."""
    return trial.config["trial"]


def _default_grace(base: TrainConfig, max_t: int) -> int:
    """A quarter of the run, rounded up to a validation step (the only steps Tune hears of)."""
    every = max(1, base.val_every)
    return max(every, math.ceil(max_t / 4 / every) * every)


def run_stable_phase(plan: SweepPlan, command_line: dict, lineage: str | None = None) -> int:
    """Train the WSD stable phase once (skipped when its checkpoint at S already verifies) and
    return S. The run is the branches' own config with max_steps = the shortest branch total, so
    its LR up to S is every branch's LR up to S; it checkpoints at S and is stopped there."""
    stable = open_run_dir(join_uri(plan.sweep_dir, STABLE_DIR))
    S = plan.shared_step
    if stable.exists(ck.step_dir(S)) and not ck.verify_checkpoint(stable, S):
        return S
    base = TrainConfig.from_dict(plan.base).with_overrides(command_line)
    every = base.checkpoint_every if base.checkpoint_every and S % base.checkpoint_every == 0 else S
    adapted: list[str] = []
    cfg = trial_config(base, {"max_steps": plan.stable_max_steps, "checkpoint_every": every},
                       stable.uri(), notes=adapted)
    log.info(f"raygpt sweep | WSD stable phase: {cfg.max_steps}-step schedule, stopping after the "
             f"checkpoint at step {S} | {stable.uri()}")
    run(cfg, stop_at_step=S, lineage=f"{lineage}/stable" if lineage else None,
        what="raygpt sweep trial", argv=list(plan.command) or None, cwd=plan.cwd or None,
        adapted=adapted)
    problems = ck.verify_checkpoint(stable, S) if stable.exists(ck.step_dir(S)) else ["missing"]
    if problems:
        raise ck.CheckpointError(f"{stable.uri(ck.step_dir(S))}: the stable phase ended without a "
                                 f"verified checkpoint at the shared step {S}: {problems[0]}")
    return S


# ====================================================================== results

def collect_rows(sweep_dir: str) -> list[TrialRow]:
    """One row per trial of the plan, sorted by val loss: `trial_rows` of the sweep directory."""
    sweep = open_run_dir(_abs(sweep_dir))
    plan = read_plan(sweep, _abs(sweep_dir))
    rows = trial_rows(plan, read_ledger(sweep))
    rows.sort(key=lambda r: (math.isnan(r.val_loss), r.val_loss))
    return rows


def trial_rows(plan: SweepPlan, ledger: dict) -> list[TrialRow]:
    """One row per trial, in the plan's order, from raygpt's JSON only: the plan (name,
    overrides), the ledger (Tune's outcome, retries, raygpt's stop verdict) and the trial's own
    loss history (val curve, final step, skips, rewinds). A history that cannot be read makes
    its row "unreadable", with why, not the whole report fail."""
    rows = []
    for t in plan.trials:
        name = t["name"]
        run_dir = join_uri(plan.sweep_dir, f"{TRIALS_DIR}/{name}")
        entry = ledger.get(name, ledger_entry())
        try:
            curve, end = trial_progress(open_run_dir(run_dir))
            status, problem = trial_status(end, entry["status"]), ""
        except (OSError, ValueError) as e:
            curve, end, status, problem = [], None, "unreadable", redact(" ".join(str(e).split()))
        errored = status == "error"
        src = end or {}
        rows.append(TrialRow(
            name=name, trial_id=entry["trial_id"], status=status,
            overrides=dict(t["overrides"]),
            val_loss=curve[-1][1] if curve else float("nan"),
            step=_count(src.get("step"), curve[-1][0] if curve else None),
            skips=_count(src.get("skips"), 0), rewinds=_count(src.get("rewinds"), 0),
            # re-runs: every failure but an errored trial's last one was followed by one
            retries=max(0, entry["failures"] - errored), run_dir=run_dir, val_curve=curve,
            stopped=entry["stopped"] if errored else None,
            error=entry["error"] if errored and entry["stopped"] is not None else problem))
    return rows


def trial_status(end: dict | None, tune_status: str) -> str:
    """done (its run reached max_steps) | stopped (its run ended early: ASHA, an operator) |
    error (Tune gave up on it) | running | pending, from the run's last attempt's end record
    (`trial_progress`) and the ledger's Tune status."""
    if end is not None and end.get("stopped_early", True) is False:
        return "done"
    if tune_status == "error":
        return "error"
    if end is not None or tune_status == "terminated":
        return "stopped"
    return tune_status


def trial_progress(run_dir: RunDir) -> tuple[list[tuple[int, float]], dict | None]:
    """(the validation curve, the end record of the run's last attempt or None) of a trial's loss
    history, streamed (`iter_history`: torn lines skipped) keeping only the val records. An end
    record counts only if no attempt started after it (a re-run that is still going)."""
    vals, end = [], None
    for r in iter_history(run_dir):
        kind = r.get("kind")
        if kind in ("start", "resume"):
            end = None
        elif kind == "end":
            end = r
        elif kind == "val":
            vals.append(r)
    return val_curve(vals), end


def _val_point(r: dict) -> tuple[int, float] | None:
    """(step, val_loss) of a val record, None when its fields are not numbers (a damaged line)."""
    step, loss = r.get("step"), r.get("val_loss")
    if type(step) is not int or not isinstance(loss, (int, float)) or isinstance(loss, bool):
        return None
    return step, float(loss)


def _count(value, default):
    """A count (step, skips, rewinds) read from a history record, `default` when it is not one."""
    return value if type(value) is int and value >= 0 else default


def sweep_status(sweep_dir: str) -> str:
    """`raygpt status SWEEP_DIR`: the plan, every trial's row as of now (the table results.txt
    gets at the end, from the plan, the ledger and the trials' own histories, so a running or
    interrupted sweep shows too), and how to look closer."""
    plan = read_plan(open_run_dir(_abs(sweep_dir)), _abs(sweep_dir))
    head = f"sweep {plan.sweep_dir} | mode {plan.mode}"
    rows = collect_rows(plan.sweep_dir)
    counts = ", ".join(f"{n} {status}" for status, n in sorted(Counter(r.status for r in rows).items()))
    ended = open_run_dir(plan.sweep_dir).exists(RESULTS_TXT)
    unreadable = [f"{r.name}: {r.error}" for r in rows if r.status == "unreadable"]
    return "\n".join([
        f"{head} | {len(rows)} trial(s)" + (f": {counts}" if counts else "")
        + ("" if ended else " (as of now: no results.txt yet)"),
        format_table(rows), *unreadable,
        f"one trial: raygpt status {join_uri(plan.sweep_dir, TRIALS_DIR)}/<trial>"])


def val_curve(records: list[dict]) -> list[tuple[int, float]]:
    """[(step, val_loss)] ascending, the latest record of each step winning (a step validated
    again after a resume or rewind); a record whose fields are not numbers is left out."""
    latest = {}
    for r in records:
        if r.get("kind") == "val" and (point := _val_point(r)) is not None:
            latest[point[0]] = point[1]
    return sorted(latest.items())


def format_table(rows: list[TrialRow]) -> str:
    head = ("#", "trial", "status", "config", "val_loss", "step", "skips", "rewinds", "retries")
    lines = [head]
    for i, r in enumerate(rows, 1):
        config = " ".join(f"{k}={v}" for k, v in sorted(r.overrides.items()))
        lines.append((str(i), r.name, r.status, config, f"{r.val_loss:.4f}",
                      "-" if r.step is None else str(r.step), str(r.skips), str(r.rewinds),
                      str(r.retries)))
    widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in lines)


def best_config(user_base: TrainConfig, overrides: dict) -> dict:
    """The TrainConfig overrides that reproduce a trial from the defaults: every field of the
    user's base + the trial's overrides that differs from TrainConfig()'s defaults, without the
    fields that only place a run ('spike.x' keys for SpikeConfig). Hardware fields left at None
    stay None, so `--config FILE` resolves them for the machine it runs on."""
    cfg = user_base.with_overrides({k: _plain(v) for k, v in overrides.items()})
    mine, default = cfg.to_dict(), TrainConfig().to_dict()
    out = {}
    for key, value in mine.items():
        if key in PLACEMENT_FIELDS:
            continue
        if key == "spike":
            out.update({f"spike.{k}": v for k, v in value.items() if v != default["spike"][k]})
        elif value != default[key]:
            out[key] = value
    return stored_fields(out)  # read back by --config: its URIs plain (check_file_fields)


def plot_val_curves(rows: list[TrialRow], sweep_dir: str, path: str, *, stable_curve=None,
                    title: str = "") -> str | None:
    """PNG of validation loss against step, one line per trial, stored whole at `path` (never
    through a link: `storage.store_png`). matplotlib is optional (the `plot` extra): without it
    no plot is written and None is returned."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.info("raygpt sweep | matplotlib is not installed (pip install raygpt[plot]); no plot")
        return None
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)  # the Agg canvas, without touching pyplot's global backend
    ax = fig.add_subplot(1, 1, 1)
    if stable_curve:
        ax.plot(*zip(*stable_curve), "k--", linewidth=1, label="WSD stable phase")
    for r in rows:
        if r.val_curve:
            label = " ".join(f"{k}={v}" for k, v in sorted(r.overrides.items())) or r.name
            ax.plot(*zip(*r.val_curve), marker=".", label=f"{label} ({r.val_loss:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    store_png(sweep_dir, path, png.getvalue())
    return path


def stable_curve(plan: SweepPlan) -> list[tuple[int, float]] | None:
    """The WSD stable phase's validation curve (branch mode: drawn under the branches'), else None."""
    if plan.mode != "wsd_branch":
        return None
    return trial_progress(open_run_dir(join_uri(plan.sweep_dir, STABLE_DIR)))[0]


def plot_sweep(sweep_dir: str, out: str | None) -> tuple[str | None, int]:
    """`raygpt plot SWEEP_DIR`: every trial's validation curve as of now (the plot the sweep's
    end writes as val_loss.png), into `out` (default: that file in a local sweep directory,
    <sweep name>_val_loss.png here for a remote one). Returns (the path or None without
    matplotlib, the number of trials)."""
    sweep = open_run_dir(_abs(sweep_dir))
    plan = read_plan(sweep, _abs(sweep_dir))
    rows = collect_rows(plan.sweep_dir)
    name = Path(plan.sweep_dir).name
    if out is None:
        out = str(sweep.local_path(PLOT)) if sweep.is_local else f"{name or 'sweep'}_{PLOT}"
    return plot_val_curves(rows, plan.sweep_dir, out, stable_curve=stable_curve(plan),
                           title=f"{name}: validation loss"), len(rows)


def summarize(sweep_dir: str, *, max_concurrent: int = 0) -> SweepReport:
    """Write results.txt/.json, best_config.json and val_loss.png; print the table."""
    sweep = open_run_dir(_abs(sweep_dir))
    plan = read_plan(sweep, _abs(sweep_dir))
    rows = collect_rows(plan.sweep_dir)
    table = format_table(rows)
    sweep.write_bytes_atomic(RESULTS_TXT, redact(table + "\n").encode())
    sweep.write_bytes_atomic(RESULTS_JSON, redact(json.dumps(
        [dataclasses.asdict(r) for r in rows], indent=1, default=str)).encode())
    # a finished trial, else an early-stopped one; never one that failed (its config may not run)
    best = next((r for r in rows if r.status == "done"), None) or next(
        (r for r in rows if r.status != "error" and not math.isnan(r.val_loss)), None)
    best_path = None
    if best is not None:
        cfg = best_config(TrainConfig.from_dict(plan.user_base), best.overrides)
        sweep.write_bytes_atomic(BEST_CONFIG, (json.dumps(cfg, indent=1, sort_keys=True) + "\n").encode())
        best_path = sweep.uri(BEST_CONFIG)
    plot_path = None
    if sweep.is_local:
        plot_path = plot_val_curves(rows, plan.sweep_dir, str(sweep.local_path(PLOT)),
                                    stable_curve=stable_curve(plan),
                                    title=f"{Path(plan.sweep_dir).name}: validation loss")
    log.info(f"raygpt sweep | {len(rows)} trial(s), by validation loss:\n{table}")
    for r in rows:
        if r.stopped is not None:
            log.info(f"raygpt sweep | {r.name}: not re-run ({'bad input' if r.stopped == EXIT_BAD_INPUT else 'raygpt stopped it'}): "
                     f"{r.error}")
    if best is not None:
        log.info(f"raygpt sweep | best: {best.name} ({best.val_loss:.4f}); its config: {best_path} "
                 f"(python experiments/shakespeare.py --config {best_path})")
    return SweepReport(sweep_dir=plan.sweep_dir, rows=rows, best=best, best_config_path=best_path,
                       plot_path=plot_path, table=table, max_concurrent=max_concurrent)


# ====================================================================== command line

def space_from_args(ns, items: list | None = None) -> dict:
    """The search space of --grid/--choice/--uniform/--loguniform as Tune domains, values in
    their fields' types (`trials.space_items`)."""
    make = {"grid": tune.grid_search, "choice": tune.choice,
            "uniform": lambda v: tune.uniform(*v), "loguniform": lambda v: tune.loguniform(*v)}
    return {key: make[flag](vals) for flag, key, vals in
            (space_items(ns) if items is None else items)}


def run_from_args(ns, items: list, base: TrainConfig) -> SweepReport:
    """Run (or, with -y 1, resume) the sweep the command line describes."""
    if base.resume == 1:
        return resume_sweep(base.output_dir, command_line=command_line_only(base),
                            ray_address=ns.address, retry_errored=ns.retry_errored)
    if ns.wsd_branches:
        return run_wsd_branches(base, _branch_totals(ns.wsd_branches), base.output_dir,
                                space=space_from_args(ns, items),
                                max_concurrent=ns.max_concurrent,
                                trial_retries=ns.trial_retries, ray_address=ns.address)
    space = space_from_args(ns, items) or {"scheduler": tune.grid_search(list(DEFAULT_SCHEDULERS))}
    return run_sweep(base, space, base.output_dir, num_samples=ns.num_samples,
                     early_stop=ns.early_stop, grace_period=ns.grace_period,
                     reduction_factor=ns.reduction_factor, max_concurrent=ns.max_concurrent,
                     trial_retries=ns.trial_retries, ray_address=ns.address)


if __name__ == "__main__":
    from raygpt.ray.sweep_command import main  # the trials checked before this module loads
    sys.exit(main())
