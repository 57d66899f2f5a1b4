"""What a sweep tells a person, from raygpt's JSON only (the plan, the ledger and the trials' own
loss histories: `sweep_plan.trial_rows`), no Ray: results.txt, results.json, best_config.json
and val_loss.png when the sweep ends (`summarize`), and `raygpt status` / `raygpt plot` of a
sweep directory at any time (`sweep_status`, `plot_sweep`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import shlex
import types
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from raygpt.config import TrainConfig, absolute_paths, stored_fields
from raygpt.ray.sweep_plan import (BEST_CONFIG, PLAN_FILE, PLOT, RESULTS_JSON, RESULTS_TXT,
                                   STABLE_DIR, TRIALS_DIR, SweepPlan, TrialRow, _abs, read_ledger,
                                   read_plan, trial_progress, trial_rows)
from raygpt.ray.trials import PLACEMENT_FIELDS, _plain
from raygpt.storage import RunDir, join_uri, open_run_dir, redact, store_png
from raygpt.train.errors import EXIT_BAD_INPUT

log = logging.getLogger(__name__)

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


def _opened(sweep_dir: str) -> tuple[RunDir, SweepPlan]:
    """The sweep directory, opened once, and its plan (which names the trials by URI: strings,
    as the trials' own runs get them)."""
    sweep = open_run_dir(_abs(sweep_dir))
    return sweep, read_plan(sweep, _abs(sweep_dir))


def for_directory(directory: RunDir, not_a_run: FileNotFoundError):
    """What `raygpt status` / `raygpt plot` call for a directory holding no run (`sweep_status`,
    `plot_sweep`) when it holds a sweep's plan (sweep.json); else `not_a_run` again."""
    if not directory.exists(PLAN_FILE):
        raise not_a_run
    return types.SimpleNamespace(sweep_status=sweep_status, plot_sweep=plot_sweep)


def collect_rows(sweep_dir: str) -> list[TrialRow]:
    """One row per trial of the plan, sorted by val loss: `trial_rows` of the sweep directory."""
    return _rows(*_opened(sweep_dir))


def _rows(sweep: RunDir, plan: SweepPlan) -> list[TrialRow]:
    rows = trial_rows(plan, read_ledger(sweep))
    rows.sort(key=lambda r: (math.isnan(r.val_loss), r.val_loss))
    return rows


def sweep_status(sweep_dir: str) -> str:
    """`raygpt status SWEEP_DIR`: the plan, every trial's row as of now (the table results.txt
    gets at the end, from the plan, the ledger and the trials' own histories, so a running or
    interrupted sweep shows too), and how to look closer."""
    sweep, plan = _opened(sweep_dir)
    head = f"sweep {plan.sweep_dir} | mode {plan.mode}"
    rows = _rows(sweep, plan)
    counts = ", ".join(f"{n} {status}" for status, n in sorted(Counter(r.status for r in rows).items()))
    ended = sweep.exists(RESULTS_TXT)
    unreadable = [f"{r.name}: {r.error}" for r in rows if r.status == "unreadable"]
    return "\n".join([
        f"{head} | {len(rows)} trial(s)" + (f": {counts}" if counts else "")
        + ("" if ended else " (as of now: no results.txt yet)"),
        format_table(rows), *unreadable,
        f"one trial: raygpt status {join_uri(plan.sweep_dir, TRIALS_DIR)}/<trial>"])


def format_table(rows: list[TrialRow]) -> str:
    # the val loss beside the step it was measured at; `steps`: how far the run trained (an
    # early-stopped trial may have trained past its last validation)
    head = ("#", "trial", "status", "config", "val_loss", "val_step", "steps", "skips", "rewinds",
            "retries")
    lines = [head]
    for i, r in enumerate(rows, 1):
        config = " ".join(f"{k}={v}" for k, v in sorted(r.overrides.items()))
        lines.append((str(i), r.name, r.status, config, f"{r.val_loss:.4f}",
                      "-" if r.val_step is None else str(r.val_step),
                      "-" if r.step is None else str(r.step), str(r.skips), str(r.rewinds),
                      str(r.retries)))
    widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in lines)


def best_config(user_base: TrainConfig, overrides: dict, cwd: str = "") -> dict:
    """The TrainConfig overrides that reproduce a trial from the defaults: every field of the
    user's base + the trial's overrides that differs from TrainConfig()'s defaults, without the
    fields that only place a run ('spike.x' keys for SpikeConfig). Hardware fields left at None
    stay None, so `--config FILE` resolves them for the machine it runs on. Local paths are made
    absolute against `cwd` (the sweep driver's working directory), so the file means the same
    data from any directory."""
    cfg = absolute_paths(user_base.with_overrides({k: _plain(v) for k, v in overrides.items()}),
                         cwd)
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


def train_command(best_path: str, local: bool) -> str:
    """The command that trains a sweep's best config on its own, from any directory (the file's
    paths are absolute); --config reads a local file, so a bucket's is copied here first."""
    if local:
        return f"raygpt train --config {shlex.quote(best_path)}"
    return f"raygpt train --config FILE, FILE a local copy of {best_path}"


def plot_val_curves(rows: list[TrialRow], sweep: RunDir, path: str, *, stable_curve=None,
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
    store_png(sweep, path, png.getvalue())
    return path


def stable_curve(plan: SweepPlan) -> list[tuple[int, float]] | None:
    """The WSD stable phase's validation curve (branch mode: drawn under the branches'), else None."""
    if plan.mode != "wsd_branch":
        return None
    return trial_progress(open_run_dir(join_uri(plan.sweep_dir, STABLE_DIR)))[0]  # the plan's URI


def plot_sweep(sweep_dir: str, out: str | None) -> tuple[str | None, int]:
    """`raygpt plot SWEEP_DIR`: every trial's validation curve as of now (the plot the sweep's
    end writes as val_loss.png), into `out` (default: that file in a local sweep directory,
    <sweep name>_val_loss.png here for a remote one). Returns (the path or None without
    matplotlib, the number of trials)."""
    sweep, plan = _opened(sweep_dir)
    rows = _rows(sweep, plan)
    name = Path(plan.sweep_dir).name
    if out is None:
        out = str(sweep.local_path(PLOT)) if sweep.caps.local_paths else f"{name or 'sweep'}_{PLOT}"
    return plot_val_curves(rows, sweep, out, stable_curve=stable_curve(plan),
                           title=f"{name}: validation loss"), len(rows)


def summarize(sweep_dir: str, *, max_concurrent: int = 0) -> SweepReport:
    """Write results.txt/.json, best_config.json and val_loss.png; print the table."""
    sweep, plan = _opened(sweep_dir)
    rows = _rows(sweep, plan)
    table = format_table(rows)
    sweep.write_bytes_atomic(RESULTS_TXT, redact(table + "\n").encode())
    sweep.write_bytes_atomic(RESULTS_JSON, redact(json.dumps(
        [dataclasses.asdict(r) for r in rows], indent=1, default=str)).encode())
    # a finished trial, else an early-stopped one; never one that failed (its config may not run)
    best = next((r for r in rows if r.status == "done"), None) or next(
        (r for r in rows if r.status != "error" and not math.isnan(r.val_loss)), None)
    best_path = None
    if best is not None:
        cfg = best_config(TrainConfig.from_dict(plan.user_base), best.overrides, plan.cwd)
        sweep.write_bytes_atomic(BEST_CONFIG, (json.dumps(cfg, indent=1, sort_keys=True) + "\n").encode())
        best_path = sweep.uri(BEST_CONFIG)
    plot_path = None
    if sweep.caps.local_paths:
        plot_path = plot_val_curves(rows, sweep, str(sweep.local_path(PLOT)),
                                    stable_curve=stable_curve(plan),
                                    title=f"{Path(plan.sweep_dir).name}: validation loss")
    log.info(f"raygpt sweep | {len(rows)} trial(s), by validation loss:\n{table}")
    for r in rows:
        if r.stopped is not None:
            log.info(f"raygpt sweep | {r.name}: not re-run ({'bad input' if r.stopped == EXIT_BAD_INPUT else 'raygpt stopped it'}): "
                     f"{r.error}")
    if best is not None:
        log.info(f"raygpt sweep | best: {best.name} ({best.val_loss:.4f}); train it on its own: "
                 f"{train_command(best_path, sweep.caps.local_paths)}")
    return SweepReport(sweep_dir=plan.sweep_dir, rows=rows, best=best, best_config_path=best_path,
                       plot_path=plot_path, table=table, max_concurrent=max_concurrent)
