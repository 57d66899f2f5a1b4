"""Run-directory I/O: every byte raygpt reads or writes under a run directory goes through here.

A run directory (`RunDir`, paths relative to its root with `/` separators) is a `pyarrow.fs`
filesystem plus a root: a local or NFS path, `file://`, `s3://`, `gs://`, or any
`pyarrow.fs.FileSystem` (tests wrap fsspec's in-memory one in `PyFileSystem`).

Durability per backend, so callers never think about it: locally an atomic write is
raygpt.storage.atomic_file's (temp file, fsync, rename, fsync of the directory); on an object store one
PUT is already all-or-nothing. `append_text` is for local / NFS run directories only (object
stores have no append: their logs are raygpt.runlog.segments); `RunDir.background_appends` moves
rank 0's appends onto a writer thread so that a step never waits for an fsync.

`open_run_dir` opens object stores through the URI door (`raygpt.storage.uri.open_filesystem`:
the endpoint applied, every call bounded in time). `check_reachable` says within a deadline,
before Ray starts, whether the store is there, as one line naming the URI and the cause.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import queue
import re
import threading
from pathlib import Path

import pyarrow.fs as pafs

from raygpt.storage.uri import (  # noqa: F401 (re-exported by raygpt.storage)
    CONNECT_TIMEOUT_S, ENDPOINT_VARIABLES, GCS_RETRY_LIMIT_S, REQUEST_TIMEOUT_S, S3_MAX_ATTEMPTS,
    bounded_filesystem, open_filesystem, rebuilt, redact, with_endpoint)
from raygpt.storage.atomic_file import (atomic_local_file, make_dirs_below, move_local_file,
                                open_local_append, open_local_read, write_local_atomic)

log = logging.getLogger(__name__)

_CHUNK = 8 << 20  # 8 MiB: streaming unit for hashing and copying (state files can be GBs)


class RunDir:
    """A run directory: `fs` + `root`; every method takes a path relative to the root.

    Appends (`append_text`: the run logs and fault_injection.jsonl of a local / NFS run
    directory) are written and fsynced before they return, nothing buffered; `background_appends`
    moves them onto a writer thread. An object store has no append: `append_text` refuses it,
    and the logs there are immutable segments (raygpt.runlog.segments) stored at the `flush()`
    points through `add_flush_hook`.
    """

    def __init__(self, fs: pafs.FileSystem, root: str):
        self.fs = fs
        self.root = root.rstrip("/") or root  # keep "/" itself
        self._writer: _Writer | None = None  # set while appends run in the background
        self._flush_hooks: list = []  # see add_flush_hook
        self._line_checked: set[str] = set()  # files whose last line this RunDir has checked

    def __repr__(self) -> str:
        return f"RunDir({self.uri()})"

    def __reduce__(self):
        # a pickled RunDir (sent to another process) arrives without this one's writer or hooks
        return RunDir, (self.fs, self.root)

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ paths
    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, rel: str = "") -> str:
        """The filesystem path of `rel` (what pyarrow.fs calls take)."""
        rel = rel.strip("/")
        if not rel:
            return self.root
        return f"{self.root.rstrip('/')}/{rel}" if self.root else rel

    def local_path(self, rel: str = "") -> Path:
        if not self.is_local:
            raise ValueError(f"{self.uri(rel)}: not on a local filesystem (found {self.fs.type_name})")
        return Path(self.path(rel))

    def uri(self, rel: str = "") -> str:
        """How error messages name a file: the plain path when local, scheme://path otherwise."""
        p = self.path(rel)
        return p if self.is_local else f"{self.fs.type_name}://{p.lstrip('/')}"

    def _relative(self, path: str) -> str:
        """`path` (as the filesystem lists it) relative to the root."""
        return path.strip("/")[len(self.root.strip("/")):].strip("/")

    def _info(self, rel: str) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path(rel))

    # ------------------------------------------------------------------ queries
    def exists(self, rel: str = "") -> bool:
        self._drain()
        return self._info(rel).type != pafs.FileType.NotFound

    def is_dir(self, rel: str = "") -> bool:
        self._drain()
        return self._info(rel).type == pafs.FileType.Directory

    def listdir(self, rel: str = "", *, files_only: bool = False) -> list[str]:
        """Sorted names directly under `rel`; [] when `rel` does not exist."""
        self._drain()
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True))
        return sorted({i.base_name for i in infos
                       if not files_only or i.type == pafs.FileType.File})

    def file_sizes(self, rel: str = "") -> dict[str, int]:
        """{name: bytes} of the files directly under `rel` (one listing); {} when it does not
        exist."""
        self._drain()
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True))
        return {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}

    def size_of(self, rel: str) -> int:
        self._drain()
        info = self._info(rel)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(f"{self.uri(rel)}: expected a file, found {info.type.name}")
        return info.size

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
        """A binary stream of a file: on a local run directory opened through no symbolic link
        below the root and only if it is a regular file (RefusedPath: a planted link to
        /dev/zero or to another user's secret is never read, nor copied on into the run)."""
        if self.is_local:
            return open_local_read(self.local_path(rel), root=self.root)
        return self.fs.open_input_stream(self.path(rel))

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
        if self.is_local:
            make_dirs_below(self.root, self.local_path(rel))
        else:
            self.fs.create_dir(self.path(rel), recursive=True)

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Readers see the old content or all of `data`, never a partial file. Locally a link
        at `rel` is replaced, never written through, and one above it refused (RefusedPath)."""
        self._drain()
        parent = rel.strip("/").rpartition("/")[0]
        self.makedirs(parent)
        if not self.is_local:
            with self.fs.open_output_stream(self.path(rel)) as f:  # one PUT: atomic on object stores
                f.write(data)
            return
        write_local_atomic(self.local_path(rel), [data], root=self.root)

    def make_durable(self, rels) -> None:
        """Make files and directories (their entries) that something else wrote durable, without
        reading their data: local / NFS, open + fsync each (a directory's fsync makes the names
        in it durable); object stores, nothing to do (a completed put is durable). For files
        another writer copied in without an fsync (Ray's checkpoint upload)."""
        if not self.is_local:
            return
        for rel in rels:
            _fsync_path(self.local_path(rel), follow=not rel.strip("/"))  # the root may be a link

    def append_text(self, rel: str, text: str) -> None:
        """Append `text` (UTF-8), whole lines, to a file of a local / NFS run directory: append
        + flush + fsync, durable on return (in the background, `background_appends`: queued,
        done in order by the writer thread). One process (rank 0) owns the appends to a file.
        Nothing is ever rewritten: when a crash tore a file's last line, this RunDir's first
        append to it starts with a newline, so the fragment stays a line of its own (readers
        skip it) and the new line is whole. An object store has no append: ValueError, naming
        the file (its logs are raygpt.runlog.segments' immutable parts)."""
        if not self.is_local:
            raise ValueError(f"{self.uri(rel)}: an object store has no append (expected a local "
                             f"or NFS run directory; logs on object stores are written as "
                             f"segments, raygpt.runlog.segments)")
        if self._writer is not None:
            self._writer.put(self._append_now, rel, text)
        else:
            self._append_now(rel, text)

    def _append_now(self, rel: str, text: str) -> None:
        os.makedirs(self.root, exist_ok=True)
        # O_APPEND|O_NOFOLLOW below a link-free path: a planted run/main.log -> ~/.bashrc is
        # refused (RefusedPath), never appended to
        fd = open_local_append(self.local_path(rel), root=self.root)
        try:
            data = text.encode("utf-8")
            if rel not in self._line_checked:  # once per file: a crash may have torn its last line
                self._line_checked.add(rel)
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    data = b"\n" + data  # the fragment stays a line of its own, which readers skip
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

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
        if self._info(rel).type == pafs.FileType.File:
            self.fs.delete_file(self.path(rel))

    def delete_dir(self, rel: str) -> None:
        """Remove a directory and everything in it; a missing directory is not an error."""
        self._drain()
        if self.is_dir(rel):
            self.fs.delete_dir(self.path(rel))

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
        if not self.is_local:
            self.fs.move(self.path(src), self.path(dst))
            return
        self.open_read(src).close()  # RefusedPath for a link at or above the source
        move_local_file(self.local_path(src), self.local_path(dst), root=self.root)

    def open_write(self, rel: str):
        """A binary stream that stores a whole file at `rel` when closed: locally an atomic
        write (no link followed), on an object store one upload."""
        if self.is_local:
            return atomic_local_file(self.local_path(rel), root=self.root)
        return self.fs.open_output_stream(self.path(rel))

    def move_dir_in(self, local_dir: str | os.PathLike, rel: str) -> None:
        """Put the files under a local directory into `rel` (created if needed), each whole under
        its final name: renamed when the run directory is local and on the same filesystem as
        `local_dir` (no byte is copied: a checkpoint's files are hundreds of MB to GB), else copied
        as `upload_dir` does (the local files then stay; the caller removes `local_dir` either
        way). Durability is the caller's: the files' data as written, their names by
        `make_durable` (the checkpoint finalizer fsyncs the step directory and the run
        directory)."""
        local_dir = Path(local_dir)
        if self.is_local:
            os.makedirs(self.root, exist_ok=True)  # a new run's root, to stat
        if not self.is_local or not self._same_device(local_dir):
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


def _fsync_path(path: Path, *, follow: bool) -> None:
    """fsync a file or a directory by name (a read-only descriptor is enough on Linux); unless
    `follow`, a link there is refused (ELOOP); a FIFO is never waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def join_uri(uri: str, rel: str) -> str:
    """`rel` under a directory given as a local path or a URI, the URI's options
    (`?endpoint_override=...`) kept at its end, where pyarrow reads them."""
    head, sep, query = uri.partition("?") if "://" in uri else (uri, "", "")
    return f"{head.rstrip('/')}/{rel.strip('/')}{sep}{query}"


def open_run_dir(uri) -> RunDir:
    """A RunDir from a local path, a file:// / s3:// / gs:// URI, an (fs, path) pair, or a RunDir
    (returned as it is). An s3:// URI without an endpoint takes AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
    (`with_endpoint`); s3:// and gs:// filesystems get bounded timeouts (`bounded_filesystem`)."""
    if isinstance(uri, RunDir):
        return uri
    if isinstance(uri, tuple):
        fs, path = uri
        if not isinstance(fs, pafs.FileSystem):
            raise TypeError(f"run dir: expected (pyarrow.fs.FileSystem, path), "
                            f"found ({type(fs).__name__}, ...)")
        return RunDir(fs, str(path))
    uri = os.fspath(uri)
    if "://" not in uri:
        return RunDir(pafs.LocalFileSystem(), os.path.abspath(uri))
    fs, path = open_filesystem(uri)
    return RunDir(fs, path)


def store_png(run_dir_uri, out_png, data: bytes) -> None:
    """Write the PNG (of a run or a sweep directory) whole (a temporary file renamed over `out_png`): a link planted at
    run/plot.png is replaced, never written through; inside a local run directory no link
    below its root is followed either (RunDir's writer)."""
    run_dir = open_run_dir(run_dir_uri)
    out = os.path.abspath(out_png)
    rel = os.path.relpath(out, run_dir.root) if run_dir.is_local else ".."
    if rel != ".." and not rel.startswith("../"):  # inside the run directory
        run_dir.write_bytes_atomic(rel, data)
    else:
        write_local_atomic(out, [data])


# ---------------------------------------------------------------------- object stores: endpoint,
# timeouts, reachability

REACHABLE_DEADLINE_S = 10.0  # how long `check_reachable` waits for the store's first answer


class StorageError(ValueError):
    """A run directory's store cannot be used: one line naming the URI and the cause."""

    def __init__(self, uri: str, cause: str):
        super().__init__(f"{uri}: {cause}")
        self.uri, self.cause = uri, cause


_NO_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                   "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")


def storage_cause(e: BaseException, environ=None) -> str:
    """What a store's error means, in one line (pyarrow's S3 errors span lines and name the
    SDK's codes; a user needs to know which of endpoint, bucket and credentials to fix)."""
    text = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()) or type(e).__name__
    environ = os.environ if environ is None else environ
    if "NETWORK_CONNECTION" in text or "Could not connect" in text or "curlCode: 28" in text:
        return f"the endpoint does not answer (unreachable, or it timed out): {text}"
    if "NO_SUCH_BUCKET" in text or re.search(r"[Bb]ucket .* not found|NoSuchBucket", text):
        return f"the bucket does not exist: {text}"
    if any(code in text for code in ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH",
                                     "HTTP status 403", "HTTP status 401", "EXPIRED_TOKEN")):
        found = any(environ.get(v) for v in _NO_CREDENTIALS) or Path(
            environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")).expanduser().exists()
        hint = ("credentials refused" if found else
                "no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "AWS_PROFILE, or use an instance role)")
        return f"access denied, {hint}: {text}"
    return text


def _probe_filesystem(fs: pafs.FileSystem, deadline_s: float) -> pafs.FileSystem:
    """`fs` with its timeouts cut so that a probe gives up before `deadline_s` by itself (two
    tries of at most deadline_s/2.5 each): no call is left running when the probe answers, so
    a command that then exits does not wait for the normal timeouts of a call in flight."""
    step = max(1.0, deadline_s / 2.5)
    return rebuilt(fs, connect=lambda t: min(t, step), request=lambda t: min(t, step),
                    s3_attempts=2, gcs_limit=lambda t: datetime.timedelta(seconds=step))


def check_reachable(run_dir: RunDir, *, deadline_s: float = REACHABLE_DEADLINE_S) -> None:
    """Raise StorageError (one line: the URI and the cause) unless the run directory's store
    answers within `deadline_s`: its bucket exists (s3:// and gs://: the root's first path
    element) and a look at the root succeeds. Local directories pass at once. The look uses
    timeouts that end it before the deadline (`_probe_filesystem`) and runs on a daemon thread,
    so even a store that hangs in a way no timeout covers (a credentials lookup) costs
    `deadline_s`, not the client's retries."""
    if run_dir.is_local:
        return
    fs, root = _probe_filesystem(run_dir.fs, deadline_s), run_dir.root.strip("/")
    bucket = root.split("/", 1)[0]
    outcome: list = []

    def look() -> None:
        try:
            if isinstance(fs, (pafs.S3FileSystem, pafs.GcsFileSystem)) and bucket:
                if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                    outcome.append(f"the bucket does not exist: Bucket '{bucket}' not found")
                    return
            fs.get_file_info(run_dir.path())
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported on the caller's thread
            outcome.append(storage_cause(e))

    thread = threading.Thread(target=look, name=f"raygpt-reach {redact(run_dir.uri())}", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if not outcome:
        raise StorageError(_store_name(run_dir), f"the store did not answer within {deadline_s:g} s "
                           f"(an endpoint that is unreachable or not an object store, or a "
                           f"credentials lookup that hangs)")
    if outcome[0] is not None:
        raise StorageError(_store_name(run_dir), outcome[0])


def _store_name(run_dir: RunDir) -> str:
    """The run directory's URI, with the S3 endpoint it goes to when not AWS's own."""
    name = redact(run_dir.uri())
    if isinstance(run_dir.fs, pafs.S3FileSystem):
        options = run_dir.fs.__reduce__()[1][0]
        if options["endpoint_override"]:
            name += f" (endpoint {options['scheme']}://{options['endpoint_override']})"
    return name
