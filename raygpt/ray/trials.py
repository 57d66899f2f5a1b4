"""A sweep's trial configs and its command line, without Ray running: what `raygpt sweep`
checks before Ray Tune and torch (seconds of imports) are loaded, asking Ray nothing but this
machine's CPU count (raygpt.ray.capacity).

- `pin_for_trials` / `trial_config`: the base every trial overrides (hardware resolved on the
  driver, paths absolute) and one trial's run config (`base.with_overrides(trial_config)`);
- `expand_trials` / `check_trials`: the sweep's trials made concrete (named, every random
  domain drawn) before Tune starts, as sweep.json stores them, and that list checked when it is
  read back from the (shared, writable by others) sweep directory;
- `known_trial_points` / `preflight_sweep`: every trial config that can be known before Tune
  samples (grid values and choice categories crossed, the ends of numeric ranges) through the
  single run's driver-side checks (raygpt.config.preflight), and the sweep directory's filesystem;
- the command line's parser (`build_sweep_parser`, `space_items`): the sweep's flags, every
  other flag a `raygpt train` flag of the base config (raygpt.ray.sweep_command runs it).

A search-space entry is read by its shape (a {"grid_search": [...]} dict, an object with
`categories`, or with `lower` and `upper`), so this module needs no Tune import.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re

import numpy as np

from raygpt.config import preflight
from raygpt.config import (FILE_REFUSED, SCHEDULERS, ConfigError, FlagParser, SpikeConfig, TrainConfig,
                           absolute_paths, check_file_fields)
from raygpt.ray import capacity

# Fields that place or arm a run, not configure it: the sweep's own command line gives them
# (never a search-space key, nor a stored trial's overrides: sweep.json is a file, and a file may
# not set them) and best_config.json leaves them out.
PLACEMENT_FIELDS = FILE_REFUSED
# A trial's name, which is also its run directory under <sweep>/trials/ (so never a path).
TRIAL_NAME_RE = re.compile(r"^trial_[0-9]{3,9}$")
# Known trial configs checked before Ray starts, at most (a larger product is checked one
# search-space key at a time against the base).
MAX_PREFLIGHT_POINTS = 4096
# flag -> how its KEY=V1,V2 values are sampled (ranges take LO,HI)
SPACE_FLAGS = ("grid", "choice", "uniform", "loguniform")


def abs_dir(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


# ====================================================================== configs (pure)

def pin_for_trials(base: TrainConfig, gpus_available: int | None,
                   cpus_available: int | None = None) -> TrainConfig:
    """The base every trial overrides: hardware defaults resolved here on the driver (a Tune trial
    actor holds no GPU, so it would resolve to CPU), and paths made absolute (trials run with
    their Tune trial directory as working directory). total_batch_size=-1 stays -1, and the
    validation batches stay unset unless given, so a trial that changes B or T still gets
    B*T*world tokens per step and validation batches fitted to its own B and T."""
    resolved = absolute_paths(base).resolve(gpus_available=gpus_available,
                                            cpus_available=cpus_available)
    return resolved.with_overrides({"total_batch_size": base.total_batch_size,
                                    "val_batch_size": base.val_batch_size,
                                    "val_batches": base.val_batches})


def _plain(value):
    """Tune samples numpy scalars; configs and manifests hold plain Python values."""
    return value.item() if isinstance(value, np.generic) else value


def trial_config(base: TrainConfig, overrides: dict, run_dir: str,
                 notes: list[str] | None = None, fresh: bool = False) -> TrainConfig:
    """A trial's run config: base + the trial's overrides, in its own run directory, resumable
    (-y 1) unless `fresh` (its first attempt: nothing to resume, nothing to say about it).
    `notes` gets what resolving adapted to the data (as for a single run)."""
    cfg = base.with_overrides({k: _plain(v) for k, v in overrides.items()})
    cfg = cfg.with_overrides({"output_dir": run_dir, "resume": 0 if fresh else 1})
    # every hardware field is pinned already; gpus_available only satisfies resolve()'s check
    return cfg.resolve(gpus_available=cfg.num_workers if cfg.device == "gpu" else 0, notes=notes)


def check_space(base: TrainConfig, space: dict) -> None:
    """Every key of a search space must name a TrainConfig field ('spike.x' for SpikeConfig)."""
    if not isinstance(space, dict) or not space:
        raise ConfigError(f"search space: expected a non-empty dict of TrainConfig overrides, "
                          f"found {space!r}")
    current = base.to_dict()
    for key in space:
        if key in PLACEMENT_FIELDS:
            raise ConfigError(f"search space key {key!r}: the sweep sets it for every trial "
                              f"(expected a training field)")
        value = current["spike"].get(key[6:]) if key.startswith("spike.") else current.get(key)
        base.with_overrides({key: value})  # raises ConfigError naming an unknown key
        # sweep.json stores the space's values: a URI there may not carry options either
        for known in known_values(space[key]) or []:
            check_file_fields({key: known}, "search space")


def trial_name(index: int) -> str:
    return f"trial_{index:03d}"


def expand_trials(space: dict, num_samples: int, seed: int) -> list[dict]:
    """The sweep's trials, made concrete before Tune starts: [{"name", "overrides"}], every
    combination of the grid values, `num_samples` times (Tune's own order: each sample runs the
    whole grid), each random domain (choice, uniform, loguniform...) drawn with its own
    `.sample()` from one RNG seeded with `seed`. The list is stored in sweep.json, so which
    trials exist and what each overrides is raygpt's own JSON, never Tune's state."""
    if num_samples < 1:
        raise ConfigError(f"--num-samples: expected >= 1, found {num_samples}")
    rng = np.random.default_rng(seed)
    grid = [k for k, v in space.items() if isinstance(v, dict) and "grid_search" in v]
    points = [{}]
    for key in grid:
        points = [{**p, key: v} for p in points for v in space[key]["grid_search"]]
    out = []
    for _ in range(num_samples):
        for point in points:
            overrides = {}
            for key, value in space.items():
                if key in point:
                    overrides[key] = _plain(point[key])
                elif hasattr(value, "sample") and known_values(value) is not None:
                    overrides[key] = _plain(value.sample(random_state=rng))
                elif isinstance(value, (bool, int, float, str)) or value is None:
                    overrides[key] = value
                else:
                    raise ConfigError(f"search space key {key!r}: expected a grid, a choice, a "
                                      f"numeric range or a constant, found {value!r}")
            out.append({"name": trial_name(len(out)), "overrides": overrides})
    return out


def check_trials(base: TrainConfig, trials, where: str) -> list[dict]:
    """A stored trial list (`expand_trials`' shape) checked as untrusted input: every name a
    TRIAL_NAME_RE (it becomes a directory), unique, every override a training field of a type
    it takes (no PLACEMENT_FIELDS). ConfigError naming `where` and the trial."""
    if not isinstance(trials, list):
        raise ConfigError(f"{where}: expected a list of trials, found {type(trials).__name__}")
    seen = set()
    for i, t in enumerate(trials):
        name = t.get("name") if isinstance(t, dict) else None
        if not isinstance(name, str) or not TRIAL_NAME_RE.match(name) or name in seen:
            raise ConfigError(f"{where}[{i}]: name: expected a new name like 'trial_000', found "
                              f"{name!r}")
        seen.add(name)
        overrides = t.get("overrides")
        if not isinstance(overrides, dict):
            raise ConfigError(f"{where}[{i}] ({name}): overrides: expected an object, found "
                              f"{type(overrides).__name__}")
        try:
            check_space(base, overrides)
            check_file_fields(overrides, "overrides")
            base.with_overrides(overrides)
        except ConfigError as e:
            raise ConfigError(f"{where}[{i}] ({name}): {e}") from None
    return trials


def known_values(value) -> list | None:
    """The values a search-space entry can take that are known before Tune samples: a grid's
    values, a choice's categories, a numeric range's two ends (checks on sizes and positivity
    are monotone in them), a constant itself; None for what only sampling tells
    (tune.sample_from, functions)."""
    if isinstance(value, dict) and "grid_search" in value:
        return list(value["grid_search"])
    if hasattr(value, "categories"):
        return list(value.categories)
    if hasattr(value, "lower") and hasattr(value, "upper"):
        # tune.randint's upper bound is exclusive
        upper = value.upper - 1 if type(value).__name__ == "Integer" else value.upper
        return [value.lower, upper]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return [value]
    return None


def known_trial_points(space: dict) -> list[dict]:
    """Every combination of the space's known values (`known_values`), as override dicts; the
    base alone ({}) when nothing is known. Past MAX_PREFLIGHT_POINTS combinations, one key at a
    time instead (each value against the base)."""
    keys = [k for k in space if known_values(space[k]) is not None]
    values = [known_values(space[k]) for k in keys]
    if math.prod(len(v) for v in values) > MAX_PREFLIGHT_POINTS:
        return [{}] + [{k: v} for k, vs in zip(keys, values) for v in vs]
    points = [{}]
    for key, vals in zip(keys, values):
        points = [{**p, key: v} for p in points for v in vals]
    return points


def preflight_sweep(pinned: TrainConfig, space: dict, sweep_dir: str, *,
                    on_this_machine: bool = False) -> list[TrainConfig]:
    """The single run's driver-side checks (raygpt.config.preflight) on every trial config known up
    front (`on_this_machine`: its workers against the Ray the sweep starts here, too), and the
    sweep directory's filesystem; ConfigError in one line naming the trial's overrides. Needs
    no running Ray: run it before Ray starts. Returns the configs checked."""
    checked = []
    for point in known_trial_points(space):
        where = " ".join(f"{k}={_plain(v)}" for k, v in point.items()) or "the base config"
        try:
            cfg = trial_config(pinned, point, f"{abs_dir(sweep_dir).rstrip('/')}/trials/preflight")
            if on_this_machine:  # a trial wider than it would wait for its workers forever
                preflight.check_fits_this_machine(cfg, capacity.this_machine(cfg))
            preflight.check_model(cfg)
            preflight.check_data(cfg)
            preflight.check_trackers(cfg)
        except ConfigError as e:
            raise ConfigError(f"trial {where}: {e}") from None
        checked.append(cfg)
    preflight.check_run_dir(pinned.with_overrides({"output_dir": abs_dir(sweep_dir)}))
    return checked



# ====================================================================== command line

SWEEP_EXIT_CODES = """exit status:
  0  a best trial exists (results.txt, best_config.json)
  1  no trial finished
  2  bad input: a trial config, a flag or the sweep directory refused before Ray started, or
     every trial stopped by a bad input (such a trial is not re-run: it would fail again)"""


def build_sweep_parser(prog: str = "raygpt sweep") -> argparse.ArgumentParser:
    p = FlagParser(
        prog=prog, allow_abbrev=False, add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SWEEP_EXIT_CODES,
        description="Ray Tune sweep over raygpt runs; every other flag is a raygpt train flag "
                    "(the base config) and -o is the sweep directory, -y 1 resumes it.")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="grid search over a TrainConfig field ('spike.soft_z' style for the spike monitor)")
    p.add_argument("--choice", action="append", default=[], metavar="KEY=V1,V2",
                   help="random choice among the values, --num-samples draws")
    p.add_argument("--uniform", action="append", default=[], metavar="KEY=LO,HI",
                   help="uniform in [LO, HI]")
    p.add_argument("--loguniform", action="append", default=[], metavar="KEY=LO,HI",
                   help="log-uniform in [LO, HI] (learning rates)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="samples of the space (each grid point N times) (default: 1)")
    p.add_argument("--early-stop", choices=("asha", "none"), default="asha",
                   help="ASHA on validation loss, or none (default: asha)")
    p.add_argument("--grace-period", type=int, default=None, metavar="STEPS",
                   help="steps before ASHA may stop a trial (default: a quarter of -x, rounded up to a validation step)")
    p.add_argument("--reduction-factor", type=float, default=2.0, metavar="X",
                   help="ASHA's reduction factor (default: 2.0)")
    p.add_argument("--max-concurrent", type=int, default=None, metavar="N",
                   help="trials at once (default: as many as the cluster's GPUs or CPUs fit)")
    p.add_argument("--trial-retries", type=int, default=2, metavar="N",
                   help="times Tune re-runs a failed trial from its checkpoint; never a trial "
                        "whose error would recur (bad input, raygpt's own stop) (default: 2)")
    p.add_argument("--wsd-branches", default=None, metavar="N1,N2,...",
                   help="WSD branch mode: branch totals (max_steps) sharing one stable phase")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--retry-errored", action="store_true", help="with -y 1: re-run errored trials too")
    return p


def _field_type(key: str) -> type:
    """bool, int, float or str: the type a TrainConfig (or 'spike.x' SpikeConfig) field holds,
    read from its annotation ('int | None' is int), so unresolved fields coerce right too."""
    cls, name = (SpikeConfig, key[6:]) if key.startswith("spike.") else (TrainConfig, key)
    ann = next((str(f.type) for f in dataclasses.fields(cls) if f.name == name), None)
    if ann is None:
        raise ConfigError(f"unknown config field {key!r} in the search space")
    parts = {p.strip() for p in ann.split("|")}
    return next((t for t in (bool, int, float) if t.__name__ in parts), str)


def _coerce(key: str, text: str):
    """A command-line value in the type of the field it overrides."""
    typ = _field_type(key)
    if typ is bool:
        if text.lower() not in ("0", "1", "true", "false"):
            raise ConfigError(f"{key}: expected true/false, found {text!r}")
        return text.lower() in ("1", "true")
    try:
        return typ(text)
    except ValueError:
        raise ConfigError(f"{key}: expected {typ.__name__}, found {text!r}") from None


def space_items(ns) -> list[tuple[str, str, list]]:
    """(flag, key, values) of every --grid/--choice/--uniform/--loguniform, values in their
    fields' types (ranges as two floats, LO and HI)."""
    out = []
    for flag in SPACE_FLAGS:
        for item in getattr(ns, flag):
            key, sep, values = item.partition("=")
            if not sep or not values:
                raise ConfigError(f"--{flag} {item!r}: expected KEY=V1,V2,...")
            vals = [_coerce(key, v) for v in values.split(",")]
            if flag in ("uniform", "loguniform"):
                if len(vals) != 2:
                    raise ConfigError(f"--{flag} {item!r}: expected KEY=LO,HI")
                vals = [float(v) for v in vals]
            out.append((flag, key, vals))
    return out


def known_space(items: list[tuple[str, str, list]]) -> dict:
    """The command line's space as known values only (every entry a grid of what it can take:
    a range's two ends), for `known_trial_points`."""
    return {key: {"grid_search": vals} for _, key, vals in items}


def _branch_totals(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"--wsd-branches {text!r}: expected N1,N2,... (integers)") from None


# a sweep without a space compares every schedule raygpt.train.schedule has
DEFAULT_SCHEDULERS = SCHEDULERS

