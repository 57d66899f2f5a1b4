"""HashingWriter: the sha256 and size of exactly the bytes written, in order, on the calling
thread or behind the writes on a thread of its own (borrow), each piece's sha256 too, and into
the caller's own hasher (the model file's)."""

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from raygpt.storage.hashing_writer import HashingWriter

PARTS = (10, 4567, 0, 1000, 1, 2001, 2999, 12345, 3)  # across chunks and pieces, an empty write


@pytest.mark.parametrize("borrow", [False, True])
@pytest.mark.parametrize("piece", [None, 1, 999, 1000, 4096, 10 ** 6])
def test_every_digest_is_of_exactly_the_bytes_written(tmp_path, monkeypatch, borrow, piece):
    """The file holds the bytes written, in order; its sha256 and size are the file's; with
    `pieces` every `piece_bytes` of it get their own sha256 (writes cross piece boundaries, a
    piece spans writes, the last piece is short). borrow=True (the checkpoint writer's mode)
    hashes the whole file behind the writes in 1000-byte chunks here: the same digests."""
    monkeypatch.setattr(HashingWriter, "CHUNK", 1000)
    parts = [os.urandom(n) for n in PARTS]
    with ThreadPoolExecutor(3) as pieces, open(tmp_path / "f", "wb") as f:
        hw = HashingWriter(f, pieces=pieces if piece else None, piece_bytes=piece or 1,
                           borrow=borrow)
        for p in parts:
            assert hw.write(memoryview(p)) == len(p)
        digest = hw.hexdigest()
    data = (tmp_path / "f").read_bytes()
    assert data == b"".join(parts) and hw.size == len(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert hw.piece_digests() == ([hashlib.sha256(data[lo:lo + piece]).hexdigest()
                                   for lo in range(0, len(data), piece)] if piece else [])


def test_the_callers_hasher_is_fed(tmp_path):
    h = hashlib.sha256()
    with open(tmp_path / "f", "wb") as f:
        hw = HashingWriter(f, h)
        hw.write(b"abc")
        hw.write(bytearray(b"def"))
    assert hw.h is h and h.hexdigest() == hashlib.sha256(b"abcdef").hexdigest() and hw.size == 6


def test_with_borrow_nothing_waits_for_the_whole_file_hash(tmp_path):
    """borrow=True: a write returns, and the bytes reach the file, while the whole-file sha256
    has not yet been fed a byte; hexdigest() waits for it, and the hash's thread ends with it
    (a second finish is harmless)."""
    class Gated:
        def __init__(self):
            self.h, self.gate, self.fed = hashlib.sha256(), threading.Event(), 0

        def update(self, b):
            assert self.gate.wait(10), "the test never opened the gate"
            self.h.update(b)
            self.fed += len(b)

        def hexdigest(self):
            return self.h.hexdigest()

    data = os.urandom(3 * HashingWriter.CHUNK // 2)
    gated = Gated()
    with open(tmp_path / "f", "wb") as f:
        hw = HashingWriter(f, gated, borrow=True)
        hw.write(data)
        f.flush()
        assert gated.fed == 0 and (tmp_path / "f").read_bytes() == data
        gated.gate.set()
        assert hw.hexdigest() == hashlib.sha256(data).hexdigest() and gated.fed == len(data)
        hw.finish()
    assert not [t for t in threading.enumerate() if t.name.startswith("raygpt-sha256")]
