"""The one atomic write of a local file, used by every writer that replaces a file in place
(storage's local run directories, llm.c model files, token shards), the move of a staged file
into a local run directory (a rename; across mounts, a copy by the same rule), and the
link-refusing opens behind a local run directory's appends and reads.

The rule: the bytes go to a temporary file in the target's directory; on a clean exit the file
is fsynced, renamed over the target, and the directory fsynced after the rename (what makes the
new name durable: without it a power loss can bring the old file back). A reader sees the old
file or the whole new one, never a mix; on an error the temporary file is removed and the
target is untouched. Some filesystems (network and FUSE ones) cannot fsync a directory: there
the rename is as durable as the filesystem makes it, and any other failure of that fsync (an
I/O error) is raised.

Links: a run directory may sit on shared storage where another user can plant a symbolic link
(run/main.log -> ~victim/.bashrc, run/checkpoints -> /elsewhere). Every function here takes the
directory the caller trusts (`root`: a run directory's root, which may itself be a link the
user chose; by default the target's own directory) and walks from it one component at a time
with O_NOFOLLOW (`openat`), so no component below `root` is ever followed: a link there is
refused with `RefusedPath`, a temporary file is created with O_EXCL|O_NOFOLLOW, a rename
replaces a link at the target's name (never its target), and an append or a read opens the
file itself with O_NOFOLLOW. A read also refuses anything but a regular file (a planted FIFO
would block it).

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
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class RefusedPath(OSError, ValueError):
    """A path below a trusted directory is a symbolic link, or not a regular file where one is
    opened: one line naming it. An OSError for the writers' callers, a ValueError for the
    readers' (a bad input, like any other unusable file of a run directory)."""

    def __init__(self, path: str | os.PathLike, message: str):
        super().__init__(f"{path}: {message}")
        self.errno = errno.ELOOP


def _link_refused(path, verb: str) -> RefusedPath:
    return RefusedPath(path, f"is a symbolic link; raygpt never {verb} through links in a run "
                             f"directory")


def _relative_parts(root: Path, path: Path) -> tuple[str, ...]:
    """The components of `path` below `root` (ValueError when it is not below it, or steps
    out through '..')."""
    parts = path.relative_to(root).parts
    if ".." in parts:
        raise ValueError(f"{path}: expected a path inside {root}, found '..' in it")
    return parts


def _open_below(root: Path, parts: tuple[str, ...], *, create: bool, verb: str) -> int:
    """A descriptor of the directory root/parts..., reached one component at a time without
    following a link (RefusedPath names the first that is one); with `create`, missing
    directories are made (0777 less the umask). `root` itself is opened as given."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    path = root
    try:
        for name in parts:
            path = path / name
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC,
                              dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, fd):
                    raise _link_refused(path, verb) from None
                raise type(e)(e.errno, e.strerror, str(path)) from None
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


@contextlib.contextmanager
def _directory_of(target: Path, root, *, create: bool = False, verb: str = "writes"):
    """(descriptor of target's directory, reached from `root` without links, target's name)."""
    root = target.parent if root is None else Path(root)
    fd = _open_below(root, _relative_parts(root, target.parent), create=create, verb=verb)
    try:
        yield fd, target.name
    finally:
        os.close(fd)


def make_dirs_below(root: str | os.PathLike, path: str | os.PathLike) -> None:
    """Make the directory `path` and any missing parents below `root` (which is made as given,
    links and all: the user chose it); RefusedPath for a component below `root` that is a link."""
    root = Path(root)
    os.makedirs(root, exist_ok=True)
    os.close(_open_below(root, _relative_parts(root, Path(path)), create=True, verb="writes"))


@contextlib.contextmanager
def atomic_local_file(target: str | os.PathLike, *, root: str | os.PathLike | None = None):
    """`with atomic_local_file(path) as f: f.write(...)`: `f` is a binary file in the target's
    directory that replaces `path` atomically and durably when the block ends without an error.
    `root`: the directory the caller trusts (see the module docstring); the target's own
    directory by default."""
    target = Path(target)
    with _directory_of(target, root) as (dir_fd, name):
        # <name>.tmp-<random>: every temporary name raygpt makes carries ".tmp-" (a reader of a
        # run or stage directory skips such names; see checkpoint's _TEMP_MARK)
        fd, tmp = _create_new(dir_fd, f"{name}.tmp-", target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # a link there: replaced
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        _fsync_directory_fd(dir_fd)


def _create_new(dir_fd: int, prefix: str, directory: Path) -> tuple[int, str]:
    """Create and open a new file `<prefix><random>` in the directory `dir_fd` (O_EXCL: never an
    existing file or a planted symlink), mode 0666 less the umask; (fd, name)."""
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(6)}"
        try:
            return os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC,
                           0o666, dir_fd=dir_fd), name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"{directory}: no free temporary name {prefix}*")


def write_local_atomic(target: str | os.PathLike, chunks, *, root: str | os.PathLike | None = None) -> None:
    """Write `chunks` (bytes-like) to a local file by `atomic_local_file`'s rule."""
    with atomic_local_file(target, root=root) as f:
        for c in chunks:
            f.write(c)


def move_local_file(src: str | os.PathLike, target: str | os.PathLike, *,
                    root: str | os.PathLike | None = None) -> None:
    """Move a local file to `target`, whole under its final name: a rename, or, where the two
    are mounted apart (EXDEV: a bind mount of the same disk passes a device check and still
    refuses a rename), a copy by `atomic_local_file`'s rule and then the source removed. The
    target's directory is reached from `root` without links (see the module docstring); its
    entry is the caller's to make durable (`fsync_directory`)."""
    target = Path(target)
    with _directory_of(target, root) as (dir_fd, name):
        try:
            os.rename(src, name, dst_dir_fd=dir_fd)  # a link at the name: replaced, not followed
            return
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
    with open(src, "rb") as fin, atomic_local_file(target, root=root) as fout:
        while chunk := fin.read(1 << 24):
            fout.write(chunk)
    os.unlink(src)


def open_local_append(target: str | os.PathLike, *, root: str | os.PathLike | None = None) -> int:
    """A descriptor (read + append) of `target`, created 0666 less the umask if missing, opened
    without following a link at its name or below `root` (RefusedPath); the caller closes it."""
    target = Path(target)
    with _directory_of(target, root, create=True) as (dir_fd, name):
        try:
            fd = os.open(name, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | _CLOEXEC, 0o666, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _link_refused(target, "writes") from None
            raise
    return _regular(fd, target)


def open_local_read(target: str | os.PathLike, *, root: str | os.PathLike | None = None):
    """A binary file object reading `target`, opened without following a link at its name or
    below `root`, and only if it is a regular file (RefusedPath otherwise: a link to /dev/zero
    or to another user's secret, a FIFO that would block)."""
    target = Path(target)
    with _directory_of(target, root, verb="reads") as (dir_fd, name):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _link_refused(target, "reads") from None
            raise
    return os.fdopen(_regular(fd, target), "rb")


def _regular(fd: int, path: Path) -> int:
    """`fd` if it is a regular file, else closed and RefusedPath."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
            "a device or socket"
        raise RefusedPath(path, f"expected a regular file, found {what}")
    return fd


def fsync_directory(path: str | os.PathLike) -> None:
    """fsync a directory by name, so the names in it (a rename, a new file) are durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        if e.errno in _NO_DIRECTORY_FSYNC:
            return
        raise
    try:
        _fsync_directory_fd(fd)
    finally:
        os.close(fd)


def _fsync_directory_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIRECTORY_FSYNC:
            raise


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
    the file that was opened; a FIFO or device is refused without blocking); NotPrivateError
    naming it otherwise. FileNotFoundError passes."""
    try:
        # O_NONBLOCK: a FIFO planted there opens at once (then refused), never waits for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | getattr(os, "O_CLOEXEC", 0))
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
