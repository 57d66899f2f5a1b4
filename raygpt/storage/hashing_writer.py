"""A write-only file that hashes what passes through it: a checkpoint's files are hashed by the
process that writes them, while it writes them, and never read back for it."""

from __future__ import annotations

import hashlib
import io
from concurrent.futures import ThreadPoolExecutor

# Bytes per piece of a file that gets a sha256 of its own (MANIFEST's "piece_sha256"): a rank that
# loads the file checks its pieces on several threads instead of one sha256 over it all (1.5 GB
# of GPT-2 124M's state at ~0.5-1.3 GB/s on one core: seconds of a restart).
PIECE_BYTES = 64 << 20


class HashingWriter(io.RawIOBase):
    """Writes to the file `f` and feeds every byte to `hasher` (a hashlib object; sha256 by
    default), counting them in `size`. With `pieces` (an executor of a few threads) every
    `piece_bytes` of the file also get a sha256 of their own (`piece_digests`), hashed on those
    threads while the file is written.

    By default each write is hashed, then written, on the calling thread. With `borrow=True`
    nothing waits for the whole-file sha256: the writer runs it on a thread of its own, in file
    order, behind the writes, so one serial sha256 overlaps the writing instead of adding to it
    (a checkpoint's state file: `bench/piece_hashes.py`). The writer then reads the caller's
    buffers after `write` returns: the caller leaves them unchanged until `hexdigest()` or
    `finish()` (a checkpoint's snapshot buffers are not touched before its writer is done). The
    file itself is written by the calling thread, in order: on the H200 machines' disk, pieces
    written at their offsets by several threads were slower (one file's writes are serialised
    there).
    """

    CHUNK = 16 << 20  # the behind-hash's unit of work

    def __init__(self, f, hasher=None, pieces=None, piece_bytes: int = PIECE_BYTES,
                 borrow: bool = False):
        self.f, self.size = f, 0
        self.h = hasher if hasher is not None else hashlib.sha256()
        self.pieces, self.piece_bytes = pieces, piece_bytes
        self._piece_hashers: list = []  # one sha256 per piece begun, in file order
        self._behind = (ThreadPoolExecutor(1, thread_name_prefix="raygpt-sha256")
                        if borrow else None)  # one thread: the whole-file hash stays in order
        self._pending: list = []  # the whole-file hash's submitted chunks (borrow)

    def writable(self):
        return True

    def write(self, b):
        view = memoryview(b).cast("B")
        if self._behind is not None:
            self._pending += [self._behind.submit(self.h.update, view[lo:lo + self.CHUNK])
                              for lo in range(0, len(view), self.CHUNK)]
        else:
            self.h.update(view)
        pieces = self._hash_pieces(view)
        self.f.write(view)
        for done in pieces:  # before returning: the next write may continue a piece hashed
            done.result()    # here (and, without borrow, the caller may reuse `b`)
        self.size += len(view)
        return len(view)

    def _hash_pieces(self, view: memoryview) -> list:
        """Submit `view`'s bytes to the sha256 of each piece they fall in (each piece once per
        write: the pieces of one write hash in parallel, a piece spanning writes in order)."""
        if self.pieces is None:
            return []
        futures, pos = [], 0
        while pos < len(view):
            k = (self.size + pos) // self.piece_bytes
            end = min(len(view), (k + 1) * self.piece_bytes - self.size)
            if k == len(self._piece_hashers):
                self._piece_hashers.append(hashlib.sha256())
            futures.append(self.pieces.submit(self._piece_hashers[k].update, view[pos:end]))
            pos = end
        return futures

    def finish(self) -> None:
        """Wait for the whole-file hash of everything written (borrow); then nothing of the
        caller's buffers is read any more. Idempotent."""
        pending, self._pending = self._pending, []
        for p in pending:
            p.result()
        if self._behind is not None:
            self._behind.shutdown()
            self._behind = None

    def close(self) -> None:
        self.finish()
        super().close()

    def hexdigest(self) -> str:
        """The whole file's sha256 (once every write is hashed)."""
        self.finish()
        return self.h.hexdigest()

    def piece_digests(self) -> list[str]:
        """The sha256 of each `piece_bytes` of the file written (the last piece may be shorter);
        [] without `pieces`."""
        return [h.hexdigest() for h in self._piece_hashers]
