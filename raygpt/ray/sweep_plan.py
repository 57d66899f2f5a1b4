"""Ray Tune sweeps over raygpt runs: the plan, its ledger and the trials' rows (no Ray).

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

The trials are concrete before Tune starts (`trials.expand_trials`: the grid crossed, each random
domain drawn from an RNG seeded with the base's seed) and stored in sweep.json; Tune gets a
grid over their names (`{"trial": grid_search([...])}`), each name its trial's Tune and run
directory name, so which trials exist and where each one's run lives is known from raygpt's JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from raygpt.config import ConfigError, config_read_back, stored_fields
from raygpt.ray.trials import TRIAL_NAME_RE, check_trials
from raygpt.runlog.history import iter_history
from raygpt.storage import RunDir, join_uri, open_run_dir, read_json_bounded, redact

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


# ====================================================================== the trials' rows

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
    val_step: int | None = None
    """The step `val_loss` was measured at (the run may have trained past it: `step`)."""


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
            curve, end = trial_progress(open_run_dir(run_dir))  # the URI its trial's run got
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
            error=entry["error"] if errored and entry["stopped"] is not None else problem,
            val_step=curve[-1][0] if curve else None))
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


def val_curve(records: list[dict]) -> list[tuple[int, float]]:
    """[(step, val_loss)] ascending, the latest record of each step winning (a step validated
    again after a resume or rewind); a record whose fields are not numbers is left out."""
    latest = {}
    for r in records:
        if r.get("kind") == "val" and (point := _val_point(r)) is not None:
            latest[point[0]] = point[1]
    return sorted(latest.items())


def _abs(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)
