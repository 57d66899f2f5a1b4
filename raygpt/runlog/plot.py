"""`raygpt plot RUN_DIR`: a PNG of a run (train/val loss, lr, grad norm and tok/s, its events
marked; `plot_series`, a pure function of the view `run_view.load_run` reads); of a sweep
directory, every trial's validation curve. A step trained more than once appears once, its
latest attempt winning; the earlier attempts are drawn faintly so a rewound spike stays visible.

`plot_run` returns the series read back from the artists it drew (not the inputs it was given),
so a test checks what is actually on the picture. matplotlib is optional (`pip install
'raygpt[plot]'`).
"""

from __future__ import annotations

import argparse
import io
import math
import sys

from raygpt.config.flag_hints import HintingParser
from raygpt.runlog.history import LOSS_HISTORY
from raygpt.runlog.run_view import (Progress, RunView, _is_number, _is_step, _open_checked,
                                    _stderr_progress, _storage_flags, _sweep_module, _verify_flags,
                                    load_run, run_state, throughput)
from raygpt.storage import RunDir, open_run_dir, store_png
from raygpt.runlog.terminal import printable


def plot_series(view: RunView) -> dict[str, tuple[list, list]]:
    """The (x, y) data of every series the plot draws (pure). Markers without a y value of
    their own (failures, resumes, rewinds, checkpoints) are vertical lines or ticks: y is []."""
    steps = sorted(view.train)
    train = [view.train[s] for s in steps]
    losses = [r["loss"] for r in train]
    finite = [v for v in losses if math.isfinite(v)]
    top = max(finite) if finite else 1.0
    val_steps = sorted(view.val)

    def at_loss(v):  # a non-finite loss is drawn at the top of the curve, not dropped
        return v if _is_number(v) and math.isfinite(v) else top

    # events are drawn at their step: one whose step is not a step is left out (untrusted input)
    skips = [r for r in view.skips if _is_step(r.get("step"))]
    rewinds = [r for r in view.rewinds if _is_step(r.get("step"))]

    return {
        "train_loss": (steps, losses),
        "train_loss_superseded": ([r["step"] for r in view.superseded],
                                  [at_loss(r["loss"]) for r in view.superseded]),
        "val_loss": (val_steps, [view.val[s] for s in val_steps]),
        "hellaswag": (sorted(view.evals), [view.evals[s] for s in sorted(view.evals)]),
        **{f"{EVAL_SET_SERIES}{name}": (sorted(series), [series[s] for s in sorted(series)])
           for name, series in view.eval_sets.items()},
        "lr": (steps, [r["lr"] for r in train]),
        "grad_norm": (steps, [r["norm"] for r in train]),
        "tok_per_s": (steps, [throughput(r) for r in train]),
        "skips": ([r["step"] for r in skips], [at_loss(r.get("loss")) for r in skips]),
        "rewinds": ([r["step"] for r in rewinds], []),
        "failures": ([r["at_step"] for r in view.failures], []),
        "resumes": ([r["resumed_from"] for r in view.attempts
                     if r.get("kind") == "resume" and _is_step(r.get("resumed_from"))], []),
        "checkpoints_verified": ([c.step for c in view.checkpoints if c.ok], []),
        "checkpoints_unusable": ([c.step for c in view.checkpoints if not c.ok], []),
    }


# style of each series: (panel, kind, matplotlib keyword arguments)
_STYLE = {
    "train_loss": ("loss", "line", dict(color="tab:blue", lw=1.0, label="train loss")),
    "train_loss_superseded": ("loss", "points", dict(color="0.55", marker=".", ms=5, ls="none",
                                                     label="re-done steps (earlier attempt)")),
    "val_loss": ("loss", "line", dict(color="tab:orange", marker="o", ms=3, lw=1.2, label="val loss")),
    "skips": ("loss", "points", dict(color="tab:red", marker="x", ms=6, ls="none",
                                     label="skipped update")),
    "lr": ("lr", "line", dict(color="tab:green", lw=1.0, label="lr")),
    "grad_norm": ("norm", "line", dict(color="tab:purple", lw=1.0, label="grad norm")),
    "tok_per_s": ("speed", "line", dict(color="tab:brown", lw=1.0, label="tok/s")),
    "hellaswag": ("eval", "line", dict(color="tab:cyan", marker="o", ms=3, lw=1.2,
                                       label="HellaSwag acc_norm")),
    "rewinds": ("all", "vline", dict(color="tab:red", ls="--", lw=1.0, label="rewind")),
    "failures": ("all", "vline", dict(color="black", ls="-", lw=1.2, label="failure")),
    "resumes": ("all", "vline", dict(color="tab:green", ls=":", lw=1.2, label="resume")),
    "checkpoints_verified": ("loss", "ticks", dict(color="tab:gray", marker="^", ms=6, ls="none",
                                                   label="checkpoint (verified)")),
    "checkpoints_unusable": ("loss", "ticks", dict(color="tab:red", marker="^", ms=6, ls="none",
                                                   label="checkpoint (NOT usable)")),
}


EVAL_SET_SERIES = "val_loss:"  # + an --eval-set's NAME: its curve on the loss panel


def _style(name: str) -> tuple[str, str, dict]:
    """(panel, kind, matplotlib keyword arguments) of series `name`."""
    if name.startswith(EVAL_SET_SERIES):
        return ("loss", "line", dict(marker="s", ms=3, lw=1.0, ls="--",
                                     label=f"val loss {name[len(EVAL_SET_SERIES):]}"))
    return _STYLE[name]


_PANELS = (("loss", "loss"), ("lr", "learning rate"), ("norm", "grad norm"), ("speed", "tok/s"),
           ("eval", "HellaSwag"))


PANEL_INCHES = 2.4  # each panel's height: a run without HellaSwag gets a shorter picture


def shown_panels(series: dict[str, tuple[list, list]]) -> tuple[tuple[str, str], ...]:
    """The panels worth drawing: every one but HellaSwag's, which only a run that scored it
    gets (an empty panel reads as a broken evaluation)."""
    return tuple(p for p in _PANELS if p[0] != "eval" or series["hellaswag"][0])


def plot_run(run_dir: RunDir | str, out_png, *, verify: str = "quick",
             progress: Progress | None = None) -> dict[str, tuple[list, list]]:
    """`raygpt plot`: write a PNG of the run (loss, lr, grad norm, tok/s, with skips, rewinds,
    failures, resumes and checkpoints marked) and return {series: (x, y)} as read back from the
    drawn artists (for vertical lines and ticks, x only). `run_dir`: a RunDir, or a place a
    library caller names (opened here, once)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError("raygpt plot needs matplotlib: pip install 'raygpt[plot]'") from e
    run_dir = open_run_dir(run_dir)
    view = load_run(run_dir, verify=verify, progress=progress)
    if not view.train:
        raise ValueError(f"{view.uri}/{LOSS_HISTORY}: no train records to plot yet")
    series = plot_series(view)

    panels = shown_panels(series)
    # No pyplot: a Figure with its own Agg canvas touches no global matplotlib state.
    fig = Figure(figsize=(12, PANEL_INCHES * len(panels)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = dict(zip((p for p, _ in panels), fig.subplots(len(panels), 1, sharex=True)))
    for name, (_, title) in zip(axes, panels):
        axes[name].set_ylabel(title)
        axes[name].grid(True, alpha=0.3)
    axes[panels[-1][0]].set_xlabel("step")
    fig.suptitle(f"{view.uri} | {run_state(view)}", fontsize=10)

    drawn: dict[str, list] = {}
    for name, (xs, ys) in series.items():
        panel, kind, style = _style(name)
        if not xs:
            continue
        if kind in ("line", "points"):
            drawn[name] = axes[panel].plot(xs, ys, **style)
        elif kind == "ticks":  # along the bottom edge: x in steps, y in axes fraction
            drawn[name] = axes[panel].plot(xs, [0.02] * len(xs), transform=axes[panel].get_xaxis_transform(),
                                           **style)
        else:  # vline on every panel; only the loss panel's lines are labelled and read back
            drawn[name] = [axes["loss"].axvline(x, **(style if i == 0 else {**style, "label": None}))
                           for i, x in enumerate(xs)]
            for other in (p for p in axes if p != "loss"):
                for x in xs:
                    axes[other].axvline(x, **{**style, "label": None})
    norms = [v for v in series["grad_norm"][1] if math.isfinite(v)]
    if norms and min(norms) > 0 and max(norms) / min(norms) > 20:
        axes["norm"].set_yscale("log")  # a spike of 100x should not flatten the rest
    axes["loss"].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    for r in view.rewinds:
        if not _is_step(r.get("step")):
            continue
        axes["loss"].annotate(f"-> {r.get('to_step')}", (r["step"], 0.95), fontsize=7,
                              xycoords=axes["loss"].get_xaxis_transform(), color="tab:red")
    png = io.BytesIO()
    fig.savefig(png, format="png")
    store_png(run_dir, out_png, png.getvalue())
    return {name: _read_back(artists, _style(name)[1]) for name, artists in drawn.items()}


def _read_back(artists: list, kind: str) -> tuple[list, list]:
    if kind == "vline":
        return [float(a.get_xdata()[0]) for a in artists], []
    (line,) = artists
    xs = [float(x) for x in line.get_xdata()]
    return xs, ([] if kind == "ticks" else [float(y) for y in line.get_ydata()])


def _plot_sweep(sweeps, uri: str, run_dir: RunDir, out: str | None,
                not_a_run: FileNotFoundError) -> str:
    """`raygpt plot` of a sweep directory: every trial's validation curve; its result line."""
    path, trials = _sweep_module(sweeps, run_dir, not_a_run).plot_sweep(uri, out)
    if path is None:
        raise RuntimeError("raygpt plot needs matplotlib: pip install 'raygpt[plot]'")
    return f"raygpt plot: wrote {path} ({trials} trial(s))"


def plot_parser() -> argparse.ArgumentParser:
    p = HintingParser(prog="raygpt plot", description=(
        "Write a PNG of a run: train/val loss, lr, grad norm and tok/s, with skipped steps, "
        "rewinds, failures, resumes and checkpoints marked; of a sweep directory, every trial's "
        "validation loss."))
    p.add_argument("run_dir", help="the run directory (or a sweep's): a path or an s3:// / gs:// URI")
    p.add_argument("-o", "--out", default=None,
                   help="the PNG to write (default: plot.png in a local run directory, "
                        "<run name>_plot.png here for a remote one)")
    _verify_flags(p)
    _storage_flags(p)
    return p


def plot_main(argv: list[str], *, sweeps=None) -> int:
    """`raygpt plot`; `sweeps`: the sweep reader for a sweep directory (run_view._sweep_module)."""
    args = plot_parser().parse_args(argv)
    try:
        uri, run_dir = _open_checked(args.run_dir, args.storage_endpoint)
    except ValueError as e:
        print(f"raygpt plot: error: {printable(e)}", file=sys.stderr)
        return 2
    out = args.out
    if out is None:
        out = (str(run_dir.local_path("plot.png")) if run_dir.caps.local_paths
               else f"{run_dir.root.rstrip('/').rpartition('/')[2] or 'run'}_plot.png")
    try:
        try:
            series = plot_run(run_dir, out, verify="full" if args.verify else "quick",
                              progress=_stderr_progress)
            line = (f"raygpt plot: wrote {out} ({len(series['train_loss'][0])} steps, "
                    f"{len(series.get('val_loss', ([],))[0])} validations)")
        except FileNotFoundError as not_a_run:  # no run's history there: a sweep directory?
            line = _plot_sweep(sweeps, uri, run_dir, args.out, not_a_run)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"raygpt plot: error: {printable(e)}", file=sys.stderr)
        return 2
    print(printable(line))  # -o and the run's name come from the command line or the URI
    return 0
