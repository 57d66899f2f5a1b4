"""Run-directory I/O: every byte raygpt reads or writes under a run directory goes through here.

A run directory is a `pyarrow.fs` filesystem plus a root path: a local or NFS path, `file://`,
`s3://`, `gs://`, or any `pyarrow.fs.FileSystem` (tests use fsspec's in-memory filesystem wrapped
in `PyFileSystem`). `RunDir` takes paths relative to the root, always with `/` separators.

Durability differs by backend and is handled here so callers never think about it:
- local: an atomic write is temp file in the same directory + fsync + rename + fsync of the
  directory, so a crash leaves either the old file or the new one, never a torn one;
- object stores: one PUT is already all-or-nothing, so an atomic write is a single put.
Appends on object stores are emulated by rewriting the whole object (see `append_text`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from pathlib import Path

import pyarrow.fs as pafs

_CHUNK = 8 << 20  # 8 MiB: streaming unit for hashing and copying (state files can be GBs)


class RunDir:
    """A run directory: `fs` + `root`; every method takes a path relative to the root."""

    def __init__(self, fs: pafs.FileSystem, root: str):
        self.fs = fs
        self.root = root.rstrip("/") or root  # keep "/" itself

    def __repr__(self) -> str:
        return f"RunDir({self.uri()})"

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
    def exists(self, rel: str = "") -> bool:
        return self._info(rel).type != pafs.FileType.NotFound

    def is_dir(self, rel: str = "") -> bool:
        return self._info(rel).type == pafs.FileType.Directory

    def listdir(self, rel: str = "", *, files_only: bool = False) -> list[str]:
        """Sorted names directly under `rel`; [] when `rel` does not exist."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True))
        return sorted(i.base_name for i in infos
                      if not files_only or i.type == pafs.FileType.File)

    def size_of(self, rel: str) -> int:
        info = self._info(rel)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(f"{self.uri(rel)}: expected a file, found {info.type.name}")
        return info.size

    def read_bytes(self, rel: str) -> bytes:
        if not self.exists(rel):
            raise FileNotFoundError(f"{self.uri(rel)}: no such file")
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def sha256_of(self, rel: str) -> str:
        """Hex sha256 of a file, streamed in 8 MiB chunks (never the whole file in memory)."""
        h = hashlib.sha256()
        with self.fs.open_input_stream(self.path(rel)) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    # ------------------------------------------------------------------ writes
    def makedirs(self, rel: str = "") -> None:
        self.fs.create_dir(self.path(rel), recursive=True)

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Readers see the old content or all of `data`, never a partial file."""
        parent = rel.strip("/").rpartition("/")[0]
        self.makedirs(parent)
        if not self.is_local:
            with self.fs.open_output_stream(self.path(rel)) as f:  # one PUT: atomic on object stores
                f.write(data)
            return
        target = self.local_path(rel)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)  # make the rename itself durable

    def append_text(self, rel: str, text: str) -> None:
        """Append `text` (UTF-8) durably.

        Local: append + flush + fsync. Object stores have no append, so the whole object is
        rewritten: old content + `text` goes to a temp object which is then moved over the
        original. That is safe against crashes (the original is intact until the move) but
        NOT against concurrent appenders: one process (rank 0) must own each appended file.
        """
        if self.is_local:
            target = self.local_path(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "a", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            return
        old = self.read_bytes(rel) if self.exists(rel) else b""
        tmp = f"{rel.strip('/')}.tmp-{uuid.uuid4().hex}"
        self.write_bytes_atomic(tmp, old + text.encode("utf-8"))
        self.fs.move(self.path(tmp), self.path(rel))

    def delete_file(self, rel: str) -> None:
        """Remove a file; a file that is already gone is not an error (deletes are retried)."""
        if self._info(rel).type == pafs.FileType.File:
            self.fs.delete_file(self.path(rel))

    def delete_dir(self, rel: str) -> None:
        """Remove a directory and everything in it; a missing directory is not an error."""
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_run_dir(uri) -> RunDir:
    """A RunDir from a local path, a file:// / s3:// / gs:// URI, an (fs, path) pair, or a RunDir."""
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
    fs, path = pafs.FileSystem.from_uri(uri)
    return RunDir(fs, path)
