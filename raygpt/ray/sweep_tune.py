"""The Tune runner of a sweep: the sweep's driver, its Tune callbacks and each trial's trainable.

A search space is a dict of `TrainConfig` overrides (`{"scheduler": tune.grid_search([...]),
"spike.soft_z": tune.choice([...]), "learning_rate": tune.loguniform(...)}`): each trial's config
is `base.with_overrides(trial_config)`, so there is no second config system.

How a trial runs (Ray Train V2's documented Train-inside-Tune pattern): the Tune trial is a small
driver (`raygpt_trial`) that builds the same `TorchTrainer` a single run builds (`train_func`,
`CheckpointFinalizer`, `FailureConfig(cfg.max_failures)`, the run directory as Ray's experiment
directory) and forwards the loop's validation reports to Tune (`TuneReportCallback`). The trial
driver reserves no CPU or GPU (only a token amount of memory, because a Tune bundle cannot be
empty), so the cluster's CPUs or GPUs go to the training workers, and `max_concurrent_trials` is
the number of trials whose workers fit at once.

Before Ray starts (raygpt/ray/trials.py holds the configs and the command line, and imports no
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys

import ray
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from raygpt.artifacts import signed_file
from raygpt.artifacts.signed_file import ArtifactKey
from raygpt.config import (ConfigError, TrainConfig, command_line_only, shards_with_endpoint,
                           without_command_line_only)
from raygpt.ray.knobs import RayConfig
from raygpt.ray import capacity
from raygpt.ray.driver import RunFailed, cluster_resources, init_ray, run, starts_its_own_ray
from raygpt.ray.sweep_asha import GracefulASHA, _default_grace, trial_control_name
from raygpt.ray.sweep_console import TUNE_VERBOSE, TrialConsole, trial_label
from raygpt.ray.sweep_plan import (PLAN_FILE, STOPPED_KEY, STOPPED_MESSAGE_KEY, TRIALS_DIR,
                                   TUNE_DIR, SweepPlan, _abs, ledger_entry, read_ledger,
                                   read_plan, trial_rows, write_ledger, write_plan)
from raygpt.ray.sweep_results import SweepReport, summarize
from raygpt.ray.sweep_wsd import (check_branch_space, run_stable_phase, seed_branch,
                                  shared_stable_step)
from raygpt.ray.trials import (DEFAULT_SCHEDULERS, _branch_totals, check_space, expand_trials,
                               pin_for_trials, preflight_sweep, space_items, trial_config)
from raygpt.storage import RunDir, join_uri, open_run_dir, redact
from raygpt.storage.ownership import Lease, check_claim, claim_dir
from raygpt.train.errors import EXIT_BAD_INPUT

log = logging.getLogger(__name__)

# What the loop reports at every validation (loop.py: session.report_metrics); Tune sees these.
VAL_KEYS = ("step", "val_loss", "skips", "rewinds")


# A Tune trial is only the driver of its Ray Train run: it needs no CPU or GPU of its own, but a
# Tune bundle may not be empty, so it reserves a token 1 MiB of memory.
TRIAL_DRIVER_RESOURCES = {"memory": 1 << 20}


# ====================================================================== the sweep driver

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
    sweep = open_run_dir(_abs(sweep_dir))
    pinned = _checked_before_ray(base, space, sweep_dir, sweep, settings, ray_address)
    _ensure_ray(ray_address)
    with _sweep_lease(sweep) as lease:
        plan = _new_plan("grid", without_command_line_only(base), without_command_line_only(pinned),
                         sweep_dir, sweep, settings, lease=lease, trials=trials)
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
    sweep = open_run_dir(_abs(sweep_dir))
    pinned = _checked_before_ray(base, space, sweep_dir, sweep, settings, ray_address)
    _ensure_ray(ray_address)
    with _sweep_lease(sweep) as lease:
        plan = _new_plan("wsd_branch", without_command_line_only(base),
                         without_command_line_only(pinned), sweep_dir, sweep, settings,
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
    sweep = open_run_dir(_abs(sweep_dir))
    check_claim(sweep, "sweep", sweep_dir, holds=_holds_sweep, resume=True)
    plan = read_plan(sweep, _abs(sweep_dir))
    preflight_sweep(TrainConfig.from_dict(plan.base).with_overrides(command_line), {}, sweep_dir,
                    on_this_machine=starts_its_own_ray(ray_address))
    _ensure_ray(ray_address)
    with _sweep_lease(sweep) as lease:
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
    from raygpt.config import mixture  # -i: one glob, or each source of a mix
    if isinstance(base.get("input_bin"), str):
        base["input_bin"] = mixture.with_patterns(
            base["input_bin"], lambda flag, p: shards_with_endpoint(flag, p, endpoint))
    if isinstance(base.get("input_val_bin"), str):
        base["input_val_bin"] = shards_with_endpoint("-j/--input-val-bin", base["input_val_bin"],
                                                     endpoint)
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


def _checked_before_ray(base: TrainConfig, space: dict, sweep_dir: str, sweep: RunDir,
                        settings: dict, ray_address: str | None) -> TrainConfig:
    """The base pinned for the trials, with the settings and every known trial config checked
    (`preflight_sweep`), all before this process starts a Ray of its own; sets settings['max_t']."""
    # the sweep directory first: one that is not this user's is refused before anything is written
    check_claim(sweep, "sweep", sweep_dir, holds=_holds_sweep, overwrite=base.overwrite)
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
def _sweep_lease(sweep: RunDir):
    """The sweep directory's lease, held by this sweep driver (a second driver on the same
    directory is refused) and renewed while the sweep runs; its token is the lineage of the
    trials' own leases."""
    lease = Lease(sweep, what="raygpt sweep")
    lease.acquire()
    try:
        lease.start_heartbeat()
        yield lease
    finally:
        lease.release()


def _new_plan(mode: str, base: TrainConfig, pinned: TrainConfig, sweep_dir: str, sweep: RunDir,
              settings: dict, lease: Lease | None = None, **wsd) -> SweepPlan:
    """Claim the sweep directory (new or empty, or this user's sweep with --overwrite: a run's
    own rule, `ownership.claim_dir`), write sweep.json (`pinned`: the checked base)."""
    claim_dir(sweep, "sweep", sweep_dir, holds=_holds_sweep, overwrite=base.overwrite, lease=lease)
    plan = SweepPlan(sweep_dir=_abs(sweep_dir), mode=mode, user_base=base.to_dict(), base=pinned.to_dict(),
                     settings=settings, command=list(getattr(sys, "orig_argv", sys.argv)),
                     cwd=os.getcwd(), **wsd)
    write_plan(sweep, plan)
    return plan


def _holds_sweep(sweep: RunDir) -> bool:
    return sweep.exists(PLAN_FILE) or sweep.exists(TUNE_DIR)


def max_concurrent_trials(cluster: dict, per_trial: RayConfig) -> int:
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


# ====================================================================== Tune

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
    sweep = open_run_dir(plan.sweep_dir)  # the plan's string: what each trial gets (pickled)
    tune_fs, tune_root = _tune_storage(sweep)
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
            verbose=TUNE_VERBOSE,  # raygpt's lines instead (raygpt.ray.sweep_console)
            callbacks=[_NoRetryOfStoppedTrials(s["trial_retries"]),
                       TrialLedger(sweep, ledger if ledger is not None else {}),
                       TrialConsole({t["name"]: trial_label(t["name"], t["overrides"])
                                     for t in plan.trials})]))
    log.info(f"raygpt sweep | {plan.sweep_dir} | mode {plan.mode} | {len(names)} trial(s), up to "
             f"{concurrent} concurrent | early stop {s['early_stop']} | Tune experiment {experiment}/")
    tuner.fit()
    return summarize(plan.sweep_dir, max_concurrent=concurrent)


def _trial_name(trial) -> str:
    """A trial's Tune name and directory: its sweep name, which is also its run directory's."""
    return trial.config["trial"]


def _tune_storage(sweep: RunDir) -> tuple:
    """(storage_filesystem, storage_path) for Tune: on an object store, the filesystem raygpt
    opened (its endpoint and bounded timeouts) and the plain path, as the single-run driver
    gives Ray Train (`driver._split_storage`); Tune would open a URI string with the store's
    defaults."""
    if sweep.caps.local_paths:
        return None, str(sweep.local_path())
    return sweep.fs, sweep.root


class TrialLedger(tune.Callback):
    """Writes ledger.json as Tune reports each trial's start, failure, end and raygpt's stop
    verdict: what `raygpt status` and `resume_sweep` know of a trial besides its run directory,
    in raygpt's JSON rather than in Tune's (pickled) experiment state."""

    def __init__(self, sweep: RunDir, entries: dict):
        self.sweep, self.entries = sweep, entries

    def _update(self, trial, **changes) -> None:
        entry = self.entries.setdefault(trial.config["trial"], ledger_entry())
        entry.update(changes, trial_id=trial.trial_id)
        write_ledger(self.sweep, self.entries)

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


# ====================================================================== one trial: one run under Ray Train

class _ValReportsToTune(TuneReportCallback):
    """Forwards the loop's validation reports, and only those, to the Tune trial: checkpoint
    reports and the final summary carry other keys, and Tune's scheduler needs val_loss in
    every result it sees."""

    def after_report(self, run_context, metrics, checkpoint):
        m = metrics[0]
        if "val_loss" not in m or "checkpoint_step" in m or m.get("final"):
            return
        super().after_report(run_context, [{k: m[k] for k in VAL_KEYS if k in m}], None)


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
        # a trial's first attempt (no run directory yet) starts fresh; a re-run (Tune's retry,
        # -y 1) and a WSD branch (seeded from the stable phase) resume their run directory
        trial_dir = open_run_dir(run_dir)  # the trial's run opens its own from cfg.output_dir
        cfg = trial_config(base, overrides, run_dir, notes=adapted,
                           fresh=plan.mode != "wsd_branch" and not trial_dir.exists())
        if plan.mode == "wsd_branch":
            seed_branch(plan, trial_dir)
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
