"""The one atomic write of a local file, used by every writer that replaces a file in place
(storage's local run directories, llm.c model files, token shards), and the move of a staged
file into a local run directory (a rename; across mounts, a copy by the same rule).

The rule: the bytes go to a temporary file in the target's directory; on a clean exit the file
is fsynced, renamed over the target, and the directory fsynced after the rename (what makes the
new name durable: without it a power loss can bring the old file back). A reader sees the old
file or the whole new one, never a mix; on an error the temporary file is removed and the
target is untouched. Some filesystems (network and FUSE ones) cannot fsync a directory: there
the rename is as durable as the filesystem makes it, and any other failure of that fsync (an
I/O error) is raised.

Permissions: the temporary file is created with mode 0666 and the process's umask (and a
directory's default ACL) narrows it, as for any file a program creates; `tempfile.mkstemp`'s
0600 would make DONE, MANIFEST, shards and model files unreadable to the other users of a shared
run directory whatever their umask says.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

# what a filesystem answers when it does not fsync directories (not an I/O failure)
_NO_DIRECTORY_FSYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF,
                                 errno.EISDIR, errno.EACCES, errno.EPERM})


@contextlib.contextmanager
def atomic_local_file(target: str | os.PathLike):
    """`with atomic_local_file(path) as f: f.write(...)`: `f` is a binary file in the target's
    directory that replaces `path` atomically and durably when the block ends without an error."""
    target = Path(target)
    # <name>.tmp-<random>: every temporary name raygpt makes carries ".tmp-" (a reader of a run
    # or stage directory skips such names; see checkpoint's _TEMP_MARK)
    fd, tmp = _create_new(target.parent, f"{target.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)


def _create_new(directory: Path, prefix: str) -> tuple[int, str]:
    """Create and open a new file `<prefix><random>` in `directory` (O_EXCL: never an existing
    file or a planted symlink), mode 0666 less the umask; (fd, path)."""
    for _ in range(100):
        path = str(directory / f"{prefix}{secrets.token_hex(6)}")
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                           | getattr(os, "O_CLOEXEC", 0), 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"{directory}: no free temporary name {prefix}*")


def write_local_atomic(target: str | os.PathLike, chunks) -> None:
    """Write `chunks` (bytes-like) to a local file by `atomic_local_file`'s rule."""
    with atomic_local_file(target) as f:
        for c in chunks:
            f.write(c)


def move_local_file(src: str | os.PathLike, target: str | os.PathLike) -> None:
    """Move a local file to `target`, whole under its final name: a rename, or, where the two
    are mounted apart (EXDEV: a bind mount of the same disk passes a device check and still
    refuses a rename), a copy by `atomic_local_file`'s rule and then the source removed. The
    target's directory entry is the caller's to make durable (`fsync_directory`)."""
    try:
        os.rename(src, target)
        return
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    with open(src, "rb") as fin, atomic_local_file(target) as fout:
        while chunk := fin.read(1 << 24):
            fout.write(chunk)
    os.unlink(src)


def fsync_directory(path: str | os.PathLike) -> None:
    """fsync a directory by name, so the names in it (a rename, a new file) are durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        if e.errno in _NO_DIRECTORY_FSYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIRECTORY_FSYNC:
            raise
    finally:
        os.close(fd)
