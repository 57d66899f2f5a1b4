"""raygpt.artifacts.signed_file: the envelope a compiled artifact travels in through the run directory
(verified for the key, the name and every byte), and the user's key file (made private, read
only when it is a private regular file of this user's)."""

from __future__ import annotations

import os
import stat

import pytest

from raygpt.artifacts import signed_file
from raygpt.artifacts.signed_file import ArtifactKey, NotSigned, load_or_create_key, sign, verified
from raygpt.config import ConfigError

KEY = ArtifactKey(bytes(range(32)))
NAME = "compile_cache/0123456789abcdef0123.bin"
PAYLOAD = b"\x80\x04compiled graphs" * 100


def test_a_signed_file_reads_back_as_written():
    assert verified(KEY, NAME, sign(KEY, NAME, PAYLOAD)) == PAYLOAD
    assert verified(KEY, NAME, sign(KEY, NAME, b"")) == b""


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


def test_a_changed_byte_another_key_or_another_name_is_refused():
    """Every byte counts (the magic, the tag, the payload's first and last), the key counts, and
    the name counts: a signed file moved to another name in the run directory is refused, and
    so is one cut short or grown."""
    good = sign(KEY, NAME, PAYLOAD)
    header = len(signed_file.MAGIC) + signed_file.TAG_BYTES
    for at in (0, len(signed_file.MAGIC), header - 1, header, len(good) - 1):
        with pytest.raises(NotSigned):
            verified(KEY, NAME, _flip(good, at))
    with pytest.raises(NotSigned, match="does not match"):
        verified(ArtifactKey(bytes(32)), NAME, good)
    for name in ("compile_cache/0123456789abcdef0124.bin", "compile_cache/x.kernels.zip",
                 "0123456789abcdef0123.bin"):
        with pytest.raises(NotSigned, match="does not match"):
            verified(KEY, name, good)
    for cut in (good[:-1], good + b"\0", good[:header - 1], b""):
        with pytest.raises(NotSigned):
            verified(KEY, NAME, cut)
    with pytest.raises(NotSigned, match="no raygpt signature"):
        verified(KEY, NAME, PAYLOAD)  # what an older raygpt stored: unsigned


def test_the_key_never_prints():
    assert "00010203" not in repr(KEY) and str(bytes(range(32))) not in str({"k": KEY})


def test_the_key_file_is_made_private_and_read_back(tmp_path, monkeypatch):
    """Made on the first call with mode 0600 in a 0700 directory, whatever the umask; the next
    call (a later driver) reads the same key."""
    path = tmp_path / "config" / "raygpt" / "artifact.key"
    old = os.umask(0)
    try:
        key = load_or_create_key(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert os.path.getsize(path) == signed_file.KEY_BYTES
    assert load_or_create_key(path).secret == key.secret
    assert sorted(os.listdir(path.parent)) == ["artifact.key"]  # no temporary file left
    assert load_or_create_key(tmp_path / "another.key").secret != key.secret


def test_where_the_key_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv(signed_file.KEY_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert signed_file.key_path() == tmp_path / "xdg" / "raygpt" / "artifact.key"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert signed_file.key_path() == tmp_path / "home" / ".config" / "raygpt" / "artifact.key"
    monkeypatch.setenv(signed_file.KEY_ENV, str(tmp_path / "elsewhere.key"))
    assert signed_file.key_path() == tmp_path / "elsewhere.key"


def test_a_key_file_someone_else_could_know_or_choose_is_refused(tmp_path, monkeypatch):
    """A symlink (to a file another user wrote: they would know the key), a key readable by
    the group, another owner, a file of the wrong size: one ConfigError line naming the file,
    and the file is left as it was."""
    chosen = tmp_path / "attackers.key"
    chosen.write_bytes(b"k" * 32)
    chosen.chmod(0o600)
    link = tmp_path / "link.key"
    link.symlink_to(chosen)
    with pytest.raises(ConfigError) as e:
        load_or_create_key(link)
    assert str(e.value).startswith(f"{link}: expected a private signing key file, found a "
                                   f"symlink")
    assert "\n" not in str(e.value) and signed_file.KEY_ENV in str(e.value)
    assert chosen.read_bytes() == b"k" * 32 and link.is_symlink()

    dangling = tmp_path / "dangling.key"
    dangling.symlink_to(tmp_path / "not_yet")
    with pytest.raises(ConfigError, match="found a symlink"):
        load_or_create_key(dangling)
    assert not (tmp_path / "not_yet").exists()  # not created through the link

    readable = tmp_path / "readable.key"
    load_or_create_key(readable)
    readable.chmod(0o640)
    with pytest.raises(ConfigError, match=rf"^{readable}: expected a signing key file only its "
                                          rf"owner can use .* found mode 0640"):
        load_or_create_key(readable)

    readable.chmod(0o600)
    uid = os.stat(readable).st_uid
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.raises(ConfigError, match=f"owned by uid {uid + 1}, found one owned by uid {uid}"):
        load_or_create_key(readable)
    monkeypatch.undo()

    short = tmp_path / "short.key"
    short.write_bytes(b"k" * 16)
    short.chmod(0o600)
    with pytest.raises(ConfigError, match=rf"^{short}: expected a signing key of 32 bytes, "
                                          rf"found 16 bytes"):
        load_or_create_key(short)


def test_a_key_that_cannot_be_made_says_where_to_put_one(tmp_path):
    not_a_dir = tmp_path / "config"
    not_a_dir.write_text("a file where the key's directory would be")
    path = not_a_dir / "artifact.key"
    with pytest.raises(ConfigError, match=rf"^{path}: the compiled-artifact signing key: cannot "
                                          rf"make or read it .*{signed_file.KEY_ENV}"):
        load_or_create_key(path)


@pytest.mark.parametrize("owner", ["another uid", "you"])
def test_a_key_directory_others_can_write_is_refused_and_no_key_is_made_there(
        tmp_path, monkeypatch, owner):
    """A raygpt/ directory another user made first (or anyone may write) would let them swap
    or read the key beside its making: one ConfigError line naming the directory, nothing
    created in it."""
    shared = tmp_path / "config" / "raygpt"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    if owner == "another uid":
        if os.geteuid() != 0:
            pytest.skip("making a directory another uid owns needs root")
        os.chown(shared, 4242, 4242)
    monkeypatch.delenv(signed_file.KEY_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    with pytest.raises(ConfigError) as e:
        load_or_create_key()
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{shared}: expected a directory owned by you "
                                                f"(uid {os.geteuid()}), not writable by others")
    assert list(shared.iterdir()) == []


def test_a_fifo_planted_as_the_key_file_is_refused_without_blocking(tmp_path):
    import threading
    fifo = tmp_path / "artifact.key"
    os.mkfifo(fifo, 0o600)
    result = []
    t = threading.Thread(target=lambda: result.append(_load(fifo)), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the open so the thread ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("load_or_create_key blocked on a FIFO")
    assert isinstance(result[0], ConfigError), result
    assert str(result[0]).startswith(f"{fifo}: expected a private signing key file, found "
                                     f"another kind of file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def _load(path):
    try:
        return load_or_create_key(path)
    except ConfigError as e:
        return e
