"""A prepare's two kinds of work on its staging area, as plain functions a worker runs (no Ray).

Pass one, `stage_unit`: a worker tokenizes one unit (raygpt.data.corpus) and writes its tokens
whole to `OUT/.prepare/units/unit_%08d.tok` (raw uint16, an atomic file or one upload),
streaming a batch of documents at a time; it returns the unit's token and document counts and
the tokens' sha256, never the tokens. Pass two, `write_shard`: a worker is handed one shard's
token ranges of staged units (the cut the driver planned from the counts alone,
raygpt.data.shard_writer.CutPlanner), reads just those bytes and writes the shard whole into
`OUT/.prepare/`, hashing as it goes; it returns the shard's name, token count and sha256.

Memory per worker is a unit's documents and one batch of their tokens in pass one, and one
read chunk in pass two: never a shard, never the corpus. Bad input is returned as the one-line
message (`error`), not raised, so that Ray does not retry it and the driver prints it as it is.
"""

from __future__ import annotations

import hashlib

from raygpt.data import corpus
from raygpt.data.corpus import CorpusError
from raygpt.data.shard_writer import STAGING, PrepareError, shard_header
from raygpt.storage import RunDir

UNITS = f"{STAGING}/units"
_READ = 8 << 20  # bytes per read of a staged unit: a shard writer's memory


def unit_file(index: int) -> str:
    return f"{UNITS}/unit_{index:08d}.tok"


def stage_unit(out: RunDir, fs, f: corpus.InputFile, unit: corpus.Unit,
               text_field: str) -> dict:
    """Tokenize `unit` of input `f` into its staged file; {unit, tokens, documents, sha256,
    error} (error "" when it went well)."""
    h, tokens, documents = hashlib.sha256(), 0, 0
    try:
        with out.open_write(unit_file(unit.index)) as w:
            for batch, n in corpus.token_batches(corpus.iter_documents(fs, f, unit, text_field)):
                data = batch.tobytes()
                w.write(data)
                h.update(data)
                tokens, documents = tokens + len(batch), documents + n
    except CorpusError as e:
        return {"unit": unit.index, "tokens": 0, "documents": 0, "sha256": "", "error": str(e)}
    return {"unit": unit.index, "tokens": tokens, "documents": documents,
            "sha256": h.hexdigest(), "error": ""}


def write_shard(out: RunDir, name: str, pieces: list[tuple[int, int, int, int, str]]) -> dict:
    """Write shard `name` into staging from `pieces`, each (unit, start, stop, the unit's
    tokens, its sha256): tokens [start, stop) of that staged unit, in order. A staged unit must
    hold its recorded count; one read whole must match its recorded sha256. {name, tokens,
    sha256, error}."""
    n = sum(stop - start for _, start, stop, _, _ in pieces)
    h = hashlib.sha256()
    try:
        with out.open_write(f"{STAGING}/{name}") as w:
            header = shard_header(n)
            w.write(header)
            h.update(header)
            for unit, start, stop, total, sha in pieces:
                for data in _unit_range(out, unit, start, stop, total, sha):
                    w.write(data)
                    h.update(data)
    except PrepareError as e:
        return {"name": name, "tokens": 0, "sha256": "", "error": str(e)}
    return {"name": name, "tokens": n, "sha256": h.hexdigest(), "error": ""}


def _unit_range(out: RunDir, unit: int, start: int, stop: int, total: int, sha: str):
    """The bytes of tokens [start, stop) of a staged unit, a read at a time."""
    rel = unit_file(unit)
    try:
        size = out.size_of(rel)
    except FileNotFoundError:
        raise PrepareError(f"{out.uri(rel)}: expected the staged tokens of unit {unit}, found "
                           f"none (is -o seen by every node? a local -o must be a shared "
                           f"filesystem on a cluster)") from None
    if size != 2 * total:
        raise PrepareError(f"{out.uri(rel)}: expected {2 * total:,} bytes ({total:,} tokens), "
                           f"found {size:,}; delete {out.uri(STAGING)} to start afresh")
    whole = hashlib.sha256() if (start, stop) == (0, total) else None
    with out.open_read(rel) as r:
        _skip(r, 2 * start)
        left = 2 * (stop - start)
        while left:
            data = r.read(min(_READ, left))
            if not data:
                raise PrepareError(f"{out.uri(rel)}: expected {2 * total:,} bytes, found fewer")
            left -= len(data)
            if whole is not None:
                whole.update(data)
            yield data
    if whole is not None and whole.hexdigest() != sha:
        raise PrepareError(f"{out.uri(rel)}: sha256: expected {sha} (recorded when it was "
                           f"staged), found {whole.hexdigest()}; delete {out.uri(STAGING)} to "
                           f"start afresh")


def _skip(r, nbytes: int) -> None:
    """Move `r` on by `nbytes`: a seek where it can (a local file), reads dropped where it
    cannot (an object store's stream: at most the unit's bytes before the range)."""
    if not nbytes:
        return
    seekable = getattr(r, "seekable", lambda: False)()
    if seekable:
        r.seek(nbytes)
        return
    while nbytes:
        data = r.read(min(_READ, nbytes))
        if not data:
            return  # a file cut short: the range's own read says so
        nbytes -= len(data)

