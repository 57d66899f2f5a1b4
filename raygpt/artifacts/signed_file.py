"""Files that one node writes into the run directory and another loads as code, signed by
this user's key: the compiled artifacts (torch unpickles them) and the kernel bundle (Triton
imports its launchers as native code).

The run directory may be on storage others can write (an NFS export with umask 002, a bucket
every worker role writes), so a file found there is loaded only when it carries an HMAC-SHA256
made with a key that never touches the run directory; of anything else not a byte is unpickled
or installed (the caller compiles instead).

The key: 32 random bytes in `key_path()` (RAYGPT_ARTIFACT_KEY_FILE, else
$XDG_CONFIG_HOME/raygpt/artifact.key, else ~/.config/raygpt/artifact.key) on the driver's
machine, made on the first compiled run and kept, so a later driver there (-y 1, a restored
sweep) verifies what earlier workers stored; elsewhere a driver has another key (its run
compiles once and re-signs). Workers get it in Ray Train's train_loop_config, held in memory,
not under the storage path; an `ArtifactKey` prints without its bytes.

A signed file: MAGIC, the 32-byte tag, the payload. The tag is HMAC-SHA256 over MAGIC, the
file's name in the run directory (length-prefixed) and the payload, so a file signed for one
name is refused under another. Reader and writer are `verified` and `sign`, side by side.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
import struct
import tempfile
from pathlib import Path

from raygpt.config import ConfigError
from raygpt.storage.atomic_file import NotPrivateError, fsync_directory, open_private_file

KEY_ENV = "RAYGPT_ARTIFACT_KEY_FILE"
KEY_BYTES = 32
MAGIC = b"raygpt-signed-file 1\n"
TAG_BYTES = hashlib.sha256().digest_size


class ArtifactKey:
    """This user's signing key; its repr and str never show the bytes."""

    __slots__ = ("secret",)

    def __init__(self, secret: bytes):
        if len(secret) != KEY_BYTES:
            raise ValueError(f"an artifact key is {KEY_BYTES} bytes, found {len(secret)}")
        self.secret = bytes(secret)

    def __repr__(self) -> str:
        return "ArtifactKey(<secret>)"


class NotSigned(ValueError):
    """A file that does not carry this key's signature for its name; says why in a few words."""


def key_path() -> Path:
    """Where this user's signing key is kept on this machine (see the module's notes)."""
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "raygpt" / "artifact.key"


def load_or_create_key(path: str | os.PathLike | None = None) -> ArtifactKey:
    """This user's signing key, read from `path` (key_path() by default), made first when there
    is none. ConfigError in one line naming the file when it cannot be made or read, or is not
    a private regular file of KEY_BYTES bytes (a symlink, another owner, group or other
    permission bits: someone else could know or choose the key)."""
    path = Path(path) if path is not None else key_path()
    try:
        try:
            if path.parent.is_dir():  # not there yet: _create_key makes and checks it
                _check_key_dir(path.parent)
            return _read_key(path)
        except FileNotFoundError:
            _create_key(path)
            return _read_key(path)
    except NotPrivateError as e:
        raise ConfigError(f"{e} (the compiled-artifact signing key; remove it to make a new "
                          f"one, or point {KEY_ENV} at another file)") from None
    except OSError as e:
        raise ConfigError(f"{path}: the compiled-artifact signing key: cannot make or read it "
                          f"({e.strerror or e}); point {KEY_ENV} at a file this user can "
                          f"write") from None


def _read_key(path: Path) -> ArtifactKey:
    fd = open_private_file(path, "signing key file")
    with os.fdopen(fd, "rb") as f:
        secret = f.read(KEY_BYTES + 1)
    if len(secret) != KEY_BYTES:
        raise NotPrivateError(f"{path}: expected a signing key of {KEY_BYTES} bytes, found "
                              f"{len(secret)}{'+' if len(secret) > KEY_BYTES else ''} bytes")
    return ArtifactKey(secret)


def _check_key_dir(directory: Path) -> None:
    """NotPrivateError naming `directory` unless it is this user's and no one else may write
    it: in a directory others can write, they could swap the key file for their own, or (owning
    it) read the temporary file it is written through."""
    st = os.stat(directory)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not stat.S_ISDIR(st.st_mode):
        raise NotPrivateError(f"{directory}: expected a directory owned by you (uid "
                              f"{os.geteuid()}), not writable by others, to hold the signing key; "
                              f"found one owned by uid {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):04o}")


def _create_key(path: Path) -> None:
    """Write a new key to `path` whole or not at all: into a new 0600 file beside it (mkstemp:
    O_EXCL, never a planted symlink), then linked to `path`, which fails if another process
    made the key meanwhile (its key is then read: the two agree). The directory is made 0700,
    and one that exists must be this user's and not writable by others (`_check_key_dir`)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_key_dir(path.parent)  # exist_ok: another user may have made it first
    fd, tmp = tempfile.mkstemp(prefix=".artifact.key.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        fsync_directory(path.parent)
    finally:
        try:
            os.unlink(tmp)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise


def _tag(key: ArtifactKey, name: str, payload) -> bytes:
    mac = hmac.new(key.secret, MAGIC, hashlib.sha256)
    encoded = name.encode()
    mac.update(struct.pack(">I", len(encoded)) + encoded)
    mac.update(payload)
    return mac.digest()


def sign(key: ArtifactKey, name: str, payload: bytes) -> bytes:
    """The signed file to store as `name` in the run directory (see the module's notes)."""
    return MAGIC + _tag(key, name, payload) + payload


def verified(key: ArtifactKey, name: str, data: bytes) -> bytes:
    """The payload of `data`, the file read from `name` in the run directory, when its tag is
    this key's for that name and those bytes; NotSigned otherwise (nothing of it is used)."""
    header = len(MAGIC) + TAG_BYTES
    if not data.startswith(MAGIC) or len(data) < header:
        raise NotSigned("no raygpt signature")
    view = memoryview(data)
    if not hmac.compare_digest(view[len(MAGIC):header], _tag(key, name, view[header:])):
        raise NotSigned("its signature does not match its name and bytes")
    return bytes(view[header:])
