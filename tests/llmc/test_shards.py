"""raygpt.llmc.shards: llm.c's token shard format (dev/data/data_common.py writes it,
llmc/dataloader.h reads it): a 256-int32 header (magic 20240520, version 1, token count) and
uint16 tokens; every malformed shard is an error naming the file, the field, what was expected
and what was found, from the reader and from the loader that opens it."""

import os

import numpy as np
import pytest

from raygpt.data.loader import DistributedDataLoader
from raygpt.llmc.shards import (HEADER_BYTES, SHARD_MAGIC, SHARD_VERSION, ShardError, read_shard,
                                read_shard_header, write_shard)


def make_shards(directory, sizes, prefix="shard"):
    """Write shards of the given token counts; return their glob pattern."""
    for s, n in enumerate(sizes):
        write_shard(directory / f"{prefix}_{s:06d}.bin", s * 1000 + np.arange(n))
    return str(directory / f"{prefix}_*.bin")


def test_write_read_round_trip(tmp_path):
    tokens = np.array([0, 1, 50256, 65535, 7] * 11, dtype=np.int64)
    path = tmp_path / "a.bin"
    write_shard(path, tokens)
    assert read_shard_header(path) == len(tokens)
    assert os.path.getsize(path) == HEADER_BYTES + 2 * len(tokens)
    got = read_shard(path)
    assert got.dtype == np.uint16
    assert np.array_equal(got, tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[0] == SHARD_MAGIC and header[1] == SHARD_VERSION and header[2] == len(tokens)
    assert not header[3:].any()
    assert os.listdir(tmp_path) == ["a.bin"]  # no temp file left behind


def test_write_replaces_atomically_and_rejects_non_uint16(tmp_path):
    path = tmp_path / "a.bin"
    write_shard(path, [1, 2, 3])
    for bad in ([1, 65536], [-1, 2]):
        with pytest.raises(ShardError, match=r"a\.bin.*tokens.*65535"):
            write_shard(path, bad)
    assert np.array_equal(read_shard(path), [1, 2, 3])  # the old shard is untouched
    assert os.listdir(tmp_path) == ["a.bin"]


def _corrupt(path, kind):
    raw = bytearray(path.read_bytes())
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4").copy()
    if kind == "magic":
        header[0] = 20240326
    elif kind == "version":
        header[1] = 2
    elif kind == "count":
        header[2] += 5
    elif kind == "truncated":
        path.write_bytes(bytes(raw[:100]))
        return
    raw[:HEADER_BYTES] = header.tobytes()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind, field, found", [
    ("magic", "magic", "20240326"),
    ("version", "version", "found 2"),
    ("count", "token count", "found 1224 bytes"),
    ("truncated", "header", "found a file of 100 bytes"),
])
def test_bad_shard_errors_name_file_field_expected_found(tmp_path, kind, field, found):
    make_shards(tmp_path, [100, 100])
    bad = tmp_path / "shard_000001.bin"
    _corrupt(bad, kind)
    for call in (lambda: read_shard_header(bad), lambda: read_shard(bad),
                 lambda: DistributedDataLoader(str(tmp_path / "*.bin"), 2, 4, 0, 2)):
        with pytest.raises(ShardError) as e:
            call()
        msg = str(e.value)
        assert "shard_000001.bin" in msg and field in msg and "expected" in msg and found in msg
