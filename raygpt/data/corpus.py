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

Bounds: a JSON Lines or text file is streamed (decompressed a chunk at a time), never read
whole: a record (a line; for text, a blank-line section) longer than `MAX_LINE_BYTES`, or a file
that decompresses to more than `MAX_UNIT_BYTES`, is a `CorpusError` naming the file and the
bound, so a few KB of compressed input cannot take a worker's memory. Local inputs are opened
only as regular files (a FIFO or device named like a corpus file is refused, never waited on).
"""

from __future__ import annotations

import array
import bz2
import dataclasses
import fcntl
import fnmatch
import gzip
import json
import os
import posixpath
import stat
import zlib

import numpy as np
import pyarrow.fs as pafs

from raygpt.data import tokenizer

PARQUET = "parquet"
JSONL = "jsonl"
TEXT = "text"
COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
_KINDS = ((".parquet", PARQUET), (".jsonl", JSONL), (".json", JSONL), (".txt", TEXT))
_GLOB_CHARS = "*?["
# one JSON Lines record or text document, held whole to tokenize: far above any real document
MAX_LINE_BYTES = 64 << 20
# a JSON Lines or text file is one unit whose tokens (uint16, ~half its bytes) one worker holds:
# above the few-GB shards corpora are published in, below a worker's memory
MAX_UNIT_BYTES = 4 << 30
_CHUNK = 1 << 20  # bytes decompressed per read: memory per reader is a line plus a chunk
# characters of text tokenized in one tokenizer call: long enough that the per-call cost
# vanishes, short enough that a worker holds little beside the unit's own rows
_BATCH_CHARS = 4 << 20
_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}


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
        if info.type == pafs.FileType.Unknown and isinstance(fs, pafs.LocalFileSystem):
            raise CorpusError(f"{given}: expected a regular file, found "
                              f"{_special_kind(os.stat(path).st_mode)}")
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
            with _open_raw(fs, f, seekable=True) as handle:
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
    return list(iter_documents(fs, f, unit, text_field))


def iter_documents(fs: pafs.FileSystem, f: InputFile, unit: Unit, text_field: str):
    """The documents of `unit` of input `f` one at a time (JSON Lines and text streamed within
    `MAX_LINE_BYTES` and `MAX_UNIT_BYTES`)."""
    if f.kind == PARQUET:
        yield from _parquet_documents(fs, f, unit, text_field)
        return
    with _open_stream(fs, f) as stream:
        if f.kind == TEXT:
            yield from _text_documents(stream, f)
        else:
            yield from _jsonl_documents(_lines(stream, f), f, text_field)


def _special_kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a special file")


def _open_local(f: InputFile):
    """A local input opened only if it is a regular file: O_NONBLOCK so a FIFO does not wait for
    a writer, fstat on what was opened (no race with a rename), then blocking reads again."""
    try:
        fd = os.open(f.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CorpusError(f"{f.uri}: cannot read ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorpusError(f"{f.uri}: expected a regular file, found {_special_kind(mode)}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _open_raw(fs: pafs.FileSystem, f: InputFile, *, seekable: bool = False):
    """The input's bytes as stored: a regular local file, or the store's stream (or random
    access file, for Parquet)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return _open_local(f)
    try:
        return fs.open_input_file(f.path) if seekable else fs.open_input_stream(
            f.path, compression=None)
    except OSError as e:
        raise CorpusError(f"{f.uri}: cannot read ({e})") from None


class _Stream:
    """A JSON Lines or text input decompressed a chunk at a time: `read(n)` returns at most n
    bytes; errors are CorpusErrors naming the file."""

    def __init__(self, fs: pafs.FileSystem, f: InputFile):
        self.f = f
        self.raw = _open_raw(fs, f)
        suffix = "." + f.path.rsplit(".", 1)[-1].lower()
        self.compressed = suffix in _CODECS
        try:
            if suffix == ".gz":
                self.stream = gzip.GzipFile(fileobj=self.raw, mode="rb")
            elif suffix == ".bz2":
                self.stream = bz2.BZ2File(self.raw, mode="rb")
            elif self.compressed:
                import pyarrow as pa
                raw = (self.raw if isinstance(self.raw, pa.NativeFile)
                       else pa.PythonFile(self.raw, "r"))
                self.stream = pa.CompressedInputStream(raw, _CODECS[suffix])
            else:
                self.stream = self.raw
        except Exception:
            self.raw.close()
            raise

    def read(self, n: int) -> bytes:
        import pyarrow as pa
        try:
            return self.stream.read(n)
        except (OSError, EOFError, ValueError, zlib.error, pa.ArrowException) as e:
            doing = " (decompressing)" if self.compressed else ""
            raise CorpusError(f"{self.f.uri}: cannot read{doing} "
                              f"({type(e).__name__}: {e})") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            if self.stream is not self.raw:
                self.stream.close()
        finally:
            self.raw.close()


def _open_stream(fs: pafs.FileSystem, f: InputFile) -> _Stream:
    return _Stream(fs, f)


def _too_much(stream: _Stream) -> CorpusError:
    return CorpusError(f"{stream.f.uri}: expected at most {MAX_UNIT_BYTES:,} "
                       f"{'decompressed ' if stream.compressed else ''}bytes (a JSON Lines or text "
                       f"file is one unit of work), found more; split it into smaller files")


def _chunks(stream: _Stream):
    total = 0
    while chunk := stream.read(_CHUNK):
        total += len(chunk)
        if total > MAX_UNIT_BYTES:
            raise _too_much(stream)
        yield chunk


def _too_long(f: InputFile, line: int, what: str) -> CorpusError:
    return CorpusError(f"{f.uri}: line {line}: expected {what} of at most {MAX_LINE_BYTES:,} "
                       f"bytes, found a longer one")


def _lines(stream: _Stream, f: InputFile):
    """(1-based number, bytes without the newline) of each line; no line held past
    MAX_LINE_BYTES."""
    parts: list[bytes] = []
    held, n = 0, 0
    for chunk in _chunks(stream):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            n += 1
            if held + end - start > MAX_LINE_BYTES:
                raise _too_long(f, n, "lines")
            yield n, (b"".join(parts) + chunk[start:end]) if parts else chunk[start:end]
            parts, held, start = [], 0, end + 1
        if start < len(chunk):
            parts.append(chunk[start:])
            held += len(chunk) - start
            if held > MAX_LINE_BYTES:
                raise _too_long(f, n + 1, "lines")
    if parts:
        yield n + 1, b"".join(parts)


def _text_documents(stream: _Stream, f: InputFile):
    """llm.c's tiny-text rule, streamed: `text.split("\\n\\n")`, each section but the last
    followed by "\\n\\n"; no section held past MAX_LINE_BYTES."""
    buf, line = b"", 1  # line: where buf starts
    for chunk in _chunks(stream):
        buf += chunk
        pos = 0
        while (end := buf.find(b"\n\n", pos)) >= 0:
            if end - pos > MAX_LINE_BYTES:
                raise _too_long(f, line, "documents (blank-line sections)")
            doc = buf[pos:end + 2]
            yield _decode(doc, f, what="text", first_line=line)
            line += doc.count(b"\n")
            pos = end + 2
        buf = buf[pos:]
        if len(buf) > MAX_LINE_BYTES + 1:  # + 1: a trailing "\n" may start the separator
            raise _too_long(f, line, "documents (blank-line sections)")
    yield _decode(buf, f, what="text", first_line=line)


def _decode(data: bytes, f: InputFile, *, what: str, line: int | None = None,
            first_line: int = 1) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line if line is not None else first_line + data.count(b"\n", 0, e.start)
        raise CorpusError(f"{f.uri}: line {at}: expected UTF-8 {what}, found byte "
                          f"0x{data[e.start]:02x}, which is not UTF-8 there ({e.reason})") from None


def _jsonl_documents(lines, f: InputFile, text_field: str):
    for n, raw in lines:
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
        yield text


def _parquet_documents(fs: pafs.FileSystem, f: InputFile, unit: Unit, text_field: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with _open_raw(fs, f, seekable=True) as handle:
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
            except UnicodeDecodeError as e:
                raise CorpusError(f"{f.uri}: row {unit.row_start + i + 1}: column {text_field!r}: "
                                  f"expected UTF-8 text, found byte 0x{chunk_value[e.start]:02x}, "
                                  f"which is not UTF-8 there ({e.reason})") from None
        raise
    return values.to_pylist()


def tokenize_documents(docs: list[str]) -> np.ndarray:
    """llm.c's fineweb rule: each document is <|endoftext|> then its encode_ordinary tokens;
    the documents' tokens concatenated, as uint16."""
    return _tokenize(docs)[0]


def token_batches(docs):
    """(tokens as uint16, documents) for successive batches of about `_BATCH_CHARS` of text
    of an iterable of documents, by llm.c's rule: memory held is a batch, not the unit."""
    batch, held = [], 0
    for doc in docs:
        batch.append(doc)
        held += len(doc)
        if held >= _BATCH_CHARS:
            yield _encode_batch(batch), len(batch)
            batch, held = [], 0
    if batch:
        yield _encode_batch(batch), len(batch)


def _encode_batch(docs: list[str]) -> np.ndarray:
    """[EOT] + encode_ordinary(doc) for each document, concatenated, in one tokenizer call:
    the documents joined by EOT's text with only EOT allowed as special, which tiktoken
    splits on before its regex, so each document's tokens are its encode_ordinary's (one call
    for many documents: bench/prepare.py measures it against a call per document). A document holding
    EOT's text itself must stay ordinary text (llm.c's rule): such a batch goes one by one."""
    enc = tokenizer.get_encoding()
    if any(tokenizer.EOT_TEXT in d for d in docs):
        out = array.array("H")
        for doc in docs:
            out.append(tokenizer.EOT)
            out.extend(enc.encode_ordinary(doc))
        return np.frombuffer(out, dtype=np.uint16).copy()
    joined = tokenizer.EOT_TEXT + tokenizer.EOT_TEXT.join(docs)
    ids = enc.encode_to_numpy(joined, allowed_special={tokenizer.EOT_TEXT}, disallowed_special=())
    return ids.astype(np.uint16)  # GPT-2's ids are < 2**16


def _tokenize(docs) -> tuple[np.ndarray, int]:
    """(tokens, documents) of an iterable of documents, whole."""
    parts, count = [], 0
    for tokens, n in token_batches(docs):
        parts.append(tokens)
        count += n
    return (np.concatenate(parts) if parts else np.zeros(0, np.uint16)), count


def tokenize_unit(fs: pafs.FileSystem, files: list[InputFile], unit: Unit,
                  text_field: str) -> tuple[np.ndarray, int]:
    """(tokens, documents) of one unit."""
    return _tokenize(iter_documents(fs, files[unit.file], unit, text_field))
