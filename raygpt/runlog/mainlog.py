"""main.log, llm.c's llmc/logger.h: one line per call, rank 0 only.

    s:<step> trl:<loss %.4f> lr:<%.6f> norm:<%.2f>     train step
    s:<step> tel:<val loss %.4f>                       validation
    s:<step> eval:<%.4f>                               evaluation (e.g. HellaSwag accuracy)
    s:<step> <kind>:1 <key>:<value> ...                raygpt event (skip, rewind, resume, ...)
Event lines keep llm.c's shape "s:N name:number": llm.c's dev/ plotting code reads the second
token of every line as a named stream and plots only trl/tel/eval, so an event lands in a stream of
its own and is otherwise ignored. Event values: ints and bools as %d, floats as %.4f, None as
"none", anything else as its str() with each run of whitespace turned into "_" (one token).
"""

from __future__ import annotations

import re

from raygpt.runlog import segments
from raygpt.runlog.segments import LogFile, LogLayout
from raygpt.storage import RunDir, open_run_dir

MAIN_LOG = "main.log"
# a local / NFS run directory keeps llm.c's one main.log file (llm.c's tools read it); an object
# store gets main_log/part-*.log segments (raygpt.runlog.segments), assembled by `read_main_log`
MAIN_LOG_LAYOUT = LogLayout(MAIN_LOG, "main_log", "log")


def read_main_log(run_dir: RunDir | str) -> bytes:
    """The whole main.log, from either layout; `run_dir`: a RunDir, or a place a library
    caller names (opened here, once)."""
    return segments.read_bytes(open_run_dir(run_dir), MAIN_LOG_LAYOUT)


_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_LLMC_STREAMS = frozenset({"trl", "tel", "eval"})


class Logger:
    """llm.c's Logger: active only on rank 0 with a log_dir; every call appends one line. A
    local or NFS run directory gets llm.c's main.log, each line durable before the call returns
    (fsynced; on the loop's background writer thread, queued); an object store gets segments,
    each stored within `segment_s` seconds or `segment_lines` lines. A fresh start (resume
    false) wipes `{log_dir}/main.log` (both layouts); a resume appends to it. log_dir is the
    run's RunDir (None: no log)."""

    def __init__(self, log_dir: RunDir | None, process_rank: int, resume: bool | int, *,
                 segment_s: float = segments.DEFAULT_INTERVAL_S,
                 segment_lines: int = segments.DEFAULT_MAX_LINES) -> None:
        self.active = log_dir is not None and process_rank == 0
        self.run_dir = log_dir if self.active else None
        self.output_log_file = self.run_dir.uri(MAIN_LOG) if self.active else None
        self.file = (LogFile(self.run_dir, MAIN_LOG_LAYOUT, interval_s=segment_s,
                             max_lines=segment_lines) if self.active else None)
        if self.active and not resume:  # wipe a previous run's log on a fresh start
            if self.run_dir.caps.appends:  # the log is one file
                self.run_dir.write_bytes_atomic(MAIN_LOG, b"")  # llm.c's fopen("w")
            else:
                segments.delete(self.run_dir, MAIN_LOG_LAYOUT)

    def close(self) -> None:
        """Store every line logged (object stores: the last segment)."""
        if self.file is not None:
            self.file.close()

    def _write(self, line: str) -> None:
        if self.active:
            self.file.append(line + "\n")

    def log_train(self, step: int, loss: float, lr: float, norm: float) -> None:
        self._write("s:%d trl:%.4f lr:%.6f norm:%.2f" % (step, loss, lr, norm))

    def log_val(self, step: int, val_loss: float) -> None:
        self._write("s:%d tel:%.4f" % (step, val_loss))

    def log_eval(self, step: int, value: float) -> None:
        self._write("s:%d eval:%.4f" % (step, value))

    def log_event(self, step: int, kind: str, **fields) -> None:
        """`s:<step> <kind>:1 key:value ...`, e.g. `s:57 skip:1 lossz:7.3100 gnormx:1.0200`.
        Fields keep the order given."""
        self._write(format_event(step, kind, **fields))


def format_event(step: int, kind: str, **fields) -> str:
    if not _TOKEN.match(kind) or kind in _LLMC_STREAMS:
        raise ValueError(f"main.log event kind: expected an identifier other than "
                         f"{sorted(_LLMC_STREAMS)}, found {kind!r}")
    parts = ["s:%d" % step, f"{kind}:1"]
    for key, value in fields.items():
        if not _TOKEN.match(key):
            raise ValueError(f"main.log event {kind!r}: field names must be identifiers, "
                             f"found {key!r}")
        parts.append(f"{key}:{_event_value(value)}")
    return " ".join(parts)


def _event_value(value) -> str:
    # A log line must never stop a run, so every value has a one-token form.
    if value is None:
        return "none"
    if isinstance(value, (bool, int)):
        return "%d" % value
    if isinstance(value, float):
        return "%.4f" % value
    return "_".join(str(value).split()) or "_"  # whitespace would split the line's tokens
