"""Append-only logs on object stores: immutable segments, read back in order as one file.

An object store has no append, so on a run directory whose store has none (`caps.appends`) each log
(loss_history.jsonl, samples.jsonl, main.log, fault_injection.jsonl) is a folder of small
immutable objects; local and NFS run directories keep the single file with a real, fsynced
append per line (what llm.c's tools and `tail -f` read; see `LogFile`). The layout:

    <run dir>/loss_history/part-00000007-3f9a1c2e.jsonl   lines written in one interval
    <run dir>/loss_history/base-00000006.jsonl            optional: `compact`'s merge of
                                                          every part numbered <= 6
    (likewise samples/part-*.jsonl, main_log/part-*.log and fault_injection/part-*.jsonl)

- `part-<seq:08d>-<writer:8 hex>.<ext>`: whole lines (ending with a newline), one put, never
  changed. `seq` orders the parts; `writer` (random per process) keeps two processes that pick
  the same `seq` (rank 0 and the driver's failure record) apart; equal `seq`s read in `writer`
  order.
- `base-<seq:08d>.<ext>`: `compact`'s merge of the single file (if any) and every part <= seq.
  Readers take the highest base and the parts above it; parts at or below it are leftovers.
- A single file beside the folder is read first, then the parts; a base replaces it.

Writing (`SegmentWriter`): a background thread seals the lines collected into a part every
`interval_s` or `max_lines` and puts it; the training thread only appends to a list. Past
`max_queued` sealed parts an append waits (a slow store slows the run rather than filling
memory); `flush()` seals and waits for every put. A process killed outright loses the lines not
yet stored. `compact` is for a run that is not writing (a live writer's part numbered at or
below a new base would be hidden): `raygpt compact` holds the run directory's lease.

Reading (`read_lines`): a part without a final newline was cut short; the newest part's cut line
is dropped with a warning, anywhere else it is an error naming the part (lines are missing). A
part larger than MAX_PART_BYTES is not raygpt's: it is skipped unread with a warning naming it,
so a planted sparse file costs neither memory nor time. The single file and a base are streamed.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import logging
import re
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

from raygpt.runlog.terminal import printable
from raygpt.storage import FileTooLarge, RunDir

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 30.0
DEFAULT_MAX_LINES = 10_000
DEFAULT_MAX_QUEUED = 8
READ_AHEAD = 16  # parts a reader fetches at once
READ_AHEAD_BYTES = 64 << 20  # ... and at most this many bytes of them (as listed)
MAX_PART_BYTES = 256 << 20  # a larger part is skipped unread (see the module docstring)


@dataclass(frozen=True)
class LogLayout:
    """One log's names: its single file (`legacy`, the local layout) and its segment folder."""

    legacy: str  # e.g. "loss_history.jsonl"
    folder: str  # e.g. "loss_history"
    ext: str  # e.g. "jsonl"

    def part(self, seq: int, writer: str) -> str:
        return f"{self.folder}/part-{seq:08d}-{writer}.{self.ext}"

    def base(self, seq: int) -> str:
        return f"{self.folder}/base-{seq:08d}.{self.ext}"


class CorruptSegment(ValueError):
    """A segment that cannot be read as part of the log; the message names it."""


def _listing(run_dir: RunDir, layout: LogLayout, names=None):
    """(bases, parts, others) of the segment folder (or of `names` listed in it): bases
    [(seq, name)], parts [(seq, writer, name)], sorted; names that are neither (left alone,
    warned about)."""
    part_re = re.compile(rf"part-(\d{{8}})-([0-9a-f]{{8}})\.{re.escape(layout.ext)}\Z")
    base_re = re.compile(rf"base-(\d{{8}})\.{re.escape(layout.ext)}\Z")
    bases, parts, others = [], [], []
    for name in run_dir.listdir(layout.folder, files_only=True) if names is None else names:
        if m := part_re.match(name):
            parts.append((int(m[1]), m[2], name))
        elif m := base_re.match(name):
            bases.append((int(m[1]), name))
        else:
            others.append(name)
    return sorted(bases), sorted(parts), others


def _plan(run_dir: RunDir, layout: LogLayout, listing=None):
    """What a reader reads, in order: [(rel, kind)] with kind "legacy", "base" or "part"."""
    bases, parts, others = listing or _listing(run_dir, layout)
    for name in others:
        log.warning(printable(f"raygpt | WARNING: {run_dir.uri(f'{layout.folder}/{name}')}: not a "
                              f"segment of {layout.legacy} (expected part-<8 digits>-<8 hex>."
                              f"{layout.ext}); ignored"))
    plan = []
    covered = -1
    if bases:
        covered, name = bases[-1]
        plan.append((f"{layout.folder}/{name}", "base"))
    elif run_dir.exists(layout.legacy):
        plan.append((layout.legacy, "legacy"))
    plan += [(f"{layout.folder}/{name}", "part") for seq, _, name in parts if seq > covered]
    return plan


def exists(run_dir: RunDir, layout: LogLayout) -> bool:
    """Whether the log has anything stored, in either layout."""
    return bool(_plan(run_dir, layout))


def stored_bytes(run_dir: RunDir, layout: LogLayout) -> int:
    return sum(run_dir.size_of(rel) for rel, _ in _plan(run_dir, layout))


def read_lines(run_dir: RunDir, layout: LogLayout):
    """The log's lines (bytes, without newlines) in order: the single file or the newest base,
    then each part above it. A torn or oversized part is handled as the module docstring says."""
    sizes = run_dir.file_sizes(layout.folder)
    plan = _plan(run_dir, layout, _listing(run_dir, layout, sorted(sizes)))
    yield from _read_plan(run_dir, layout, plan, sizes, skip_oversized=True)


def _read_part(run_dir: RunDir, rel: str, skip_oversized: bool) -> bytes | None:
    """A part's bytes; larger than MAX_PART_BYTES: None with a warning (`skip_oversized`), else
    FileTooLarge naming it."""
    try:
        return run_dir.read_bytes(rel, max_bytes=MAX_PART_BYTES)
    except FileTooLarge:
        if not skip_oversized:
            raise
        _warn_oversized(run_dir, rel, "more")
        return None


def _warn_oversized(run_dir: RunDir, rel: str, size) -> None:
    log.warning(printable(f"raygpt | WARNING: {run_dir.uri(rel)}: skipped, unread: expected a "
                          f"segment of at most {MAX_PART_BYTES:,} bytes (what raygpt writes), "
                          f"found {size if isinstance(size, str) else f'{size:,}'} bytes"))


def _read_plan(run_dir: RunDir, layout: LogLayout, plan, sizes: dict[str, int] | None = None, *,
               skip_oversized: bool = False):
    """The lines of `plan`'s files in order. `sizes` ({name in the folder: bytes}, as listed)
    bounds the bytes read ahead; an oversized part is skipped with a warning (readers:
    `skip_oversized`) or raises FileTooLarge (a merge must not drop it)."""
    for rel, kind in plan:
        if kind != "part":
            yield from run_dir.iter_lines(rel)  # streamed: a base may be a week's history
    sizes = sizes or {}
    parts = []  # after the base, in order
    for rel, kind in plan:
        if kind != "part":
            continue
        size = sizes.get(rel.rpartition("/")[2], 0)
        if size > MAX_PART_BYTES and skip_oversized:
            _warn_oversized(run_dir, rel, size)  # unread: a listed size needs no byte of it
        else:
            parts.append((rel, size))
    # a week at 30 s is ~20k parts: read one after another at an object store's ~30 ms per GET
    # that is minutes, so up to READ_AHEAD parts (READ_AHEAD_BYTES) are fetched at once, still
    # yielded in order
    with concurrent.futures.ThreadPoolExecutor(READ_AHEAD) as pool:
        ahead: collections.deque = collections.deque()
        queued = in_flight = 0
        for i, (rel, size) in enumerate(parts):
            while queued < len(parts) and len(ahead) < READ_AHEAD and (
                    not ahead or in_flight + parts[queued][1] <= READ_AHEAD_BYTES):
                ahead.append(pool.submit(_read_part, run_dir, parts[queued][0], skip_oversized))
                in_flight += parts[queued][1]
                queued += 1
            data = ahead.popleft().result()
            in_flight -= size
            if data is None:
                continue
            if data and not data.endswith(b"\n"):
                if i != len(parts) - 1:
                    raise CorruptSegment(
                        f"{run_dir.uri(rel)}: expected a segment that ends with a newline, found "
                        f"one cut short ({len(data)} bytes) with newer segments after it: lines "
                        f"are missing from the middle of {layout.legacy}")
                log.warning(f"raygpt | WARNING: {run_dir.uri(rel)}: the newest segment ends in a "
                            f"cut line (its writer was killed while storing it); skipping that line")
            # what follows the last newline is dropped: b"" in a whole part, the cut line otherwise
            yield from data.split(b"\n")[:-1]


def read_bytes(run_dir: RunDir, layout: LogLayout) -> bytes:
    """The whole log as one file (e.g. llm.c's main.log assembled from its parts)."""
    return b"".join(line + b"\n" for line in read_lines(run_dir, layout))


def delete(run_dir: RunDir, layout: LogLayout) -> None:
    """Remove the log in both layouts (a fresh start over an old run)."""
    run_dir.delete_file(layout.legacy)
    run_dir.delete_dir(layout.folder)


def _next_seq(run_dir: RunDir, layout: LogLayout) -> int:
    bases, parts, _ = _listing(run_dir, layout)
    return 1 + max([s for s, _ in bases] + [s for s, _, _ in parts], default=-1)


def append_once(run_dir: RunDir, layout: LogLayout, text: str) -> None:
    """Append whole lines from a process that writes to the log once (the Ray driver's failure
    record): a real append locally, a part of its own on an object store, stored on return."""
    if run_dir.caps.appends:
        run_dir.append_text(layout.legacy, text)
        run_dir.flush()
        return
    run_dir.write_bytes_atomic(layout.part(_next_seq(run_dir, layout), uuid.uuid4().hex[:8]),
                               text.encode("utf-8"))


# ---------------------------------------------------------------------- writing

class SegmentWriter:
    """Rank 0's writer of one log on an object store; see the module docstring. Thread-safe:
    `append` from the training thread, the puts on this writer's own thread."""

    def __init__(self, run_dir: RunDir, layout: LogLayout, *, interval_s: float = DEFAULT_INTERVAL_S,
                 max_lines: int = DEFAULT_MAX_LINES, max_queued: int = DEFAULT_MAX_QUEUED,
                 clock=time.monotonic):
        self.check(interval_s, max_lines)
        self.run_dir, self.layout = run_dir, layout
        self.interval_s, self.max_lines, self.max_queued = float(interval_s), max_lines, max_queued
        self.clock = clock
        self.writer = uuid.uuid4().hex[:8]
        self._seq: int | None = None  # the next part's number, found on the first seal
        self._lines: list[str] = []
        self._since: float | None = None  # clock time of the oldest unsealed line
        self._queue: collections.deque = collections.deque()  # sealed (text) awaiting a put
        self._busy = False  # a put is running
        self._error: BaseException | None = None
        self._closing = False
        self._cond = threading.Condition()
        self.parts_written = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"raygpt-segments {run_dir.uri(layout.folder)}")
        self._thread.start()
        # the interpreter's exit stores what is left (a Python file flushes at exit, too)
        atexit.register(_flush_quietly, weakref.ref(self))

    @staticmethod
    def check(interval_s, max_lines) -> None:
        if not (isinstance(interval_s, (int, float)) and interval_s > 0):  # also refuses NaN
            raise ValueError(f"segment interval: expected seconds > 0, found {interval_s!r}")
        if not (isinstance(max_lines, int) and max_lines >= 1):
            raise ValueError(f"segment max lines: expected an integer >= 1, found {max_lines!r}")

    # -------------------------------------------------------------- the caller's side
    def append(self, text: str) -> None:
        """Queue whole lines (`text` ends with a newline). Raises the first failed put."""
        with self._cond:
            self._raise()
            if self._closing:
                raise RuntimeError(f"{self.run_dir.uri(self.layout.folder)}: append after close")
            if not self._lines:
                self._since = self.clock()
            self._lines.append(text)
            if len(self._lines) >= self.max_lines:
                self._seal()
                self._cond.notify_all()
            elif len(self._lines) == 1:  # the thread starts this part's clock; later lines
                self._cond.notify_all()  # need not wake it (one wake-up per part, not per step)

    def seal(self) -> None:
        """Make the collected lines a part now (stored by the thread, without waiting)."""
        with self._cond:
            self._raise()
            self._seal()
            self._cond.notify_all()

    def flush(self) -> None:
        """Seal, then wait until every part is stored; raises the first failed put."""
        with self._cond:
            self._seal()
            self._cond.notify_all()
            while (self._queue or self._busy) and self._error is None:
                self._cond.wait()
            self._raise()

    def close(self) -> None:
        """`flush()` and stop the thread."""
        try:
            self.flush()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{self.run_dir.uri(self.layout.folder)}: storing a segment failed "
                               f"({type(self._error).__name__}: {self._error}); the lines after "
                               f"the last stored segment are not stored") from self._error

    def _seal(self) -> None:
        """Move the collected lines to the upload queue (caller holds the lock). Waits while
        `max_queued` parts are already waiting: the bound on memory and on lines at risk."""
        if not self._lines:
            return
        while len(self._queue) >= self.max_queued and self._error is None:
            self._cond.wait()
        self._queue.append("".join(self._lines))
        self._lines, self._since = [], None

    # -------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._error is not None or (self._closing and not self._queue):
                        return
                    due = (self._since is not None
                           and self.clock() - self._since >= self.interval_s)
                    if due and len(self._queue) < self.max_queued:  # full: store one first
                        self._seal()
                    if self._queue:
                        break
                    timeout = (None if self._since is None
                               else max(0.0, self._since + self.interval_s - self.clock()))
                    self._cond.wait(timeout)
                text = self._queue[0]
                self._busy = True
            try:
                self._put(text)
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                with self._cond:
                    self._error, self._busy = e, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._queue.popleft()
                self._busy = False
                self.parts_written += 1
                self._cond.notify_all()

    def _put(self, text: str) -> None:
        # the first part numbers itself above every part stored so far (the earlier attempts',
        # the driver's failure record); later ones count on from there. One listing per writer:
        # a week's history is ~20k parts, too many to list every interval. Another process
        # writing at the same time may take the same number: the writer token keeps both.
        if self._seq is None:
            self._seq = _next_seq(self.run_dir, self.layout)
        self.run_dir.write_bytes_atomic(self.layout.part(self._seq, self.writer),
                                        text.encode("utf-8"))
        self._seq += 1


def _flush_quietly(ref) -> None:
    w = ref()
    if w is None:
        return
    try:
        w.close()
    except Exception as e:  # noqa: BLE001 - at exit: say what is lost, do not raise
        log.warning(f"raygpt | WARNING: {e}")


class LogFile:
    """Where rank 0 appends one log: the single file with fsynced appends on a local / NFS run
    directory (through the RunDir, on its background writer thread when the loop turned that
    on), a `SegmentWriter` on an object store. `flush(wait=False)` only seals the segment."""

    def __init__(self, run_dir: RunDir, layout: LogLayout, *, interval_s: float = DEFAULT_INTERVAL_S,
                 max_lines: int = DEFAULT_MAX_LINES):
        self.run_dir, self.layout = run_dir, layout
        self.interval_s, self.max_lines = interval_s, max_lines
        if not run_dir.caps.appends:  # refuse a bad setting now, not at the first append
            SegmentWriter.check(interval_s, max_lines)
        self.segments: SegmentWriter | None = None  # started by the first append (a thread)

    def append(self, text: str) -> None:
        if self.run_dir.caps.appends:
            self.run_dir.append_text(self.layout.legacy, text)
            return
        if self.segments is None:
            self.segments = SegmentWriter(self.run_dir, self.layout, interval_s=self.interval_s,
                                          max_lines=self.max_lines)
            # a checkpoint publish's run_dir.flush() then stores the parts too
            self.run_dir.add_flush_hook(self.segments.flush)
        self.segments.append(text)

    def flush(self, wait: bool = True) -> None:
        if self.run_dir.caps.appends:
            self.run_dir.flush()  # waits for the RunDir's background queue, if any
        elif self.segments is not None:
            self.segments.flush() if wait else self.segments.seal()

    def close(self) -> None:
        """Store everything appended and stop the writer thread; a later append starts anew."""
        segments, self.segments = self.segments, None
        if segments is None:
            if self.run_dir.caps.appends:
                self.run_dir.flush()
            return
        self.run_dir.remove_flush_hook(segments.flush)
        segments.close()


# ---------------------------------------------------------------------- compaction

def compact(run_dir: RunDir, layout: LogLayout) -> dict:
    """Merge the log's stored layout (single file or base, and every part) into one base object;
    delete what it replaces only after the base is stored and read back equal. Returns
    {"parts": n merged, "bytes": size of the base, "base": its name or None if nothing to do}.
    Meant for a run that is not writing (`raygpt compact`, raygpt.runlog.compact, holds the run's
    lease): a part stored while this runs is kept (not deleted) unless its number is at or below
    the base's."""
    if run_dir.caps.appends:
        return {"parts": 0, "bytes": 0, "base": None}  # a local log is one file already
    listing = _listing(run_dir, layout)  # one listing: what is merged is what is deleted
    bases, parts, _ = listing
    plan = _plan(run_dir, layout, listing)
    merged_parts = [p for p in plan if p[1] == "part"]
    if not merged_parts:
        return {"parts": 0, "bytes": 0, "base": None}
    top = parts[-1][0]
    data = b"".join(line + b"\n" for line in _read_plan(run_dir, layout, plan))
    base = layout.base(top)
    run_dir.write_bytes_atomic(base, data)
    if run_dir.read_bytes(base) != data:  # stored, and stored whole, before anything goes
        raise CorruptSegment(f"{run_dir.uri(base)}: the merged object read back differs from "
                             f"what was written; nothing was deleted")
    for seq, _, name in parts:
        if seq <= top:
            run_dir.delete_file(f"{layout.folder}/{name}")
    for seq, name in bases:
        if seq < top:
            run_dir.delete_file(f"{layout.folder}/{name}")
    run_dir.delete_file(layout.legacy)  # folded into the base
    return {"parts": len(merged_parts), "bytes": len(data), "base": base}
