"""llm.c's token shards, byte for byte (llm.c's dev/data/data_common.py writes them,
llmc/dataloader.h reads them): a header of 256 little-endian int32 -- magic 20240520, version 1,
the token count, the rest zero -- followed by the tokens as uint16. Reader and writer side by
side; every mismatch is a ShardError naming the file and the header field.
"""

from __future__ import annotations

import os
import shlex

import numpy as np

from raygpt.storage.atomic_file import atomic_local_file

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4  # 1024
TOKEN_DTYPE = np.dtype("<u2")  # GPT-2's 50257 tokens fit uint16
_MAX_TOKEN_COUNT = 2**31 - 1  # header[2] is an int32


class ShardError(ValueError):
    """A token shard (or a shard pattern) cannot be used; the message names the file and field."""


def write_shard(path: str | os.PathLike, tokens) -> None:
    """Write `tokens` as an llm.c shard at `path`, atomically (raygpt.storage.atomic_file), so a crash
    never leaves a half-written shard under the final name."""
    path = os.fspath(path)
    toks = np.asarray(tokens)
    if toks.ndim != 1:
        raise ShardError(f"{path}: tokens: expected a 1-D sequence, found shape {toks.shape}")
    if toks.size and not np.issubdtype(toks.dtype, np.integer):
        raise ShardError(f"{path}: tokens: expected integers, found dtype {toks.dtype}")
    if toks.size and (int(toks.min()) < 0 or int(toks.max()) > np.iinfo(np.uint16).max):
        raise ShardError(f"{path}: tokens: expected values in [0, 65535] (uint16), "
                         f"found range [{int(toks.min())}, {int(toks.max())}]")
    if toks.size > _MAX_TOKEN_COUNT:
        raise ShardError(f"{path}: token count: expected at most {_MAX_TOKEN_COUNT} (int32 header "
                         f"field), found {toks.size}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, toks.size

    with atomic_local_file(path) as f:
        f.write(header.tobytes())
        f.write(toks.astype(TOKEN_DTYPE, copy=False).tobytes())


# What a file given where shards belong is, by its first bytes: a corpus `raygpt prepare` reads
_CORPUS_MAGICS = ((b"PAR1", "a Parquet file"), (b"\x1f\x8b", "a gzip-compressed file"),
                  (b"BZh", "a bzip2-compressed file"), (b"\x28\xb5\x2f\xfd", "a zstd-compressed file"))


def sniff_corpus(raw: bytes) -> str | None:
    """What `raw` (a file's first bytes) shows the file to be when it is a corpus rather than a
    shard: "a Parquet file", "a JSON Lines file", "a text file", a compressed file; None when
    it looks like none of them."""
    for magic, what in _CORPUS_MAGICS:
        if raw.startswith(magic):
            return what
    head = raw[:HEADER_BYTES]
    if head.lstrip()[:1] == b"{":
        return "a JSON Lines file"
    if not head:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:  # a character cut by the end of `head` is still text
        if e.start < len(head) - 3:
            return None
        text = head[:e.start].decode("utf-8")
    # a shard's header is mostly NULs, which are not printable
    return "a text file" if all(c.isprintable() or c in "\n\r\t" for c in text) else None


def check_shard_header(raw: bytes, size: int, name: str) -> int:
    """Check a shard's first HEADER_BYTES bytes (`raw`) against llm.c's format and the file's
    `size`; return the token count. `name` is how errors name the file (a path or a URI); a
    corpus given where a shard belongs (`sniff_corpus`) is told to go through `raygpt prepare`."""
    corpus = None if raw[:4] == SHARD_MAGIC.to_bytes(4, "little") else sniff_corpus(raw)
    if corpus:
        raise ShardError(f"{name}: expected an llm.c token shard (magic {SHARD_MAGIC}), found "
                         f"{corpus}; tokenize it into shards first: raygpt prepare {shlex.quote(name)} -o DIR")
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"{name}: header: expected {HEADER_BYTES} bytes (256 int32), "
                         f"found a file of {len(raw)} bytes")
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    if header[0] != SHARD_MAGIC:
        raise ShardError(f"{name}: magic (header[0]): expected {SHARD_MAGIC}, found {int(header[0])}"
                         " -- not an llm.c token shard")
    if header[1] != SHARD_VERSION:
        raise ShardError(f"{name}: version (header[1]): expected {SHARD_VERSION}, "
                         f"found {int(header[1])}")
    ntok = int(header[2])
    expected_size = HEADER_BYTES + ntok * TOKEN_DTYPE.itemsize
    if ntok < 0 or size != expected_size:
        raise ShardError(f"{name}: token count (header[2]) = {ntok}: expected a file of "
                         f"{HEADER_BYTES} + 2*{ntok} = {expected_size} bytes, found {size} bytes")
    return ntok


def read_shard_header(path: str | os.PathLike) -> int:
    """Check the header of the shard at `path` against llm.c's format and its file size;
    return the token count."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise ShardError(f"{path}: cannot read shard ({e})") from e
    return check_shard_header(raw, size, path)


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """The tokens of the shard at `path` as a read-only uint16 array (memory-mapped)."""
    path = os.fspath(path)
    ntok = read_shard_header(path)
    if ntok == 0:  # mmap cannot map zero bytes
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(ntok,))
