"""A write-only file that hashes what passes through it: a checkpoint's files are hashed by the
process that writes them, while it writes them, and never read back for it."""

from __future__ import annotations

import hashlib
import io


class HashingWriter(io.RawIOBase):
    """Writes to the file `f` and feeds every byte to `hasher` (a hashlib object; sha256 by
    default), counting them in `size`. With `pool` (a one-thread executor) large writes go in
    chunks, each hashed on the pool's thread while it is written here (hashlib and the file
    write both release the GIL: the hash then costs next to no time on top of the write)."""

    CHUNK = 16 << 20

    def __init__(self, f, hasher=None, pool=None):
        self.f, self.size, self.pool = f, 0, pool
        self.h = hasher if hasher is not None else hashlib.sha256()

    def writable(self):
        return True

    def write(self, b):
        view = memoryview(b).cast("B")
        for lo in range(0, len(view), self.CHUNK):
            chunk = view[lo:lo + self.CHUNK]
            hashed = self.pool.submit(self.h.update, chunk) if self.pool else None
            if hashed is None:
                self.h.update(chunk)
            self.f.write(chunk)
            if hashed is not None:
                hashed.result()
        self.size += len(view)
        return len(view)
