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

Private paths: what raygpt keeps on a node in a shared temp directory (the compile cache, the
checkpoint copies, the staging roots) and the artifact signing key are loaded as code or as
training state, so each is used only when it is a real directory (or file) owned by this user
that no other user may read or write: `private_dir` makes or checks one, `check_private_dir`
checks one, `open_private_file` opens one. A name another user made first in /tmp (a directory,
or a symlink to a directory they write) is refused, naming it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
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


class NotPrivateError(PermissionError):
    """A path raygpt loads code or state from is not private to this user; the message names it."""


def private_dir(path: str | os.PathLike, what: str) -> Path:
    """The directory `path` (its parents made as needed), created private to this user (mode
    0700) if it is missing, then checked as `check_private_dir` does: a name that another user
    made first, or a symlink, is refused (NotPrivateError naming it and `what` it is for)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # never follows a planted symlink: EEXIST, then lstat says what
    except FileExistsError:
        pass
    check_private_dir(path, what)
    return path


def check_private_dir(path: str | os.PathLike, what: str) -> None:
    """NotPrivateError unless `path` is a real directory (not a symlink) owned by this user
    with no group or other permission bits; the message names `path` and `what` it is for."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise NotPrivateError(f"{path}: expected a private {what}, cannot stat it ({e})") from None
    if stat.S_ISLNK(st.st_mode):
        raise NotPrivateError(f"{path}: expected a private {what}, found a symlink (to "
                              f"{os.readlink(path)!r}); refusing to use it")
    if not stat.S_ISDIR(st.st_mode):
        raise NotPrivateError(f"{path}: expected a private {what}, found another kind of file")
    _check_owner_only(st, path, what)


def open_private_file(path: str | os.PathLike, what: str) -> int:
    """A read-only descriptor of the regular file `path`, owned by this user with no group or
    other permission bits (checked on the open file: O_NOFOLLOW refuses a symlink, fstat sees
    the file that was opened); NotPrivateError naming it otherwise. FileNotFoundError passes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotPrivateError(f"{path}: expected a private {what}, found a symlink (to "
                                  f"{os.readlink(path)!r}); refusing to use it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotPrivateError(f"{path}: expected a private {what}, found another kind of file")
        _check_owner_only(st, path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_owner_only(st: os.stat_result, path, what: str) -> None:
    if st.st_uid != os.getuid():
        raise NotPrivateError(f"{path}: expected a {what} owned by uid {os.getuid()}, found one "
                              f"owned by uid {st.st_uid}; refusing to use it")
    if st.st_mode & 0o077:
        raise NotPrivateError(f"{path}: expected a {what} only its owner can use (no group or "
                              f"other permissions), found mode {stat.S_IMODE(st.st_mode):04o}")
