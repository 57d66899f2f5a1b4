"""Run-directory I/O: every byte raygpt reads or writes under a run directory goes through here.

A run directory (`RunDir`, paths relative to its root with `/` separators) is a store
(raygpt.storage.store: a local or NFS directory, `file://`, `s3://`, `gs://`, any
`pyarrow.fs.FileSystem`, or the in-memory store of the tests). RunDir asks the store only what
its capabilities say it has, never which backend it is.

Durability per backend, so callers never think about it: the store publishes a file atomically
(locally raygpt.storage.atomic_file's temp file, fsync, rename, fsync of the directory; on an
object store one PUT). `append_text` needs a store with appends (object stores have none: their
logs are raygpt.runlog.segments); `RunDir.background_appends` moves rank 0's appends onto a
writer thread so that a step never waits for an fsync.

`open_run_dir` makes the store through the URI door (`raygpt.storage.uri.open_store`: the
endpoint applied, every call bounded in time). raygpt.storage.reachable says within a deadline,
before Ray starts, whether the store is there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
from pathlib import Path

import pyarrow.fs as pafs

from raygpt.storage.atomic_file import move_local_file, write_local_atomic
from raygpt.storage.local_store import store_for
from raygpt.storage.store import Capabilities, Store, Unsupported
from raygpt.storage.uri import open_store

log = logging.getLogger(__name__)

_CHUNK = 8 << 20  # 8 MiB: streaming unit for hashing and copying (state files can be GBs)


class RunDir:
    """A run directory: a `Store`; every method takes a path relative to its root.

    Appends (`append_text`: the run logs and fault_injection.jsonl where the store appends) are
    written and made durable before they return, nothing buffered; `background_appends` moves
    them onto a writer thread. A store without appends (an object store) refuses
    `append_text`, and the logs there are immutable segments (raygpt.runlog.segments) stored at
    the `flush()` points through `add_flush_hook`.
    """

    def __init__(self, store: Store | pafs.FileSystem, root: str | None = None):
        # RunDir(fs, root) as before the store seam: the store of that filesystem
        self.store = store if isinstance(store, Store) else store_for(store, str(root))
        self._writer: _Writer | None = None  # set while appends run in the background
        self._flush_hooks: list = []  # see add_flush_hook
        self._line_checked: set[str] = set()  # files whose last line this RunDir has checked

    def __repr__(self) -> str:
        return f"RunDir({self.uri()})"

    def __reduce__(self):
        # a pickled RunDir (sent to another process) arrives without this one's writer or hooks
        return RunDir, (self.store,)

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ paths
    @property
    def caps(self) -> Capabilities:
        return self.store.caps

    @property
    def fs(self):
        """The pyarrow filesystem behind the store (Ray's storage filesystem), or None."""
        return self.store.fs

    @property
    def root(self) -> str:
        return self.store.root

    def path(self, rel: str = "") -> str:
        """The store's own path of `rel`."""
        return self.store.path(rel)

    def local_path(self, rel: str = "") -> Path:
        try:
            return self.store.local_path(rel)
        except Unsupported:
            name = self.fs.type_name if self.fs is not None else type(self.store).__name__
            raise ValueError(f"{self.uri(rel)}: not on a local filesystem (found {name})") from None

    def uri(self, rel: str = "") -> str:
        """How error messages name a file: the plain path when local, scheme://path otherwise."""
        return self.store.uri(rel)

    # ------------------------------------------------------------------ queries
    def exists(self, rel: str = "") -> bool:
        self._drain()
        return self.store.info(rel) is not None

    def is_dir(self, rel: str = "") -> bool:
        self._drain()
        entry = self.store.info(rel)
        return entry is not None and entry.kind == "dir"

    def listdir(self, rel: str = "", *, files_only: bool = False) -> list[str]:
        """Sorted names directly under `rel`; [] when `rel` does not exist."""
        self._drain()
        return sorted(n for n, e in self.store.list(rel).items()
                      if not files_only or e.kind == "file")

    def file_sizes(self, rel: str = "") -> dict[str, int]:
        """{name: bytes} of the files directly under `rel` (one listing); {} when it does not
        exist."""
        self._drain()
        return {n: e.size for n, e in self.store.list(rel).items() if e.kind == "file"}

    def size_of(self, rel: str) -> int:
        self._drain()
        entry = self.store.info(rel)
        if entry is None or entry.kind != "file":
            found = "NotFound" if entry is None else {"dir": "Directory"}.get(entry.kind, "Unknown")
            raise FileNotFoundError(f"{self.uri(rel)}: expected a file, found {found}")
        return entry.size

    def read_bytes(self, rel: str, *, max_bytes: int | None = None) -> bytes:
        """The whole file; with `max_bytes`, FileTooLarge instead of reading past that many
        bytes (a file in a run directory is untrusted: a MANIFEST that is a link to /dev/zero
        must not be read until memory runs out)."""
        self._drain()
        if not self.exists(rel):
            raise FileNotFoundError(f"{self.uri(rel)}: no such file")
        with self.open_read(rel) as f:
            return _read_at_most(f, max_bytes, self.uri(rel))

    def open_read(self, rel: str):
        """A binary stream of a file; on a local run directory opened through no symbolic link
        below the root and only if it is a regular file (RefusedPath)."""
        return self.store.open_read(rel)

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """At most `length` bytes of the file from `offset` (one ranged GET on an object store)."""
        self._drain()
        return self.store.read_range(rel, offset, length)

    def iter_lines(self, rel: str, *, max_line: int = 1 << 20, chunk_bytes: int = 1 << 20):
        """The file's lines (bytes, without the newline), streamed in `chunk_bytes` chunks:
        memory stays bounded by a few chunks plus one line, whatever the file's size. A line longer than
        `max_line` bytes is yielded as its first `max_line` bytes followed by b"..." (never a
        valid JSON record), so a hostile file cannot make a reader hold it whole."""
        self._drain()
        with self.open_read(rel) as f:
            pending, overlong = b"", False
            while chunk := f.read(chunk_bytes):
                parts = (pending + chunk).split(b"\n")
                pending = parts.pop()
                for part in parts:
                    yield part[:max_line] + b"..." if overlong or len(part) > max_line else part
                    overlong = False
                if len(pending) > max_line:  # keep the head of an overlong line, drop the rest
                    pending, overlong = pending[:max_line], True
            if pending:
                yield pending + b"..." if overlong else pending

    def sha256_of(self, rel: str, *, max_bytes: int | None = None) -> str:
        """Hex sha256 of a file, streamed in 8 MiB chunks (never the whole file in memory). With
        `max_bytes`, FileTooLarge once more than that many bytes come (a file that is a link to
        /dev/zero does not stream forever)."""
        self._drain()
        h = hashlib.sha256()
        with self.open_read(rel) as f:
            seen = 0
            while chunk := f.read(_CHUNK):
                seen += len(chunk)
                if max_bytes is not None and seen > max_bytes:
                    raise FileTooLarge(f"{self.uri(rel)}: expected at most {max_bytes:,} bytes, "
                                       f"found more")
                h.update(chunk)
        return h.hexdigest()

    # ------------------------------------------------------------------ writes
    def makedirs(self, rel: str = "") -> None:
        """Make a directory and its missing parents; on a local run directory never through a
        symbolic link below the root (RefusedPath): run/checkpoints -> /elsewhere is refused."""
        self._drain()
        self.store.makedirs(rel)

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Readers see the old content or all of `data`, never a partial file. Locally a link
        at `rel` is replaced, never written through, and one above it refused (RefusedPath)."""
        self._drain()
        self.store.publish(rel, data)

    def make_durable(self, rels) -> None:
        """Make files and directories (their entries) that something else wrote durable, without
        reading their data: local / NFS, open + fsync each (a directory's fsync makes the names
        in it durable); object stores, nothing to do (a completed put is durable). For files
        another writer copied in without an fsync (Ray's checkpoint upload)."""
        self.store.make_durable(rels)

    def append_text(self, rel: str, text: str) -> None:
        """Append `text` (UTF-8), whole lines, to a file of a store with appends (`caps.appends`):
        durable on return (in the background, `background_appends`: queued, done in order by
        the writer thread). One process (rank 0) owns the appends to a file. Nothing is ever
        rewritten: when a crash tore a file's last line, this RunDir's first append to it
        starts with a newline, so the fragment stays a line of its own (readers skip it) and
        the new line is whole. A store without appends: ValueError, naming the file (its logs
        are raygpt.runlog.segments' immutable parts)."""
        if not self.caps.appends:
            raise ValueError(f"{self.uri(rel)}: an object store has no append (expected a local "
                             f"or NFS run directory; logs on object stores are written as "
                             f"segments, raygpt.runlog.segments)")
        if self._writer is not None:
            self._writer.put(self._append_now, rel, text)
        else:
            self._append_now(rel, text)

    def _append_now(self, rel: str, text: str) -> None:
        data = text.encode("utf-8")
        if rel not in self._line_checked:  # once per file: a crash may have torn its last line
            self._line_checked.add(rel)
            entry = self.store.info(rel)
            if entry is not None and entry.size and \
                    self.store.read_range(rel, entry.size - 1, 1) != b"\n":
                data = b"\n" + data  # the fragment stays a line of its own, which readers skip
        self.store.append(rel, data)

    @contextlib.contextmanager
    def background_appends(self, enabled: bool = True):
        """While inside, `append_text` only queues its line and returns: one writer thread does
        the appends in order (write + fsync). Why: a step that waits for two fsyncs
        (loss_history.jsonl and main.log) leaves the GPU idle (bench/throughput.py's "other"
        column; docs/performance.md).
        What changes for callers:
        - every other method of this RunDir first waits for the queued appends, so a read
          through it sees every line, and a delete or an overwrite never races a queued append;
        - `flush()` waits for the queue: after it, everything appended is durable (the loop
          flushes at every checkpoint publish and at the end);
        - a failed append is raised by the next `append_text`, `flush()` or the exit of this
          block, with the file's name; the appends queued after it are dropped, so the file
          never has a gap in the middle;
        - a process killed outright loses the lines still queued (a step's worth or two; a
          resumed attempt re-trains those steps anyway).
        Leaving the block drains the queue and stops the thread. `enabled=False` is a no-op
        (ranks other than 0 append nothing)."""
        if not enabled or self._writer is not None:
            yield self
            return
        self._writer = _Writer(f"raygpt-appends {self.uri()}")
        try:
            yield self
        except BaseException:
            writer, self._writer = self._writer, None
            writer.close_quietly()  # the body's error is the one to see
            raise
        writer, self._writer = self._writer, None
        writer.close()

    def _drain(self) -> None:
        if self._writer is not None and threading.current_thread() is not self._writer.thread:
            self._writer.wait()

    def flush(self) -> None:
        """Store every appended line: wait for the queued appends (`background_appends`; each
        is durable once written), then run the flush hooks (the logs' segments on an object
        store)."""
        self._drain()
        for hook in list(self._flush_hooks):
            hook()

    def add_flush_hook(self, hook) -> None:
        """Call `hook()` at every `flush()` and `close()`: how the logs' segments on an object
        store (raygpt.runlog.segments) are stored whenever the run directory is flushed (each
        checkpoint publish, the end of an attempt)."""
        self._flush_hooks.append(hook)

    def remove_flush_hook(self, hook) -> None:
        if hook in self._flush_hooks:
            self._flush_hooks.remove(hook)

    def close(self) -> None:
        """`flush()`; the RunDir stays usable."""
        self.flush()

    def delete_file(self, rel: str) -> None:
        """Remove a file; a file that is already gone is not an error (deletes are retried)."""
        self._drain()
        self.store.delete_file(rel)

    def delete_dir(self, rel: str) -> None:
        """Remove a directory and everything in it; a missing directory is not an error."""
        self._drain()
        self.store.delete_tree(rel)

    # ------------------------------------------------------------------ whole directories
    def upload_dir(self, local_dir: str | os.PathLike, rel: str) -> None:
        """Copy the files under a local directory into `rel` (created if needed)."""
        local_dir = Path(local_dir)
        for src in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            dst = f"{rel.strip('/')}/{src.relative_to(local_dir).as_posix()}"
            self.makedirs(dst.rpartition("/")[0])
            with open(src, "rb") as fin, self.open_write(dst) as fout:
                while chunk := fin.read(_CHUNK):
                    fout.write(chunk)

    def move_file(self, src: str, dst: str) -> None:
        """Rename the file `src` to `dst` inside this run directory; locally without following
        a link below the root on either side (a link at `dst` is replaced), on an object store a
        copy then a delete."""
        self._drain()
        self.store.move(src, dst)

    def open_write(self, rel: str):
        """A binary stream that stores a whole file at `rel` when closed: locally an atomic
        write (no link followed), on an object store one upload."""
        return self.store.open_publish(rel)

    def move_dir_in(self, local_dir: str | os.PathLike, rel: str) -> None:
        """Put the files under a local directory into `rel` (created if needed), each whole under
        its final name: renamed when the run directory is local and on the same filesystem as
        `local_dir` (no byte is copied: a checkpoint's files are hundreds of MB to GB), else copied
        as `upload_dir` does (the local files then stay; the caller removes `local_dir` either
        way). Durability is the caller's: the files' data as written, their names by
        `make_durable` (the checkpoint finalizer fsyncs the step directory and the run
        directory)."""
        local_dir = Path(local_dir)
        renames = self.caps.local_paths and self.caps.atomic_rename
        if renames:
            os.makedirs(self.root, exist_ok=True)  # a new run's root, to stat
        if not renames or not self._same_device(local_dir):
            self.upload_dir(local_dir, rel)
            return
        dest = self.local_path(rel)
        for src in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            target = dest / src.relative_to(local_dir)
            self.makedirs(target.parent.relative_to(self.root).as_posix())
            move_local_file(src, target, root=self.root)

    def _same_device(self, local_dir: Path) -> bool:
        """Whether `local_dir` and this (local) run directory's root are on one filesystem,
        where a rename moves a file."""
        try:
            return os.stat(self.local_path()).st_dev == os.stat(local_dir).st_dev
        except OSError:
            return False


class _Writer:
    """One daemon thread that runs queued calls in order; see `RunDir.background_appends`.
    The first failure is kept and raised to the caller (by `put`, `wait` or `close`), and
    every call queued after it is dropped rather than run out of order."""

    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            call = self._queue.get()
            try:
                if call is None:
                    return
                if self._error is None:
                    fn, args = call
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 - kept, raised on the caller's thread
                self._error = e
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"a background append failed ({type(self._error).__name__}: "
                               f"{self._error}); the lines queued after it were dropped"
                               ) from self._error

    def put(self, fn, *args) -> None:
        self._raise()
        self._queue.put((fn, args))

    def wait(self) -> None:
        """Return once every queued call has run; raise the first failure."""
        self._queue.join()
        self._raise()

    def close(self) -> None:
        self._queue.put(None)
        self.thread.join()
        self._raise()

    def close_quietly(self) -> None:
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - the caller is already raising its own error
            log.warning(f"raygpt | WARNING: {e}")


class FileTooLarge(ValueError):
    """A file is larger than its reader allows; the message names it and the bound."""


MAX_JSON_BYTES = 16 << 20  # raygpt's JSON files (MANIFEST, markers, plans) are KBs to a few MB


def _read_at_most(f, max_bytes: int | None, name: str) -> bytes:
    if max_bytes is None:
        return f.read()
    data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLarge(f"{name}: expected at most {max_bytes:,} bytes, found more")
    return data


def read_json_bounded(run_dir: "RunDir", rel: str, max_bytes: int = MAX_JSON_BYTES):
    """Parse a JSON file of a run directory, reading at most `max_bytes`; ValueError (naming
    the file) when it is larger, a link, not UTF-8, or not JSON (`parse_json`)."""
    return parse_json(run_dir.read_bytes(rel, max_bytes=max_bytes), run_dir.uri(rel))


class JSONError(ValueError):
    """An untrusted JSON value that does not parse: `where` (the file, and the line where there
    is one) and `reason`, one line."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def parse_json(data: bytes | str, where: str, *, line: int | None = None):
    """The one parse of a JSON value read from a file that raygpt does not control (anything in
    a run or sweep directory): JSONError naming `where` (and `line`) when it is not UTF-8, not
    JSON, or nested deeper than the parser's recursion allows (a line of 200,000 '[' makes
    json.loads raise RecursionError, which no reader expects)."""
    where = f"{where}: line {line}" if line is not None else where
    try:
        return json.loads(data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data)
    except RecursionError:
        raise JSONError(where, "expected JSON, found arrays or objects nested too deep to "
                               "parse") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise JSONError(where, f"expected JSON ({e})") from e


def join_uri(uri: str, rel: str) -> str:
    """`rel` under a directory given as a local path or a URI, the URI's options
    (`?endpoint_override=...`) kept at its end, where pyarrow reads them."""
    head, sep, query = uri.partition("?") if "://" in uri else (uri, "", "")
    return f"{head.rstrip('/')}/{rel.strip('/')}{sep}{query}"


def open_run_dir(uri) -> RunDir:
    """A RunDir from a local path, a file:// / s3:// / gs:// URI (through the URI door,
    `open_store`: the endpoint applied, every remote call bounded), an (fs, path) pair, a
    Store, or a RunDir (returned as it is)."""
    if isinstance(uri, RunDir):
        return uri
    if isinstance(uri, Store):
        return RunDir(uri)
    if isinstance(uri, tuple):
        fs, path = uri
        if not isinstance(fs, pafs.FileSystem):
            raise TypeError(f"run dir: expected (pyarrow.fs.FileSystem, path), "
                            f"found ({type(fs).__name__}, ...)")
        return RunDir(store_for(fs, str(path)))
    return RunDir(open_store(uri))


def store_png(run_dir: RunDir, out_png, data: bytes) -> None:
    """Write the PNG (of a run or a sweep directory) whole (a temporary file renamed over `out_png`): a link planted at
    run/plot.png is replaced, never written through; inside a local run directory no link
    below its root is followed either (RunDir's writer)."""
    out = os.path.abspath(out_png)
    rel = os.path.relpath(out, run_dir.root) if run_dir.caps.local_paths else ".."
    if rel != ".." and not rel.startswith("../"):  # inside the run directory
        run_dir.write_bytes_atomic(rel, data)
    else:
        write_local_atomic(out, [data])
