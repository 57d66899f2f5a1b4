"""Tests of raygpt.data.staging (no Ray): a unit staged returns counts and a hash, never tokens;
a shard written from staged byte ranges is llm.c's; a staged unit that is not what was recorded
is one line; memory is bounded by a unit (pass one) and by a read (pass two)."""

from __future__ import annotations

import hashlib
import json
import pickle
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raygpt.data import corpus, staging
from raygpt.data import shard_writer as sw
from raygpt.data.tokenizer import EOT, get_encoding
from raygpt.storage import open_run_dir


def _rule(docs: list[str]) -> np.ndarray:
    """llm.c's fineweb rule, stated independently."""
    enc, out = get_encoding(), []
    for d in docs:
        out += [EOT] + enc.encode_ordinary(d)
    return np.array(out, dtype=np.uint16)


def _parquet(path, docs, row_group_size):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": docs}), path, row_group_size=row_group_size)
    fs, files = corpus.expand_inputs([str(path)])
    return fs, files, corpus.plan_units(fs, files, "text")


def _docs(n, seed):
    rng = np.random.default_rng(seed)
    words = np.array(["the", "naïve", "日本語", "🙂", "  ", "\n\n", "shard", "<|endoftext|>"])
    return [" ".join(rng.choice(words, int(rng.integers(0, 50)))) for _ in range(n)]


def test_a_staged_unit_is_its_tokens_on_disk_and_only_counts_and_a_hash_come_back(tmp_path):
    docs = _docs(60, 1)
    fs, files, units = _parquet(tmp_path / "c" / "a.parquet", docs, 25)
    out = open_run_dir(str(tmp_path / "out"))
    out.makedirs(staging.UNITS)
    result = staging.stage_unit(out, fs, files[0], units[1], "text")
    want = _rule(docs[25:50])
    staged = (tmp_path / "out" / staging.unit_file(1)).read_bytes()
    assert staged == want.tobytes()
    assert result == {"unit": 1, "tokens": len(want), "documents": 25,
                      "sha256": hashlib.sha256(want.tobytes()).hexdigest(), "error": ""}
    # what travels back to the driver: a few numbers and a hash, whatever the unit's size
    assert len(pickle.dumps(result)) < 300 < len(staged)


def test_a_shard_written_from_ranges_is_the_cut_of_the_stream(tmp_path):
    docs = _docs(90, 2)
    fs, files, units = _parquet(tmp_path / "c" / "a.parquet", docs, 5)
    out = open_run_dir(str(tmp_path / "out"))
    out.makedirs(staging.UNITS)
    staged = [staging.stage_unit(out, fs, files[0], u, "text") for u in units]
    planner = sw.CutPlanner(997, 401)
    plan = [s for r in staged for s in planner.add(r["unit"], r["tokens"])] + planner.finish()
    assert len(plan) > 4 and any(len(pieces) > 2 for _, pieces in plan)
    stream = _rule(docs)
    pos = 0
    for index, pieces in plan:
        name = sw.shard_name("c", index)
        got = staging.write_shard(out, name, [(u, a, b, staged[u]["tokens"], staged[u]["sha256"])
                                              for u, a, b in pieces])
        size = 401 if index == 0 else 997
        data = (tmp_path / "out" / ".prepare" / name).read_bytes()
        assert data == sw.shard_bytes(stream[pos:pos + size])
        assert got == {"name": name, "tokens": len(stream[pos:pos + size]),
                       "sha256": hashlib.sha256(data).hexdigest(), "error": ""}
        pos += size
    assert pos >= len(stream)


@pytest.mark.parametrize("damage", ["other_bytes", "shorter", "gone"])
def test_a_staged_unit_unlike_its_record_is_one_line_returned_not_raised(tmp_path, damage):
    fs, files, units = _parquet(tmp_path / "c" / "a.parquet", _docs(10, 3), 10)
    out = open_run_dir(str(tmp_path / "out"))
    out.makedirs(staging.UNITS)
    r = staging.stage_unit(out, fs, files[0], units[0], "text")
    path = tmp_path / "out" / staging.unit_file(0)
    data = path.read_bytes()
    if damage == "other_bytes":
        path.write_bytes(data[:-2] + bytes([data[-2] ^ 1, data[-1]]))
    elif damage == "shorter":
        path.write_bytes(data[:-2])
    else:
        path.unlink()
    got = staging.write_shard(out, "c_val_000000.bin",
                              [(0, 0, r["tokens"], r["tokens"], r["sha256"])])
    expected = {"other_bytes": rf"{path}: sha256: expected {r['sha256']} \(recorded when it was "
                               rf"staged\), found [0-9a-f]{{64}}; delete .*\.prepare to start",
                "shorter": rf"{path}: expected {2 * r['tokens']:,} bytes \({r['tokens']:,} "
                           rf"tokens\), found {2 * r['tokens'] - 2:,}",
                "gone": rf"{path}: expected the staged tokens of unit 0, found none"}[damage]
    import re
    assert re.fullmatch(expected + ".*", got["error"]) and "\n" not in got["error"], got["error"]


def test_bad_input_in_a_unit_comes_back_as_its_line(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "z.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" +
                                            json.dumps({"text": 3}) + "\n")
    fs, files = corpus.expand_inputs([str(tmp_path / "c")])
    out = open_run_dir(str(tmp_path / "out"))
    out.makedirs(staging.UNITS)
    r = staging.stage_unit(out, fs, files[0], corpus.plan_units(fs, files, "text")[0], "text")
    assert r["error"] == f"{tmp_path}/c/z.jsonl: line 2: field 'text': expected a string, found int"
    assert not (tmp_path / "out" / staging.unit_file(0)).exists()  # nothing staged


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_a_unit_in_pass_one_and_a_read_in_pass_two(tmp_path, monkeypatch):
    """Staging one unit of a corpus 40 times its size holds about what it holds for a corpus
    of that one unit; writing a shard of 2.4 MB holds a small read, not the shard."""
    small = _parquet(tmp_path / "s" / "a.parquet", _docs(200, 4), 200)
    big = _parquet(tmp_path / "b" / "a.parquet", _docs(200, 4) * 40, 200)
    out = open_run_dir(str(tmp_path / "out"))
    out.makedirs(staging.UNITS)
    peaks = [_peak(lambda: staging.stage_unit(out, fs, files[0], units[0], "text"))
             for fs, files, units in (small, big, small, big)]
    assert len(big[2]) == 40
    assert max(peaks[1], peaks[3]) < 2 * min(peaks[0], peaks[2]), peaks

    monkeypatch.setattr(staging, "_READ", 64 << 10)
    tokens = np.arange(1_200_000, dtype=np.uint16)
    (tmp_path / "out" / staging.unit_file(7)).write_bytes(tokens.tobytes())
    sha = hashlib.sha256(tokens.tobytes()).hexdigest()
    peak = _peak(lambda: staging.write_shard(
        out, "x_train_000001.bin", [(7, 0, len(tokens), len(tokens), sha)]))
    assert (tmp_path / "out" / ".prepare" / "x_train_000001.bin").read_bytes() == \
        sw.shard_bytes(tokens)
    assert 64 << 10 < peak < 600 << 10, peak
