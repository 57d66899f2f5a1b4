"""A token stream cut into llm.c's shards, written so that a prepare can be killed and rerun.

The layout is llm.c's `dev/data/fineweb.py`, byte for byte: the stream is cut into shards of
`shard_size` tokens, the last holding the remainder; shard 0 is `NAME_val_000000.bin`, the rest
`NAME_train_%06d.bin` (the index counts the val shard). `val_tokens` sizes shard 0 on its own
(llm.c's tiny-text recipes hold 32,768 tokens out); by default it is `shard_size`.

Where the files go, reader and writer side by side:

    OUT/.prepare/progress.json    while running: the finished shards (name, tokens, sha256) and
                                  the (tokens, documents, sha256) of every unit staged, so a
                                  rerun redoes neither
    OUT/.prepare/units/*.tok      each unit's tokens (raw uint16), written whole by the worker
                                  that tokenized it (raygpt.data.staging); removed once every
                                  shard that reads them is written
    OUT/.prepare/NAME_*.bin       finished shards, each written whole (atomic file or one upload)
                                  by a worker from the units' byte ranges the cut gives it
    OUT/NAME_*.bin                the shards, moved out of .prepare/ only once every unit was
                                  tokenized: bad input found late leaves no shard under a final
                                  name
    OUT/manifest.json             written last: the prepare is complete when it exists

The manifest (format "raygpt-shards") names the inputs with their sizes, the tokenizer's
fingerprint, and every shard with its token count and sha256; training and `raygpt status` read
it to check shards they fetch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from raygpt.llmc.shards import HEADER_INTS, SHARD_MAGIC, SHARD_VERSION, TOKEN_DTYPE
from raygpt.storage import RunDir, read_json_bounded

STAGING = ".prepare"
PROGRESS = f"{STAGING}/progress.json"
PROGRESS_FORMAT = "raygpt-prepare-progress"
PROGRESS_VERSION = 2  # 2: units staged as files, the cut planned from their counts
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "raygpt-shards"
VERSION = 1
RULE = "llm.c dev/data/fineweb.py: each document is <|endoftext|> + encode_ordinary(text)"
DEFAULT_SHARD_SIZE = 10**8
MAX_SHARD_TOKENS = 2**31 - 1  # the token count is an int32 in llm.c's header


def _whole_count(n) -> bool:
    """A shard capacity: an int (not a bool, float or NaN) from 1 to MAX_SHARD_TOKENS."""
    return (isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_))
            and 1 <= n <= MAX_SHARD_TOKENS)


class PrepareError(ValueError):
    """An output directory cannot take this prepare; the message names it and what to do."""


def shard_name(name: str, index: int) -> str:
    return f"{name}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def shard_header(tokens: int) -> bytes:
    """An llm.c shard's header: 256 int32 (magic, version, token count, zeros)."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, tokens
    return header.tobytes()


def shard_bytes(tokens: np.ndarray) -> bytes:
    """An llm.c shard's bytes: its header, then the uint16 tokens."""
    return shard_header(len(tokens)) + np.asarray(tokens).astype(TOKEN_DTYPE, copy=False).tobytes()


class CutPlanner:
    """llm.c's cut planned from token counts alone: units are given in order with their token
    counts (`add`), and each shard comes out, as soon as it is full, as its index and the
    (unit, start, stop) token ranges it takes, in order (shard 0 holds `val_tokens`, every later
    one `shard_size`); `finish` gives the remainder's shard, if any. The cut depends only on the
    counts, so the driver plans it while the tokens stay where they were written."""

    def __init__(self, shard_size: int, val_tokens: int, *, first_index: int = 0):
        if not (_whole_count(shard_size) and _whole_count(val_tokens)):
            raise ValueError(f"shard_size and val_tokens: expected integers from 1 to "
                             f"{MAX_SHARD_TOKENS} (llm.c's int32 header field), found "
                             f"{shard_size!r} and {val_tokens!r}")
        self.shard_size, self.val_tokens = int(shard_size), int(val_tokens)
        self.index = first_index
        self.pieces: list[tuple[int, int, int]] = []
        self.filled = 0

    def capacity(self) -> int:
        return self.val_tokens if self.index == 0 else self.shard_size

    def add(self, unit: int, tokens: int) -> list[tuple[int, list[tuple[int, int, int]]]]:
        """The shards that unit `unit`'s `tokens` tokens complete: [(index, pieces)]."""
        done, pos = [], 0
        while pos < tokens:
            room = self.capacity() - self.filled
            if room < 1:  # a loop that takes nothing would never end
                raise ValueError(f"shard {self.index}: capacity {self.capacity()} with "
                                 f"{self.filled} tokens in it: expected room for at least one")
            take = min(room, tokens - pos)
            self.pieces.append((unit, pos, pos + take))
            self.filled += take
            pos += take
            if self.filled == self.capacity():
                done.append(self._cut())
        return done

    def finish(self) -> list[tuple[int, list[tuple[int, int, int]]]]:
        return [self._cut()] if self.filled else []

    def _cut(self) -> tuple[int, list[tuple[int, int, int]]]:
        shard = (self.index, self.pieces)
        self.index, self.pieces, self.filled = self.index + 1, [], 0
        return shard


# ---------------------------------------------------------------------- identity

def identity(inputs: list[tuple[str, int]], *, name: str, text_field: str, shard_size: int,
             val_tokens: int, tokenizer_sha256: str) -> str:
    """What makes two prepares the same job: the inputs (URI, size) in order, the settings, the
    tokenizer and the rule. A rerun continues only a prepare of the same identity."""
    blob = json.dumps({"inputs": inputs, "name": name, "text_field": text_field,
                       "shard_size": shard_size, "val_tokens": val_tokens,
                       "tokenizer": tokenizer_sha256, "rule": RULE}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# ---------------------------------------------------------------------- progress

@dataclasses.dataclass
class Progress:
    """A prepare under way: the shards written to staging, and each unit staged so far, as
    {unit index: (tokens, documents, sha256 of its staged tokens)}: counts and hashes, the
    driver's whole knowledge of the tokens."""

    identity: str
    shards: list[dict] = dataclasses.field(default_factory=list)
    units: dict[int, tuple[int, int, str]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"format": PROGRESS_FORMAT, "version": PROGRESS_VERSION, "identity": self.identity,
                "shards": self.shards,
                "units": [[i, *self.units[i]] for i in sorted(self.units)]}


def write_progress(out: RunDir, progress: Progress) -> None:
    out.write_bytes_atomic(PROGRESS, json.dumps(progress.to_dict()).encode())


def read_progress(out: RunDir) -> Progress | None:
    """The staging's progress, None when there is none; PrepareError when it is not one."""
    if not out.exists(PROGRESS):
        return None
    d = _read_json(out, PROGRESS, PROGRESS_FORMAT, PROGRESS_VERSION)
    try:
        shards = [_shard_entry(s) for s in d["shards"]]
        units = {}
        for i, tokens, docs, sha in d["units"]:
            if min(int(i), int(tokens), int(docs)) < 0:
                raise ValueError(f"unit {i}: negative counts")
            units[int(i)] = (int(tokens), int(docs), str(sha))
        return Progress(str(d["identity"]), shards, units)
    except (KeyError, TypeError, ValueError) as e:
        raise PrepareError(f"{out.uri(PROGRESS)}: expected {PROGRESS_FORMAT} fields "
                           f"(identity, shards, units), found a damaged file ({e})") from None


# ---------------------------------------------------------------------- manifest

def write_manifest(out: RunDir, manifest: dict) -> None:
    out.write_bytes_atomic(MANIFEST, json.dumps(manifest, indent=1).encode())


def make_manifest(*, name: str, identity_hex: str, inputs: list[tuple[str, int]], text_field: str,
                  shard_size: int, val_tokens: int, tokenizer_sha256: str, documents: int,
                  shards: list[dict]) -> dict:
    return {"format": MANIFEST_FORMAT, "version": VERSION, "name": name, "identity": identity_hex,
            "rule": RULE, "tokenizer": {"name": "gpt2", "ranks_sha256": tokenizer_sha256},
            "text_field": text_field, "shard_size": shard_size, "val_tokens": val_tokens,
            "inputs": [{"uri": u, "size": s} for u, s in inputs], "documents": documents,
            "tokens": sum(s["tokens"] for s in shards), "shards": shards}


def read_manifest(out: RunDir) -> dict | None:
    """The manifest of a complete prepare in `out`, None when there is none; PrepareError when
    the file is not one."""
    if not out.exists(MANIFEST):
        return None
    d = _read_json(out, MANIFEST, MANIFEST_FORMAT)
    try:
        d["shards"] = [_shard_entry(s) for s in d["shards"]]
        str(d["identity"]), int(d["documents"])
    except (KeyError, TypeError, ValueError) as e:
        raise PrepareError(f"{out.uri(MANIFEST)}: expected {MANIFEST_FORMAT} fields (identity, "
                           f"documents, shards), found a damaged file ({e})") from None
    return d


def _shard_entry(s) -> dict:
    entry = {"name": str(s["name"]), "tokens": int(s["tokens"]), "sha256": str(s["sha256"])}
    if "/" in entry["name"] or entry["name"].startswith("."):
        raise ValueError(f"shard name {entry['name']!r} is not a plain file name")
    return entry


def _read_json(out: RunDir, rel: str, fmt: str, version: int = VERSION) -> dict:
    try:
        d = read_json_bounded(out, rel)
    except (ValueError, RecursionError) as e:
        raise PrepareError(f"{out.uri(rel)}: expected {fmt} JSON ({str(e)[:200]})") from None
    if not isinstance(d, dict) or d.get("format") != fmt or d.get("version") != version:
        found = (d.get("format"), d.get("version")) if isinstance(d, dict) else type(d).__name__
        raise PrepareError(f"{out.uri(rel)}: format/version: expected {fmt!r} {version}, found "
                           f"{found}")
    return d


# ---------------------------------------------------------------------- writing shards

def publish(out: RunDir, manifest: dict) -> None:
    """Move every staged shard to its final name, then write the manifest, then remove the
    staging. Each step can be repeated: a shard already moved is found in place and checked by
    size (a rerun after a kill between two moves finishes the job)."""
    for s in manifest["shards"]:
        staged, final = f"{STAGING}/{s['name']}", s["name"]
        expected = HEADER_INTS * 4 + 2 * s["tokens"]
        if out.exists(staged):
            out.move_file(staged, final)
        elif not (out.exists(final) and out.size_of(final) == expected):
            raise PrepareError(f"{out.uri(final)}: expected the shard of {s['tokens']:,} tokens "
                               f"(staged in {out.uri(STAGING)}), found neither")
    out.make_durable([""])
    write_manifest(out, manifest)
    out.delete_dir(STAGING)
