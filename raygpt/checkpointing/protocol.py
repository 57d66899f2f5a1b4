"""The checkpoint protocol and the pure policies around it: names, DONE, MANIFEST, the one
completeness check (quick or with hashes), resume selection, compatibility checks, abandoned
trajectories, copy (staging is raygpt.checkpointing.staging's).

A checkpoint at step N is one directory of the run directory (see raygpt/storage.py):

    step_<N:08d>/
        model_<N:08d>.bin            llm.c model file, rank 0 (raygpt.llmc.model_file)
        state_<N:08d>_<rank:05d>.bin llm.c state file, one per rank (raygpt.llmc.state_file)
        DONE_<N:08d>                 llm.c's sentinel: every rank's files are in storage
        MANIFEST.json                size + sha256 of every other file (the sha256 its
                                     writing rank computed while writing; for a state file
                                     also one per 64 MiB piece), identity hashes

Write order: all rank files -> DONE -> MANIFEST. DONE keeps llm.c's meaning (written only after
every rank finished, so llm.c-style tools can rely on it). MANIFEST comes last because it is the
last word: it hashes DONE too, and a checkpoint is trusted only when DONE and MANIFEST exist and
every listed hash matches. A crash anywhere before the MANIFEST lands therefore leaves a
checkpoint that readers treat as absent (they fall back to an older one and say so), never one
that is half-trusted. Checking costs stay flat in the world size: MANIFEST takes the writers'
hashes (nothing is read back to write it), "complete" (DONE, MANIFEST, every file with its size:
`verify_checkpoint(hashes=False)`) is what selection, retention and `raygpt status` check, and
each rank hashes the bytes it loads (`verify_bytes`: by pieces, in parallel, when MANIFEST lists
them; the whole-file sha256 stays for everything else, `sha256sum` included).

The worker side (save, restore, rewind) is raygpt.checkpointing.runtime's; making a stored
checkpoint complete (DONE, MANIFEST) is raygpt.checkpointing.finalize's, and deleting the ones
the policy lets go raygpt.checkpointing.retention's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from raygpt.llmc.state_file import json_default
from raygpt.storage import (MAX_JSON_BYTES, FileTooLarge, JSONError, RunDir, parse_json,
                            read_json_bounded)

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "raygpt-checkpoint"
MANIFEST_VERSION = 1
# A file's optional sha256 per piece (raygpt.storage.hashing_writer.PIECE_BYTES): what its writer hashed
# beside the whole-file sha256, so that a reader checks the pieces on PIECE_THREADS threads.
PIECE_KEYS = ("piece_bytes", "piece_sha256")
PIECE_THREADS = min(8, os.cpu_count() or 1)
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a digest as MANIFEST writes it
_TEMP_MARK = ".tmp-"  # every temporary name raygpt creates contains this (storage.py, staging.stage_dir)
_STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint file or manifest cannot be used; the message names the file and the field."""


class WorldSizeMismatch(CheckpointError):
    """The checkpoint was written by a different number of ranks (everything else matches)."""


# ---------------------------------------------------------------------- names (llm.c's)
def step_of_dir(name: str) -> int | None:
    """The step of a checkpoint directory's name (`step_XXXXXXXX`), None for any other name:
    the one place a step is read back from a name."""
    m = _STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def model_file(step: int) -> str:
    return f"model_{step:08d}.bin"


def state_file(step: int, rank: int) -> str:
    return f"state_{step:08d}_{rank:05d}.bin"


def done_file(step: int) -> str:
    return f"DONE_{step:08d}"


def done_path(step: int) -> str:
    """DONE's path in the run directory: the one thing that says checkpoint `step` is complete."""
    return f"{step_dir(step)}/{done_file(step)}"


def expected_files(step: int, world_size: int) -> list[str]:
    """The files a complete checkpoint must hold besides DONE and MANIFEST."""
    return [model_file(step)] + [state_file(step, r) for r in range(world_size)]


# ====================================================================== DONE and MANIFEST
def write_done(run_dir: RunDir, step: int) -> None:
    """Create the empty DONE_<step> sentinel: only after every rank's files are in storage."""
    run_dir.write_bytes_atomic(done_path(step), b"")


# ---------------------------------------------------------------------------------------------
# Abandoned trajectories. A spike rewind abandons every checkpoint after its target; rank 0
# deletes them, but one still on its way (reported, not yet finalized by the driver) could be
# made complete after the deletion. Each trajectory has a token (a new one at every rewind and
# every attempt), a checkpoint's MANIFEST "extra" carries the token it was saved under, and this
# file lists the tokens rewinds abandoned, with the step they went back to; the finalizer
# refuses DONE to a checkpoint past that step on an abandoned trajectory, and resume passes
# over one (a crash may come between this record and the deletion).
#
# The same entry is the rewind's decision, made durable before training goes on (the file is
# written atomically and fsynced): "ledger" (the RewindLedger's state after the rewind: count,
# lr_scale, regions) and "skip_ranges" (the loader's whole skip list after it). Checkpoints
# written later carry both; one written before does not, so a resume from it (a worker lost
# right after the rewind, -y 1) applies the newest decision whose rewind count is above the
# checkpoint's. Decisions only accumulate along the run's one live trajectory (a rewind keeps
# the ledger and skip list of the present), so the newest one holds them all.

ABANDONED = "abandoned_trajectories.json"


def read_abandoned_trajectories(run_dir: RunDir) -> list[dict]:
    """[{"trajectory": token, "to_step": N, "ledger": {...}, "skip_ranges": [...]}, ...] in
    rewind order (the decision fields absent from entries written before they existed); []
    when none."""
    if not run_dir.exists(ABANDONED):
        return []
    try:
        entries = read_json_bounded(run_dir, ABANDONED)
        if not (isinstance(entries, list) and all(
                isinstance(e, dict) and isinstance(e.get("trajectory"), str)
                and isinstance(e.get("to_step"), int) for e in entries)):
            raise ValueError("expected a list of {trajectory: str, to_step: int}")
        for i, e in enumerate(entries):
            if "ledger" in e and not (
                    isinstance(e["ledger"], dict) and isinstance(e["ledger"].get("rewinds"), int)
                    and isinstance(e.get("skip_ranges"), list) and all(
                        isinstance(r, list) and len(r) == 3 and all(isinstance(v, int) for v in r)
                        for r in e["skip_ranges"])):
                raise ValueError(f"entry {i}: expected a rewind decision with ledger "
                                 f"{{rewinds: int, ...}} and skip_ranges [[shard, start, end], ...]")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{run_dir.uri(ABANDONED)}: {e}") from e
    return entries


def record_abandoned_trajectory(run_dir: RunDir, trajectory: str, to_step: int, *,
                                ledger: dict | None = None, skip_ranges=None) -> None:
    """Add `trajectory`, abandoned back to `to_step`, to the list, with the rewind's decision
    (the ledger's state and the whole skip list after the rewind) when given. Rewritten
    atomically and durably; rank 0 only, before it deletes the abandoned checkpoints and before
    training goes on."""
    entries = read_abandoned_trajectories(run_dir)
    entry = {"trajectory": trajectory, "to_step": int(to_step)}
    if ledger is not None:
        entry["ledger"] = ledger
        entry["skip_ranges"] = [[int(v) for v in r] for r in (skip_ranges or [])]
    entries.append(entry)
    run_dir.write_bytes_atomic(ABANDONED, json.dumps(entries, indent=1).encode("utf-8"))


def latest_rewind_decision(entries: list[dict]) -> dict | None:
    """The newest entry that carries a rewind's decision ("ledger" and "skip_ranges"), or None."""
    return next((e for e in reversed(entries) if "ledger" in e), None)


def abandoned_by(step: int, trajectory: str | None, entries: list[dict]) -> dict | None:
    """The entry that abandoned checkpoint `step` saved on `trajectory`, or None."""
    return next((e for e in entries if e["trajectory"] == trajectory and step > e["to_step"]),
                None)


def published_files(run_dir: RunDir, step: int) -> list[str]:
    """The names in a step directory that its MANIFEST lists (all but MANIFEST and temp files)."""
    return [name for name in run_dir.listdir(step_dir(step), files_only=True)
            if name != MANIFEST and _TEMP_MARK not in name]


def write_manifest(run_dir: RunDir, step: int, *, world_size: int, num_parameters: int,
                   config_hash: str, tokenizer_hash: str, data_hash: str,
                   config_identity: dict | None = None, extra: dict | None = None,
                   written: dict | None = None, val_data_hash: str | None = None,
                   model_source: str | None = None) -> dict:
    """List (size + sha256) every file of the step directory except MANIFEST (and temp files),
    then write MANIFEST.json atomically. Call it last, after DONE. Returns the manifest.

    `written` ({name: {"size", "sha256"[, "piece_bytes", "piece_sha256"]}}) is what the ranks
    hashed while writing their files:
    those files are not read again, only their stored size is compared with the written one
    (CheckpointError on a difference or a file missing from storage), so the cost of a manifest
    does not grow with the state. A file `written` does not cover (DONE, a few bytes) is hashed
    from storage. Without `written` every file is hashed from storage (tools, tests).
    config_identity (TrainConfig.identity()) lets `check_compatible` name differing fields;
    data_hash and val_data_hash identify the train and validation shards by their bytes,
    model_source the model the run started from (config.FILE_FIELDS).
    """
    d = step_dir(step)
    written = written or {}
    present = published_files(run_dir, step)
    missing = sorted(set(written) - set(present))
    if missing:
        raise CheckpointError(f"{run_dir.uri(f'{d}/{missing[0]}')}: written by its rank but not "
                              f"in storage ({len(missing)} file(s) missing); no MANIFEST")
    files = {}
    for name in present:
        rel = f"{d}/{name}"
        size = run_dir.size_of(rel)
        if name in written:
            if size != written[name]["size"]:
                raise CheckpointError(f"{run_dir.uri(rel)}: size: expected {written[name]['size']} "
                                      f"bytes as written by its rank, found {size} in storage; "
                                      f"no MANIFEST")
            files[name] = {"size": size, "sha256": written[name]["sha256"],
                           **{k: written[name][k] for k in PIECE_KEYS if k in written[name]}}
        else:
            files[name] = {"size": size, "sha256": run_dir.sha256_of(rel, max_bytes=size)}
    manifest = {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "step": step,
        "world_size": world_size, "num_parameters": num_parameters,
        "config_hash": config_hash, "tokenizer_hash": tokenizer_hash, "data_hash": data_hash,
        "config_identity": config_identity, "files": files, "extra": extra or {},
    }
    for key, value in (("val_data_hash", val_data_hash), ("model_source", model_source)):
        if value is not None:
            manifest[key] = value
    data = json.dumps(manifest, indent=1, sort_keys=True, default=json_default).encode("utf-8")
    run_dir.write_bytes_atomic(f"{d}/{MANIFEST}", data)
    return manifest


def read_manifest(run_dir: RunDir, step: int) -> dict:
    """The parsed MANIFEST.json of a step, or CheckpointError naming the file and what is wrong."""
    manifest, problem = _load_manifest(run_dir, step)
    if problem:
        raise CheckpointError(f"{run_dir.uri(f'{step_dir(step)}/{MANIFEST}')}: {problem}")
    return manifest


def _load_manifest(run_dir: RunDir, step: int) -> tuple[dict | None, str | None]:
    """(manifest, None) or (None, what is wrong with it). A MANIFEST is untrusted input: it is
    read with a size bound, and every field a reader uses is checked here, each file name
    confined to its step directory, so a malformed one condemns its checkpoint (readers fall
    back to an older one) instead of raising somewhere later."""
    rel = f"{step_dir(step)}/{MANIFEST}"
    if not run_dir.exists(rel):
        return None, "missing (the checkpoint was never completed)"
    try:
        manifest = parse_json(run_dir.read_bytes(rel, max_bytes=MAX_JSON_BYTES), run_dir.uri(rel))
    except FileTooLarge:
        return None, f"unreadable: expected at most {MAX_JSON_BYTES:,} bytes of JSON, found more"
    except JSONError as e:
        return None, f"unreadable: {e.reason}"
    except OSError as e:
        return None, f"unreadable ({type(e).__name__}: {e})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        return None, f"format: expected {MANIFEST_FORMAT!r}, found {found!r}"
    if manifest.get("version") != MANIFEST_VERSION:
        return None, f"version: expected {MANIFEST_VERSION}, found {manifest.get('version')!r}"
    if not isinstance(manifest.get("files"), dict):
        return None, f"files: expected an object, found {_short(manifest.get('files'))}"
    for name, entry in manifest["files"].items():
        problem = _bad_file_name(name) or _bad_file_entry(entry)
        if problem:
            return None, f"files[{_short(name)}]: {problem}"
    for key, kinds, what in (("world_size", int, "an integer"), ("num_parameters", int, "an integer"),
                             ("extra", dict, "an object"), ("config_identity", dict, "an object"),
                             ("retention", dict, "an object")):
        value = manifest.get(key)
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            return None, f"{key}: expected {what}, found {_short(value)}"
    return manifest, None


def _bad_file_name(name: str) -> str | None:
    """Why `name` cannot be a file of a step directory (a plain name: no path separator, no
    `..`, nothing hidden from a listing), or None."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name \
            or "\\" in name or "\x00" in name or name != name.strip():
        return "expected a file name inside the step directory, found a path or an empty name"
    return None


def _bad_file_entry(entry) -> str | None:
    if not isinstance(entry, dict):
        return f"expected {{size, sha256}}, found {_short(entry)}"
    size, digest = entry.get("size"), entry.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"size: expected an integer >= 0, found {_short(size)}"
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
        return f"sha256: expected 64 hex digits, found {_short(digest)}"
    if not any(k in entry for k in PIECE_KEYS):
        return None
    step, pieces = entry.get("piece_bytes"), entry.get("piece_sha256")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        return f"piece_bytes: expected an integer >= 1, found {_short(step)}"
    count = -(-size // step)
    if not isinstance(pieces, list) or len(pieces) != count:
        return (f"piece_sha256: expected a list of {count} sha256 (size {size} in pieces of "
                f"{step}), found {_short(pieces)}")
    bad = next((p for p in pieces if not isinstance(p, str) or not _SHA256_HEX.fullmatch(p)),
               None)
    if bad is not None:
        return f"piece_sha256: expected 64 hex digits each, found {_short(bad)}"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def verify_checkpoint(run_dir: RunDir, step: int, *, world_size: int | None = None,
                      hashes: bool = True) -> list[str]:
    """Problems that make the checkpoint at `step` untrustworthy; [] means verified.

    Needs DONE, a readable MANIFEST, the model file and one state file per rank listed in it
    (world_size ranks, or the manifest's own world_size when None), and every listed file
    present with the listed size and (with `hashes`) sha256. Files the manifest does not list
    are ignored. Without `hashes` nothing but MANIFEST is read (a listing and sizes: cheap on
    object stores, a flipped bit goes unnoticed): what resume selection, retention and
    `raygpt status` use; each rank then hashes what it loads (`verify_bytes`).
    """
    d = step_dir(step)
    problems = []
    if not run_dir.exists(f"{d}/{done_file(step)}"):
        problems.append(f"{d}/{done_file(step)}: missing (not every rank finished writing)")
    manifest, problem = _load_manifest(run_dir, step)
    if problem:
        return problems + [f"{d}/{MANIFEST}: {problem}"]
    if manifest.get("step") != step:
        problems.append(f"{d}/{MANIFEST}: step: expected {step}, found {manifest.get('step')!r}")
    listed = manifest["files"]
    ranks = world_size if world_size is not None else manifest.get("world_size")
    if not isinstance(ranks, int) or ranks < 1:
        problems.append(f"{d}/{MANIFEST}: world_size: expected an integer >= 1, found {ranks!r}")
        ranks = 0
    for name in expected_files(step, ranks):
        if name not in listed:
            problems.append(f"{d}/{name}: expected rank file not listed in {MANIFEST}")
    for name, entry in sorted(listed.items()):
        rel = f"{d}/{name}"
        if not run_dir.exists(rel):
            problems.append(f"{rel}: listed in {MANIFEST} but missing")
            continue
        try:
            size = run_dir.size_of(rel)
        except (OSError, ValueError) as e:  # a directory or other non-file under a listed name
            problems.append(f"{rel}: listed in {MANIFEST} but not a readable file ({e})")
            continue
        if size != entry.get("size"):
            problems.append(f"{rel}: size: expected {entry.get('size')}, found {size}")
            continue  # a size mismatch already condemns it; skip hashing gigabytes
        if not hashes:
            continue
        try:  # at most the listed size: a name that is a link to /dev/zero ends here
            digest = run_dir.sha256_of(rel, max_bytes=size)
        except (OSError, ValueError) as e:
            problems.append(f"{rel}: unreadable ({e})")
            continue
        if digest != entry.get("sha256"):
            problems.append(f"{rel}: sha256: expected {entry.get('sha256')}, found {digest}")
    return problems


def verify_bytes(run_dir: RunDir, step: int, name: str, data: bytes, manifest: dict) -> None:
    """CheckpointError unless `data` (file `name` of checkpoint `step`, as a rank read it to
    load it) has the size and sha256 that MANIFEST lists: a rank hashes only what it loads,
    from the bytes it already holds."""
    rel = f"{step_dir(step)}/{name}"
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{run_dir.uri(rel)}: not listed in {MANIFEST}")
    if len(data) != entry["size"]:
        raise CheckpointError(f"{run_dir.uri(rel)}: size: expected {entry['size']}, found {len(data)}")
    if "piece_sha256" in entry:  # every byte in a hashed piece, the pieces on several threads
        problem = _bad_file_entry(entry)  # read_manifest checked it; a MANIFEST built in memory
        if problem is not None:           # must not leave bytes unchecked either
            raise CheckpointError(f"{run_dir.uri(rel)}: {MANIFEST}: {problem}")
        bad = first_bad_piece(data, entry["piece_bytes"], entry["piece_sha256"])
        if bad is not None:
            lo, hi, expected, found = bad
            raise CheckpointError(f"{run_dir.uri(rel)}: sha256 of bytes [{lo}, {hi}): expected "
                                  f"{expected}, found {found}")
        return
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise CheckpointError(f"{run_dir.uri(rel)}: sha256: expected {entry['sha256']}, found {digest}")


def first_bad_piece(data, piece_bytes: int, digests: list[str]) -> tuple | None:
    """(lo, hi, expected, found) of the first piece of `data` whose sha256 is not its listed
    one, or None; the pieces are hashed on up to PIECE_THREADS threads (hashlib releases the
    GIL), so checking a file costs its size over that many cores."""
    view = memoryview(data).cast("B")
    spans = [(lo, min(lo + piece_bytes, len(view))) for lo in range(0, len(view), piece_bytes)]

    def digest(span):
        return hashlib.sha256(view[span[0]:span[1]]).hexdigest()

    with ThreadPoolExecutor(max(1, min(PIECE_THREADS, len(spans)))) as pool:
        for (lo, hi), expected, found in zip(spans, digests, pool.map(digest, spans)):
            if found != expected:
                return lo, hi, expected, found
    return None


# ====================================================================== resume selection
def list_checkpoint_steps(run_dir: RunDir) -> list[int]:
    """Steps of the step_XXXXXXXX directories, ascending (temp and other names are ignored)."""
    steps = []
    for name in run_dir.listdir():
        match = _STEP_DIR_RE.match(name)
        if match and run_dir.is_dir(name):
            steps.append(int(match.group(1)))
    return sorted(steps)


def find_latest_verified(run_dir: RunDir, *, before_step: int | None = None,
                         world_size: int | None = None,
                         warn: Callable[[str], None] | None = None,
                         hashes: bool = True) -> int | None:
    """Newest step (strictly below before_step, if given) whose checkpoint verifies; None if none.
    `hashes=False`: complete (DONE, MANIFEST, every listed file with its size), not hashed.

    Each newer checkpoint skipped on the way is reported through warn (default: log.warning)
    with its step and the file that failed.
    """
    warn = warn or log.warning
    for step in reversed(list_checkpoint_steps(run_dir)):
        if before_step is not None and step >= before_step:
            continue
        problems = verify_checkpoint(run_dir, step, world_size=world_size, hashes=hashes)
        if not problems:
            return step
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        warn(f"checkpoint step {step} in {run_dir.uri()} is not usable, falling back to an older "
             f"one: {problems[0]}{more}")
    return None


def check_compatible(manifest: dict, *, config_identity: dict, tokenizer_hash: str,
                     data_hash: str, world_size: int, by_content: dict[str, str] | None = None,
                     content: dict[str, str] | None = None) -> None:
    """Raise CheckpointError listing every field in which the checkpoint and this run differ.

    Config fields are compared one by one against the manifest's config_identity (the caller
    passes TrainConfig.identity(), which already leaves out the fields allowed to change), but
    a field that `by_content` maps to one of the manifest's fingerprints (config.FILE_FIELDS:
    the shard globs to data_hash and val_data_hash, -e to model_source) is compared by that
    fingerprint instead of as written, where the manifest has it: the same bytes at another
    path resume. `content` holds this run's fingerprints ({"val_data_hash": ...}), each compared
    where the manifest has it (a manifest from before it existed compares the path as written).
    A world size difference alone raises WorldSizeMismatch, so elastic resume can catch just
    that.
    """
    where = f"{step_dir(manifest.get('step', -1))}/{MANIFEST}"
    current = json.loads(json.dumps(config_identity, default=json_default))  # as stored: no tuples
    diffs = []
    stored = manifest.get("config_identity")
    by_hash = {f for f, h in (by_content or {}).items() if h in manifest}
    if isinstance(stored, dict):
        diffs += _dict_diffs({k: v for k, v in stored.items() if k not in by_hash},
                             {k: v for k, v in current.items() if k not in by_hash}, "")
    else:  # older manifest without the identity: the hash is all we can compare
        mine = hashlib.sha256(json.dumps(current, sort_keys=True).encode()).hexdigest()
        if manifest.get("config_hash") != mine:
            diffs.append(f"config_hash: checkpoint {manifest.get('config_hash')!r}, this run {mine!r} "
                         "(the manifest has no config_identity to name the fields)")
    hashes = [("tokenizer_hash", tokenizer_hash), ("data_hash", data_hash)]
    hashes += [(key, mine) for key, mine in (content or {}).items() if key in manifest]
    for field, mine in hashes:
        if manifest.get(field) != mine:
            diffs.append(f"{field}: checkpoint {manifest.get(field)!r}, this run {mine!r}")
    ws_line = (f"world_size: checkpoint {manifest.get('world_size')!r} ranks, this run {world_size} "
               "(llm.c state files are per rank)")
    if diffs:
        if manifest.get("world_size") != world_size:
            diffs.append(ws_line)
        raise CheckpointError(f"{where}: this run cannot resume the checkpoint; differing fields:\n  "
                              + "\n  ".join(diffs))
    if manifest.get("world_size") != world_size:
        raise WorldSizeMismatch(f"{where}: {ws_line}")


def _dict_diffs(stored: dict, current: dict, prefix: str) -> list[str]:
    diffs = []
    for key in sorted(set(stored) | set(current)):
        a, b = stored.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _dict_diffs(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: checkpoint {a!r}, this run {b!r}")
    return diffs


# ---------------------------------------------------------------------- copy

def copy_checkpoint(src: RunDir, dst: RunDir, step: int) -> None:
    """Copy a verified checkpoint directory, in the write protocol's order: rank files, then DONE,
    then MANIFEST (atomically, last), so an interrupted copy is never mistaken for a checkpoint."""
    sdir = step_dir(step)
    problems = verify_checkpoint(src, step)
    if problems:
        raise CheckpointError(f"{src.uri(sdir)}: cannot branch from an unverified checkpoint: "
                                 + "; ".join(problems))
    dst.delete_dir(sdir)  # leftovers of an interrupted copy
    dst.makedirs(sdir)
    last = (done_file(step), MANIFEST)
    names = src.listdir(sdir, files_only=True)
    for name in [n for n in names if n not in last] + [done_file(step)]:
        with src.open_read(f"{sdir}/{name}") as fin, dst.open_write(f"{sdir}/{name}") as fout:
            while chunk := fin.read(8 << 20):
                fout.write(chunk)
    dst.write_bytes_atomic(f"{sdir}/{MANIFEST}", src.read_bytes(f"{sdir}/{MANIFEST}"))
    problems = verify_checkpoint(dst, step)
    if problems:
        raise CheckpointError(f"{dst.uri(sdir)}: the copy does not verify: " + "; ".join(problems))
