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
from raygpt.tokenizer import EOT, get_encoding


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
    with pytest.raises(CorpusError, match=r"p.parquet: row 3: column 'text': expected UTF-8 text"):
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
    (b'{"text": "bad \xff"}', r"c.jsonl: line 3: expected UTF-8 JSON, found byte 0xff"),
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
    with pytest.raises(CorpusError, match=r"bad.txt: line 3: expected UTF-8 text, found byte 0xfe"):
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
