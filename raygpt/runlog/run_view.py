"""A run as `raygpt status` and `raygpt plot` see it, and what the two commands share.

Both read only what the run left in its run directory, through `RunDir` (local, NFS, s3://,
gs://), and need neither Ray nor a running job:
    loss_history.jsonl   every train / val record and event (skip, rewind, failure, resume ...)
    step_XXXXXXXX/       the checkpoints: complete (DONE, MANIFEST, sizes), hashed with --verify

`load_run` gathers that into a `RunView` (raygpt.runlog.status and raygpt.runlog.plot are pure
functions of it). A step that was trained more than once (after a rewind or a resume) appears
once in the curves, its latest attempt winning, as loss_history.jsonl's own rule says. Also here:
both commands' --verify and storage flags, the run directory checked before it is read, and a
sweep directory's report (raygpt.ray.sweep_results) when the directory holds no run.
"""

from __future__ import annotations

import argparse
import collections
import sys
from dataclasses import dataclass, field
from typing import Callable

from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing.store import CheckpointStore
from raygpt.train.faults import read_armed, read_fired
from raygpt.runlog import segments
from raygpt.runlog.history import LOSS_HISTORY, LOSS_HISTORY_LOG, GoodputTally, iter_history
from raygpt.storage import RunDir, open_run_dir
from raygpt.runlog.terminal import printable


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
    source_epochs: dict[str, int] = field(default_factory=dict)  # a mixed -i's source -> epoch
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)       # records of each kind, all of them
    last_time: float = 0.0                                     # newest record's time
    last_record: dict | None = None                            # last record but audit / watch
    goodput: dict | None = None                                # summarize_run over the history
    faults: tuple[int, list] = (0, [])                         # faults.read_armed
    fired: tuple[int, list] = (0, [])                          # faults.read_fired
    checkpoint_check: str = "full"     # how `checkpoints` were checked: "full" hashed, "quick" not


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
        elif kind == "source_epoch" and _is_step(r.get("epoch")):  # the newest epoch of each
            view.source_epochs[str(r.get("source"))] = r["epoch"]
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
    steps = CheckpointStore(run_dir).steps()
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


def load_run(run_dir: RunDir | str, *, verify: str = "quick", progress: Progress | None = None,
             recent: int | None = None) -> RunView:
    """Read a run directory (a RunDir, or a place a library caller names: opened here, once)
    into a RunView; the history is streamed, and with `recent` (see RunView) never held
    whole."""
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


STATUS_RECENT = 20  # train steps (and events of each kind) `raygpt status` keeps in memory


STATUS_FAULTS = 50  # fired faults `raygpt status` lists (the newest)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


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


def _open_checked(run_dir: str, endpoint: str) -> tuple[str, RunDir]:
    """(the run directory's URI with its endpoint, its RunDir), opened once its store answered
    (within storage.REACHABLE_DEADLINE_S); ValueError in one line (the URI and the cause) if
    not. The URI stays for a sweep directory, whose plan names its trials by URI."""
    from raygpt.storage import check_reachable, with_endpoint
    if endpoint and not run_dir.startswith("s3://"):
        raise ValueError(f"--storage-endpoint: expected with an s3:// run directory, found {run_dir}")
    uri = with_endpoint(run_dir, endpoint)
    opened = open_run_dir(uri)
    check_reachable(opened)
    return uri, opened


def _sweep_module(sweeps, run_dir: RunDir, not_a_run: FileNotFoundError):
    """The sweep reader `sweeps(run_dir, not_a_run)` gives for a sweep directory (the command
    line hands raygpt.ray.sweep_results' `for_directory`: the run log sits below the Ray seam);
    `not_a_run` again without one, or when `run_dir` holds no sweep."""
    if sweeps is None:
        raise not_a_run
    return sweeps(run_dir, not_a_run)
