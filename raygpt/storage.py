"""Run-directory I/O: every byte raygpt reads or writes under a run directory goes through here.

A run directory is a `pyarrow.fs` filesystem plus a root path: a local or NFS path, `file://`,
`s3://`, `gs://`, or any `pyarrow.fs.FileSystem` (tests use fsspec's in-memory filesystem wrapped
in `PyFileSystem`). `RunDir` takes paths relative to the root, always with `/` separators.

Durability differs by backend and is handled here so callers never think about it:
- local: an atomic write is raygpt.atomic_file's (temp file in the same directory, fsync,
  rename, fsync of the directory), so a crash leaves the old file or the new one, never a torn one;
- object stores: one PUT is already all-or-nothing, so an atomic write is a single put.
Object stores have no append: appends go to a local mirror of the file that is uploaded whole
(one put) every `flush_interval_s` and on `flush()` (see `RunDir` for what that trades away).
The training loop's rank 0 moves its appends onto a writer thread (`RunDir.background_appends`)
so that a training step never waits for an fsync or an upload.

Object stores are opened bounded and where the user points (`open_run_dir`):
- an S3-compatible endpoint (MinIO, Ceph, moto in the tests) comes, as for the AWS tools, from
  the URI's own `?endpoint_override=`, else `--storage-endpoint`, else AWS_ENDPOINT_URL_S3, else
  AWS_ENDPOINT_URL (`with_endpoint` writes it into the URI, so every process of a run opens the
  same store from the same string);
- every remote call is bounded: S3 connects within CONNECT_TIMEOUT_S, a request that stalls
  REQUEST_TIMEOUT_S fails, S3_MAX_ATTEMPTS tries in all; GCS retries for GCS_RETRY_LIMIT_S at most;
- `check_reachable` answers within a deadline whether the store is there (bucket, credentials,
  endpoint), as one line naming the URI and the cause (`StorageError`), before Ray starts.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import json
import logging
import os
import queue
import re
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pyarrow.fs as pafs

from raygpt.atomic_file import write_local_atomic

log = logging.getLogger(__name__)

_CHUNK = 8 << 20  # 8 MiB: streaming unit for hashing and copying (state files can be GBs)
DEFAULT_FLUSH_INTERVAL_S = 30.0  # how old an appended line gets before an append uploads it


class RunDir:
    """A run directory: `fs` + `root`; every method takes a path relative to the root.

    Appends (`append_text`: local run logs, fault_injection.jsonl; on object stores the run logs
    are immutable segments instead, raygpt.runlog.segments) and their durability:
    - local / NFS: every append is written and fsynced before it returns; nothing is buffered.
    - object stores: there is no append, and rewriting a 100 MB loss history per step is not an
      option, so each appended file has a local mirror (a private temp file, seeded on first use
      from the stored object, so an existing file is continued, never truncated). Appends go to
      the mirror; the whole mirror is uploaded in one put (all-or-nothing) by the first append
      that finds its oldest un-uploaded line `flush_interval_s` old (0: every append), and by
      `flush()` (no timer thread: the interval is checked at each append). The loop flushes at
      every checkpoint publish (so the stored history is at least as new as the newest
      checkpoint), at the start, rewinds and the end of an attempt (a stop by signal included),
      and `close()` / garbage collection / interpreter exit flush too, like a Python file. The
      trade-off: a process killed outright (SIGKILL, node loss) loses the lines appended since
      the last upload (about one interval while steps keep coming); a resumed attempt re-trains
      those steps anyway and logs them again. Each upload is the whole file, synchronous on the
      appending thread (~100 MB every 30 s for a week-long run: ~3 MB/s from rank 0).
    - readers: reads through this RunDir (`read_bytes`, `exists`, `size_of`, `sha256_of`,
      `listdir`) see the mirror, i.e. every line appended so far; any other RunDir or process
      (`raygpt status`, a resumed attempt) sees what was last flushed.
    - in the background (`background_appends()`, what the training loop's rank 0 uses): the
      appends above are queued to one writer thread and done there in order; see that method.
    One process owns the appends to a file (rank 0). The Ray driver's failure record is the one
    foreign append: when an upload finds the stored object grown past what this process last
    stored, the foreign bytes are kept (spliced in before this process's new lines).
    """

    def __init__(self, fs: pafs.FileSystem, root: str, *,
                 flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S, clock=time.monotonic):
        if not flush_interval_s >= 0:  # also refuses NaN
            raise ValueError(f"RunDir flush_interval_s: expected seconds >= 0, "
                             f"found {flush_interval_s!r}")
        self.fs = fs
        self.root = root.rstrip("/") or root  # keep "/" itself
        self.flush_interval_s = float(flush_interval_s)
        self._appends = None if self.is_local else _Appends(fs, self.flush_interval_s, clock)
        if self._appends is not None:  # flush what is buffered when this RunDir goes away
            weakref.finalize(self, self._appends.close_quietly)
        self._writer: _Writer | None = None  # set while appends run in the background
        self._flush_hooks: list = []  # see add_flush_hook
        self._line_checked: set[str] = set()  # files whose last line this RunDir has checked

    def __repr__(self) -> str:
        return f"RunDir({self.uri()})"

    def __reduce__(self):
        # a pickled RunDir (sent to another process) arrives without this one's mirrors
        return _rebuild_run_dir, (self.fs, self.root, self.flush_interval_s)

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

    def _info(self, rel: str) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path(rel))

    # ------------------------------------------------------------------ queries
    def _mirror(self, rel: str) -> "_Mirror | None":
        return self._appends.mirrors.get(self.path(rel)) if self._appends is not None else None

    def exists(self, rel: str = "") -> bool:
        self._drain()
        return self._mirror(rel) is not None or self._info(rel).type != pafs.FileType.NotFound

    def is_dir(self, rel: str = "") -> bool:
        self._drain()
        return self._info(rel).type == pafs.FileType.Directory

    def listdir(self, rel: str = "", *, files_only: bool = False) -> list[str]:
        """Sorted names directly under `rel`; [] when `rel` does not exist."""
        self._drain()
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True))
        names = {i.base_name for i in infos if not files_only or i.type == pafs.FileType.File}
        if self._appends is not None:  # appended files not uploaded yet are here all the same
            here = self.path(rel).rstrip("/")
            names.update(p.rpartition("/")[2] for p in self._appends.mirrors
                         if p.rpartition("/")[0].rstrip("/") == here)
        return sorted(names)

    def size_of(self, rel: str) -> int:
        self._drain()
        if (m := self._mirror(rel)) is not None:
            return m.local.stat().st_size
        info = self._info(rel)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(f"{self.uri(rel)}: expected a file, found {info.type.name}")
        return info.size

    def read_bytes(self, rel: str, *, max_bytes: int | None = None) -> bytes:
        """The whole file; with `max_bytes`, FileTooLarge instead of reading past that many
        bytes (a file in a run directory is untrusted: a MANIFEST that is a link to /dev/zero
        must not be read until memory runs out)."""
        self._drain()
        if (m := self._mirror(rel)) is not None:
            with self._appends.lock, open(m.local, "rb") as f:
                return _read_at_most(f, max_bytes, self.uri(rel))
        if not self.exists(rel):
            raise FileNotFoundError(f"{self.uri(rel)}: no such file")
        with self.fs.open_input_stream(self.path(rel)) as f:
            return _read_at_most(f, max_bytes, self.uri(rel))

    def iter_lines(self, rel: str, *, max_line: int = 1 << 20, chunk_bytes: int = 1 << 20):
        """The file's lines (bytes, without the newline), streamed in `chunk_bytes` chunks:
        memory stays bounded by a few chunks plus one line, whatever the file's size. A line longer than
        `max_line` bytes is yielded as its first `max_line` bytes followed by b"..." (never a
        valid JSON record), so a hostile file cannot make a reader hold it whole."""
        self._drain()
        if (m := self._mirror(rel)) is not None:
            with self._appends.lock:
                data = m.local.read_bytes()  # this process's own appends (bounded by its run)
            yield from data.split(b"\n")
            return
        with self.fs.open_input_stream(self.path(rel)) as f:
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
        with contextlib.ExitStack() as stack:
            if (m := self._mirror(rel)) is not None:
                stack.enter_context(self._appends.lock)
                f = stack.enter_context(open(m.local, "rb"))
            else:
                f = stack.enter_context(self.fs.open_input_stream(self.path(rel)))
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
        self._drain()
        self.fs.create_dir(self.path(rel), recursive=True)

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Readers see the old content or all of `data`, never a partial file."""
        self._drain()
        parent = rel.strip("/").rpartition("/")[0]
        self.makedirs(parent)
        if not self.is_local:
            self._appends.forget(self.path(rel))  # the new content replaces what was appended
            with self.fs.open_output_stream(self.path(rel)) as f:  # one PUT: atomic on object stores
                f.write(data)
            return
        write_local_atomic(self.local_path(rel), [data])

    def make_durable(self, rels) -> None:
        """Make files and directories (their entries) that something else wrote durable, without
        reading their data: local / NFS, open + fsync each (a directory's fsync makes the names
        in it durable); object stores, nothing to do (a completed put is durable). For files
        another writer copied in without an fsync (Ray's checkpoint upload)."""
        if not self.is_local:
            return
        for rel in rels:
            _fsync_path(self.local_path(rel))

    def append_text(self, rel: str, text: str) -> None:
        """Append `text` (UTF-8), whole lines. Local: append + flush + fsync, durable on return.
        Object stores: appended to the local mirror, stored by the next due upload or `flush()`
        (see the class docstring). In the background (`background_appends`): queued, done in
        order by the writer thread. One process (rank 0) owns the appends to a file. Nothing is
        ever rewritten: when a crash tore a file's last line, this RunDir's first append to it
        starts with a newline, so the fragment stays a line of its own (readers skip it) and
        the new line is whole."""
        if self._writer is not None:
            self._writer.put(self._append_now, rel, text)
        else:
            self._append_now(rel, text)

    def _append_now(self, rel: str, text: str) -> None:
        if rel not in self._line_checked:  # once per file: a crash may have torn its last line
            self._line_checked.add(rel)
            if self._ends_torn(rel):
                text = "\n" + text  # the fragment stays a line of its own, which readers skip
        if self.is_local:
            target = self.local_path(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "a", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            return
        self._appends.append(self.path(rel), text.encode("utf-8"))

    def _ends_torn(self, rel: str) -> bool:
        """True when the file is non-empty and its last byte is not a newline."""
        if self.is_local:
            try:
                with open(self.local_path(rel), "rb") as f:
                    f.seek(0, os.SEEK_END)
                    if f.tell() == 0:
                        return False
                    f.seek(-1, os.SEEK_END)
                    return f.read(1) != b"\n"
            except FileNotFoundError:
                return False
        if self._mirror(rel) is not None:
            return False  # continued from what this process already checked or wrote
        info = self._info(rel)
        if info.type != pafs.FileType.File or info.size == 0:
            return False
        with self.fs.open_input_file(self.path(rel)) as f:
            f.seek(info.size - 1)
            return f.read(1) != b"\n"

    @contextlib.contextmanager
    def background_appends(self, enabled: bool = True):
        """While inside, `append_text` only queues its line and returns: one writer thread does
        the appends in order (local: write + fsync; object stores: the mirror and its due
        uploads). Why: a step that waits for two fsyncs (loss_history.jsonl and main.log) leaves
        the GPU idle for milliseconds per step, several percent of a GPT-2 step on an H200
        (bench/throughput.py's "other" column), and an upload of a long history far more.
        What changes for callers:
        - every other method of this RunDir first waits for the queued appends, so a read
          through it sees every line, and a delete or an overwrite never races a queued append;
        - `flush()` waits for the queue, then stores as before: after it, everything appended
          is durable (the loop flushes at every checkpoint publish and at the end);
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
        """Store every appended line: wait for the queued appends (`background_appends`), then
        upload each mirror with lines not yet stored (one put each). Local appends are durable
        once written, so a local flush only waits for the queue."""
        self._drain()
        if self._appends is not None:
            self._appends.flush_all()
        for hook in list(self._flush_hooks):
            hook()

    def add_flush_hook(self, hook) -> None:
        """Call `hook()` at every `flush()` and `close()`: how a log stored outside this RunDir's
        mirrors (raygpt.runlog.segments on object stores) is stored whenever the run directory
        is flushed (each checkpoint publish, the end of an attempt)."""
        self._flush_hooks.append(hook)

    def remove_flush_hook(self, hook) -> None:
        if hook in self._flush_hooks:
            self._flush_hooks.remove(hook)

    def close(self) -> None:
        """`flush()`, then remove the local mirrors. The RunDir stays usable: a later append
        seeds a new mirror from the stored file."""
        self._drain()
        for hook in list(self._flush_hooks):
            hook()
        if self._appends is not None:
            self._appends.close()

    def delete_file(self, rel: str) -> None:
        """Remove a file; a file that is already gone is not an error (deletes are retried)."""
        self._drain()
        if self._appends is not None:
            self._appends.forget(self.path(rel))
        if self._info(rel).type == pafs.FileType.File:
            self.fs.delete_file(self.path(rel))

    def delete_dir(self, rel: str) -> None:
        """Remove a directory and everything in it; a missing directory is not an error."""
        self._drain()
        if self._appends is not None:
            self._appends.forget(self.path(rel), under=True)
        if self.is_dir(rel):
            self.fs.delete_dir(self.path(rel))

    # ------------------------------------------------------------------ whole directories
    def upload_dir(self, local_dir: str | os.PathLike, rel: str) -> None:
        """Copy the files under a local directory into `rel` (created if needed)."""
        local_dir = Path(local_dir)
        for src in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            dst = f"{rel.strip('/')}/{src.relative_to(local_dir).as_posix()}"
            self.makedirs(dst.rpartition("/")[0])
            with open(src, "rb") as fin, self.fs.open_output_stream(self.path(dst)) as fout:
                while chunk := fin.read(_CHUNK):
                    fout.write(chunk)

    def download_dir(self, rel: str, local_dir: str | os.PathLike) -> None:
        """Copy every file under `rel` into a local directory (created if needed)."""
        base = self.path(rel).strip("/")
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel), recursive=True))
        for info in infos:
            if info.type != pafs.FileType.File:
                continue
            # some filesystems return '/a/b' for a selector on 'a': compare without slashes
            sub = info.path.strip("/")[len(base):].strip("/")
            dst = Path(local_dir) / sub
            dst.parent.mkdir(parents=True, exist_ok=True)
            with self.fs.open_input_stream(info.path) as fin, open(dst, "wb") as fout:
                while chunk := fin.read(_CHUNK):
                    fout.write(chunk)


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
    the file) when it is larger, not UTF-8, or not JSON."""
    data = run_dir.read_bytes(rel, max_bytes=max_bytes)
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{run_dir.uri(rel)}: expected UTF-8 JSON ({e})") from e


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory by name (a read-only descriptor is enough on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# credentials a URI can carry: s3://KEY:SECRET@bucket/... and pyarrow's ?access_key=...&secret_key=...
_URI_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^\s@]+@")  # "/" too: secrets hold it
_URI_SECRET_PARAM = re.compile(r"((?:access_key|secret_key|session_token|token|password)=)[^&\s]*",
                               re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every credential a storage URI can carry replaced by ***: whatever raygpt
    prints about a run directory or stores outside it (failure reports, status, sweep.json)
    goes through this."""
    text = _URI_USERINFO.sub(r"\1***@", str(text))
    return _URI_SECRET_PARAM.sub(r"\1***", text)


def open_run_dir(uri, *, flush_interval_s: float | None = None) -> RunDir:
    """A RunDir from a local path, a file:// / s3:// / gs:// URI, an (fs, path) pair, or a RunDir
    (returned as it is, mirrors and interval included). `flush_interval_s` (default
    DEFAULT_FLUSH_INTERVAL_S) bounds how long an append to an object store stays local only.
    An s3:// URI without an endpoint takes AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
    (`with_endpoint`); s3:// and gs:// filesystems get bounded timeouts (`bounded_filesystem`)."""
    if isinstance(uri, RunDir):
        return uri
    opts = {} if flush_interval_s is None else {"flush_interval_s": flush_interval_s}
    if isinstance(uri, tuple):
        fs, path = uri
        if not isinstance(fs, pafs.FileSystem):
            raise TypeError(f"run dir: expected (pyarrow.fs.FileSystem, path), "
                            f"found ({type(fs).__name__}, ...)")
        return RunDir(fs, str(path), **opts)
    uri = os.fspath(uri)
    if "://" not in uri:
        return RunDir(pafs.LocalFileSystem(), os.path.abspath(uri), **opts)
    fs, path = pafs.FileSystem.from_uri(with_endpoint(uri))
    return RunDir(bounded_filesystem(fs), path, **opts)


# ---------------------------------------------------------------------- object stores: endpoint,
# timeouts, reachability

ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # the AWS tools' order
CONNECT_TIMEOUT_S = 5.0    # a TCP/TLS connection to the store
REQUEST_TIMEOUT_S = 30.0   # a request with no byte moving this long fails (curl's low-speed rule)
S3_MAX_ATTEMPTS = 3        # tries of one S3 call in all (AWS standard retries: backoff + jitter)
GCS_RETRY_LIMIT_S = 60.0   # pyarrow's GCS client retries transient errors this long (default 15 min)
REACHABLE_DEADLINE_S = 10.0  # how long `check_reachable` waits for the store's first answer


class StorageError(ValueError):
    """A run directory's store cannot be used: one line naming the URI and the cause."""

    def __init__(self, uri: str, cause: str):
        super().__init__(f"{uri}: {cause}")
        self.uri, self.cause = uri, cause


def _endpoint_query(endpoint: str, source: str) -> str:
    """`http://host:port` -> `endpoint_override=host:port&scheme=http` (pyarrow's URI options)."""
    parts = urlsplit(endpoint.strip())
    if (parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/")
            or parts.query or parts.fragment or "@" in parts.netloc):
        raise ValueError(f"{source}: expected an endpoint URL such as http://minio:9000 or "
                         f"https://s3.example.com, found {endpoint!r}")
    return f"endpoint_override={parts.netloc}&scheme={parts.scheme}"


def with_endpoint(uri: str, endpoint: str = "", environ=None) -> str:
    """An s3:// URI that names its endpoint: unchanged when it is not s3:// or already has
    `endpoint_override=`; else with the endpoint of `endpoint` (--storage-endpoint), or of
    AWS_ENDPOINT_URL_S3, or of AWS_ENDPOINT_URL (the precedence of the AWS CLI and SDKs) added
    as pyarrow's `endpoint_override` and `scheme` options; unchanged when none is set. In the
    URI because Ray's workers and controller (on other machines, with other environments) open
    the run directory from the same string as the driver (pyarrow reads the two variables too,
    but only where they are set). ValueError, naming the setting, for an
    endpoint that is not an http(s)://host[:port] URL."""
    if not uri.startswith("s3://"):
        return uri
    query = urlsplit(uri).query
    if "endpoint_override" in parse_qs(query):
        return uri
    environ = os.environ if environ is None else environ
    source, value = "--storage-endpoint", endpoint
    for name in ENDPOINT_VARIABLES:
        if value:
            break
        source, value = name, environ.get(name, "")
    if not value:
        return uri
    return f"{uri}{'&' if query else '?'}{_endpoint_query(value, source)}"


def bounded_filesystem(fs: pafs.FileSystem) -> pafs.FileSystem:
    """`fs` with every remote call bounded in time, options the URI set kept: S3 (pyarrow's
    default is no connect or request timeout) gets CONNECT_TIMEOUT_S / REQUEST_TIMEOUT_S and
    S3_MAX_ATTEMPTS standard retries; GCS (default: retries for 15 minutes) GCS_RETRY_LIMIT_S.
    Other filesystems are returned as they are."""
    return _rebuilt(fs, connect=lambda t: t if t > 0 else CONNECT_TIMEOUT_S,
                    request=lambda t: t if t > 0 else REQUEST_TIMEOUT_S,
                    s3_attempts=S3_MAX_ATTEMPTS,
                    gcs_limit=lambda t: t or datetime.timedelta(seconds=GCS_RETRY_LIMIT_S))


def _rebuilt(fs: pafs.FileSystem, *, connect, request, s3_attempts: int, gcs_limit) -> pafs.FileSystem:
    """`fs` made again from the options pyarrow parsed from its URI (its pickle state: the one
    place raygpt reads it), each limit replaced by its function of the current one: S3's
    `connect` and `request` timeouts (<= 0: none) with `s3_attempts` standard retries, GCS's
    retry time limit (None: pyarrow's 15 minutes). Other filesystems are returned unchanged."""
    if isinstance(fs, pafs.S3FileSystem):
        options = fs.__reduce__()[1][0]
        options["connect_timeout"] = connect(options["connect_timeout"])
        options["request_timeout"] = request(options["request_timeout"])
        return pafs.S3FileSystem(**options, retry_strategy=pafs.AwsStandardS3RetryStrategy(
            max_attempts=s3_attempts))
    if isinstance(fs, pafs.GcsFileSystem):
        options = fs.__reduce__()[1][0]
        options["retry_time_limit"] = gcs_limit(options["retry_time_limit"])
        return pafs.GcsFileSystem(**options)
    return fs


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
    return _rebuilt(fs, connect=lambda t: min(t, step), request=lambda t: min(t, step),
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


def _rebuild_run_dir(fs, root, flush_interval_s) -> RunDir:
    return RunDir(fs, root, flush_interval_s=flush_interval_s)


# ---------------------------------------------------------------------- appends on object stores

class _Mirror:
    """The local copy of one appended object. The whole local file is the object's content as
    this process knows it; its first `synced` bytes are what storage held when this process
    last looked (the seeding download or its own last upload). `dirty_since`: clock time of the
    oldest append not yet uploaded (None: nothing to upload)."""

    def __init__(self, remote: str, local: Path, synced: int):
        self.remote, self.local, self.synced = remote, local, synced
        self.dirty_since: float | None = None


class _Appends:
    """The mirrors of one non-local RunDir, keyed by the object's full path. Kept apart from the
    RunDir so that a finalizer can flush them without keeping the RunDir alive. One lock guards
    them: an append, a read and an upload of a mirror never interleave."""

    def __init__(self, fs: pafs.FileSystem, interval_s: float, clock):
        self.fs, self.interval_s, self.clock = fs, interval_s, clock
        self.mirrors: dict[str, _Mirror] = {}
        self.tmpdir: Path | None = None
        self.lock = threading.RLock()
        self._names = itertools.count()

    def append(self, remote: str, data: bytes) -> None:
        with self.lock:
            m = self.mirrors.get(remote) or self._seed(remote)
            with open(m.local, "ab") as f:  # a temp copy: no fsync, storage is the durable one
                f.write(data)
            now = self.clock()
            if m.dirty_since is None:
                m.dirty_since = now
            if now - m.dirty_since >= self.interval_s:
                self._upload(m)

    def _seed(self, remote: str) -> _Mirror:
        """Start a mirror with the stored object's content, so appends continue it."""
        if self.tmpdir is None:
            self.tmpdir = Path(tempfile.mkdtemp(prefix="raygpt-appends-"))
        local = self.tmpdir / f"{next(self._names)}-{remote.rpartition('/')[2]}"
        synced = 0
        with open(local, "wb") as fout:
            if self.fs.get_file_info(remote).type == pafs.FileType.File:
                with self.fs.open_input_stream(remote) as fin:
                    while chunk := fin.read(_CHUNK):
                        fout.write(chunk)
                        synced += len(chunk)
        m = self.mirrors[remote] = _Mirror(remote, local, synced)
        return m

    def _upload(self, m: _Mirror) -> None:
        """Store the whole mirror in one put (all-or-nothing on object stores)."""
        info = self.fs.get_file_info(m.remote)
        stored = info.size if info.type == pafs.FileType.File else None
        if stored is not None and stored > m.synced:
            self._splice_foreign(m, stored)
        elif stored != m.synced and not (stored is None and m.synced == 0):
            log.warning(f"raygpt | WARNING: {m.remote}: expected the stored object to hold {m.synced} "
                        f"bytes as last seen, found {'none' if stored is None else f'{stored} bytes'}; "
                        f"uploading this process's copy")
        parent = m.remote.rpartition("/")[0]
        if stored is None and parent:
            self.fs.create_dir(parent, recursive=True)
        size = m.local.stat().st_size
        with open(m.local, "rb") as fin, self.fs.open_output_stream(m.remote) as fout:
            while chunk := fin.read(_CHUNK):
                fout.write(chunk)
        m.synced, m.dirty_since = size, None

    def _splice_foreign(self, m: _Mirror, stored: int) -> None:
        """Another process appended to the object since this one last stored it (the Ray
        driver's failure record): keep its bytes, after what was stored and before this
        process's own new lines, so neither writer's lines are lost."""
        with self.fs.open_input_file(m.remote) as f:
            f.seek(m.synced)
            foreign = f.read(stored - m.synced)
        spliced = m.local.with_name(m.local.name + ".splice")
        with open(m.local, "rb") as src, open(spliced, "wb") as dst:
            _copy_exactly(src, dst, m.synced)
            dst.write(foreign)
            shutil.copyfileobj(src, dst, _CHUNK)
        os.replace(spliced, m.local)
        m.synced = stored  # the stored object is now a prefix of the mirror again

    def flush_all(self) -> None:
        with self.lock:
            for m in list(self.mirrors.values()):
                if m.dirty_since is not None:
                    self._upload(m)

    def forget(self, remote: str, *, under: bool = False) -> None:
        """Drop the mirror of `remote` (or of every file under it) whose object is being
        replaced or deleted through the RunDir; a later append seeds afresh."""
        prefix = remote.rstrip("/") + "/"
        with self.lock:
            for p in [p for p in self.mirrors if p == remote or (under and p.startswith(prefix))]:
                self.mirrors.pop(p).local.unlink(missing_ok=True)

    def close(self) -> None:
        with self.lock:
            self.flush_all()  # raises before anything local is removed
            if self.tmpdir is not None:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.mirrors.clear()
            self.tmpdir = None

    def close_quietly(self) -> None:
        """close() for a finalizer: on failure say where the unstored lines are, keep them."""
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - a finalizer must not raise
            log.warning(f"raygpt | WARNING: could not store appended lines ({type(e).__name__}: {e}); "
                        f"their local copies stay in {self.tmpdir}")


def _copy_exactly(src, dst, n: int) -> None:
    while n > 0:
        chunk = src.read(min(n, _CHUNK))
        if not chunk:
            raise EOFError(f"{src.name}: expected {n} more bytes, found the end of the file")
        dst.write(chunk)
        n -= len(chunk)
