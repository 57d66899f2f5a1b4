"""Tests of raygpt.data.shard_writer: the cut planned from counts against llm.c's own loop, the
progress a rerun starts from, the manifest's reader and writer, and publishing (no Ray)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from raygpt.data import shard_writer as sw
from raygpt.llmc.shards import read_shard
from raygpt.storage import open_run_dir


def llmc_fineweb_cut(docs: list[np.ndarray], shard_size: int) -> list[np.ndarray]:
    """llm.c's dev/data/fineweb.py main loop, restated: a document that does not fit fills the
    shard, the shard is written, and the document's rest starts the next one."""
    shards, buf, count = [], np.empty(shard_size, dtype=np.uint16), 0
    for tokens in docs:
        while count + len(tokens) >= shard_size:  # llm.c's else-branch, once per filled shard
            remainder = shard_size - count
            buf[count:] = tokens[:remainder]
            shards.append(buf.copy())
            tokens, count = tokens[remainder:], 0
        buf[count:count + len(tokens)] = tokens
        count += len(tokens)
    if count:
        shards.append(buf[:count].copy())
    return shards


def _cut(docs, shard_size, val_tokens=None):
    """The planner's cut from the documents' counts alone (each document a unit), made into
    shards by taking the ranges it names."""
    planner = sw.CutPlanner(shard_size, val_tokens or shard_size)
    planned = [s for i, d in enumerate(docs) for s in planner.add(i, len(d))] + planner.finish()
    return [(index, np.concatenate([docs[u][a:b] for u, a, b in pieces]))
            for index, pieces in planned]


@pytest.mark.timeout(60)  # a cutter that stops making progress fails here instead of hanging
@pytest.mark.parametrize("shard_size", [1, 7, 64, 1000, 5000])
def test_cut_is_llmc_fineweb_byte_for_byte(shard_size):
    rng = np.random.default_rng(0)
    # empty documents (EOT only), one longer than several shards, and exact fits
    lengths = [1, 1, 300, 64, 63, 1, 2000, 7, 7, 0, 5]
    docs = [rng.integers(0, 50257, n).astype(np.uint16) for n in lengths]
    got = _cut(docs, shard_size)
    want = llmc_fineweb_cut(docs, shard_size)
    assert [i for i, _ in got] == list(range(len(want)))
    assert [t.tobytes() for _, t in got] == [t.tobytes() for t in want]


def test_val_tokens_sizes_shard_zero_alone():
    stream = np.arange(25, dtype=np.uint16)
    got = _cut([stream[:4], stream[4:]], shard_size=10, val_tokens=3)
    assert [t.tolist() for _, t in got] == [[0, 1, 2], list(range(3, 13)), list(range(13, 23)),
                                            [23, 24]]
    assert _cut([np.zeros(0, dtype=np.uint16)], 4) == []
    with pytest.raises(ValueError, match="expected integers from 1"):
        sw.CutPlanner(0, 1)


def test_names_and_bytes_are_llmcs():
    assert sw.shard_name("edu_fineweb", 0) == "edu_fineweb_val_000000.bin"
    assert sw.shard_name("edu_fineweb", 12) == "edu_fineweb_train_000012.bin"
    data = sw.shard_bytes(np.array([5, 65535], dtype=np.uint16))
    header = np.frombuffer(data[:1024], dtype="<i4")
    assert header[:3].tolist() == [20240520, 1, 2] and not header[3:].any()
    assert data[1024:] == b"\x05\x00\xff\xff" and len(data) == 1028


def test_the_plan_is_ranges_of_units_in_order_and_each_shard_once_full():
    planner = sw.CutPlanner(10, 3)
    assert planner.add(0, 2) == []
    assert planner.add(1, 15) == [(0, [(0, 0, 2), (1, 0, 1)]), (1, [(1, 1, 11)])]
    assert planner.add(2, 0) == []  # a unit with no documents takes no range
    assert planner.add(3, 6) == [(2, [(1, 11, 15), (3, 0, 6)])]  # an exact fit
    assert planner.finish() == []
    assert planner.add(4, 1) == [] and planner.finish() == [(3, [(4, 0, 1)])]


def test_progress_and_manifest_round_trip_and_refuse_foreign_files(tmp_path):
    out = open_run_dir(str(tmp_path))
    p = sw.Progress("abc", [{"name": "x_val_000000.bin", "tokens": 3, "sha256": "00"}],
                    {0: (3, 1, "aa"), 2: (0, 0, "bb")})
    sw.write_progress(out, p)
    assert sw.read_progress(out) == p
    progress = json.loads((tmp_path / ".prepare" / "progress.json").read_text())
    (tmp_path / ".prepare" / "progress.json").write_text(json.dumps({**progress, "version": 1}))
    with pytest.raises(sw.PrepareError, match=r"progress.json: format/version: expected "
                                              r"'raygpt-prepare-progress' 2, found"):
        sw.read_progress(out)
    (tmp_path / ".prepare" / "progress.json").write_text(
        json.dumps({**progress, "units": [[0, -3, 1, "aa"]]}))
    with pytest.raises(sw.PrepareError, match="found a damaged file"):
        sw.read_progress(out)
    m = sw.make_manifest(name="x", identity_hex="abc", inputs=[("a.txt", 10)], text_field="text",
                         shard_size=8, val_tokens=8, tokenizer_sha256="f", documents=1,
                         shards=p.shards)
    sw.write_manifest(out, m)
    assert sw.read_manifest(out) == m and m["tokens"] == 3
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "format": "other"}))
    with pytest.raises(sw.PrepareError, match=r"manifest.json: format/version: expected 'raygpt-shards' 1"):
        sw.read_manifest(out)
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "shards": [{"name": "../x"}]}))
    with pytest.raises(sw.PrepareError, match="manifest.json: expected raygpt-shards fields"):
        sw.read_manifest(out)
    (tmp_path / "manifest.json").write_text("[" * 200_000)
    with pytest.raises(sw.PrepareError, match="manifest.json: expected raygpt-shards JSON"):
        sw.read_manifest(out)


def test_publish_moves_staged_shards_then_writes_the_manifest_and_can_be_repeated(tmp_path):
    out = open_run_dir(str(tmp_path))
    (tmp_path / ".prepare").mkdir()
    shards = []
    for i in range(3):  # what raygpt.data.staging.write_shard leaves in staging
        data = sw.shard_bytes(np.full(i + 1, i, np.uint16))
        (tmp_path / ".prepare" / sw.shard_name("n", i)).write_bytes(data)
        shards.append({"name": sw.shard_name("n", i), "tokens": i + 1,
                       "sha256": hashlib.sha256(data).hexdigest()})
    m = sw.make_manifest(name="n", identity_hex="i", inputs=[], text_field="text", shard_size=3,
                         val_tokens=1, tokenizer_sha256="f", documents=3, shards=shards)
    # a kill between two moves: the first shard is already in place
    (tmp_path / ".prepare" / "n_val_000000.bin").rename(tmp_path / "n_val_000000.bin")
    sw.publish(out, m)
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ["manifest.json", "n_train_000001.bin", "n_train_000002.bin", "n_val_000000.bin"]
    assert read_shard(tmp_path / "n_train_000002.bin").tolist() == [2, 2, 2]
    assert sw.read_manifest(out)["shards"] == shards
    (tmp_path / "n_train_000002.bin").unlink()
    with pytest.raises(sw.PrepareError, match="n_train_000002.bin: expected the shard of 3 tokens"):
        sw.publish(out, m)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("shard_size,val_tokens", [
    (float("nan"), 8), (8, float("nan")), (float("inf"), 8), (2.5, 8), (8, 0.5), (True, 8),
    (8, -1), (2**31, 8), ("8", 8), (None, 8)])
def test_a_cutter_that_could_not_fill_a_shard_is_refused_at_construction(shard_size, val_tokens):
    """Capacities that are not whole token counts in llm.c's int32 header field never reach
    the cut loop."""
    with pytest.raises(ValueError, match=r"shard_size and val_tokens: expected integers from 1 "
                                         r"to 2147483647"):
        sw.CutPlanner(shard_size, val_tokens)


@pytest.mark.timeout(10)
def test_a_cut_that_can_take_no_token_fails_instead_of_looping():
    """A capacity of zero (or less) met in the loop (an attribute changed after construction)
    is an error, never a loop that takes nothing forever."""
    planner = sw.CutPlanner(4, 2)
    planner.shard_size = 0
    with pytest.raises(ValueError, match="capacity 0"):
        planner.add(0, 10)
