"""Ray Tune sweeps over raygpt runs: every trial is a full raygpt run in its own run directory.

A search space is a dict of `TrainConfig` overrides (`{"scheduler": tune.grid_search([...]),
"spike.soft_z": tune.choice([...]), "learning_rate": tune.loguniform(...)}`): each trial's config
is `base.with_overrides(trial_config)`, so there is no second config system.

A sweep directory holds

    sweep.json             the plan (format "raygpt-sweep", version 1): base config, mode, settings
    tune/                  Ray Tune's experiment; `resume_sweep` hands it to `Tuner.restore`
    trials/<trial name>/   one raygpt run directory per trial: checkpoints, main.log, loss history
    stable/                WSD branch mode only: the shared stable phase, trained once
    results.txt, results.json, best_config.json, val_loss.png    written when the sweep ends

How a trial runs (Ray Train V2's documented Train-inside-Tune pattern): the Tune trial is a small
driver (`raygpt_trial`) that builds the same `TorchTrainer` a single run builds (`train_func`,
`CheckpointFinalizer`, `FailureConfig(cfg.max_failures)`, the run directory as Ray's experiment
directory) and forwards the loop's validation reports to Tune (`TuneReportCallback`). The trial
driver reserves no CPU or GPU (only a token amount of memory, because a Tune bundle cannot be
empty), so the cluster's CPUs or GPUs go to the training workers, and `max_concurrent_trials` is
the number of trials whose workers fit at once.

Early stopping is ASHA on validation loss against step (`GracefulASHA`), with one change: a trial
ASHA stops is asked to checkpoint and stop through its run's control actor (what a driver's
SIGTERM does), rather than having Tune kill its actor. A killed trial takes its Ray Train
controller down with it and leaves the workers' placement group to Ray Train's best-effort
cleaner, which on a machine running more than one Ray instance never frees it; the graceful
stop frees everything and leaves a resumable run directory.

Before Ray starts (raygpt/trials.py holds the configs and the command line, and imports no
Ray), every trial config that can be known up front (the base, and every combination of grid
values and choice categories, the bounds of numeric ranges) goes through the single run's
driver-side checks (`raygpt.preflight`: model file, shards against B, T and
the world size, trackers) and the sweep directory must be writable: a bad value is one line
naming the trial's overrides and the flag, exit 2, before anything trains. Each trial writes
its `config.json` like a single run (`run_config.write_launch`, with the sweep's command line).

Fault tolerance has two levels. A lost worker is raygpt's own business: Ray Train restarts the
worker group inside the trial and the loop resumes from the newest verified checkpoint. A trial
whose driver died (or whose Ray Train retry budget ran out) is re-run by Tune
(`tune.FailureConfig`); every trial runs with `resume=1`, so a re-run continues its run directory
instead of refusing it. A trial that raygpt stopped because a restart would meet the same error
(bad input, a stop raygpt decided: `raygpt.errors`) is not re-run: Tune has no per-error retry
policy (its controller re-runs any failed trial while `num_failures <= max_failures`), so the
trial reports the verdict as its last result and `_NoRetryOfStoppedTrials`, a Tune callback on
the sweep's driver, sets that trial's budget to zero before its error arrives. When the sweep's
own driver dies, `resume_sweep` restores Tune's experiment: finished trials stay finished,
unfinished ones continue from their checkpoints.

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

from raygpt.checkpointing import protocol as ck
from raygpt.config import RESUME_MUTABLE_FIELDS, ConfigError, TrainConfig
from raygpt.errors import EXIT_BAD_INPUT
from raygpt.ownership import Lease, check_claim, claim_dir
from raygpt.ray import capacity
from raygpt.ray.driver import RunFailed, cluster_resources, init_ray, run, starts_its_own_ray
from raygpt.ray.trials import (DEFAULT_SCHEDULERS, PLACEMENT_FIELDS, _branch_totals, _plain,
                               check_space, main, pin_for_trials,
                               preflight_sweep, space_items, trial_config)
from raygpt.runlog.history import read_history
from raygpt.schedule import wsd_decay_start
from raygpt.storage import RunDir, join_uri, open_run_dir, read_json_bounded, redact

log = logging.getLogger(__name__)

PLAN_FILE = "sweep.json"
PLAN_FORMAT = "raygpt-sweep"
PLAN_VERSION = 1
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

    def to_dict(self) -> dict:
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, **dataclasses.asdict(self)}


def write_plan(sweep: RunDir, plan: SweepPlan) -> None:
    """sweep.json, with every credential a URI in it carries redacted (`storage.redact`): the
    plan's paths are only for people to read; `read_plan` takes the sweep directory from its
    caller, and the trials get the plan from the driver's memory, not from this file."""
    text = json.dumps(plan.to_dict(), indent=1, sort_keys=True)
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
        raise ConfigError(f"{where}: version: expected {PLAN_VERSION}, found {d.get('version')!r}")
    fields = {f.name for f in dataclasses.fields(SweepPlan)}
    return SweepPlan(**{k: v for k, v in d.items() if k in fields})


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
    be continued later with -y 1. Tune sees the trial finish on its own a step or two later."""

    def __init__(self, *, time_attr: str, max_t: int, **kwargs):
        super().__init__(time_attr=time_attr, max_t=max_t, **kwargs)
        self.time_key, self.max_t = time_attr, max_t
        self.stopping: set = set()  # trial ids whose run was asked to stop

    def on_trial_result(self, tune_controller, trial, result):
        if trial.trial_id in self.stopping or STOPPED_KEY in result:
            # decided already (results until it stops are late), or raygpt's stop verdict,
            # which is not a validation result: the trial's error follows it
            return self.CONTINUE
        decision = super().on_trial_result(tune_controller, trial, result)
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


def seed_branch(plan: SweepPlan, run_dir: RunDir) -> bool:
    """Give a branch trial the shared stable-phase checkpoint, unless its run directory already
    has a verified checkpoint of its own (a retried or restored trial continues from that).
    Returns True when it copied."""
    if ck.find_latest_verified(run_dir, warn=lambda m: None) is not None:
        return False
    stable = open_run_dir(join_uri(plan.sweep_dir, STABLE_DIR))
    ck.copy_checkpoint(stable, run_dir, plan.shared_step)
    return True


def raygpt_trial(config: dict, plan: dict, lineage: str | None = None) -> None:
    """The Tune trainable: one trial = one raygpt run in <sweep>/trials/<trial name>/.

    A run that failed in a way a re-run would repeat (a bad input, a stop raygpt decided) sends
    Tune its verdict as a last result before raising, so the sweep's driver does not re-run
    the trial (`_NoRetryOfStoppedTrials`); any other failure is Tune's to retry."""
    plan = SweepPlan(**{k: v for k, v in plan.items() if k not in ("format", "version")})
    name = tune.get_context().get_trial_name()
    run_dir = join_uri(plan.sweep_dir, f"{TRIALS_DIR}/{name}")
    try:
        adapted: list[str] = []
        cfg = trial_config(TrainConfig.from_dict(plan.base), config, run_dir, notes=adapted)
        if plan.mode == "wsd_branch":
            seed_branch(plan, open_run_dir(run_dir))
        trial_id = tune.get_context().get_trial_id()
        run(cfg, callbacks=(_ValReportsToTune(),), control_name=trial_control_name(trial_id),
            lineage=f"{lineage}/{trial_id}" if lineage else None, what="raygpt sweep trial",
            argv=list(plan.command) or None, cwd=plan.cwd or None, adapted=adapted)
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
    gets the sweep's budget back (a restored sweep's --retry-errored re-runs such trials)."""

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
    status: str
    """done (reached max_steps) | stopped (early-stopped by the scheduler) | error | pending | running"""
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
    """That stop's message."""


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
    pinned = _checked_before_ray(base, space, sweep_dir, settings, ray_address)
    _ensure_ray(ray_address)
    with _sweep_lease(sweep_dir) as lease:
        plan = _new_plan("grid", base, pinned, sweep_dir, settings, lease=lease)
        return _fit(plan, space, lineage=lease.token)


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
    # the stable phase is the shortest branch's config: among the trials checked
    pinned = _checked_before_ray(base, space, sweep_dir, settings, ray_address)
    _ensure_ray(ray_address)
    with _sweep_lease(sweep_dir) as lease:
        plan = _new_plan("wsd_branch", base, pinned, sweep_dir, settings,
                         shared_step=shared, stable_max_steps=totals[0], lease=lease)
        return _fit(plan, space, lineage=lease.token)


def resume_sweep(sweep_dir: str, *, ray_address: str | None = None,
                 retry_errored: bool = False) -> SweepReport:
    """Continue a sweep whose driver died: Tune's experiment is restored (finished trials are not
    run again; unfinished ones continue from their own checkpoints). The plan's base config is
    checked before Ray starts (its files may have changed since); each trial checks its own
    checkpoint when it resumes."""
    plan = read_plan(open_run_dir(_abs(sweep_dir)), _abs(sweep_dir))
    preflight_sweep(TrainConfig.from_dict(plan.base), {}, sweep_dir,
                    on_this_machine=starts_its_own_ray(ray_address))
    _ensure_ray(ray_address)
    with _sweep_lease(sweep_dir) as lease:
        plan = read_plan(open_run_dir(_abs(sweep_dir)), _abs(sweep_dir))
        return _fit(plan, None, restore=True, retry_errored=retry_errored, lineage=lease.token)


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


def _fit(plan: SweepPlan, space: dict | None, *, restore: bool = False,
         retry_errored: bool = False, lineage: str | None = None) -> SweepReport:
    base = TrainConfig.from_dict(plan.base)
    s = plan.settings
    concurrent = s.get("max_concurrent") or max_concurrent_trials(ray.cluster_resources(), base)
    if plan.mode == "wsd_branch":
        run_stable_phase(plan, lineage)
    trainable = tune.with_resources(tune.with_parameters(raygpt_trial, plan=plan.to_dict(),
                                                         lineage=lineage),
                                    TRIAL_DRIVER_RESOURCES)
    tune_fs, tune_root = _tune_storage(plan.sweep_dir)
    if restore:
        tuner = tune.Tuner.restore(f"{tune_root.rstrip('/')}/{TUNE_DIR}", trainable=trainable,
                                   resume_unfinished=True, resume_errored=retry_errored,
                                   storage_filesystem=tune_fs)
    else:
        scheduler = None
        if s["early_stop"] == "asha":
            grace = s.get("grace_period") or _default_grace(base, s["max_t"])
            scheduler = GracefulASHA(
                time_attr="step", max_t=s["max_t"], grace_period=min(grace, s["max_t"]),
                reduction_factor=s["reduction_factor"])
        tuner = tune.Tuner(
            trainable, param_space=space,
            tune_config=tune.TuneConfig(metric="val_loss", mode="min", scheduler=scheduler,
                                        num_samples=s["num_samples"],
                                        max_concurrent_trials=concurrent),
            run_config=tune.RunConfig(
                name=TUNE_DIR, storage_path=tune_root, storage_filesystem=tune_fs,
                failure_config=tune.FailureConfig(max_failures=s["trial_retries"]),
                callbacks=[_NoRetryOfStoppedTrials(s["trial_retries"])]))
    log.info(f"raygpt sweep | {plan.sweep_dir} | mode {plan.mode} | up to {concurrent} concurrent "
             f"trial(s) | early stop {s['early_stop']}" + (" | restored" if restore else ""))
    tuner.fit()
    return summarize(plan.sweep_dir, max_concurrent=concurrent)


def _default_grace(base: TrainConfig, max_t: int) -> int:
    """A quarter of the run, rounded up to a validation step (the only steps Tune hears of)."""
    every = max(1, base.val_every)
    return max(every, math.ceil(max_t / 4 / every) * every)


def run_stable_phase(plan: SweepPlan, lineage: str | None = None) -> int:
    """Train the WSD stable phase once (skipped when its checkpoint at S already verifies) and
    return S. The run is the branches' own config with max_steps = the shortest branch total, so
    its LR up to S is every branch's LR up to S; it checkpoints at S and is stopped there."""
    stable = open_run_dir(join_uri(plan.sweep_dir, STABLE_DIR))
    S = plan.shared_step
    if stable.exists(ck.step_dir(S)) and not ck.verify_checkpoint(stable, S):
        return S
    base = TrainConfig.from_dict(plan.base)
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
    """One row per Tune trial, from Tune's experiment state (config, status, retries) and the
    trial's own loss history (val curve, final step, skips, rewinds), sorted by val loss."""
    plan = read_plan(open_run_dir(sweep_dir), _abs(sweep_dir))
    analysis = tune.ExperimentAnalysis(join_uri(plan.sweep_dir, TUNE_DIR))
    rows = []
    for trial in analysis.trials:
        name = str(trial)
        run_dir = join_uri(plan.sweep_dir, f"{TRIALS_DIR}/{name}")
        records = read_history(open_run_dir(run_dir))
        curve = val_curve(records)
        end = next((r for r in reversed(records) if r.get("kind") == "end"), None)
        last = trial.last_result or {}
        done = end is not None and not end.get("stopped_early", True)
        status = ("done" if done else "stopped" if trial.status == "TERMINATED"
                  else trial.status.lower())
        verdict = _stop_verdict(analysis, trial) if trial.status == "ERROR" else {}
        stopped = verdict.get(STOPPED_KEY)
        src = end if end is not None else last
        rows.append(TrialRow(
            name=name, trial_id=trial.trial_id, status=status,
            overrides={k: _plain(v) for k, v in trial.config.items()},
            val_loss=curve[-1][1] if curve else float("nan"),
            step=src.get("step", curve[-1][0] if curve else None),
            skips=int(src.get("skips", 0)), rewinds=int(src.get("rewinds", 0)),
            # re-runs: every failure but an errored trial's last one was followed by one
            retries=int(trial.num_failures) - (trial.status == "ERROR"), run_dir=run_dir,
            val_curve=curve, stopped=None if stopped is None else int(stopped),
            error=str(verdict.get(STOPPED_MESSAGE_KEY, "")) if stopped is not None else ""))
    rows.sort(key=lambda r: (math.isnan(r.val_loss), r.val_loss))
    return rows


def sweep_status(sweep_dir: str) -> str:
    """`raygpt status SWEEP_DIR`: the plan, every trial's row as of now (the table results.txt
    gets at the end, from Tune's experiment state and the trials' own histories, so a running
    or interrupted sweep shows too), and how to look closer."""
    plan = read_plan(open_run_dir(_abs(sweep_dir)), _abs(sweep_dir))
    head = f"sweep {plan.sweep_dir} | mode {plan.mode}"
    try:
        rows = collect_rows(plan.sweep_dir)
    except ValueError as e:  # Tune has not written its experiment state yet
        return f"{head} | no trial state yet ({' '.join(str(e).split())})"
    counts = ", ".join(f"{n} {status}" for status, n in sorted(Counter(r.status for r in rows).items()))
    ended = open_run_dir(plan.sweep_dir).exists(RESULTS_TXT)
    return "\n".join([
        f"{head} | {len(rows)} trial(s): {counts}" + ("" if ended else " (as of now: no results.txt yet)"),
        format_table(rows),
        f"one trial: raygpt status {join_uri(plan.sweep_dir, TRIALS_DIR)}/<trial>"])


def _stop_verdict(analysis, trial) -> dict:
    """The result in which raygpt stopped an errored trial ({} when it did not): usually its last
    result, but a validation result forwarded by the run's Ray Train controller (another process)
    can reach Tune after the trial's own verdict, so the trial's results are searched, newest
    first."""
    last = trial.last_result or {}
    if last.get(STOPPED_KEY) is not None:
        return last
    frame = analysis.trial_dataframes.get(trial.trial_id)
    if frame is None or STOPPED_KEY not in frame:
        return {}
    rows = frame[frame[STOPPED_KEY].notna()]
    return {} if rows.empty else rows.iloc[-1].to_dict()


def val_curve(records: list[dict]) -> list[tuple[int, float]]:
    """[(step, val_loss)] ascending, the latest record of each step winning (a step validated
    again after a resume or rewind)."""
    latest = {}
    for r in records:
        if r.get("kind") == "val":
            latest[int(r["step"])] = float(r["val_loss"])
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
    return out


def plot_val_curves(rows: list[TrialRow], path: str, *, stable_curve=None, title: str = "") -> str | None:
    """PNG of validation loss against step, one line per trial. matplotlib is optional (the
    `plot` extra): without it no plot is written and None is returned."""
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
    fig.savefig(path, format="png")
    return path


def stable_curve(plan: SweepPlan) -> list[tuple[int, float]] | None:
    """The WSD stable phase's validation curve (branch mode: drawn under the branches'), else None."""
    if plan.mode != "wsd_branch":
        return None
    return val_curve(read_history(open_run_dir(join_uri(plan.sweep_dir, STABLE_DIR))))


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
    return plot_val_curves(rows, out, stable_curve=stable_curve(plan),
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
        plot_path = plot_val_curves(rows, str(sweep.local_path(PLOT)), stable_curve=stable_curve(plan),
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
        return resume_sweep(base.output_dir, ray_address=ns.address,
                            retry_errored=ns.retry_errored)
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
    sys.exit(main())
