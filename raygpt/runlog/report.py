"""Seeing a run at a glance: `raygpt status RUN_DIR` (text) and `raygpt plot RUN_DIR` (a PNG).

Both read only what the run left in its run directory, through `RunDir` (local, NFS, s3://,
gs://), and need neither Ray nor a running job:
    loss_history.jsonl   every train / val record and event (skip, rewind, failure, resume ...)
    step_XXXXXXXX/       the checkpoints: complete (DONE, MANIFEST, sizes), hashed with --verify

`load_run` gathers that into a `RunView`; `format_status` and `plot_series` are pure functions of
the view. A step that was trained more than once (after a rewind or a resume) appears once in the
curves, its latest attempt winning, as loss_history.jsonl's own rule says; the earlier attempts
are drawn faintly so a rewound spike stays visible.

`plot_run` returns the series read back from the artists it drew (not the inputs it was given),
so a test checks what is actually on the picture. matplotlib is optional (`pip install
'raygpt[plot]'`); status needs nothing beyond raygpt.
"""

from __future__ import annotations

import argparse
import collections
import io
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from raygpt.checkpointing import protocol as ck
from raygpt.train.faults import WHAT as FAULT_WHAT
from raygpt.train.faults import read_armed, read_fired
from raygpt.runlog import segments
from raygpt.runlog.history import LOSS_HISTORY, LOSS_HISTORY_LOG, GoodputTally, iter_history
from raygpt.storage import RunDir, open_run_dir, store_png
from raygpt.runlog.terminal import printable, printable_lines

Progress = Callable[[str], None]


@dataclass
class CheckpointInfo:
    step: int
    problems: list[str]          # [] = verified (or, with quick checks, complete and sized right)
    size: int = 0                # bytes listed in its MANIFEST (0 when unreadable)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class RunView:
    """What a run directory says about its run; every list is in file (= time) order.

    A view built with `recent=K` (what `raygpt status` uses, streaming the history) keeps only
    the K highest steps in `train` and `val`, the last K records of each event list and no
    `records` or `superseded`; `counts`, `last_time`, `last_record` and `goodput` always cover
    the whole history."""

    uri: str
    records: list[dict]
    train: dict[int, dict] = field(default_factory=dict)       # step -> latest train record
    superseded: list[dict] = field(default_factory=list)       # train records a later one replaced
    val: dict[int, float] = field(default_factory=dict)        # step -> latest val loss
    evals: dict[int, float] = field(default_factory=dict)      # step -> latest HellaSwag acc_norm
    eval_sets: dict[str, dict[int, float]] = field(default_factory=dict)  # --eval-set NAME's val
    skips: list[dict] = field(default_factory=list)
    rewinds: list[dict] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)         # each with "at_step" added
    attempts: list[dict] = field(default_factory=list)         # start and resume records
    audits: list[dict] = field(default_factory=list)
    ends: list[dict] = field(default_factory=list)
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)       # records of each kind, all of them
    last_time: float = 0.0                                     # newest record's time
    last_record: dict | None = None                            # last record but audit / watch
    goodput: dict | None = None                                # summarize_run over the history
    faults: tuple[int, list] = (0, [])                         # faults.read_armed
    fired: tuple[int, list] = (0, [])                          # faults.read_fired
    checkpoint_check: str = "full"     # how `checkpoints` were checked: "full" hashed, "quick" not


# ---------------------------------------------------------------------- reading a run

_EVENT_LISTS = {"skip": "skips", "rewind": "rewinds", "failure": "failures", "start": "attempts",
                "resume": "attempts", "audit": "audits", "end": "ends"}


_NUMBERS = {"train": ("loss", "lr", "norm", "tokens"), "val": ("val_loss",),
            "eval": ("hellaswag",), "eval_set": ("val_loss",)}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_step(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _well_formed(r: dict) -> bool:
    """A train, val or eval record whose numbers are numbers (the history is untrusted input: a
    record that is not is counted as malformed and left out, rather than crash the report)."""
    return (_is_step(r.get("step")) and all(_is_number(r.get(k)) for k in _NUMBERS[r["kind"]])
            and (r.get("dt") is None or _is_number(r.get("dt")))
            and (r["kind"] != "eval_set" or _is_set_name(r.get("name"))))


def _is_set_name(v) -> bool:
    from raygpt.eval.sets import NAME
    return isinstance(v, str) and NAME.fullmatch(v) is not None


def view_from_records(uri: str, records, checkpoints: list[CheckpointInfo] | None = None, *,
                      recent: int | None = None) -> RunView:
    """Sort loss-history records (any iterable, a stream included) into a RunView (pure).
    `recent`: keep only that much of each series (see RunView); memory is then bounded by a
    number per step (for goodput), not by the records."""
    keep_all = recent is None
    view = RunView(uri=uri, records=[], checkpoints=list(checkpoints or []))
    if not keep_all:
        for name in set(_EVENT_LISTS.values()):
            setattr(view, name, collections.deque(maxlen=recent))
    tally = GoodputTally()
    last_trained = 0  # failures carry a time, not a step: place each at the last step trained
    for r in records:
        if keep_all:
            view.records.append(r)
        tally.add(r)
        kind = r.get("kind")
        if not isinstance(kind, str):  # the history is untrusted: a kind must be a name
            view.counts["malformed"] = view.counts.get("malformed", 0) + 1
            continue
        view.counts[kind] = view.counts.get(kind, 0) + 1
        t = r.get("time")
        if isinstance(t, (int, float)) and t > view.last_time:
            view.last_time = t
        if kind not in ("audit", "watch"):
            view.last_record = r
        step = r.get("step")
        if kind in _NUMBERS and not _well_formed(r):
            view.counts["malformed"] = view.counts.get("malformed", 0) + 1
            continue
        if kind == "train":
            if step in view.train and keep_all:
                view.superseded.append(view.train[step])
            view.train[step] = r
            last_trained = step
            if not keep_all and len(view.train) > 2 * recent:
                for s in sorted(view.train)[:-recent]:
                    del view.train[s]
        elif kind in ("val", "eval", "eval_set"):
            series = (view.val if kind == "val" else view.evals if kind == "eval"
                      else view.eval_sets.setdefault(r["name"], {}))
            series[step] = r.get("hellaswag" if kind == "eval" else "val_loss")
            if not keep_all and len(series) > 2 * recent:
                for s in sorted(series)[:-recent]:
                    del series[s]
        elif kind in _EVENT_LISTS:
            getattr(view, _EVENT_LISTS[kind]).append(
                {**r, "at_step": last_trained} if kind == "failure" else r)
    view.goodput = tally.result() if tally.count else None
    for name in set(_EVENT_LISTS.values()):
        setattr(view, name, list(getattr(view, name)))
    return view


def _manifest_bytes(run_dir: RunDir, step: int) -> int:
    try:
        return sum(int(e.get("size", 0)) for e in ck.read_manifest(run_dir, step)["files"].values())
    except ck.CheckpointError:
        return 0


def check_checkpoints(run_dir: RunDir, *, verify: str = "quick",
                      progress: Progress | None = None) -> list[CheckpointInfo]:
    """Every step_XXXXXXXX/ of the run, checked for completeness and sizes ("quick", the
    default: MANIFEST is all that is read) or hashed ("full": sha256 of every file, what
    `--verify` asks for). Hashing a week-long run's checkpoints reads every byte, so each one is
    announced through `progress` first."""
    if verify not in ("full", "quick"):
        raise ValueError(f"checkpoint verification: expected 'full' or 'quick', found {verify!r}")
    steps = ck.list_checkpoint_steps(run_dir)
    out = []
    for i, step in enumerate(steps, start=1):
        size = _manifest_bytes(run_dir, step)
        if progress is not None:
            progress(f"{'verifying' if verify == 'full' else 'checking'} checkpoint {i}/{len(steps)}"
                     f" (step {step}, {_human_bytes(size)})")
        problems = (ck.verify_checkpoint(run_dir, step) if verify == "full"
                    else ck.verify_checkpoint(run_dir, step, hashes=False))
        out.append(CheckpointInfo(step, problems, size))
    return out


def load_run(run_dir, *, verify: str = "quick", progress: Progress | None = None,
             recent: int | None = None) -> RunView:
    """Read a run directory (anything `open_run_dir` takes) into a RunView; the history is
    streamed, and with `recent` (see RunView) never held whole."""
    run_dir = open_run_dir(run_dir)
    if not segments.exists(run_dir, LOSS_HISTORY_LOG):
        raise FileNotFoundError(f"{run_dir.uri(LOSS_HISTORY)}: no such file, nor segments in "
                                f"{run_dir.uri(LOSS_HISTORY_LOG.folder)}/ (is {run_dir.uri()} "
                                f"a raygpt run directory?)")
    if progress is not None:
        progress(f"reading {run_dir.uri(LOSS_HISTORY)} "
                 f"({_human_bytes(segments.stored_bytes(run_dir, LOSS_HISTORY_LOG))})")
    view = view_from_records(run_dir.uri(), iter_history(run_dir),
                             check_checkpoints(run_dir, verify=verify, progress=progress),
                             recent=recent)
    view.faults = read_armed(run_dir)
    view.fired = read_fired(run_dir, keep=STATUS_FAULTS)
    view.checkpoint_check = verify
    return view


# ---------------------------------------------------------------------- derived numbers

def tokens_per_step(rec: dict) -> float:
    """Tokens of one optimizer step: a train record's `tokens` counts every step from 0 to
    `step` inclusive (skipped ones too), each the same total batch."""
    return rec["tokens"] / (rec["step"] + 1)


def throughput(rec: dict) -> float:
    """tok/s of one step (training time only: dt excludes validation and checkpoint stalls)."""
    dt = rec.get("dt") or 0.0
    return tokens_per_step(rec) / dt if dt > 0 else float("nan")


def max_steps_of(view: RunView) -> int | None:
    """The run's length, if a record says it (an end record, or an attempt that logged it)."""
    for r in reversed(view.ends + view.attempts):
        m = r.get("max_steps")
        if isinstance(m, int) and not isinstance(m, bool) and m > 0:
            return m
    return None


def run_state(view: RunView) -> str:
    """One phrase for where the run is, judged from its last meaningful record."""
    last = view.last_record
    if last is None:
        return "empty"
    if last.get("kind") == "end":
        if last.get("stopped_early"):
            return f"stopped early at step {last.get('step')} (resume with -y 1)"
        return f"finished at step {last.get('step')}"
    if last.get("kind") == "failure":
        return "failed (Ray restarts it if the retry budget allows)"
    return "running, or died without a word (no end record yet)"


# ---------------------------------------------------------------------- status

def format_status(view: RunView, *, now: float | None = None) -> str:
    """The status report of a run (pure; `now` only sets the "ago" figures)."""
    now = time.time() if now is None else now
    lines = [f"run       {view.uri}"]
    n_attempts = view.counts.get("start", 0) + view.counts.get("resume", 0)
    restarts = max(n_attempts - 1, 0)
    lines.append(f"state     {run_state(view)} | last record {_human_seconds(now - view.last_time)}"
                 f" ago | {n_attempts} attempt(s), {restarts} restart(s)")
    armed, last_armed = view.faults
    if armed:
        a = last_armed[-1]
        lines.append(f"faults    FAULT INJECTION ARMED {armed} time(s) in this run directory; "
                     f"last: {a.get('spec')} (from {' and '.join(map(str, a.get('sources') or []))})")
    lines += fired_lines(*view.fired)

    if view.train:
        step = max(view.train)
        rec = view.train[step]
        total = max_steps_of(view)
        where = (f"{step + 1}/{total} steps ({100 * (step + 1) / total:.1f}%)" if total
                 else f"{step + 1} steps")
        recent = [view.train[s] for s in sorted(view.train)[-20:]]
        dts = sum(r.get("dt") or 0.0 for r in recent)
        avg_tps = sum(tokens_per_step(r) for r in recent) / dts if dts > 0 else float("nan")
        val_step = max(view.val) if view.val else None
        val = f"val {view.val[val_step]:.4f} (step {val_step})" if val_step is not None else "val n/a"
        hs = (f" | HellaSwag {view.evals[max(view.evals)]:.4f} (step {max(view.evals)})"
              if view.evals else "")
        lines.append(f"progress  {where} | loss {rec['loss']:.4f} | {val}{hs} | "
                     f"lr {rec['lr']:.2e} | norm {rec['norm']:.4f}")
        if view.eval_sets:  # --eval-set: each set's last loss
            lines.append("eval sets " + " | ".join(
                f"{name} {series[max(series)]:.4f} (step {max(series)})"
                for name, series in view.eval_sets.items()))
        eta = ""
        if total and dts > 0 and step + 1 < total:
            eta = f" | ETA {_human_seconds((total - step - 1) * dts / len(recent))} of training"
        lines.append(f"speed     {throughput(rec):,.0f} tok/s last step, {avg_tps:,.0f} tok/s over "
                     f"the last {len(recent)} | {rec['tokens']:,} tokens seen{eta}")
    else:
        lines.append("progress  no step trained yet")

    n = view.counts
    events = [f"{n.get('skip', 0)} skip(s)"]
    if view.skips:
        s = view.skips[-1]
        events[-1] += f" (last at step {s.get('step')}: {s.get('reason') or 'no reason given'})"
    events.append(f"{n.get('rewind', 0)} rewind(s)" + (
        " (" + ", ".join(f"step {r.get('step')} -> {r.get('to_step')}" for r in view.rewinds[-3:]) + ")"
        if view.rewinds else ""))
    events.append(f"{n.get('failure', 0)} failure(s)" + (
        f" (last after step {view.failures[-1]['at_step']}: {_first_cause(view.failures[-1])})"
        if view.failures else ""))
    resumed = [r for r in view.attempts if r.get("kind") == "resume"]
    events.append(f"{n.get('resume', 0)} resume(s)" + (
        " (from step " + ", ".join(str(r.get("resumed_from")) for r in resumed[-5:]) + ")"
        if resumed else ""))
    if n.get("malformed"):
        events.append(f"{n['malformed']} malformed record(s) left out")
    lines.append("events    " + " | ".join(events))
    lines += resume_lines(view)

    good = [c for c in view.checkpoints if c.ok]
    bad = [c for c in view.checkpoints if not c.ok]
    # "verified" only when every byte was hashed: the quick check sees missing and short files
    # (DONE, MANIFEST, each listed size), not a flipped byte, and says so
    hashed = view.checkpoint_check == "full"
    ckpt = (f"{len(good)} {'verified' if hashed else 'complete'}"
            + (": step " + ", ".join(str(c.step) for c in good) if good else ""))
    if good:
        ckpt += f" | newest resumable: step {good[-1].step} ({_human_bytes(good[-1].size)})"
    if not hashed and view.checkpoints:
        ckpt += " | sizes checked, not hashed (--verify hashes)"
    lines.append(f"ckpts     {ckpt}")
    for c in bad:
        more = f" (+{len(c.problems) - 1} more)" if len(c.problems) > 1 else ""
        lines.append(f"          NOT usable: step {c.step}: {c.problems[0]}{more}")

    if view.goodput is not None:
        lines.append(f"goodput   {view.goodput['line']}")
        split = view.goodput.get("recovery_lines", [])
        if len(split) > RECOVERIES_SHOWN:
            lines.append(f"          (the last {RECOVERIES_SHOWN} of {len(split)} recoveries)")
        lines += [f"          {line}" for line in split[-RECOVERIES_SHOWN:]]
    return "\n".join(printable(line) for line in lines)


# recoveries split into their parts on `raygpt status` (the newest; the goodput line has them all)
RECOVERIES_SHOWN = 5


def fired_lines(count: int, fired: list[dict]) -> list[str]:
    """One line per fault that fired (faults.read_fired: the last few, oldest first)."""
    if not count:
        return []
    out = [f"fired     {count} fault(s) injected" + (f", the last {len(fired)}:" if len(fired) < count
                                                     else ":")]
    for r in fired:
        kind = str(r.get("kind"))
        if r.get("by") == "external":
            name = f"{kind} after step {r.get('at_step')} (injected by {r.get('injector') or 'an outside tool'})"
        else:
            name = str(r.get("fault", kind))
            if isinstance(r.get("at_step"), int) and r["at_step"] != r.get("step"):
                name += f" (struck at step {r['at_step']})"
        what = FAULT_WHAT.get(kind)
        detail = f" [{r['detail']}]" if r.get("detail") else ""
        out.append(f"          {name}" + (f": {what}" if what else "") + detail)
    return out


def resume_lines(view: RunView) -> list[str]:
    """One line per resume (the last few): where it resumed from, how many steps it re-did and
    what the resume audit found when it had re-done them (history.ResumeAudit)."""
    resumes = [r for r in view.attempts if r.get("kind") == "resume"]
    if not resumes:
        return [f"audit     {a.get('message', '')}" for a in view.audits[-1:]]
    audits = {a["attempt"]: a for a in view.audits if isinstance(a.get("attempt"), int)}
    newest = max((r["attempt"] for r in view.attempts if isinstance(r.get("attempt"), int)),
                 default=0)
    out = []
    for i, r in enumerate(resumes):
        attempt, lost = r.get("attempt"), r.get("steps_lost")
        head = f"attempt {attempt} from step {r.get('resumed_from')}"
        n = f"{lost} step(s)" if isinstance(lost, int) else "steps"  # older records lack it
        if isinstance(attempt, int) and attempt in audits:
            verdict = f"{n} re-done: {audits[attempt].get('message', '')}"
        elif lost == 0:
            verdict = "no step to re-do (it resumed where the run stopped): nothing to audit"
        elif attempt == newest and view.last_record is not None \
                and view.last_record.get("attempt") == attempt \
                and view.last_record.get("kind") != "end":
            verdict = f"{n} to re-do: audit pending"
        else:
            verdict = f"{n} to re-do: no audit (the attempt ended before re-doing them)"
        out.append(f"{'resumes' if i == 0 else '':<10}{head}: {verdict}")
    total = view.counts.get("resume", 0)
    if total > len(resumes):
        out.append(f"          (the last {len(resumes)} of {total} resumes)")
    return out


STATUS_RECENT = 20  # train steps (and events of each kind) `raygpt status` keeps in memory
STATUS_FAULTS = 50  # fired faults `raygpt status` lists (the newest)


def run_status(run_dir_uri, *, verify: str = "quick", progress: Progress | None = None) -> str:
    """`raygpt status`: what ran (config.json of every launch), the last step, loss, tok/s,
    checkpoints, restarts, the faults injected (RUN_DIR/faults/), each resume with its audit and
    goodput of a run. The history is streamed: memory does not grow
    with its records (only a number per step)."""
    from raygpt.runlog.run_config import format_launches, read_launches
    text = format_status(load_run(run_dir_uri, verify=verify, progress=progress,
                                  recent=STATUS_RECENT))
    skipped: list[str] = []
    launches = format_launches(read_launches(open_run_dir(run_dir_uri), skipped=skipped), skipped)
    return "\n".join([text, *launches]) if launches else text


def _first_cause(failure: dict) -> str:
    causes = failure.get("causes")
    if not causes or not isinstance(causes, dict):
        return "no cause recorded"
    rank, cause = next(iter(causes.items()))
    return f"rank {rank}: {str(cause)[:120]}"


def _human_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


# ---------------------------------------------------------------------- plot

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


def plot_run(run_dir_uri, out_png, *, verify: str = "quick",
             progress: Progress | None = None) -> dict[str, tuple[list, list]]:
    """`raygpt plot`: write a PNG of the run (loss, lr, grad norm, tok/s, with skips, rewinds,
    failures, resumes and checkpoints marked) and return {series: (x, y)} as read back from the
    drawn artists (for vertical lines and ticks, x only)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError("raygpt plot needs matplotlib: pip install 'raygpt[plot]'") from e
    view = load_run(run_dir_uri, verify=verify, progress=progress)
    if not view.train:
        raise ValueError(f"{view.uri}/{LOSS_HISTORY}: no train records to plot yet")
    series = plot_series(view)

    # No pyplot: a Figure with its own Agg canvas touches no global matplotlib state.
    fig = Figure(figsize=(12, 12), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = dict(zip((p for p, _ in _PANELS), fig.subplots(len(_PANELS), 1, sharex=True)))
    for name, (_, title) in zip(axes, _PANELS):
        axes[name].set_ylabel(title)
        axes[name].grid(True, alpha=0.3)
    axes[_PANELS[-1][0]].set_xlabel("step")
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
            for other in ("lr", "norm", "speed", "eval"):
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
    store_png(run_dir_uri, out_png, png.getvalue())
    return {name: _read_back(artists, _style(name)[1]) for name, artists in drawn.items()}


def _read_back(artists: list, kind: str) -> tuple[list, list]:
    if kind == "vline":
        return [float(a.get_xdata()[0]) for a in artists], []
    (line,) = artists
    xs = [float(x) for x in line.get_xdata()]
    return xs, ([] if kind == "ticks" else [float(y) for y in line.get_ydata()])


# ---------------------------------------------------------------------- command line

def _stderr_progress(message: str) -> None:
    print(f"raygpt | {printable(message)}", file=sys.stderr, flush=True)


def _verify_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--verify", action="store_true",
                   help="also read and sha256 every checkpoint file against its MANIFEST (reads "
                        "every byte of every checkpoint); default: DONE, MANIFEST and sizes only")
    g.add_argument("--quick", action="store_true",
                   help="the default (kept for scripts that pass it): no hashing")


def _storage_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-endpoint", default="", metavar="URL",
                   help="S3-compatible endpoint of an s3:// run directory, e.g. http://minio:9000 "
                        "(default: AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL)")


def _open_checked(run_dir: str, endpoint: str) -> str:
    """The run directory's URI with its endpoint, once its store answered (within
    storage.REACHABLE_DEADLINE_S); ValueError in one line (the URI and the cause) if not."""
    from raygpt.storage import check_reachable, with_endpoint
    if endpoint and not run_dir.startswith("s3://"):
        raise ValueError(f"--storage-endpoint: expected with an s3:// run directory, found {run_dir}")
    uri = with_endpoint(run_dir, endpoint)
    check_reachable(open_run_dir(uri))
    return uri


def status_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raygpt status", description=(
        "Print where a run is: last step, loss, tok/s, checkpoints (complete? --verify: hashed), "
        "restarts, failures, skips, rewinds, injected faults, each resume's audit and goodput; "
        "of a sweep directory, every trial's row."))
    p.add_argument("run_dir", help="the run directory (or a sweep's): a path or an s3:// / gs:// URI")
    _verify_flags(p)
    _storage_flags(p)
    return p


def status_main(argv: list[str]) -> int:
    args = status_parser().parse_args(argv)
    try:
        run_dir = _open_checked(args.run_dir, args.storage_endpoint)
        try:
            text = run_status(run_dir, verify="full" if args.verify else "quick",
                              progress=_stderr_progress)
        except FileNotFoundError as not_a_run:  # no run's history there: a sweep directory?
            text = _sweep_module(run_dir, not_a_run).sweep_status(run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"raygpt status: error: {printable(e)}", file=sys.stderr)
        return 2
    print(printable_lines(text))  # a guard: every part above made its values printable already
    return 0


def _sweep_module(uri: str, not_a_run: FileNotFoundError):
    """raygpt.ray.sweep when `uri` is a sweep directory (it holds sweep.json); else `not_a_run`
    is raised again. Ray Tune is imported only here: a run's status and plot need none of it."""
    from raygpt.ray import sweep
    if not open_run_dir(uri).exists(sweep.PLAN_FILE):
        raise not_a_run
    return sweep


def _plot_sweep(uri: str, out: str | None, not_a_run: FileNotFoundError) -> str:
    """`raygpt plot` of a sweep directory: every trial's validation curve; its result line."""
    path, trials = _sweep_module(uri, not_a_run).plot_sweep(uri, out)
    if path is None:
        raise RuntimeError("raygpt plot needs matplotlib: pip install 'raygpt[plot]'")
    return f"raygpt plot: wrote {path} ({trials} trial(s))"


def plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raygpt plot", description=(
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


def plot_main(argv: list[str]) -> int:
    args = plot_parser().parse_args(argv)
    try:
        uri = _open_checked(args.run_dir, args.storage_endpoint)
    except ValueError as e:
        print(f"raygpt plot: error: {printable(e)}", file=sys.stderr)
        return 2
    out = args.out
    if out is None:
        run_dir = open_run_dir(uri)
        out = (str(run_dir.local_path("plot.png")) if run_dir.is_local
               else f"{run_dir.root.rstrip('/').rpartition('/')[2] or 'run'}_plot.png")
    try:
        try:
            series = plot_run(uri, out, verify="full" if args.verify else "quick",
                              progress=_stderr_progress)
            line = (f"raygpt plot: wrote {out} ({len(series['train_loss'][0])} steps, "
                    f"{len(series.get('val_loss', ([],))[0])} validations)")
        except FileNotFoundError as not_a_run:  # no run's history there: a sweep directory?
            line = _plot_sweep(uri, args.out, not_a_run)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"raygpt plot: error: {printable(e)}", file=sys.stderr)
        return 2
    print(printable(line))  # -o and the run's name come from the command line or the URI
    return 0
