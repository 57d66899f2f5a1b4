"""A write-only file that hashes what passes through it: a checkpoint's files are hashed by the
process that writes them, while it writes them, and never read back for it."""

from __future__ import annotations

import hashlib
import io

# Bytes per piece of a file that gets a sha256 of its own (MANIFEST's "piece_sha256"): a rank that
# loads the file checks its pieces on several threads instead of one sha256 over it all (1.5 GB
# of GPT-2 124M's state at ~0.5-1.3 GB/s on one core: seconds of a restart).
PIECE_BYTES = 64 << 20


class HashingWriter(io.RawIOBase):
    """Writes to the file `f` and feeds every byte to `hasher` (a hashlib object; sha256 by
    default), counting them in `size`. With `pool` (a one-thread executor) large writes go in
    chunks, each hashed on the pool's thread while it is written here (hashlib and the file
    write both release the GIL: the hash then costs next to no time on top of the write).
    With `pieces` (an executor of a few threads) every `piece_bytes` of the file also get a
    sha256 of their own (`piece_digests`), hashed on those threads while the file is written."""

    CHUNK = 16 << 20

    def __init__(self, f, hasher=None, pool=None, pieces=None, piece_bytes: int = PIECE_BYTES):
        self.f, self.size, self.pool = f, 0, pool
        self.h = hasher if hasher is not None else hashlib.sha256()
        self.pieces, self.piece_bytes = pieces, piece_bytes
        self._piece_hashers: list = []  # one sha256 per piece begun, in file order

    def writable(self):
        return True

    def write(self, b):
        view = memoryview(b).cast("B")
        pieces = self._hash_pieces(view)
        for lo in range(0, len(view), self.CHUNK):
            chunk = view[lo:lo + self.CHUNK]
            hashed = self.pool.submit(self.h.update, chunk) if self.pool else None
            if hashed is None:
                self.h.update(chunk)
            self.f.write(chunk)
            if hashed is not None:
                hashed.result()
        for done in pieces:  # before returning: the caller may reuse `b`, and the next write
            done.result()    # may continue a piece hashed here
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

    def piece_digests(self) -> list[str]:
        """The sha256 of each `piece_bytes` of the file written (the last piece may be shorter);
        [] without `pieces`."""
        return [h.hexdigest() for h in self._piece_hashers]
