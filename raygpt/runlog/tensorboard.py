"""TensorBoard event files for a run's standard scalars, under `<run dir>/tb/`.

Rank 0 calls `TensorBoardWriter.train(...)` once per step and `.val(...)` per validation:
    train/loss  train/lr  train/grad_norm  train/tok_per_s      every step
    val/loss                                                    every validation
Each attempt (a resume, a Ray restart) writes a new event file into `tb/` with `purge_step` =
the step it resumed from, so TensorBoard shows one curve, as loss_history.jsonl does.

Events are written with tensorboardX (`pip install 'raygpt[tensorboard]'`; without it the writer
prints one line and does nothing). On an object store the event file is written locally and
uploaded whole into `tb/` every `upload_every_s` seconds, at every validation and at `close()`;
a crash loses at most that long of TensorBoard points (loss_history.jsonl loses none).

`read_scalars` reads the same format (TFRecord framing: u64 length, masked crc32c of the length,
the serialized `Event` protobuf, masked crc32c of the data), for tests and for checking a run
without TensorBoard.
"""

from __future__ import annotations

import logging
import shutil
import struct
import tempfile
import time
from pathlib import Path

from raygpt.storage import RunDir, open_run_dir

log = logging.getLogger(__name__)

TB_DIR = "tb"
EVENT_FILE_MARK = "tfevents"  # every event file's name contains it (events.out.tfevents.<time>...)
FILE_VERSION = "brain.Event:2"  # the first event of every event file says this


class TensorBoardWriter:
    """Scalars of one attempt of a run; a no-op when disabled (ranks other than 0) or when
    tensorboardX is not installed.

    Writes synchronously through tensorboardX's `EventsWriter` (no queue, no thread: what was
    flushed is in the file), one `Event` per call carrying all of that call's scalars. The file
    is flushed (and fsynced: RecordWriter does) by the first call `flush_every_s` seconds after
    the last flush, at every validation and at close."""

    def __init__(self, run_dir: RunDir, *, enabled: bool = True, purge_step: int | None = None,
                 flush_every_s: float = 10.0, upload_every_s: float = 60.0):
        self._events = None
        if not enabled:
            return
        try:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event, SessionLog
            from tensorboardX.proto.summary_pb2 import Summary
        except ImportError:
            log.info("raygpt | TensorBoard: tensorboardX is not installed, no event files "
                     "(pip install 'raygpt[tensorboard]')")
            return
        self._EventsWriter, self._Event, self._SessionLog, self._Summary = (
            EventsWriter, Event, SessionLog, Summary)
        self.run_dir = run_dir
        self.flush_every_s, self.upload_every_s = flush_every_s, upload_every_s
        self._open(purge_step)

    def _open(self, purge_step: int | None) -> None:
        self._last_flush = self._last_upload = time.monotonic()
        if self.run_dir.caps.local_paths:  # TensorBoard writes by path
            self.run_dir.makedirs(TB_DIR)
            self.local_dir, self._staging = self.run_dir.local_path(TB_DIR), False
        else:
            self.local_dir, self._staging = Path(tempfile.mkdtemp(prefix="raygpt-tb-")), True
        # The file name has whole seconds (events.out.tfevents.<s>.<host>); the suffix keeps two
        # attempts started within one second apart, and name order = creation order.
        self._events = self._EventsWriter(str(self.local_dir / "events"), f".{time.time_ns()}")
        if purge_step is not None:
            # TensorBoard's resume marker: hide the earlier files' points at steps >= purge_step
            self._events.write_event(self._Event(
                wall_time=time.time(), step=purge_step,
                session_log=self._SessionLog(status=self._SessionLog.START)))

    @property
    def active(self) -> bool:
        return self._events is not None

    def restart_at(self, step: int) -> None:
        """After a rewind to `step`: close this event file and start another that purges the
        points at steps >= `step`, so TensorBoard shows the re-done steps once, not twice."""
        if self._events is None:
            return
        self.close()
        self._open(step)

    def _scalars(self, step: int, pairs) -> None:
        summary = self._Summary(value=[self._Summary.Value(tag=tag, simple_value=float(v))
                                       for tag, v in pairs])
        self._events.write_event(self._Event(wall_time=time.time(), step=step, summary=summary))

    def train(self, step: int, *, loss: float, lr: float, norm: float, tok_per_s: float) -> None:
        if self._events is None:
            return
        self._scalars(step, (("train/loss", loss), ("train/lr", lr), ("train/grad_norm", norm),
                             ("train/tok_per_s", tok_per_s)))
        now = time.monotonic()
        if self._staging and now - self._last_upload >= self.upload_every_s:
            self.upload()
        elif now - self._last_flush >= self.flush_every_s:
            self.flush()

    def val(self, step: int, val_loss: float) -> None:
        if self._events is None:
            return
        self._scalars(step, (("val/loss", val_loss),))
        self.upload() if self._staging else self.flush()

    def scalar(self, step: int, tag: str, value: float) -> None:
        if self._events is None:
            return
        self._scalars(step, ((tag, value),))
        self.upload() if self._staging else self.flush()

    def flush(self) -> None:
        if self._events is not None:
            self._events.flush()
            self._last_flush = time.monotonic()

    def upload(self) -> None:
        """Flush, and copy the local event file into `<run dir>/tb/` (remote run dirs only)."""
        self.flush()
        if self._events is not None and self._staging:
            self.run_dir.upload_dir(self.local_dir, TB_DIR)
            self._last_upload = time.monotonic()

    def close(self) -> None:
        if self._events is None:
            return
        self.upload()
        self._events.close()
        if self._staging:
            shutil.rmtree(self.local_dir, ignore_errors=True)
        self._events = None


# ---------------------------------------------------------------------- reader

_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")


def _masked_crc32c(data: bytes) -> int:
    # TFRecord's masking: rotate right by 15 and add a constant, mod 2^32
    from tensorboardX.crc32c import crc32c
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(data: bytes, name: str = "<events>") -> list:
    """The `Event` protobufs of one event file, checking the framing CRCs and the file version."""
    from tensorboardX.proto.event_pb2 import Event

    events, off = [], 0
    while off < len(data):
        if off + 12 > len(data):
            raise ValueError(f"{name}: record header at byte {off}: expected 12 bytes, found "
                             f"{len(data) - off} (file truncated)")
        (length,) = _LEN.unpack_from(data, off)
        (len_crc,) = _CRC.unpack_from(data, off + 8)
        if len_crc != _masked_crc32c(data[off:off + 8]):
            raise ValueError(f"{name}: record at byte {off}: length crc32c mismatch")
        body = data[off + 12:off + 12 + length]
        if len(body) != length or off + 16 + length > len(data):
            raise ValueError(f"{name}: record at byte {off}: expected {length} bytes of data and a "
                             f"crc, found {len(data) - off - 12} (file truncated)")
        (body_crc,) = _CRC.unpack_from(data, off + 12 + length)
        if body_crc != _masked_crc32c(body):
            raise ValueError(f"{name}: record at byte {off}: data crc32c mismatch")
        event = Event()
        event.ParseFromString(body)
        events.append(event)
        off += 16 + length
    if events and events[0].file_version != FILE_VERSION:
        raise ValueError(f"{name}: first event file_version: expected {FILE_VERSION!r}, found "
                         f"{events[0].file_version!r}")
    return events


def read_scalars(run_dir: RunDir | str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from every event file in `<run dir>/tb/`, files in name order
    (= creation time), points in file order; `run_dir`: a RunDir, or a place a library
    caller names (opened here, once)."""
    run_dir = open_run_dir(run_dir)
    out: dict[str, list[tuple[int, float]]] = {}
    for name in run_dir.listdir(TB_DIR, files_only=True):
        if EVENT_FILE_MARK not in name:
            continue
        rel = f"{TB_DIR}/{name}"
        for event in read_events(run_dir.read_bytes(rel), run_dir.uri(rel)):
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out
