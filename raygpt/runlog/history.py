"""The run's own memory: loss_history.jsonl and samples.jsonl, and the resume audit.

`loss_history.jsonl` gets one line per step, validation, event (skip, rewind, resume, failure,
end) and never loses one: it is appended across restarts and policy changes, never truncated or
rewritten. Each record carries the attempt number. When a resumed attempt passes steps
an earlier attempt already logged, the audit compares the two losses as floats and says either
"resume verified bit-exact over K steps" or where and by how much they first differ, so a resume
that lost state is noticed at once, not a week later.

All I/O goes through `RunDir` (local, NFS or object storage). Only rank 0 writes (and the Ray
driver, one failure record at a time: `append_record`). On a local or NFS run directory each log
is one file appended line by line; on an object store it is a folder of immutable segments
(`raygpt.runlog.segments`: loss_history/part-*.jsonl, samples/part-*.jsonl) stored by a
background thread every `TrainConfig.log_segment_s` seconds or `log_segment_lines` lines. The
history stores what it has at once after the rare events a reader must see even if the process
dies next (FLUSH_AFTER: a rewind's record is what tells a resume which steps were abandoned); the
checkpointer's flush at every checkpoint publish stores the rest. Readers
(`iter_history`) read either layout, and an old single file followed by segments, as one log.
"""

from __future__ import annotations

import json
import logging
import math
import time

from raygpt.runlog import segments
from raygpt.runlog.segments import LogFile, LogLayout
from raygpt.runlog.terminal import printable
from raygpt.storage import JSONError, RunDir, parse_json

log = logging.getLogger(__name__)

LOSS_HISTORY = "loss_history.jsonl"
SAMPLES = "samples.jsonl"
LOSS_HISTORY_LOG = LogLayout(LOSS_HISTORY, "loss_history", "jsonl")
SAMPLES_LOG = LogLayout(SAMPLES, "samples", "jsonl")
# an attempt's start, a rewind (perhaps escalated: the process stops right after) and the end
# (also a stop by signal): stored at once on an object store, not at the next flush interval
FLUSH_AFTER = frozenset({"start", "resume", "rewind", "end"})


WARNED_LINES = 3  # damaged lines of one log warned about one by one; the rest are counted


def iter_records(lines, name: str):
    """The records (JSON objects) among JSONL `lines` (bytes). A line that is not one (torn by
    a crash mid-append, overlong, nested too deep to parse, not an object) is skipped: the
    first WARNED_LINES each with a warning naming the file and the line (its number in the
    log read as one file, segments included), then one count."""
    skipped = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            rec = parse_json(raw, name, line=number)
        except JSONError as e:
            rec = e
        if isinstance(rec, dict):
            yield rec
            continue
        skipped += 1
        if skipped <= WARNED_LINES:
            why = rec.reason if isinstance(rec, JSONError) else f"expected a JSON object, found " \
                                                                f"{type(rec).__name__}"
            log.warning(printable(f"raygpt | WARNING: {name}: line {number}: skipped ({why}): "
                                  f"{raw[:60]!r}"))
    if skipped > WARNED_LINES:
        log.warning(printable(f"raygpt | WARNING: {name}: {skipped} damaged lines skipped in all"))


def parse_jsonl(data: bytes, name: str) -> list[dict]:
    """Complete records of a JSONL file; a torn last line (a crash mid-append) is skipped."""
    return list(iter_records(data.split(b"\n"), name))


def iter_history(run_dir: RunDir, layout: LogLayout = LOSS_HISTORY_LOG):
    """The records of the loss history (single file, segments or both, in order), streamed
    (memory bounded by one chunk and one line, or one segment); nothing when there is none."""
    yield from iter_records(segments.read_lines(run_dir, layout), run_dir.uri(layout.legacy))


def read_history(run_dir: RunDir) -> list[dict]:
    return list(iter_history(run_dir))


def read_samples(run_dir: RunDir) -> list[dict]:
    return list(iter_history(run_dir, SAMPLES_LOG))


def history_exists(run_dir: RunDir) -> bool:
    return segments.exists(run_dir, LOSS_HISTORY_LOG)


def append_record(run_dir: RunDir, record: dict) -> None:
    """One record from a process other than rank 0 (the Ray driver's failure record), stored
    on return: appended locally, a segment of its own on an object store."""
    segments.append_once(run_dir, LOSS_HISTORY_LOG, _line(record))


def _line(record: dict) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


class ResumeAudit:
    """Compares a resumed attempt's losses with an earlier attempt's at the same steps.
    `exact`: whether the run promises equal losses (deterministic, or on CPU, whose kernels are);
    a GPU run under --no-deterministic does not, so a difference there is reported as what that
    mode allows, not as a resume that lost state (`exact_expected`)."""

    def __init__(self, previous: dict[int, float], *, exact: bool = True):
        self.previous, self.exact = previous, exact
        self.matched = 0
        self.first_mismatch: tuple[int, float, float] | None = None
        self.reported = not previous

    def observe(self, step: int, loss: float) -> str | None:
        """Returns a line to print when the audit has its answer."""
        if self.reported:
            return None
        if step in self.previous:
            before = self.previous[step]
            if before == loss or (before != before and loss != loss):
                self.matched += 1
            elif self.first_mismatch is None:
                self.first_mismatch = (step, before, loss)
                self.reported = True
                if not self.exact:
                    return (f"resume audit: step {step} loss {loss!r} differs from the earlier "
                            f"attempt's {before!r} by {loss - before:+.3e} after {self.matched} "
                            f"equal steps; not checked further: this GPU run is not deterministic "
                            f"(--no-deterministic), so its losses are not reproducible bit for bit")
                return (f"resume audit: WARNING step {step} loss {loss!r} differs from the earlier "
                        f"attempt's {before!r} by {loss - before:+.3e} after {self.matched} equal "
                        f"steps: the resume did not restore everything")
        if step >= max(self.previous):
            self.reported = True
            return f"resume verified bit-exact over {self.matched} steps"
        return None


def exact_expected(cfg) -> bool:
    """Whether a run's resumed losses must equal the uninterrupted run's as floats: in the
    deterministic mode, and on CPU (its kernels are deterministic without it). Pure."""
    return (cfg is None or bool(getattr(cfg, "deterministic", True))
            or getattr(cfg, "device", "cpu") != "gpu")


def steps_logged(records: list[dict]) -> dict[int, float]:
    """{step: loss} from loss-history records, the latest attempt of each step winning (the file
    is in time order, so a step re-run after a resume or rewind overrides its earlier line).
    Step records carry "step" and "loss"; records with an "event" key (a skip or rewind note,
    even one that repeats the loss) are ignored."""
    out: dict[int, float] = {}
    for rec in records:
        if "step" in rec and "loss" in rec and "event" not in rec and _is_int(rec["step"]) \
                and _is_number(rec["loss"]):  # a hand-edited record is not a loss to compare
            out[rec["step"]] = float(rec["loss"])
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def trajectory_losses(records) -> dict[int, float]:
    """{step: loss} of the trajectory the run is on, from loss-history records in file order:
    each step's latest train record, without the steps a rewind abandoned (a rewind to
    checkpoint T re-trains from step T, so every step >= T logged before it belongs to a
    trajectory the run left; one the run did not re-train before a crash must not be what a
    resume's audit compares with: the resume skips the same data window and differs there)."""
    out: dict[int, float] = {}
    for r in records:
        kind = r.get("kind")
        if kind == "rewind" and _is_int(r.get("to_step")):
            for s in [s for s in out if s >= r["to_step"]]:
                del out[s]
        elif kind == "train":
            out.update(steps_logged([r]))
    return out


class RunHistory:
    def __init__(self, run_dir: RunDir, cfg, *, enabled: bool):
        self.run_dir, self.cfg, self.enabled = run_dir, cfg, enabled
        self.attempt = 1
        self.audit = ResumeAudit({})
        bound = dict(interval_s=getattr(cfg, "log_segment_s", segments.DEFAULT_INTERVAL_S),
                     max_lines=getattr(cfg, "log_segment_lines", segments.DEFAULT_MAX_LINES))
        self.logs = {LOSS_HISTORY: LogFile(run_dir, LOSS_HISTORY_LOG, **bound),
                     SAMPLES: LogFile(run_dir, SAMPLES_LOG, **bound)} if enabled else {}

    def _append(self, name: str, record: dict) -> None:
        if self.enabled:
            self.logs[name].append(_line(record))

    def flush(self, wait: bool = True) -> None:
        """Store what was appended (wait=False on an object store: seal the segment now and let
        the writer thread store it)."""
        for f in self.logs.values():
            f.flush(wait)

    def close(self) -> None:
        """Store everything and stop the segment writers (a later append starts them again)."""
        for f in self.logs.values():
            f.close()

    def begin_attempt(self, resumed_from: int | None, note: str | None, max_steps: int | None = None,
                      startup: dict | None = None) -> int:
        """Number this attempt, mark the resume point, arm the resume audit. `startup`: the wall
        times (time.time()) of this attempt's start-up marks (STARTUP_MARKS) and `load_s`, kept
        in the record for the recovery split (`GoodputTally`)."""
        if not self.enabled:
            return 0
        records = read_history(self.run_dir)
        self.attempt = 1 + max((r["attempt"] for r in records if _is_int(r.get("attempt"))),
                               default=0)
        if resumed_from is not None:
            earlier = trajectory_losses(records)
            self.audit = ResumeAudit({s: l for s, l in earlier.items() if s >= resumed_from},
                                     exact=exact_expected(self.cfg))
        self.event(resumed_from or 0, "resume" if resumed_from is not None else "start",
                   resumed_from=resumed_from, note=note, max_steps=max_steps,
                   steps_lost=(max(trajectory_losses(records), default=-1) + 1 - resumed_from)
                   if resumed_from is not None else None,
                   **({"startup": startup} if startup else {}))
        return self.attempt

    def train(self, step: int, **fields) -> None:
        self._append(LOSS_HISTORY, {"kind": "train", "step": step, **fields,
                                    "time": time.time(), "attempt": self.attempt})
        if self.enabled:
            line = self.audit.observe(step, fields["loss"])
            if line:
                log.info(f"raygpt | {line}")
                self.event(step, "audit", message=line, matched=self.audit.matched)

    def val(self, step: int, val_loss: float) -> None:
        self._append(LOSS_HISTORY, {"kind": "val", "step": step, "val_loss": val_loss,
                                    "time": time.time(), "attempt": self.attempt})

    def event(self, step: int, kind: str, **fields) -> None:
        self._append(LOSS_HISTORY, {"kind": kind, "step": step, **fields, "time": time.time(),
                                    "attempt": self.attempt})
        if self.enabled and kind in FLUSH_AFTER:
            self.flush()  # stored before the next step: a crash right after must not lose it

    def sample(self, step: int, text: str) -> None:
        self._append(SAMPLES, {"step": step, "text": text, "time": time.time(),
                               "attempt": self.attempt})

    def end(self, summary: dict) -> None:
        self.event(summary["step"], "end", **{k: v for k, v in summary.items() if k != "step"})


# An attempt's start-up, as wall times (time.time()) in its start/resume record's "startup":
# the controller saw the new worker group's actors up and then the process group formed (Ray
# Train's backend on_start; trainer._Backend), the loop began looking for a checkpoint and had
# the state loaded; `load_s` is the part of that spent reading state (the rest: finding and
# verifying the checkpoint). Clocks of different nodes are as close as NTP keeps them.
STARTUP_MARKS = ("group_up", "process_group", "restore_started", "state_loaded")

# The parts of one recovery, in order, as `raygpt status` names them; they add up to the whole:
# from the last step trained before the failure to the last step re-trained after it.
RECOVERY_PARTS = ("detected", "group_up", "process_group", "setup", "checkpoint_found",
                  "state_loaded", "first_step", "retrained")
PART_LABELS = {"detected": "failure detected", "group_up": "worker group up",
               "process_group": "process group formed", "setup": "worker setup",
               "checkpoint_found": "checkpoint found+verified", "state_loaded": "state loaded",
               "first_step": "first step (compile)", "retrained": "steps re-trained"}


def recovery_split(last_step_time: float | None, failure_time: float, start: dict | None,
                   first_step_time: float | None, caught_up_time: float | None) -> dict:
    """One recovery's parts in seconds (None where a mark is missing: a record from an older
    raygpt, a local run without Ray's marks): from the last step trained before the failure
    (`last_step_time`) to its record (`failure_time`), the new attempt's start-up marks
    (`start`: its record's time and "startup"), its first step's record, and the record of the
    last step it re-trained (`caught_up_time`, the first step's when none was lost)."""
    marks = (start or {}).get("startup")
    marks = marks if isinstance(marks, dict) else {}  # the records are untrusted input
    t = [last_step_time, failure_time, marks.get("group_up"), marks.get("process_group"),
         marks.get("restore_started"), None, marks.get("state_loaded"), first_step_time,
         caught_up_time]
    load_s = marks.get("load_s")
    if _is_number(t[6]) and _is_number(load_s):
        t[5] = t[6] - load_s  # checkpoint verified: state loading began
    parts = {}
    for name, a, b in zip(RECOVERY_PARTS, t, t[1:]):
        parts[name] = (b - a) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None
    ends = [x for x in (caught_up_time, first_step_time) if x is not None]
    begin = last_step_time if last_step_time is not None else failure_time
    parts["total"] = (ends[0] - begin) if ends else None
    return parts


def recovery_line(i: int, rec: dict) -> str:
    """`raygpt status`'s line for recovery `i` (1-based)."""
    parts = rec["parts"]
    shown = []
    for name in RECOVERY_PARTS:
        v = parts.get(name)
        if v is None:
            continue
        extra = f" ({rec['steps_retrained']} steps)" if name == "retrained" else ""
        shown.append(f"{PART_LABELS[name]} {v:.2f} s{extra}")
    total = parts.get("total")
    return (f"recovery {i}: " + (f"{total:.2f} s" if total is not None else "not trained again yet")
            + (" = " + " + ".join(shown) if shown else ""))


def summarize_run(records, since: float | None = None) -> dict:
    """Failures, resumes, recovery times and goodput of a run (or of the part after `since`).

    recovery time: from a failure record to the next step trained after it.
    recoveries: each recovery split into its parts (`recovery_split`), from the last step
    trained before a failure to the last step the next attempt re-trained.
    goodput: the time spent on the steps that made the final loss curve (each step's latest
    attempt) over the wall-clock time from the first to the last record; what is missing was
    lost to failures, restarts, re-done steps, evaluation and checkpoint stalls.
    `records` may be any iterable (a stream: see `GoodputTally`).
    """
    tally = GoodputTally(since)
    for r in records:
        tally.add(r)
    return tally.result()


class GoodputTally:
    """`summarize_run` one record at a time, keeping only a number per step (not the records),
    so `raygpt status` can stream a long history."""

    def __init__(self, since: float | None = None):
        self.since = since
        self.failures = self.resumes = 0
        self.pending: list[float] = []  # failure times awaiting the next step trained after them
        self.recoveries: list[float] = []
        self.latest: dict[int, float] = {}  # step -> dt of its latest attempt
        self.first_time = self.last_time = None
        self.count = 0
        self.last_step_time: float | None = None  # the newest train record's time
        self.open: list[dict] = []  # recoveries whose attempt has not caught up yet
        self.split: list[dict] = []  # every recovery, in order of its failure
        self.next_step = 0  # one past the highest step trained so far

    def _recovery_event(self, r: dict, kind: str, t: float) -> None:
        if kind == "failure":
            rec = {"last_step_time": self.last_step_time, "failure_time": t, "start": None,
                   "first_step_time": None, "caught_up_time": None, "catch_up_step": None,
                   "steps_retrained": None}
            self.split.append(rec)
            self.open.append(rec)
        elif kind in ("start", "resume"):
            # the attempt that recovers from every failure since the last start (a worker
            # group that failed while starting is the same recovery, still going)
            for rec in self.open:
                if rec["first_step_time"] is None:
                    rec["start"] = r
                    # a restart with no checkpoint to resume from trains every step again
                    lost = r.get("steps_lost") if kind == "resume" else self.next_step
                    from_step = r.get("resumed_from") if _is_int(r.get("resumed_from")) else 0
                    rec["steps_retrained"] = lost if isinstance(lost, int) and lost > 0 else 0
                    rec["catch_up_step"] = from_step + rec["steps_retrained"] - 1
        elif kind == "train":
            for rec in self.open:
                if rec["start"] is None:
                    continue
                if rec["first_step_time"] is None:
                    rec["first_step_time"] = t
                if _is_int(r.get("step")) and r["step"] >= rec["catch_up_step"]:
                    rec["caught_up_time"] = t
            self.open = [rec for rec in self.open if rec["caught_up_time"] is None]
            self.last_step_time = t
            if isinstance(r.get("step"), int):
                self.next_step = max(self.next_step, r["step"] + 1)

    def add(self, r: dict) -> None:
        t = r.get("time", 0)
        if not _is_number(t) or not math.isfinite(t):
            return
        if self.since is not None and t < self.since:
            return
        self.count += 1
        if self.first_time is None:
            self.first_time = t
        self.last_time = t
        kind = r.get("kind")
        if kind == "train" and _is_int(r.get("step")):
            dt = r.get("dt", 0.0)
            self.latest[r["step"]] = dt if _is_number(dt) and math.isfinite(dt) else 0.0
            still = [f for f in self.pending if not t > f]
            self.recoveries += [t - f for f in self.pending if t > f]
            self.pending = still
        elif kind == "failure":
            self.failures += 1
            self.pending.append(t)
        elif kind == "resume":
            self.resumes += 1
        self._recovery_event(r, kind, t)

    def result(self) -> dict:
        wall = (self.last_time - self.first_time) if self.count > 1 else 0.0
        useful = sum(self.latest.values())
        goodput = useful / wall if wall > 0 else float("nan")
        recoveries = self.recoveries
        line = (f"{self.failures} failure(s), {self.resumes} resume(s)"
                + (f", recovery {', '.join(f'{t:.1f} s' for t in recoveries)}" if recoveries else "")
                + f" | goodput {100 * goodput:.1f}% ({useful:.1f} s training of {wall:.1f} s)")
        split = [{"parts": recovery_split(rec["last_step_time"], rec["failure_time"], rec["start"],
                                          rec["first_step_time"], rec["caught_up_time"]),
                  "steps_retrained": rec["steps_retrained"]} for rec in self.split]
        return {"failures": self.failures, "resumes": self.resumes, "recovery_s": recoveries,
                "goodput": goodput, "line": line, "recoveries": split,
                "recovery_lines": [recovery_line(i, rec) for i, rec in enumerate(split, 1)]}
