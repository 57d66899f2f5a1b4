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


def _corpus_files(directory) -> dict[str, object]:
    """One file of each corpus format `raygpt prepare` reads, by what the error calls it."""
    import bz2
    import gzip
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"text": f"row {i}: To be, or not to be"} for i in range(40)]
    jsonl = "".join(json.dumps(r) + "\n" for r in rows).encode()
    files = {"a Parquet file": directory / "c.parquet",
             "a JSON Lines file": directory / "c.jsonl",
             "a gzip-compressed file": directory / "c.jsonl.gz",
             "a bzip2-compressed file": directory / "c.txt.bz2",
             "a text file": directory / "c.txt"}
    pq.write_table(pa.Table.from_pylist(rows), files["a Parquet file"])
    files["a JSON Lines file"].write_bytes(jsonl)
    files["a gzip-compressed file"].write_bytes(gzip.compress(jsonl))
    files["a bzip2-compressed file"].write_bytes(bz2.compress(jsonl))
    # the 1024 bytes a header reads end inside a two-byte character
    text = ("To be, or not to be.\n" * 49)[:HEADER_BYTES - 1] + "Ça, Citizen: hear me.\n" * 9
    assert text.encode()[HEADER_BYTES - 1:HEADER_BYTES + 1] == "Ç".encode()
    files["a text file"].write_text(text, encoding="utf-8")
    return files


def test_a_corpus_where_a_shard_belongs_points_at_raygpt_prepare(tmp_path):
    from raygpt.llmc.shards import sniff_corpus
    for what, path in _corpus_files(tmp_path).items():
        assert sniff_corpus(path.read_bytes()[:HEADER_BYTES]) == what, path
        with pytest.raises(ShardError) as e:
            read_shard_header(path)
        assert str(e.value) == (f"{path}: expected an llm.c token shard (magic {SHARD_MAGIC}), "
                                f"found {what}; tokenize it into shards first: raygpt prepare "
                                f"{path} -o DIR")
    assert sniff_corpus(b"\x28\xb5\x2f\xfd\x00\x58") == "a zstd-compressed file"
    # what is none of them keeps the header's own message: a shard, llm.c's model file, bytes
    shard = make_shards(tmp_path, [300]).replace("*", "000000")
    model_header = np.zeros(256, "<i4")
    model_header[:2] = 20240326, 3
    for raw in (open(shard, "rb").read(HEADER_BYTES), model_header.tobytes(),
                bytes(range(256)) * 4, b"\xff\xfe" * 512, b""):
        assert sniff_corpus(raw) is None, raw[:8]


@pytest.mark.parametrize("flag", ["-i", "-j", "--eval-set"])
def test_train_given_a_corpus_names_raygpt_prepare_in_one_line_and_exits_2(tmp_path, flag):
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    path = _corpus_files(tmp_path)["a Parquet file"]
    value = f"book={path}" if flag == "--eval-set" else str(path)
    out = subprocess.run([sys.executable, "-m", "raygpt", "train", flag, value, "-o",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(repo)})
    named = {"-i": "-i/--input-bin", "-j": "-j/--input-val-bin", "--eval-set": "--eval-set book"}
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (f"raygpt: error: {named[flag]}: {path}: expected an llm.c token shard "
                          f"(magic {SHARD_MAGIC}), found a Parquet file; tokenize it into shards "
                          f"first: raygpt prepare {path} -o DIR\n")
    assert not (tmp_path / "run").exists()  # refused before anything was made
