"""A corpus as an ordered list of documents, and its documents as GPT-2 tokens (no Ray here).

Inputs are files, globs, directories or object-store URIs (`s3://`, `gs://`) of

- Parquet: one document per row, the string column `text_field`;
- JSON Lines (`.jsonl`, `.json`, optionally `.gz`, `.bz2`, `.zst`, `.lz4`): one document per line,
  the string field `text_field` of each object (blank lines are skipped);
- plain text (`.txt`, optionally compressed): split on blank lines, llm.c's tiny-text recipe: each
  section is a document, followed by "\\n\\n" but for the last one.

The documents' order is the inputs' sorted path order, then file order. Work is cut into *units*
(a Parquet row group, or a whole JSON Lines or text file), each tokenized on its own: a unit is
`[<|endoftext|>] + encode_ordinary(text)` for each of its documents, concatenated, which is
llm.c's `dev/data/fineweb.py` rule. Bad input is a `CorpusError` naming the file, and the row
(1-based line for JSON Lines and text) where there is one.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import posixpath

import numpy as np
import pyarrow.fs as pafs

from raygpt import tokenizer

PARQUET = "parquet"
JSONL = "jsonl"
TEXT = "text"
COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
_KINDS = ((".parquet", PARQUET), (".jsonl", JSONL), (".json", JSONL), (".txt", TEXT))
_GLOB_CHARS = "*?["


class CorpusError(ValueError):
    """An input cannot be prepared; the message names the file (and row) and what was expected."""


@dataclasses.dataclass(frozen=True)
class InputFile:
    """One input file: where it is (`path` as the filesystem names it, `uri` as the user would),
    its size and its kind."""

    uri: str
    path: str
    size: int
    kind: str


@dataclasses.dataclass(frozen=True)
class Unit:
    """A piece of work tokenized on its own: the `index`-th of the corpus, rows
    [row_start, row_start + rows) of input `file` (all of it for JSON Lines and text: rows -1),
    Parquet row group `row_group`, and the bytes it reads, for progress."""

    index: int
    file: int
    row_group: int
    row_start: int
    rows: int
    nbytes: int


def kind_of(name: str) -> str | None:
    """The input kind a file name says (its extension, after a compression suffix), or None."""
    base = name.lower()
    for suffix in COMPRESSED:
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    for ext, kind in _KINDS:
        if base.endswith(ext):
            return None if kind == PARQUET and base != name.lower() else kind
    return None


def filesystem_for(uri: str, endpoint: str = "") -> tuple[pafs.FileSystem, str]:
    """(filesystem, path within it) for a local path or a URI, opened through the URI door
    (raygpt.storage.uri.open_filesystem: the storage endpoint applied, every call bounded)."""
    from raygpt.storage.uri import open_filesystem

    if "://" not in uri:
        return pafs.LocalFileSystem(), posixpath.abspath(uri)
    try:
        return open_filesystem(uri, endpoint)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad URI
        raise CorpusError(f"{uri}: cannot open ({type(e).__name__}: {e})") from None


def _uri_of(uri: str, fs: pafs.FileSystem, path: str) -> str:
    if "://" not in uri:
        return path
    scheme = uri.split("://", 1)[0]
    return f"{scheme}://{path.lstrip('/')}"


def expand_inputs(inputs: list[str], endpoint: str = "") -> tuple[pafs.FileSystem, list[InputFile]]:
    """Every file the inputs name, deduplicated and in sorted path order. A directory contributes
    the files under it whose extension names a kind (hidden files left out); a file named
    directly must have such an extension; a glob or directory that matches nothing is an error.
    All inputs must be on one filesystem (one store)."""
    if not inputs:
        raise CorpusError("INPUT: expected at least one file, glob, directory or URI, found none")
    found: dict[str, InputFile] = {}
    fs_seen: pafs.FileSystem | None = None
    for given in inputs:
        fs, path = filesystem_for(given, endpoint)
        if fs_seen is not None and fs.type_name != fs_seen.type_name:
            raise CorpusError(f"{given}: expected every input on one filesystem "
                              f"({fs_seen.type_name}), found {fs.type_name}")
        fs_seen = fs_seen or fs
        for info in _matches(given, fs, path):
            kind = kind_of(info.base_name)
            if kind is None:
                raise CorpusError(f"{_uri_of(given, fs, info.path)}: expected a .parquet, .jsonl, "
                                  f".json or .txt file (JSON Lines and text optionally .gz, .bz2, "
                                  f".zst or .lz4), found {info.base_name!r}")
            found[info.path] = InputFile(_uri_of(given, fs, info.path), info.path, info.size, kind)
    return fs_seen, [found[p] for p in sorted(found)]


def _matches(given: str, fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    try:
        if any(c in path for c in _GLOB_CHARS):
            root = path[: min(path.index(c) for c in _GLOB_CHARS if c in path)].rpartition("/")[0]
            infos = [i for i in fs.get_file_info(pafs.FileSelector(root or "/", recursive=True,
                                                                   allow_not_found=True))
                     if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, path)]
            if not infos:
                raise CorpusError(f"{given}: expected a glob matching at least one file, found none")
            return infos
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            return [info]
        if info.type == pafs.FileType.Directory:
            infos = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                     if i.type == pafs.FileType.File and kind_of(i.base_name)
                     and not any(part.startswith((".", "_"))
                                 for part in posixpath.relpath(i.path, path).split("/"))]
            if not infos:
                raise CorpusError(f"{given}: expected a directory holding .parquet, .jsonl, .json "
                                  f"or .txt files, found none")
            return infos
    except OSError as e:
        raise CorpusError(f"{given}: cannot read ({e})") from None
    raise CorpusError(f"{given}: expected an existing file, glob, directory or URI, found nothing")


def plan_units(fs: pafs.FileSystem, files: list[InputFile], text_field: str) -> list[Unit]:
    """The corpus's units in order. Parquet files are checked here from their footers alone:
    the field exists and is a string column (so a wrong --text-field fails before anything is
    tokenized); each row group is one unit."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    units: list[Unit] = []
    for i, f in enumerate(files):
        if f.kind != PARQUET:
            units.append(Unit(len(units), i, -1, 0, -1, f.size))
            continue
        try:
            with fs.open_input_file(f.path) as handle:
                meta = pq.ParquetFile(handle).metadata
                schema = meta.schema.to_arrow_schema()
        except (OSError, pa.ArrowException) as e:
            raise CorpusError(f"{f.uri}: expected a Parquet file ({e})") from None
        if text_field not in schema.names:
            raise CorpusError(f"{f.uri}: --text-field {text_field!r}: expected a column of that "
                              f"name, found columns {schema.names}")
        field_type = schema.field(text_field).type
        if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):
            raise CorpusError(f"{f.uri}: column {text_field!r}: expected strings, found "
                              f"{field_type}")
        start = 0
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            units.append(Unit(len(units), i, g, start, group.num_rows, group.total_byte_size))
            start += group.num_rows
    return units


def read_documents(fs: pafs.FileSystem, f: InputFile, unit: Unit, text_field: str) -> list[str]:
    """The documents of `unit` of input `f`, each checked to be a string."""
    if f.kind == PARQUET:
        return _parquet_documents(fs, f, unit, text_field)
    data = _read_all(fs, f)
    if f.kind == TEXT:
        text = _decode(data, f, what="text")
        sections = text.split("\n\n")
        return [s + "\n\n" for s in sections[:-1]] + sections[-1:]
    return _jsonl_documents(data, f, text_field)


def _read_all(fs: pafs.FileSystem, f: InputFile) -> bytes:
    try:
        with fs.open_input_stream(f.path, compression="detect") as stream:
            return stream.read()
    except OSError as e:
        raise CorpusError(f"{f.uri}: cannot read ({e})") from None


def _decode(data: bytes, f: InputFile, *, what: str, line: int | None = None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line if line is not None else data.count(b"\n", 0, e.start) + 1
        raise CorpusError(f"{f.uri}: line {at}: expected UTF-8 {what}, found byte "
                          f"0x{data[e.start]:02x} that is not") from None


def _jsonl_documents(data: bytes, f: InputFile, text_field: str) -> list[str]:
    docs = []
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(_decode(raw, f, what="JSON", line=n))
        except (json.JSONDecodeError, RecursionError) as e:
            raise CorpusError(f"{f.uri}: line {n}: expected a JSON object ({e})") from None
        if not isinstance(row, dict) or text_field not in row:
            found = sorted(row)[:8] if isinstance(row, dict) else type(row).__name__
            raise CorpusError(f"{f.uri}: line {n}: --text-field {text_field!r}: expected an object "
                              f"with that field, found {found}")
        text = row[text_field]
        if not isinstance(text, str):
            raise CorpusError(f"{f.uri}: line {n}: field {text_field!r}: expected a string, found "
                              f"{'null' if text is None else type(text).__name__}")
        docs.append(text)
    return docs


def _parquet_documents(fs: pafs.FileSystem, f: InputFile, unit: Unit, text_field: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with fs.open_input_file(f.path) as handle:
            column = pq.ParquetFile(handle).read_row_group(unit.row_group, columns=[text_field])
    except (OSError, pa.ArrowException) as e:
        raise CorpusError(f"{f.uri}: row group {unit.row_group}: cannot read ({e})") from None
    values = column.column(0)
    if values.null_count:
        row = next(i for i, v in enumerate(values.is_null().to_pylist()) if v)
        raise CorpusError(f"{f.uri}: row {unit.row_start + row + 1}: column {text_field!r}: "
                          f"expected a string, found null")
    try:
        values.validate(full=True)  # invalid UTF-8 in a string column
    except pa.ArrowInvalid:
        for i, chunk_value in enumerate(values.cast(pa.binary()).to_pylist()):
            try:
                chunk_value.decode("utf-8")
            except UnicodeDecodeError:
                raise CorpusError(f"{f.uri}: row {unit.row_start + i + 1}: column {text_field!r}: "
                                  f"expected UTF-8 text, found bytes that are not") from None
        raise
    return values.to_pylist()


def tokenize_documents(docs: list[str]) -> np.ndarray:
    """llm.c's fineweb rule: each document is <|endoftext|> then its encode_ordinary tokens;
    the documents' tokens concatenated, as uint16."""
    enc = tokenizer.get_encoding()
    tokens: list[int] = []
    for doc in docs:
        tokens.append(tokenizer.EOT)
        tokens.extend(enc.encode_ordinary(doc))
    return np.array(tokens, dtype=np.uint16)


def tokenize_unit(fs: pafs.FileSystem, files: list[InputFile], unit: Unit,
                  text_field: str) -> tuple[np.ndarray, int]:
    """(tokens, documents) of one unit."""
    docs = read_documents(fs, files[unit.file], unit, text_field)
    return tokenize_documents(docs), len(docs)
