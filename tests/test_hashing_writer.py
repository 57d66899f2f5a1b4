"""HashingWriter: the sha256 and size of exactly the bytes written, in order, with or without
its helper thread, and into the caller's own hasher (the model file's)."""

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from raygpt.hashing_writer import HashingWriter


@pytest.mark.parametrize("threaded", [False, True])
def test_the_hash_is_of_every_byte_written_in_order(tmp_path, monkeypatch, threaded):
    """Chunks, each hashed on the helper thread while it is written: the sha256 and size are
    exactly the file's."""
    monkeypatch.setattr(HashingWriter, "CHUNK", 1000)
    parts = [os.urandom(n) for n in (10, 4567, 0, 1000, 1, 2001, 2999)]
    with ThreadPoolExecutor(1) as pool, open(tmp_path / "f", "wb") as f:
        hw = HashingWriter(f, pool=pool if threaded else None)
        for p in parts:
            assert hw.write(memoryview(p)) == len(p)
    data = (tmp_path / "f").read_bytes()
    assert data == b"".join(parts)
    assert (hw.h.hexdigest(), hw.size) == (hashlib.sha256(data).hexdigest(), len(data))


def test_the_callers_hasher_is_fed(tmp_path):
    h = hashlib.sha256()
    with open(tmp_path / "f", "wb") as f:
        hw = HashingWriter(f, h)
        hw.write(b"abc")
        hw.write(bytearray(b"def"))
    assert hw.h is h and h.hexdigest() == hashlib.sha256(b"abcdef").hexdigest() and hw.size == 6


@pytest.mark.parametrize("piece", [1, 999, 1000, 4096, 10 ** 6])
def test_each_piece_gets_the_sha256_of_its_own_bytes(tmp_path, monkeypatch, piece):
    """With `pieces`, every `piece_bytes` of the file get their own sha256, hashed on the pieces'
    threads: writes cross piece boundaries, a piece spans writes, the last piece is short; the
    whole-file sha256 is unchanged by it."""
    monkeypatch.setattr(HashingWriter, "CHUNK", 1000)
    parts = [os.urandom(n) for n in (10, 4567, 0, 1000, 1, 2001, 2999)]
    with ThreadPoolExecutor(1) as pool, ThreadPoolExecutor(3) as pieces, \
            open(tmp_path / "f", "wb") as f:
        hw = HashingWriter(f, pool=pool, pieces=pieces, piece_bytes=piece)
        for p in parts:
            hw.write(memoryview(p))
    data = (tmp_path / "f").read_bytes()
    assert hw.piece_digests() == [hashlib.sha256(data[lo:lo + piece]).hexdigest()
                                  for lo in range(0, len(data), piece)]
    assert hw.h.hexdigest() == hashlib.sha256(data).hexdigest()
    with open(tmp_path / "g", "wb") as f:
        assert HashingWriter(f).piece_digests() == []  # no pieces asked


@pytest.mark.parametrize("piece", [None, 999, 1000, 4096, 10 ** 6])
def test_borrowed_writes_give_the_same_file_and_digests(tmp_path, monkeypatch, piece):
    """borrow=True (the checkpoint writer's mode): the whole-file sha256 runs behind the writes on
    the writer's own thread, the pieces' on theirs. The file holds exactly the bytes written, in
    order, and every digest is of exactly those bytes."""
    monkeypatch.setattr(HashingWriter, "CHUNK", 1000)
    parts = [os.urandom(n) for n in (10, 4567, 0, 1000, 1, 2001, 2999, 12345, 3)]
    with ThreadPoolExecutor(3) as pieces, open(tmp_path / "f", "wb") as f:
        hw = HashingWriter(f, pieces=pieces if piece else None, piece_bytes=piece or 1,
                           borrow=True)
        for p in parts:
            assert hw.write(memoryview(p)) == len(p)
        digest = hw.hexdigest()
    data = (tmp_path / "f").read_bytes()
    assert data == b"".join(parts) and hw.size == len(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert hw.piece_digests() == ([hashlib.sha256(data[lo:lo + piece]).hexdigest()
                                   for lo in range(0, len(data), piece)] if piece else [])
