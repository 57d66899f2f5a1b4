"""Tests of raygpt.data.corpus: inputs found and ordered, documents read from Parquet, JSON Lines
and text, each bad input one error naming the file and row, and the tokens rule (no Ray)."""

from __future__ import annotations

import bz2
import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raygpt.data import corpus
from raygpt.data.corpus import CorpusError
from raygpt.data.tokenizer import EOT, get_encoding


def _parquet(path, texts, *, field="text", row_group_size=None, type_=pa.string()):
    pq.write_table(pa.table({field: pa.array(texts, type=type_), "id": list(range(len(texts)))}),
                   path, row_group_size=row_group_size)


def _docs(tmp_path, name, **kw):
    fs, files = corpus.expand_inputs([str(tmp_path / name)])
    units = corpus.plan_units(fs, files, kw.pop("field", "text"))
    return [d for u in units for d in corpus.read_documents(fs, files[u.file], u, "text")]


@pytest.mark.parametrize("name,kind", [
    ("a.parquet", "parquet"), ("a.jsonl", "jsonl"), ("a.json", "jsonl"), ("a.jsonl.gz", "jsonl"),
    ("a.JSONL.ZST", "jsonl"), ("a.txt", "text"), ("a.txt.bz2", "text"), ("a.parquet.gz", None),
    ("a.csv", None), ("README", None)])
def test_kind_of(name, kind):
    assert corpus.kind_of(name) == kind


def test_inputs_are_files_globs_and_directories_in_sorted_path_order(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for rel in ["d/b.jsonl", "d/a.txt", "d/sub/c.parquet", "d/.hidden.txt", "d/_SUCCESS.txt",
                "d/notes.csv", "z.txt"]:
        (tmp_path / rel).write_text("x")
    _, files = corpus.expand_inputs([str(tmp_path / "z.txt"), str(tmp_path / "d")])
    assert [f.path.removeprefix(str(tmp_path) + "/") for f in files] == \
        ["d/a.txt", "d/b.jsonl", "d/sub/c.parquet", "z.txt"]
    _, files = corpus.expand_inputs([str(tmp_path / "d" / "*.txt"), str(tmp_path / "d/a.txt")])
    assert [f.path.rsplit("/", 1)[1] for f in files] == [".hidden.txt", "_SUCCESS.txt", "a.txt"]
    assert [f.size for f in files] == [1, 1, 1]


@pytest.mark.parametrize("given,message", [
    ("missing.txt", "missing.txt: expected an existing file"),
    ("nomatch/*.parquet", r"nomatch/\*.parquet: expected a glob matching at least one file"),
    ("notes.csv", "notes.csv: expected a .parquet, .jsonl"),
    ("empty_dir", "empty_dir: expected a directory holding"),
])
def test_bad_inputs_name_the_path(tmp_path, given, message):
    (tmp_path / "notes.csv").write_text("a,b")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(CorpusError, match=message):
        corpus.expand_inputs([str(tmp_path / given)])
    with pytest.raises(CorpusError, match="expected at least one"):
        corpus.expand_inputs([])


def test_parquet_rows_in_order_one_unit_per_row_group(tmp_path):
    texts = [f"doc {i} ✓" if i % 7 else "" for i in range(50)]
    _parquet(tmp_path / "p.parquet", texts, row_group_size=16)
    fs, files = corpus.expand_inputs([str(tmp_path / "p.parquet")])
    units = corpus.plan_units(fs, files, "text")
    assert [(u.row_group, u.row_start, u.rows) for u in units] == \
        [(0, 0, 16), (1, 16, 16), (2, 32, 16), (3, 48, 2)]
    assert _docs(tmp_path, "p.parquet") == texts


@pytest.mark.parametrize("case,message", [
    ("missing", r"p.parquet: --text-field 'text': expected a column of that name, found columns \['body', 'id'\]"),
    ("binary", r"p.parquet: column 'text': expected strings, found binary"),
    ("null", r"p.parquet: row 20: column 'text': expected a string, found null"),
])
def test_bad_parquet_is_one_line_naming_file_and_row(tmp_path, case, message):
    texts = [f"row {i}" for i in range(30)]
    if case == "missing":
        _parquet(tmp_path / "p.parquet", texts, field="body")
    elif case == "binary":
        _parquet(tmp_path / "p.parquet", [t.encode() for t in texts], type_=pa.binary())
    else:
        texts[19] = None
        _parquet(tmp_path / "p.parquet", texts, row_group_size=8)
    with pytest.raises(CorpusError, match=message) as e:
        _docs(tmp_path, "p.parquet")
    assert "\n" not in str(e.value)


def test_parquet_invalid_utf8_names_the_row(tmp_path):
    values = pa.array([b"fine", b"also fine", b"bad \xff byte"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": values}), tmp_path / "p.parquet")
    with pytest.raises(CorpusError, match=r"p.parquet: row 3: column 'text': expected UTF-8 text, found "
                       r"byte 0xff, which is not UTF-8 there \(invalid start byte\)$"):
        _docs(tmp_path, "p.parquet")


@pytest.mark.parametrize("suffix,opener", [(".jsonl", open), (".jsonl.gz", gzip.open),
                                           (".json.bz2", bz2.open)])
def test_jsonl_one_document_per_line_compressed_or_not(tmp_path, suffix, opener):
    rows = [{"text": "héllo"}, {"text": ""}, {"text": "a\n\nb", "extra": [1, 2]}]
    with opener(tmp_path / f"c{suffix}", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    assert _docs(tmp_path, f"c{suffix}") == ["héllo", "", "a\n\nb"]


def test_jsonl_zstd(tmp_path):
    with pa.CompressedOutputStream(str(tmp_path / "c.jsonl.zst"), "zstd") as f:
        f.write(b'{"text": "zstd doc"}\n')
    assert _docs(tmp_path, "c.jsonl.zst") == ["zstd doc"]


@pytest.mark.parametrize("line,message", [
    (b'{"text": null}', r"c.jsonl: line 3: field 'text': expected a string, found null"),
    (b'{"text": 42}', r"c.jsonl: line 3: field 'text': expected a string, found int"),
    (b'{"body": "x"}', r"c.jsonl: line 3: --text-field 'text': expected an object with that field, found \['body'\]"),
    (b'["text"]', r"c.jsonl: line 3: --text-field 'text': expected an object with that field, found list"),
    (b'{"text": "x"', r"c.jsonl: line 3: expected a JSON object"),
    (b'{"text": "bad \xff"}', r"c.jsonl: line 3: expected UTF-8 JSON, found byte 0xff, which is not UTF-8 "
                            r"there \(invalid start byte\)$"),
    (b"[" * 200_000, r"c.jsonl: line 3: expected a JSON object"),
])
def test_bad_jsonl_is_one_line_naming_file_and_line(tmp_path, line, message):
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "a"}\n\n' + line + b"\n")
    with pytest.raises(CorpusError, match=message) as e:
        _docs(tmp_path, "c.jsonl")
    assert "\n" not in str(e.value)


def test_text_is_split_on_blank_lines_llmc_recipe(tmp_path):
    (tmp_path / "t.txt").write_text("First\n\nSecond\nline\n\n\nlast")
    assert _docs(tmp_path, "t.txt") == ["First\n\n", "Second\nline\n\n", "\nlast"]
    (tmp_path / "bad.txt").write_bytes(b"ok\nok\nbad \xfe\n")
    with pytest.raises(CorpusError, match=r"bad.txt: line 3: expected UTF-8 text, found byte 0xfe, "
                       r"which is not UTF-8 there \(invalid start byte\)$"):
        _docs(tmp_path, "bad.txt")


def test_tokens_are_eot_then_encode_ordinary_per_document():
    enc = get_encoding()
    docs = ["Hello world", "", "text with <|endoftext|> inside", "naïve café 🙂"]
    expected = []
    for d in docs:
        expected += [EOT] + enc.encode_ordinary(d)
    got = corpus.tokenize_documents(docs)
    assert got.dtype == np.uint16 and got.tolist() == expected
    assert corpus.tokenize_documents([]).tolist() == []


def test_batches_of_documents_tokenize_as_each_document_alone(monkeypatch):
    """One tokenizer call per batch (documents joined by EOT's text) gives each document's own
    encode_ordinary: trailing and leading whitespace, empty documents, batch edges anywhere."""
    monkeypatch.setattr(corpus, "_BATCH_CHARS", 37)
    enc = get_encoding()
    rng = np.random.default_rng(5)
    pieces = ["word", " ", "  ", "\n", "\n\n", "naïve", "日本語", "🙂", "'s", "123", "!?"]
    docs = ["".join(rng.choice(pieces, int(rng.integers(0, 12)))) for _ in range(300)]
    docs += ["ends with spaces   ", "   ", "", "\n\n\n"]
    batches = list(corpus.token_batches(iter(docs)))
    assert len(batches) > 10 and sum(n for _, n in batches) == len(docs)
    want = []
    for d in docs:
        want += [EOT] + enc.encode_ordinary(d)
    assert np.concatenate([t for t, _ in batches]).tolist() == want


# ---------------------------------------------------------------------- bounds (issue 53)

def _bomb(path, opener, payload: bytes, total: int, **kw):
    """A compressed file of `total` bytes of `payload` repeated, written a chunk at a time."""
    chunk = payload * max(1, (1 << 20) // len(payload))
    with opener(path, "wb", **kw) as f:
        written = 0
        while written < total:
            f.write(chunk)
            written += len(chunk)


@pytest.mark.parametrize("suffix,opener,kw", [(".jsonl.gz", gzip.open, {"compresslevel": 1}),
                                              (".jsonl.bz2", bz2.open, {}),
                                              (".txt.gz", gzip.open, {"compresslevel": 1})])
def test_a_line_longer_than_the_bound_is_refused_in_one_line(tmp_path, monkeypatch, suffix,
                                                            opener, kw):
    monkeypatch.setattr(corpus, "MAX_LINE_BYTES", 1 << 20)
    _bomb(tmp_path / f"c{suffix}", opener, b"\0", 8 << 20, **kw)
    with pytest.raises(CorpusError, match=rf"c{suffix}: line 1: expected .* of at most "
                                          rf"1,048,576 bytes") as e:
        _docs(tmp_path, f"c{suffix}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["c.jsonl", "c.txt"])
def test_an_uncompressed_giant_line_is_refused_too(tmp_path, monkeypatch, name):
    monkeypatch.setattr(corpus, "MAX_LINE_BYTES", 1 << 16)
    (tmp_path / name).write_bytes(b'{"text": "a"}\n\n{"text": "' + b"x" * (1 << 18) + b'"}\n')
    with pytest.raises(CorpusError, match=rf"{name}: line 3: expected .* of at most 65,536 bytes"):
        _docs(tmp_path, name)


def test_more_decompressed_bytes_than_the_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "MAX_UNIT_BYTES", 1 << 20)
    _bomb(tmp_path / "c.jsonl.gz", gzip.open, b'{"text": "x"}\n', 4 << 20)
    with pytest.raises(CorpusError, match=r"c.jsonl.gz: expected at most 1,048,576 "
                                          r"decompressed bytes"):
        _docs(tmp_path, "c.jsonl.gz")
    (tmp_path / "c.jsonl.gz").unlink()
    _bomb(tmp_path / "p.txt", open, b"word\n\n", 2 << 20)
    with pytest.raises(CorpusError, match=r"p.txt: expected at most 1,048,576 bytes"):
        _docs(tmp_path, "p.txt")


def test_within_the_bounds_documents_are_read_whole_across_chunks(tmp_path, monkeypatch):
    """Lines and blank-line sections that straddle the reader's chunks come out whole."""
    monkeypatch.setattr(corpus, "_CHUNK", 7)
    rows = [{"text": "héllo wörld " * 5}, {"text": ""}, {"text": "🙂" * 9}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert _docs(tmp_path, "c.jsonl") == [r["text"] for r in rows]
    text = "First line\n\nSecond\nline\n\n\nlast ✓\n\n\n\n"
    (tmp_path / "t.txt").write_text(text)
    sections = text.split("\n\n")
    assert _docs(tmp_path, "t.txt") == [s + "\n\n" for s in sections[:-1]] + sections[-1:]


@pytest.mark.parametrize("suffix,opener", [(".jsonl.gz", gzip.open), (".jsonl.bz2", bz2.open)])
def test_a_bomb_is_refused_with_memory_bounded(tmp_path, suffix, opener):
    """A few KB that decompress to 256 MiB of zeros on one line: refused at the line bound,
    the reader's peak memory (VmHWM, in a child) well below what the file decompresses to."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    total = 256 << 20
    _bomb(tmp_path / f"c{suffix}", opener, b"\0", total)
    assert (tmp_path / f"c{suffix}").stat().st_size < total // 1000
    child = f"""
import sys
from raygpt.data import corpus
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
fs, files = corpus.expand_inputs([{str(tmp_path / f"c{suffix}")!r}])
units = corpus.plan_units(fs, files, "text")
before = hwm()
try:
    corpus.tokenize_unit(fs, files, units[0], "text")
except corpus.CorpusError as e:
    print(str(e))
print(hwm() - before)
"""
    repo = str(Path(__file__).resolve().parents[2])
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": repo})
    assert r.returncode == 0, r.stderr[-2000:]
    said, grew = r.stdout.splitlines()[-2:]
    assert "expected lines of at most" in said, r.stdout
    assert int(grew) < total // 2, f"peak memory grew by {int(grew):,} bytes"


def test_a_fifo_input_is_refused_not_waited_on(tmp_path):
    import os
    os.mkfifo(tmp_path / "c.jsonl")
    with pytest.raises(CorpusError, match=r"c.jsonl: expected a regular file, found a FIFO"):
        corpus.expand_inputs([str(tmp_path / "c.jsonl")])


class _Unblocker:
    """Opens the write end of a FIFO (non-blocking, retried) while inside, so a reader that
    waits on it (the unfixed code) gets an end of file instead of hanging the test."""

    def __init__(self, path):
        import threading
        self.path, self.stop = path, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import os
        while not self.stop.wait(0.05):
            try:
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["c.jsonl", "c.txt.gz", "c.parquet"])
def test_an_input_swapped_for_a_fifo_after_listing_is_refused_not_waited_on(tmp_path, name):
    import os
    if name.endswith(".parquet"):
        _parquet(tmp_path / name, ["a"])
    else:
        (tmp_path / name).write_bytes(b"")
    fs, files = corpus.expand_inputs([str(tmp_path / name)])
    units = corpus.plan_units(fs, files, "text")
    (tmp_path / name).unlink()
    os.mkfifo(tmp_path / name)
    with _Unblocker(tmp_path / name):
        with pytest.raises(CorpusError, match=rf"{name}: expected a regular file, found a FIFO"):
            corpus.read_documents(fs, files[0], units[0], "text")
        if name.endswith(".parquet"):  # the only kind whose plan reads the file (its footer)
            with pytest.raises(CorpusError, match=rf"{name}: expected a regular file, found a FIFO"):
                corpus.plan_units(fs, files, "text")


@pytest.mark.parametrize("name", ["c.jsonl.gz", "c.jsonl.bz2"])
def test_corrupt_compressed_data_is_one_line(tmp_path, name):
    """Damaged data after a valid header: a CorpusError naming the file, not zlib's own error."""
    opener = gzip.open if name.endswith(".gz") else bz2.open
    _bomb(tmp_path / "whole", opener, b'{"text": "some words here"}\n', 1 << 20)
    data = bytearray((tmp_path / "whole").read_bytes())
    data[40:60] = b"\xff" * 20
    (tmp_path / name).write_bytes(bytes(data))
    with pytest.raises(CorpusError, match=rf"{name}: cannot read \(decompressing\)"):
        _docs(tmp_path, name)
