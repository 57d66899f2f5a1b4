"""`raygpt prepare`: a corpus tokenized on Ray Data into llm.c's token shards.

    raygpt prepare INPUT... -o OUT [--name NAME] [--text-field text] [--shard-size 100000000]
                   [--val-tokens N] [--storage-endpoint URL]

The corpus is planned on the driver (raygpt.data.corpus: inputs in sorted path order, Parquet
footers checked, one unit per row group or file), then the units run as a Ray Data `map_batches`
over the Ray this command starts or joins (`ray job submit -- raygpt prepare ...` uses the
cluster's CPUs). Results come back in unit order (`preserve_order`), so the bytes never depend
on how many workers or blocks Ray used, and the driver cuts the stream into shards
(raygpt.data.shard_writer), staging them until the last unit is in. A rerun of the same prepare
continues from its last finished shard; a rerun over a complete output says so and does nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import posixpath
import sys
import time

import numpy as np

from raygpt.data import corpus
from raygpt.data.corpus import CorpusError
from raygpt.data.shard_writer import (DEFAULT_SHARD_SIZE, PROGRESS, STAGING, PrepareError, Progress,
                                      ShardCutter, identity, make_manifest, publish, read_manifest,
                                      read_progress, shard_name, write_progress, write_staged_shard)
from raygpt.storage.atomic_file import RefusedPath
from raygpt.config import ConfigError
from raygpt.train.errors import EXIT_BAD_INPUT
from raygpt.storage.ownership import RunDirRefused, check_claim, claim_dir
from raygpt.runlog.terminal import printable
from raygpt.storage import RunDir, open_run_dir, redact, with_endpoint
from raygpt.data.tokenizer import tokenizer_fingerprint


@dataclasses.dataclass(frozen=True)
class PrepareSettings:
    inputs: tuple[str, ...]
    out: str
    name: str | None = None
    text_field: str = "text"
    shard_size: int = DEFAULT_SHARD_SIZE
    val_tokens: int | None = None  # None: shard_size, llm.c's
    storage_endpoint: str = ""
    ray_address: str | None = None


@dataclasses.dataclass
class Plan:
    """What the driver knows before Ray starts."""

    settings: PrepareSettings
    fs: object
    files: list
    units: list
    name: str
    val_tokens: int
    identity: str
    out: RunDir
    progress: Progress | None
    complete: dict | None


def default_name(inputs: list[str]) -> str:
    """The shards' name from the first input: a file's stem, else the directory's (a glob's
    directory's) name."""
    given = inputs[0].split("?", 1)[0]
    if "://" in given:  # drop the scheme and any credentials before the bucket
        given = given.split("://", 1)[1]
        head, sep, rest = given.partition("/")
        given = head.rpartition("@")[2] + sep + rest
    if any(c in given for c in "*?["):
        fixed = given[: min(given.index(c) for c in "*?[" if c in given)]
        given = fixed if fixed.endswith("/") else posixpath.dirname(fixed)
    base = posixpath.basename(given.rstrip("/"))
    while corpus.kind_of(base) or base.endswith(corpus.COMPRESSED):
        base = base.rsplit(".", 1)[0]
    return base or "corpus"


def plan(s: PrepareSettings) -> Plan:
    """Everything checked before Ray starts: the inputs, the settings, the output directory."""
    if s.shard_size < 1:
        raise CorpusError(f"--shard-size: expected an integer >= 1, found {s.shard_size}")
    if s.val_tokens is not None and s.val_tokens < 1:
        raise CorpusError(f"--val-tokens: expected an integer >= 1, found {s.val_tokens}")
    if s.shard_size > 2**31 - 1:
        raise CorpusError(f"--shard-size: expected at most {2**31 - 1} (llm.c's int32 header "
                          f"field), found {s.shard_size}")
    fs, files = corpus.expand_inputs(list(s.inputs), s.storage_endpoint)
    units = corpus.plan_units(fs, files, s.text_field)
    name = s.name or default_name(list(s.inputs))
    if "/" in name or not name.strip() or name.startswith("."):
        raise CorpusError(f"--name: expected a plain file-name prefix, found {name!r}")
    val_tokens = s.val_tokens or s.shard_size
    inputs = [(redact(f.uri), f.size) for f in files]
    ident = identity(inputs, name=name, text_field=s.text_field, shard_size=s.shard_size,
                     val_tokens=val_tokens, tokenizer_sha256=tokenizer_fingerprint())
    try:
        out = open_run_dir(with_endpoint(s.out, s.storage_endpoint) if "://" in s.out
                           else posixpath.abspath(s.out))
    except ValueError as e:  # a malformed URI or endpoint
        raise CorpusError(f"-o {redact(s.out)}: {e}") from None
    # the output is this user's prepare, or new or empty: a planted progress.json or
    # manifest.json (whose identity anyone can compute) is refused before it is read
    try:
        check_claim(out, PREPARE_KIND, s.out, holds=_holds_prepare, resume=True)
    except RunDirRefused as e:
        raise PrepareError(str(e)) from None
    complete, progress = read_manifest(out), read_progress(out)
    if complete is not None and complete["identity"] != ident:
        raise PrepareError(f"-o {redact(out.uri())}: holds a complete prepare of other inputs or "
                           f"settings ({out.uri('manifest.json')}); expected an empty directory "
                           f"or this prepare's own; choose another -o")
    if progress is not None and progress.identity != ident:
        raise PrepareError(f"-o {redact(out.uri())}: holds a prepare under way of other inputs or "
                           f"settings ({out.uri(PROGRESS)}); expected an empty directory or this "
                           f"prepare's own; choose another -o, or delete {out.uri(STAGING)}")
    return Plan(s, fs, files, units, name, val_tokens, ident, out, progress, complete)


PREPARE_KIND = "prepare"  # the output's marker kind (ownership.py): a run's or a sweep's is refused


def _holds_prepare(out: RunDir) -> bool:
    """Whether `out` holds a prepare (finished, or under way)."""
    return any(out.exists(name) for name in ("manifest.json", PROGRESS, STAGING))


def run(p: Plan, *, num_blocks: int | None = None, report=None) -> dict:
    """Tokenize the plan's units on Ray Data (the Ray this process is in, else one it starts)
    and write the shards; the manifest. `num_blocks` sets Ray Data's block count (tests: the
    bytes must not depend on it)."""
    import ray
    import ray.data

    from raygpt.ray.driver import init_ray

    if p.complete is not None:
        return p.complete
    try:  # marked as this user's before anything is written (checked again, as plan() did)
        claim_dir(p.out, PREPARE_KIND, p.settings.out, holds=_holds_prepare, resume=True)
    except RunDirRefused as e:
        raise PrepareError(str(e)) from None
    progress = p.progress or Progress(p.identity)
    first, drop, docs_before = progress.restart_point()
    staged = list(progress.shards)
    units_done = [list(u) for u in progress.units[:first]]
    report = report or ProgressLine(p, first, docs_before)

    def emit(index: int, tokens: np.ndarray) -> None:
        staged.append(write_staged_shard(p.out, shard_name(p.name, index), tokens))
        write_progress(p.out, Progress(p.identity, list(staged), [list(u) for u in units_done]))

    cutter = ShardCutter(p.settings.shard_size, p.val_tokens, emit, first_index=len(staged))
    documents = docs_before
    if first < len(p.units):
        init_ray(p.settings.ray_address)
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # the shards' bytes follow the units' order
        ctx.enable_progress_bars = False  # ProgressLine says what a user needs
        todo = [{"unit": u.index} for u in p.units[first:]]
        ds = ray.data.from_items(todo, override_num_blocks=num_blocks or min(len(todo), 1024))
        tokenize = _Tokenize(p.fs, p.files, p.units, p.settings.text_field)
        results = ds.map_batches(tokenize, batch_size=1, batch_format="numpy")
        for batch in results.iter_batches(batch_size=None, batch_format="numpy"):
            for unit, tokens, docs, error in zip(batch["unit"], batch["tokens"],
                                                 batch["documents"], batch["error"]):
                if error:
                    raise CorpusError(str(error))
                arr = np.frombuffer(tokens, dtype=np.uint16)
                cutter.add(arr[drop:] if int(unit) == first else arr)
                units_done.append([len(arr), int(docs)])
                documents += int(docs)
                report.unit_done(p.units[int(unit)], len(arr), int(docs))
    cutter.finish()
    if not staged:  # an empty corpus: nothing to publish
        raise CorpusError(f"{', '.join(p.settings.inputs)}: expected at least one document, "
                          f"found none")
    manifest = make_manifest(name=p.name, identity_hex=p.identity,
                             inputs=[(redact(f.uri), f.size) for f in p.files],
                             text_field=p.settings.text_field, shard_size=p.settings.shard_size,
                             val_tokens=p.val_tokens, tokenizer_sha256=tokenizer_fingerprint(),
                             documents=documents, shards=staged)
    publish(p.out, manifest)
    report.done(manifest)
    return manifest


class _Tokenize:
    """One unit per call, run by Ray Data's workers: its tokens, document count, or the one-line
    error naming the file and row (returned, not raised: the driver prints it as it is)."""

    def __init__(self, fs, files, units, text_field):
        self.fs, self.files, self.units, self.text_field = fs, files, units, text_field

    def __call__(self, batch: dict) -> dict:
        out = {"unit": [], "tokens": [], "documents": [], "error": []}
        for index in batch["unit"]:
            unit = self.units[int(index)]
            try:
                tokens, docs = corpus.tokenize_unit(self.fs, self.files, unit, self.text_field)
                error = ""
            except CorpusError as e:
                tokens, docs, error = np.zeros(0, dtype=np.uint16), 0, str(e)
            out["unit"].append(int(index))
            out["tokens"].append(tokens.tobytes())
            out["documents"].append(docs)
            out["error"].append(error)
        return {"unit": np.array(out["unit"], dtype=np.int64),
                "tokens": np.array(out["tokens"], dtype=object),
                "documents": np.array(out["documents"], dtype=np.int64),
                "error": np.array(out["error"], dtype=object)}


class ProgressLine:
    """Documents, tokens/s and ETA on stderr: rewritten in place on a terminal, a line every
    `every_s` otherwise (a job's log)."""

    def __init__(self, p: Plan, first_unit: int, docs_before: int, *, stream=None,
                 every_s: float = 10.0):
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.every_s = 0.5 if self.tty else every_s
        self.total_bytes = sum(u.nbytes for u in p.units[first_unit:]) or 1
        self.done_bytes, self.tokens, self.docs = 0, 0, docs_before
        self.start = self.last = time.monotonic()

    def unit_done(self, unit, tokens: int, docs: int) -> None:
        self.done_bytes += unit.nbytes
        self.tokens += tokens
        self.docs += docs
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self._print(now)

    def _print(self, now: float, end: str = "") -> None:
        elapsed = max(now - self.start, 1e-9)
        frac = min(1.0, self.done_bytes / self.total_bytes)
        eta = elapsed * (1 - frac) / frac if frac > 0 else math.inf
        line = (f"raygpt prepare | {self.docs:,} documents | {self.tokens / elapsed:,.0f} tok/s | "
                f"{100 * frac:.1f}% | ETA {_human(eta)}")
        self.stream.write(("\r" + line + " " * 4 if self.tty else line + "\n") + end)
        self.stream.flush()

    def done(self, manifest: dict) -> None:
        if self.tty:
            self._print(time.monotonic(), end="\n")


def _human(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="raygpt prepare",
        description="Tokenize Parquet, JSON Lines or text files (local paths, globs, directories "
                    "or s3:// / gs:// URIs) into llm.c's GPT-2 token shards, on Ray Data.")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, globs (quoted), directories or URIs; read in sorted path order")
    p.add_argument("-o", "--out-dir", required=True,
                   help="output directory or URI (new or empty, or this prepare's own to resume)")
    p.add_argument("--name", default=None,
                   help="shard name prefix: NAME_val_000000.bin, NAME_train_000001.bin, ... "
                        "(default: the input's name)")
    p.add_argument("--text-field", default="text",
                   help="the text column (Parquet) or field (JSON Lines) (default: text)")
    p.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE,
                   help=f"tokens per shard (default: {DEFAULT_SHARD_SIZE:,}, llm.c's)")
    p.add_argument("--val-tokens", type=int, default=None,
                   help="tokens in the val shard (shard 0) (default: --shard-size, llm.c's)")
    p.add_argument("--storage-endpoint", default="",
                   help="object store endpoint for s3:// inputs and output (else AWS_ENDPOINT_URL)")
    p.add_argument("--ray-address", default=None,
                   help="the Ray cluster to use (default: RAY_ADDRESS, else a local Ray)")
    return p


def main(argv: list[str], prog: str = "raygpt prepare") -> int:
    args = build_parser().parse_args(argv)
    settings = PrepareSettings(tuple(args.inputs), args.out_dir, args.name, args.text_field,
                               args.shard_size, args.val_tokens, args.storage_endpoint,
                               args.ray_address)
    try:
        p = plan(settings)
        if p.complete is not None:
            print(f"{prog}: {printable(p.out.uri())} is complete ({len(p.complete['shards'])} shards, "
                  f"{p.complete['tokens']:,} tokens): nothing to do")
            return 0
        if p.progress is not None:
            print(f"{prog}: continuing the prepare in {printable(p.out.uri())} after "
                  f"{len(p.progress.shards)} finished shard(s)", file=sys.stderr)
        manifest = run(p)
    except (CorpusError, PrepareError, ConfigError, RefusedPath) as e:
        # one line, escaped: names and text in it come from files (a planted name, a field)
        print(f"{prog}: error: {printable(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for s in manifest["shards"]:
        print(f"wrote {printable(p.out.uri(s['name']))}: {s['tokens']:,} tokens")
    print(f"total: {manifest['tokens']:,} tokens from {manifest['documents']:,} documents in "
          f"{len(manifest['shards'])} shards; manifest {printable(p.out.uri('manifest.json'))}")
    if len(manifest["shards"]) == 1:
        print(f"{prog}: warning: every token went to the val shard; pass --val-tokens (e.g. "
              f"32768) to hold fewer out for validation", file=sys.stderr)
    return 0
