"""Everything about a run that can be checked on the driver, checked before Ray starts.

A bad input found inside a worker costs a Ray start-up, a worker group and, before raygpt ended
such runs at once, the whole retry budget; found here it costs milliseconds. `check(cfg)` takes
a resolved config and raises `ConfigError` with one line naming the flag, the file and what
was expected, or returns what it found (for the start-up line):

- model: an `-e model_*.bin` file's header and size, and T against its max_seq_len;
- data: every train and validation shard's header (magic, version, token count against the
  file size; for shards in a bucket one range read each, and the token count against the
  prepare's manifest.json beside them) and its size against B, T and the largest world size
  (llm.c's B*T*world+1 rule, `data.tokens_needed`), validation's micro-batch against the
  smallest validation shard (and each --eval-set's), -x -1 (one epoch) against the global
  batch, and the node's shard cache (--shard-cache-gb) against the largest shard in a bucket;
- resume (-y 1): the newest complete checkpoint's MANIFEST against this config
  (`checkpoint.check_compatible`: config fields, tokenizer and data hashes; a different world
  size is fine, the loop reshards);
- the run directory: its filesystem reachable and writable (a probe file written and deleted),
  so a missing bucket or a read-only path is one line, not a pyarrow traceback from a worker;
- trackers: an --mlflow URI MLflow cannot open (`tracking.check_mlflow_uri`; a missing wandb or
  mlflow package is refused earlier, by `TrainConfig.validate`).
- the workers against this machine, when raygpt starts a Ray of its own here
  (`check_fits_this_machine`): more GPU or CPU workers than it has would wait for them forever
  (a cluster may grow: its own scheduler decides there), and a worker's estimated peak memory
  (raygpt.model.memory) against the GPU's memory, or the CPU workers' together against the host
  memory Ray's memory monitor lets them take: one that cannot fit is refused naming -b.

`raygpt.ray.trials.preflight_sweep` runs the model, data and tracker checks over every trial config
of a Ray Tune sweep that can be known before Tune samples anything, before Ray starts.

Nothing here needs Ray; the data and model checks read headers only, the resume check reads one
MANIFEST and checks sizes (the workers verify every hash when they load the checkpoint).
"""

from __future__ import annotations

import os

import uuid

from raygpt.config import ConfigError, TrainConfig, mixture
from raygpt.data.knobs import DataConfig
from raygpt.model.knobs import ModelConfig
from raygpt.runlog.knobs import RunLogConfig
from raygpt.data.loader import SHARDS_HELD, ranks_with_data, tokens_needed
from raygpt.data.mixture import epoch_samples
from raygpt.data.sources import is_remote, shard_token_counts
from raygpt.llmc.shards import HEADER_BYTES, ShardError
from raygpt.model import memory
from raygpt.model.memory import GiB


def check(cfg: TrainConfig, *, machine: dict[str, int] | None = None) -> list[str]:
    """Check a resolved config against its files and run directory (and its workers against
    `machine`, what the Ray raygpt will start here holds: raygpt.ray.capacity.this_machine);
    return lines describing the data plan and the resume. Raises ConfigError (one line) on the
    first problem."""
    if machine is not None:
        check_fits_this_machine(cfg, machine)
    check_model(cfg)  # first of the files: resolve() may have taken T from this file's header
    check_hellaswag(cfg)
    facts = check_data(cfg)
    facts += check_resume(cfg)
    check_trackers(cfg)
    check_run_dir(cfg)
    return facts


def check_fits_this_machine(cfg: TrainConfig, machine: dict[str, int]) -> None:
    """The Ray raygpt starts on this machine has its GPUs (or, for CPU workers, Ray's count of
    its CPUs), `machine` ({"GPU": n} or {"CPU": n}): a worker group larger than that is never
    placed. An elastic run (--min-workers) starts on what there is, so its minimum must fit."""
    kind = "GPU" if cfg.device == "gpu" else "CPU"
    have = machine.get(kind, 0)
    flag, need = (("--num-workers", cfg.num_workers) if cfg.min_workers is None
                  else ("--min-workers", cfg.min_workers))
    if need > have:
        raise ConfigError(f"{flag}: expected at most {have}, the {kind}s of this machine (each "
                          f"{cfg.device} worker takes one, and the Ray raygpt starts here has no "
                          f"more; RAY_ADDRESS runs on a cluster), found {need}")
    check_memory(cfg, machine)


def check_memory(cfg: TrainConfig, machine: dict[str, int]) -> None:
    """A worker's estimated peak (raygpt.model.memory) against what `machine` says it may take:
    "gpu_memory" (one GPU's bytes: each GPU worker has one) or "memory" (the host memory all of
    this machine's CPU workers share). A figure `machine` lacks, or a model whose shape
    cannot be read, is not checked."""
    est = memory.estimate_for(cfg)
    if est is None:
        return
    if cfg.device == "gpu":
        limit, workers, what = machine.get("gpu_memory"), 1, "the GPU's memory"
    else:
        limit, workers = machine.get("memory"), cfg.num_workers
        what = "the host memory Ray lets this machine's workers take"
    if limit is None or workers * est.total <= limit:
        return
    each = (f"{workers} {cfg.device} workers x {est.total / GiB:.1f} GiB = " if workers > 1
            else "")
    raise ConfigError(f"-b/--batch-size: expected a micro-batch whose estimated peak fits "
                      f"{what}, {limit / GiB:.1f} GiB, found {cfg.batch_size}: "
                      f"{each}{workers * est.total / GiB:.1f} GiB at B={cfg.batch_size} "
                      f"T={cfg.seq_len} (raygpt.model.memory: {est.line()}); lower -b")


def check_trackers(cfg: RunLogConfig) -> None:
    from raygpt.runlog.tracking import check_mlflow_uri
    problem = check_mlflow_uri(cfg.mlflow)
    if problem:
        raise ConfigError(problem)


# ---------------------------------------------------------------------- data

def _counts(pattern: str, flag: str) -> list[tuple[str, int]]:
    try:
        return shard_token_counts(pattern)
    except ShardError as e:
        raise ConfigError(f"{flag}: {e}") from None


def check_data(cfg: TrainConfig) -> list[str]:
    """Shard headers, and their sizes against B, T and the world size (elastic runs at the
    largest, which needs the most)."""
    B, T, world = cfg.batch_size, cfg.seq_len, cfg.num_workers
    need = tokens_needed(B, T, world)
    sources = mixture.flags_and_patterns(cfg.input_bin)  # one glob, or each source of a mix
    facts, epochs = [], []
    for flag, pattern in sources:
        train = _counts(pattern, flag)
        for path, ntok in train:
            if ntok < need:
                raise ConfigError(
                    f"{flag}: {path}: token count {ntok:,}: expected at least B*T*world+1 = "
                    f"{B}*{T}*{world}+1 = {need:,} (use a smaller -b/--batch-size or "
                    f"-t/--seq-len, fewer workers, or larger shards)")
        facts.append(f"train{flag[len(mixture.FLAG):]}: {sum(n for _, n in train):,} tokens in "
                     f"{len(train)} shard(s)")
        epochs.append(sum((n - 1) // T for _, n in train))
        # (a mix holds its sources' shards at once: each loader its own few)
        check_shard_cache(cfg, train, flag, held=SHARDS_HELD * len(sources))
    mix = mixture.parse(cfg.input_bin)
    if mix is not None and len(mix) > 1:
        facts.append("mixed by weight: " + ", ".join(f"{s.name} {s.weight:g}" for s in mix)
                     + " (weight 0: never drawn)" * any(s.weight == 0 for s in mix))
    if cfg.max_steps == -1:
        epoch_tokens = T * (epochs[0] if mix is None or len(mix) == 1 else
                            epoch_samples(epochs, [s.weight for s in mix]))
        if epoch_tokens < cfg.total_batch_size:
            raise ConfigError(f"-x/--max-steps -1: one epoch of {cfg.input_bin if mix is None else 'the mix'} is "
                              f"{epoch_tokens:,} tokens at T={T}; expected at least one step of "
                              f"-d/--total-batch-size {cfg.total_batch_size:,} tokens")
    if cfg.input_val_bin and cfg.val_every > 0:
        val = _counts(cfg.input_val_bin, "-j/--input-val-bin")
        check_shard_cache(cfg, val, "-j/--input-val-bin")
        tokens = [n for _, n in val]
        vb = cfg.val_batch_size
        ranks = ranks_with_data(tokens, vb, T, world)
        if ranks < 1:
            path, ntok = min(val, key=lambda pn: pn[1])
            raise ConfigError(
                f"-j/--input-val-bin: {path}: token count {ntok:,}: expected at least "
                f"val_batch_size*T+1 = {vb}*{T}+1 = {tokens_needed(vb, T, 1):,} for one rank "
                f"to validate (set a smaller --val-batch-size or -t/--seq-len, or -v 0 to turn "
                f"validation off)")
        # an elastic run that shrinks keeps at least its smallest world's share
        smallest = ranks_with_data(tokens, vb, T, cfg.min_workers or world)
        facts.append(f"validation: {cfg.val_batches} x {vb} x {T} tokens on {ranks} of "
                     f"{world} rank(s)" + (f" ({smallest} at {cfg.min_workers} workers)"
                                           if cfg.min_workers and smallest != ranks else "")
                     + f", from {sum(tokens):,} tokens in {len(val)} shard(s)")
    facts += check_eval_sets(cfg)
    return facts


def check_eval_sets(cfg: TrainConfig) -> list[str]:
    """Each --eval-set's shards as -j's: headers, the node's cache, and one rank's micro-batch
    (--val-batch-size) against its smallest shard (nothing to check while -v is 0)."""
    from raygpt.config import eval_sets
    if cfg.val_every <= 0:
        return []
    facts, T, vb = [], cfg.seq_len, cfg.val_batch_size
    for name, pattern in eval_sets.parse(cfg.eval_set):
        flag = f"--eval-set {name}"
        counts = _counts(pattern, flag)
        check_shard_cache(cfg, counts, flag)
        tokens = [n for _, n in counts]
        ranks = ranks_with_data(tokens, vb, T, cfg.num_workers)
        if ranks < 1:
            path, ntok = min(counts, key=lambda pn: pn[1])
            raise ConfigError(
                f"{flag}: {path}: token count {ntok:,}: expected at least val_batch_size*T+1 = "
                f"{vb}*{T}+1 = {tokens_needed(vb, T, 1):,} for one rank to evaluate it (set a "
                f"smaller --val-batch-size or -t/--seq-len)")
        facts.append(f"eval set {name}: {cfg.val_batches} x {vb} x {T} tokens on {ranks} of "
                     f"{cfg.num_workers} rank(s), from {sum(tokens):,} tokens in {len(counts)} "
                     f"shard(s)")
    return facts


def check_shard_cache(cfg: DataConfig, counts: list[tuple[str, int]], flag: str,
                      held: int = SHARDS_HELD) -> None:
    """The node's shard cache holds what a loader of shards in a bucket keeps in it at once
    (`held` of the largest: SHARDS_HELD, times the sources of a mix); local shards need none."""
    if not counts or not is_remote(counts[0][0]):
        return
    uri, ntok = max(counts, key=lambda un: un[1])
    need = held * (HEADER_BYTES + 2 * ntok)
    if cfg.shard_cache_gb * 2**30 < need:
        raise ConfigError(f"--shard-cache-gb: expected at least {need / 2**30:.3g} (the {flag} "
                          f"loader holds {held} shards in the node's cache, and {uri} is "
                          f"{(HEADER_BYTES + 2 * ntok) / 2**30:.3g} GB), found "
                          f"{cfg.shard_cache_gb:g}")
    # the directory as this node's workers will take it: a home or a project is refused here,
    # before Ray starts, not in every worker (eviction would delete its files)
    from raygpt.data.sources import ShardError, cache_root
    try:
        cache_root(cfg.shard_cache_dir or None)
    except ShardError as e:
        raise ConfigError(f"--shard-cache-dir: {e}") from None


# ---------------------------------------------------------------------- model file

def check_model(cfg: TrainConfig) -> None:
    """An -e model_*.bin file: llm.c's header (magic, version, shape), its size, and T against
    its max_seq_len; an -e Hugging Face folder: its config and every tensor's shape (hf.check_hf).
    dN names need nothing (validate() checked them)."""
    if cfg.depth is not None:
        return
    from raygpt.llmc.model_file import ModelFileError, read_model_header
    path = cfg.model
    try:
        if os.path.isdir(path):  # a Hugging Face GPT-2 folder: its config and weights checked
            from raygpt.interop.hf import HFError, check_hf
            try:
                gpt = check_hf(path)
            except HFError as e:
                raise ConfigError(f"-e/--model: {e}") from None
        else:
            gpt, _ = read_model_header(path)
    except (ModelFileError, OSError) as e:
        raise ConfigError(f"-e/--model: {e}") from None
    if cfg.seq_len > gpt.block_size:
        raise ConfigError(f"-t/--seq-len: expected at most {gpt.block_size} (max_seq_len of "
                          f"{path}), found {cfg.seq_len}")


def check_hellaswag(cfg: TrainConfig) -> None:
    """--hellaswag: every line an example (ctx, 4 endings, a label), and each example within the
    model's context window, before Ray starts."""
    if not cfg.hellaswag:
        return
    from raygpt.eval import hellaswag
    try:
        examples = hellaswag.read_examples(cfg.hellaswag, cfg.storage_endpoint)
        hellaswag.check_context(examples, _block_size(cfg), cfg.hellaswag)
    except hellaswag.HellaSwagError as e:
        raise ConfigError(f"--hellaswag: {e}") from None


def _block_size(cfg: ModelConfig) -> int:
    if cfg.depth is not None:
        return 1024  # GPTConfig.from_depth's
    if os.path.isdir(cfg.model):
        from raygpt.interop.hf import check_hf
        return check_hf(cfg.model).block_size
    from raygpt.llmc.model_file import read_model_header
    return read_model_header(cfg.model)[0].block_size


# ---------------------------------------------------------------------- resume

def check_resume(cfg: TrainConfig) -> list[str]:
    """With -y 1: the newest complete checkpoint (DONE, MANIFEST, listed sizes) must be one this
    config can resume. No checkpoint at all is fine: the run starts fresh and says so."""
    if cfg.resume != 1:
        return []
    from raygpt.checkpointing import protocol as ck
    from raygpt.checkpointing.fingerprints import compatibility, run_fingerprints
    run_dir = _open(cfg)
    try:
        if not run_dir.exists():
            return []
        from raygpt.checkpointing.store import CheckpointStore
        step = CheckpointStore(run_dir).latest_verified()
        if step is None:
            return []
        manifest = ck.read_manifest(run_dir, step)
    except ck.CheckpointError as e:
        raise ConfigError(f"-y 1: {_one_line(e, every_line=True)}") from None
    except Exception as e:  # noqa: BLE001 - the filesystem's own error, reduced to one line
        raise ConfigError(f"-o/--output-dir {cfg.output_dir}: cannot read the run directory to "
                          f"resume it: {_one_line(e)}") from None
    try:  # the workers' own check (their Checkpointer), without importing torch
        ck.check_compatible(manifest, config_identity=cfg.identity(), world_size=cfg.num_workers,
                            **compatibility(run_fingerprints(cfg)))
    except ck.WorldSizeMismatch:
        return [f"resume: step {step}, written by {manifest.get('world_size')} rank(s), "
                f"resharded onto {cfg.num_workers}"]
    except ck.CheckpointError as e:
        # the message starts with step_N/MANIFEST.json and lists one differing field a line
        raise ConfigError(f"-y 1: {run_dir.uri()}/{_one_line(e, every_line=True)} (give the "
                          f"checkpoint's values, or start afresh with --overwrite instead of "
                          f"-y 1)") from None
    return [f"resume: step {step}"]


# ---------------------------------------------------------------------- run directory

def _open(cfg: RunLogConfig):
    """The run directory, its store answering (bucket, credentials, endpoint: within
    storage.REACHABLE_DEADLINE_S, whatever the client's own retries), or one line why not."""
    from raygpt.storage import StorageError, check_reachable, open_run_dir, redact
    try:
        run_dir = open_run_dir(cfg.output_dir)
    except Exception as e:  # noqa: BLE001 - pyarrow's URI and filesystem errors vary by backend
        raise ConfigError(f"-o/--output-dir {redact(cfg.output_dir)}: expected a local path or a "
                          f"filesystem URI raygpt can open, found: {_one_line(e)}") from None
    try:
        check_reachable(run_dir)
    except StorageError as e:
        raise ConfigError(f"-o/--output-dir {redact(cfg.output_dir)}: {e.cause}") from None
    return run_dir


def check_run_dir(cfg: TrainConfig) -> None:
    """The run directory's filesystem is reachable and writable: create the directory (as the
    run would) and write and delete a probe file in it. A missing bucket, missing credentials,
    a read-only mount or a path under a regular file fail here, in one line."""
    run_dir = _open(cfg)
    probe = f".raygpt-preflight-{uuid.uuid4().hex}"
    try:
        run_dir.makedirs("")
        run_dir.write_bytes_atomic(probe, b"raygpt preflight: may be deleted\n")
        run_dir.delete_file(probe)
    except Exception as e:  # noqa: BLE001 - OSError locally, pyarrow's errors on object stores
        from raygpt.storage import redact, storage_cause
        raise ConfigError(f"-o/--output-dir {redact(cfg.output_dir)}: expected a run directory "
                          f"this process can create and write, found: {storage_cause(e)}") from None


def _one_line(e: BaseException, every_line: bool = False) -> str:
    """An exception as one line: its first (pyarrow's S3 errors add lines of details), or all
    of them joined with '; '."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    return lines[0] + (" " + "; ".join(lines[1:]) if every_line and len(lines) > 1 else "")
