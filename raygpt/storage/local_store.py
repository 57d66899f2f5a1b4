"""A store on this machine's disk (a local or NFS directory): every capability. Reads, writes,
appends and moves go through raygpt.storage.atomic_file, which walks below the root without
following a link (a link planted in a shared run directory is refused, never written through);
listing and deleting through pyarrow's LocalFileSystem. `store_for` picks the store of a
pyarrow filesystem and a path."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

import pyarrow.fs as pafs

from raygpt.storage.arrow_store import ArrowStore
from raygpt.storage.atomic_file import (atomic_local_file, make_dirs_below, move_local_file,
                                        open_local_append, open_local_read)
from raygpt.storage.store import Capabilities, Owner, Store


class LocalStore(ArrowStore):
    caps = Capabilities(local_paths=True, atomic_rename=True, appends=True, owners=True,
                        locks=True, shared=True)

    def __init__(self, root: str | os.PathLike):
        super().__init__(pafs.LocalFileSystem(), os.fspath(root))

    def __reduce__(self):
        return LocalStore, (self.root,)

    def uri(self, rel: str = "") -> str:
        return self.path(rel)

    def local_path(self, rel: str = "") -> Path:
        return Path(self.path(rel))

    def open_read(self, rel: str):
        # through no link below the root, a regular file only (RefusedPath): a planted link to
        # /dev/zero or another user's secret is never read, nor copied on into the run
        return open_local_read(self.local_path(rel), root=self.root)

    def makedirs(self, rel: str = "") -> None:
        make_dirs_below(self.root, self.local_path(rel))

    def open_publish(self, rel: str):
        return atomic_local_file(self.local_path(rel), root=self.root)

    def append(self, rel: str, data: bytes) -> None:
        os.makedirs(self.root, exist_ok=True)
        # O_APPEND|O_NOFOLLOW below a link-free path: a planted run/main.log -> ~/.bashrc is
        # refused (RefusedPath), never appended to
        fd = open_local_append(self.local_path(rel), root=self.root)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def move(self, src: str, dst: str) -> None:
        self.open_read(src).close()  # RefusedPath for a link at or above the source
        move_local_file(self.local_path(src), self.local_path(dst), root=self.root)

    def make_durable(self, rels) -> None:
        for rel in rels:
            _fsync_path(self.local_path(rel), follow=not rel.strip("/"))  # the root may be a link

    def owner(self, rel: str) -> Owner | None:
        # the entry itself, not what a link there points to; the root may be a link the user chose
        look = os.stat if not rel.strip("/") else os.lstat
        try:
            st = look(self.local_path(rel))
        except FileNotFoundError:
            return None
        return Owner(st.st_uid, stat.S_ISREG(st.st_mode))

    @contextlib.contextmanager
    def lock(self, rel: str):
        """flock on the file `rel` (made if missing, never through a link, never truncated)."""
        self.makedirs("")
        # 0666 less the umask, as every file raygpt writes (a shared run directory stays usable)
        fd = os.open(self.local_path(rel), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock


def _fsync_path(path: Path, *, follow: bool) -> None:
    """fsync a file or a directory by name (a read-only descriptor is enough on Linux); unless
    `follow`, a link there is refused (ELOOP); a FIFO is never waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def store_for(fs: pafs.FileSystem, root: str) -> Store:
    """The store of a pyarrow filesystem and a path: this machine's disk, or an object store."""
    if isinstance(fs, pafs.LocalFileSystem):
        return LocalStore(root)
    return ArrowStore(fs, root)
