"""The run's own memory: loss_history.jsonl and samples.jsonl, and the resume audit.

`loss_history.jsonl` gets one line per step, validation, event (skip, rewind, resume, failure,
end) and never loses one: it is appended across restarts and policy changes, never truncated or
rewritten. Each record carries the attempt number. When a resumed attempt passes steps
an earlier attempt already logged, the audit compares the two losses as floats and says either
"resume verified bit-exact over K steps" or where and by how much they first differ, so a resume
that lost state is noticed at once, not a week later.

All I/O goes through `RunDir` (local, NFS or object storage). Only rank 0 writes. On an object
store the appends are buffered in a local mirror (see `RunDir`); the history flushes it after the
rare events a reader must see even if the process dies next (FLUSH_AFTER), and the checkpointer
flushes at every checkpoint publish.
"""

from __future__ import annotations

import json
import logging
import time

from raygpt.storage import RunDir

log = logging.getLogger(__name__)

LOSS_HISTORY = "loss_history.jsonl"
SAMPLES = "samples.jsonl"
# an attempt's start, a rewind (perhaps escalated: the process stops right after) and the end
# (also a stop by signal): stored at once on an object store, not at the next flush interval
FLUSH_AFTER = frozenset({"start", "resume", "rewind", "end"})


def iter_records(lines, name: str):
    """The complete records among JSONL `lines` (bytes); a torn line (a crash mid-append) or an
    overlong one is skipped with a warning."""
    for raw in lines:
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            log.warning(f"raygpt | WARNING: {name}: skipping a torn line {raw[:60]!r}")
            continue
        if isinstance(rec, dict):
            yield rec


def parse_jsonl(data: bytes, name: str) -> list[dict]:
    """Complete records of a JSONL file; a torn last line (a crash mid-append) is skipped."""
    return list(iter_records(data.split(b"\n"), name))


def iter_history(run_dir: RunDir):
    """The records of loss_history.jsonl, streamed (memory bounded by one chunk and one line,
    whatever the file's size); nothing when there is no history."""
    if not run_dir.exists(LOSS_HISTORY):
        return
    yield from iter_records(run_dir.iter_lines(LOSS_HISTORY), run_dir.uri(LOSS_HISTORY))


def read_history(run_dir: RunDir) -> list[dict]:
    return list(iter_history(run_dir))


class ResumeAudit:
    """Compares a resumed attempt's losses with an earlier attempt's at the same steps."""

    def __init__(self, previous: dict[int, float]):
        self.previous = previous
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
                return (f"resume audit: WARNING step {step} loss {loss!r} differs from the earlier "
                        f"attempt's {before!r} by {loss - before:+.3e} after {self.matched} equal "
                        f"steps: the resume did not restore everything")
        if step >= max(self.previous):
            self.reported = True
            return f"resume verified bit-exact over {self.matched} steps"
        return None


def steps_logged(records: list[dict]) -> dict[int, float]:
    """{step: loss} from loss-history records, the latest attempt of each step winning (the file
    is in time order, so a step re-run after a resume or rewind overrides its earlier line).
    Step records carry "step" and "loss"; records with an "event" key (a skip or rewind note,
    even one that repeats the loss) are ignored."""
    out: dict[int, float] = {}
    for rec in records:
        if "step" in rec and "loss" in rec and "event" not in rec:
            out[int(rec["step"])] = float(rec["loss"])
    return out


def trajectory_losses(records) -> dict[int, float]:
    """{step: loss} of the trajectory the run is on, from loss-history records in file order:
    each step's latest train record, without the steps a rewind abandoned (a rewind to
    checkpoint T re-trains from step T, so every step >= T logged before it belongs to a
    trajectory the run left; one the run did not re-train before a crash must not be what a
    resume's audit compares with: the resume skips the same data window and differs there)."""
    out: dict[int, float] = {}
    for r in records:
        kind = r.get("kind")
        if kind == "rewind" and isinstance(r.get("to_step"), int):
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

    def _append(self, name: str, record: dict) -> None:
        if self.enabled:
            self.run_dir.append_text(name, json.dumps(record, separators=(",", ":")) + "\n")

    def begin_attempt(self, resumed_from: int | None, note: str | None, max_steps: int | None = None) -> int:
        """Number this attempt, mark the resume point, arm the resume audit."""
        if not self.enabled:
            return 0
        records = read_history(self.run_dir)
        self.attempt = 1 + max((r.get("attempt") or 0 for r in records), default=0)
        if resumed_from is not None:
            earlier = trajectory_losses(records)
            self.audit = ResumeAudit({s: l for s, l in earlier.items() if s >= resumed_from})
        self.event(resumed_from or 0, "resume" if resumed_from is not None else "start",
                   resumed_from=resumed_from, note=note, max_steps=max_steps,
                   steps_lost=(max(trajectory_losses(records), default=-1) + 1 - resumed_from)
                   if resumed_from is not None else None)
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
            self.run_dir.flush()

    def sample(self, step: int, text: str) -> None:
        self._append(SAMPLES, {"step": step, "text": text, "time": time.time(),
                               "attempt": self.attempt})

    def end(self, summary: dict) -> None:
        self.event(summary["step"], "end", **{k: v for k, v in summary.items() if k != "step"})


def summarize_run(records, since: float | None = None) -> dict:
    """Failures, resumes, recovery times and goodput of a run (or of the part after `since`).

    recovery time: from a failure record to the next step trained after it.
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

    def add(self, r: dict) -> None:
        t = r.get("time", 0)
        if not isinstance(t, (int, float)):
            return
        if self.since is not None and t < self.since:
            return
        self.count += 1
        if self.first_time is None:
            self.first_time = t
        self.last_time = t
        kind = r.get("kind")
        if kind == "train":
            dt = r.get("dt", 0.0)
            self.latest[r.get("step")] = dt if isinstance(dt, (int, float)) else 0.0
            still = [f for f in self.pending if not t > f]
            self.recoveries += [t - f for f in self.pending if t > f]
            self.pending = still
        elif kind == "failure":
            self.failures += 1
            self.pending.append(t)
        elif kind == "resume":
            self.resumes += 1

    def result(self) -> dict:
        wall = (self.last_time - self.first_time) if self.count > 1 else 0.0
        useful = sum(self.latest.values())
        goodput = useful / wall if wall > 0 else float("nan")
        recoveries = self.recoveries
        line = (f"{self.failures} failure(s), {self.resumes} resume(s)"
                + (f", recovery {', '.join(f'{t:.1f} s' for t in recoveries)}" if recoveries else "")
                + f" | goodput {100 * goodput:.1f}% ({useful:.1f} s training of {wall:.1f} s)")
        return {"failures": self.failures, "resumes": self.resumes, "recovery_s": recoveries,
                "goodput": goodput, "line": line}
