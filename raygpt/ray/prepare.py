"""`raygpt prepare`: a corpus tokenized by Ray tasks into llm.c's token shards.

    raygpt prepare INPUT... -o OUT [--name NAME] [--text-field text] [--shard-size 100000000]
                   [--val-tokens N] [--storage-endpoint URL]

The corpus is planned on the driver (raygpt.data.corpus: inputs in sorted path order, Parquet
footers checked, one unit per row group or file), then each unit is a Ray task over the Ray
this command starts or joins (`ray job submit -- raygpt prepare ...` uses the cluster's CPUs)
that tokenizes it and stages its tokens beside the output (raygpt.data.staging); the driver
receives counts and hashes only, plans llm.c's cut from the counts in unit order, so the bytes
never depend on how many workers ran or in which order they finished, and hands each full
shard to a task that writes it from the staged byte ranges. Shards stay staged until the last
unit is in. A rerun of the same prepare redoes neither a staged unit nor a written shard; a
rerun over a complete output says so and does nothing.

The output directory is claimed as a run directory is (raygpt.storage.ownership, kind "prepare"): a new
or empty one gets this user's marker before anything is written into it, and a rerun continues
(or reports complete) only a directory carrying this user's marker, whose progress, manifest
and shards are regular files of this user's: a directory someone else planted, with a forged
progress.json or manifest.json, is refused in one line, exit 2, before anything is written.
Every string printed from data (file names, URIs, field values, errors) goes through
raygpt.runlog.terminal.printable.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import posixpath
import stat
import sys
import time

from raygpt.config.flag_hints import HintingParser
from raygpt.data import corpus
from raygpt.data.corpus import CorpusError
from raygpt.data import staging
from raygpt.data.shard_writer import (DEFAULT_SHARD_SIZE, MANIFEST, MAX_SHARD_TOKENS, PROGRESS,
                                      STAGING, CutPlanner, PrepareError, Progress, identity,
                                      make_manifest, publish, read_manifest, read_progress,
                                      shard_name, write_progress)
from raygpt.data.tokenizer import tokenizer_fingerprint
from raygpt.runlog.terminal import printable
from raygpt.storage import RunDir, open_run_dir, redact, with_endpoint
from raygpt.storage.ownership import check_claim, claim_dir, foreign_entries
from raygpt.train.errors import EXIT_BAD_INPUT


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


KIND = "prepare"  # the output directory's marker kind (raygpt.storage.ownership)


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
    for flag, value in (("--shard-size", s.shard_size), ("--val-tokens", s.val_tokens)):
        if value is not None and value > MAX_SHARD_TOKENS:
            raise CorpusError(f"{flag}: expected at most {MAX_SHARD_TOKENS} (llm.c's int32 header "
                              f"field), found {value}")
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
    _check_ours(out, s.out)
    _check_entries(out, [(STAGING, True), (staging.UNITS, True), (PROGRESS, False),
                         (MANIFEST, False)])
    complete, progress = read_manifest(out), read_progress(out)
    if progress is not None:
        _check_entries(out, [(rel, False) for e in progress.shards
                             for rel in (f"{STAGING}/{e['name']}", e["name"])]
                       + [(staging.unit_file(u), False) for u in progress.units])
        missing = [e["name"] for e in progress.shards
                   if not (out.exists(f"{STAGING}/{e['name']}") or out.exists(e["name"]))]
        if missing:
            raise PrepareError(f"{out.uri(PROGRESS)}: expected the finished shards it names in "
                               f"{out.uri(STAGING)}, found {missing[0]} missing; delete "
                               f"{out.uri(STAGING)} to start this prepare afresh")
    if complete is not None:
        _check_entries(out, [(e["name"], False) for e in complete["shards"]])
    if complete is not None and complete["identity"] != ident:
        raise PrepareError(f"-o {redact(out.uri())}: holds a complete prepare of other inputs or "
                           f"settings ({out.uri('manifest.json')}); expected an empty directory "
                           f"or this prepare's own; choose another -o")
    if progress is not None and progress.identity != ident:
        raise PrepareError(f"-o {redact(out.uri())}: holds a prepare under way of other inputs or "
                           f"settings ({out.uri(PROGRESS)}); expected an empty directory or this "
                           f"prepare's own; choose another -o, or delete {out.uri(STAGING)}")
    # a staging without progress is this user's prepare killed before its first progress write
    held = ([n for n in foreign_entries(out) if n != STAGING]
            if complete is None and progress is None else [])
    if held:
        raise PrepareError(f"-o {redact(out.uri())}: expected an empty or new directory, found "
                           f"{', '.join(held[:3])}{' ...' if len(held) > 3 else ''}")
    return Plan(s, fs, files, units, name, val_tokens, ident, out, progress, complete)


def _check_ours(out: RunDir, given: str) -> None:
    """RunDirRefused (one line) unless `out` is new, empty, or marked as this user's prepare
    output (raygpt.storage.ownership.check_claim: reads only)."""
    if out.caps.local_paths and out.exists():
        mode = os.stat(out.local_path()).st_mode  # the root may be a link the user chose
        if not stat.S_ISDIR(mode):
            raise PrepareError(f"-o {out.uri()}: expected a directory, found "
                               f"{'a file' if stat.S_ISREG(mode) else 'a special file'}")
    check_claim(out, KIND, given, holds=lambda _: False, resume=True)


def _check_entries(out: RunDir, entries: list[tuple[str, bool]]) -> None:
    """PrepareError (one line) unless each of prepare's own entries that exists in a local
    output is what prepare writes there, a directory (True) or a regular file (False), not a
    link, and this user's; checked before anything is read or written."""
    if not out.caps.local_paths:
        return  # an object store has neither links nor owners raygpt can read
    uid = os.geteuid()
    for rel, is_dir in entries:
        try:
            st = os.lstat(out.local_path(rel))
        except FileNotFoundError:
            continue
        except OSError as e:  # a link or a file where a directory is expected above it
            raise PrepareError(f"{out.uri(rel)}: expected {'a directory' if is_dir else 'a file'} "
                               f"written by raygpt prepare, cannot look at it "
                               f"({e.strerror})") from None
        if not (stat.S_ISDIR if is_dir else stat.S_ISREG)(st.st_mode):
            found = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory"
                     if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                     else "a regular file" if stat.S_ISREG(st.st_mode) else "a special file")
            want = "a directory" if is_dir else "a regular file"
            raise PrepareError(f"{out.uri(rel)}: expected {want} written by raygpt prepare, "
                               f"found {found}; remove it by hand")
        if st.st_uid != uid:
            raise PrepareError(f"{out.uri(rel)}: expected a file of yours (uid {uid}) written by "
                               f"raygpt prepare, found one owned by uid {st.st_uid}; name an "
                               f"output directory of your own")


def run(p: Plan, *, report=None, window: int | None = None) -> dict:
    """Tokenize the plan's units as Ray tasks (the Ray this process is in, else one it starts)
    and write the shards; the manifest. The driver hands each task its own unit or shard, and
    receives counts and hashes (raygpt.data.staging): pass one stages each unit's tokens
    beside the output, the cut is planned from their counts in unit order as they come in
    (raygpt.data.shard_writer.CutPlanner), and each shard, once full, is written by a task
    that reads its byte ranges there (pass two, overlapping pass one). `window`: tasks in
    flight (default twice the cluster's CPUs; tests: the bytes must not depend on it)."""
    import ray

    from raygpt.ray import shared_dir
    from raygpt.ray.connect import init_ray

    if p.complete is not None:
        return p.complete
    init_ray(p.settings.ray_address)
    if p.out.caps.local_paths:  # tasks on every node stage and read units there: a shared directory
        line = shared_dir.blind_nodes_line("-o", redact(p.out.uri()),
                                           *shared_dir.nodes_not_seeing(p.out.local_path()))
        if line:
            raise PrepareError(line)
    # marked before the first write (and checked again): a new -o becomes this user's
    claim_dir(p.out, KIND, p.settings.out, holds=lambda _: False, resume=True)
    p.out.makedirs(staging.UNITS)  # the tasks write files into it
    progress = p.progress or Progress(p.identity)
    redo = _units_to_redo(p, progress)
    units = {i: v for i, v in progress.units.items() if i not in redo}
    done_shards = {s["name"]: s for s in progress.shards}
    todo = [u for u in p.units if u.index not in units]
    report = report or ProgressLine(todo, sum(v[1] for v in units.values()))
    stage = ray.remote(staging.stage_unit).options(num_cpus=1)
    write = ray.remote(staging.write_shard).options(num_cpus=1)
    window = window or 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
    planner = CutPlanner(p.settings.shard_size, p.val_tokens)
    readers: dict[int, int] = {}  # unit -> shards not yet written that read it
    reading: dict[str, list[int]] = {}  # shard being written -> the units it reads
    pending: dict = {}  # ObjectRef -> "unit" | "shard"
    next_unit, planned, last_write = 0, 0, 0.0

    def plan_shards(shards) -> None:
        for index, pieces in shards:
            name = shard_name(p.name, index)
            if name in done_shards:  # written before a kill
                if done_shards[name]["tokens"] != sum(b - a for _, a, b in pieces):
                    raise PrepareError(f"{p.out.uri(PROGRESS)}: {name}: expected the token count "
                                       f"the cut gives, found another; delete "
                                       f"{p.out.uri(STAGING)} to start afresh")
                continue
            reading[name] = [u for u, _, _ in pieces]
            for unit in reading[name]:
                readers[unit] = readers.get(unit, 0) + 1
            ref = write.remote(p.out, name, [(u, a, b, units[u][0], units[u][2])
                                             for u, a, b in pieces])
            pending[ref] = "shard"

    while True:
        while planned in units:  # the cut follows the units' order
            plan_shards(planner.add(planned, units[planned][0]))
            planned += 1
        if planned == len(p.units):
            plan_shards(planner.finish())
            planned += 1
        while next_unit < len(todo) and len(pending) < window:
            u = todo[next_unit]
            pending[stage.remote(p.out, p.fs, p.files[u.file], u, p.settings.text_field)] = "unit"
            next_unit += 1
        if not pending:
            break
        ready, _ = ray.wait(list(pending), num_returns=1)
        result = ray.get(ready[0])
        kind = pending.pop(ready[0])
        if result["error"]:  # bad input: one line, and the work in flight stopped
            for ref in pending:
                ray.cancel(ref)
            raise CorpusError(result["error"]) if kind == "unit" else \
                PrepareError(result["error"])
        if kind == "unit":
            units[result["unit"]] = (result["tokens"], result["documents"], result["sha256"])
            report.unit_done(p.units[result["unit"]], result["tokens"], result["documents"])
        else:
            done_shards[result["name"]] = {k: result[k] for k in ("name", "tokens", "sha256")}
        now = time.monotonic()
        if kind == "shard" or now - last_write > _PROGRESS_EVERY_S:
            write_progress(p.out, Progress(p.identity, _in_order(done_shards), dict(units)))
            last_write = now
        if kind == "shard":  # a unit no shard still to write reads is no longer needed
            tail = {u for u, _, _ in planner.pieces}
            for unit in reading.pop(result["name"]):
                readers[unit] -= 1
                if not readers[unit] and unit not in tail:
                    p.out.delete_file(staging.unit_file(unit))
    shards = _in_order(done_shards)
    if not shards:  # an empty corpus: nothing to publish
        raise CorpusError(f"{', '.join(p.settings.inputs)}: expected at least one document, "
                          f"found none")
    manifest = make_manifest(name=p.name, identity_hex=p.identity,
                             inputs=[(redact(f.uri), f.size) for f in p.files],
                             text_field=p.settings.text_field, shard_size=p.settings.shard_size,
                             val_tokens=p.val_tokens, tokenizer_sha256=tokenizer_fingerprint(),
                             documents=sum(v[1] for v in units.values()), shards=shards)
    publish(p.out, manifest)
    report.done(manifest)
    return manifest


_PROGRESS_EVERY_S = 2.0  # units staged since the last write are redone after a kill


def _units_to_redo(p: Plan, progress: Progress) -> set[int]:
    """Units the progress records as staged whose staged file is gone (removed once the shards
    then planned were written) while a shard not yet written reads them: the cut replayed
    from the recorded counts says which."""
    present = set(p.out.file_sizes(staging.UNITS))
    done = {s["name"] for s in progress.shards}
    planner = CutPlanner(p.settings.shard_size, p.val_tokens)
    needed: set[int] = set()
    unit = 0
    while unit in progress.units:
        for index, pieces in planner.add(unit, progress.units[unit][0]):
            if shard_name(p.name, index) not in done:
                needed.update(u for u, _, _ in pieces)
        unit += 1
    for index, pieces in planner.finish():  # the shard the recorded prefix has begun
        if unit < len(p.units) or shard_name(p.name, index) not in done:
            needed.update(u for u, _, _ in pieces)
    needed.update(u for u in progress.units if u >= unit)
    return {u for u in needed if staging.unit_file(u).rsplit("/", 1)[1] not in present}


def _in_order(shards: dict) -> list[dict]:
    return sorted(shards.values(), key=lambda s: s["name"].rsplit("_", 1)[1])


class ProgressLine:
    """Documents, tokens/s and ETA on stderr: rewritten in place on a terminal, a line every
    `every_s` otherwise (a job's log)."""

    def __init__(self, todo: list, docs_before: int, *, stream=None, every_s: float = 10.0):
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.every_s = 0.5 if self.tty else every_s
        self.total_bytes = sum(u.nbytes for u in todo) or 1
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
        """The last line, 100% (a log too: a prepare quicker than `every_s` said nothing yet)."""
        self._print(time.monotonic(), end="\n" if self.tty else "")


def _human(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def build_parser() -> argparse.ArgumentParser:
    p = HintingParser(
        prog="raygpt prepare",
        description="Tokenize Parquet, JSON Lines or text files (local paths, globs, directories "
                    "or s3:// / gs:// URIs) into llm.c's GPT-2 token shards, as Ray tasks.")
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
            print(f"{prog}: {printable(p.out.uri())} is complete ({len(p.complete['shards'])} "
                  f"shards, {p.complete['tokens']:,} tokens): nothing to do")
            return 0
        if p.progress is not None:
            print(f"{prog}: continuing the prepare in {printable(p.out.uri())} after "
                  f"{len(p.progress.shards)} finished shard(s)", file=sys.stderr)
        manifest = run(p)
    except (ValueError, OSError) as e:  # CorpusError, PrepareError, RunDirRefused, RefusedPath...
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
