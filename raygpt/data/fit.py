"""Defaults that depend on the data: a micro-batch the train shards can feed on this many workers,
validation batches that fit the validation set. The data and evaluation knobs' resolve calls them;
they read shard headers (only the headers)."""

from __future__ import annotations

import glob

from raygpt.config import mixture
from raygpt.config.errors import ConfigError
from raygpt.config.paths import _remote

DEFAULT_VAL_BATCHES = 20  # llm.c's val_max_steps



def _shard_tokens(pattern: str, flag: str) -> list[int] | None:
    """Token counts of the shards matching `pattern` (headers only), None when nothing matches
    (validate() says so); a bad header is a ConfigError naming the flag and the file."""
    from raygpt.data.sources import shard_token_counts  # numpy: only when resolving
    from raygpt.llmc.shards import ShardError
    found = [(f, p) for f, p in (mixture.flags_and_patterns(pattern) if flag == mixture.FLAG
                                 else [(flag, pattern)]) if p and (_remote(p) or glob.glob(p))]
    try:
        return [n for f, p in found for _, n in shard_token_counts(p)] or None
    except ShardError as e:
        raise ConfigError(f"{flag}: {e}") from None



def fit_batch_size(input_bin: str, seq_len: int, workers: int, default: int,
                   notes: list[str]) -> int:
    """The default micro-batch, made smaller when the smallest train shard cannot hold one
    global micro-batch on `workers` workers (B*T*workers+1 tokens). A shard too small even
    for B=1 is left to `raygpt.config.preflight`, which names it."""
    tokens = _shard_tokens(input_bin, "-i/--input-bin")
    if tokens is None or seq_len < 1 or workers < 1:
        return default
    fits = (min(tokens) - 1) // (seq_len * workers)
    if 1 <= fits < default:
        notes.append(f"B={fits} (not {default}): the smallest train shard holds {min(tokens):,} "
                     f"tokens and one micro-batch on {workers} workers needs "
                     f"B*T*{workers}+1 (T={seq_len})")
        return fits
    return default



def fit_validation(c, notes: list[str]) -> None:
    """Fill val_batch_size and val_batches (when unset) to the validation shards: every rank
    that validates reads val_batches micro-batches of val_batch_size samples of T+1 tokens;
    ranks beyond the data sit validation out (`data.ranks_with_data`). The defaults cover as much
    of the validation set as DEFAULT_VAL_BATCHES batches can without reading a sample twice,
    with the largest micro-batch (at most B) that does so."""
    from raygpt.data.loader import ranks_with_data
    if not c.input_val_bin or c.val_every <= 0:  # validation off: nothing to fit
        c.val_batch_size = c.batch_size if c.val_batch_size is None else c.val_batch_size
        c.val_batches = DEFAULT_VAL_BATCHES if c.val_batches is None else c.val_batches
        return
    tokens = _shard_tokens(c.input_val_bin, "-j/--input-val-bin")
    if (tokens is None or c.seq_len < 1 or c.batch_size < 1 or c.num_workers < 1
            or (c.val_batch_size is not None and c.val_batch_size < 1)):
        c.val_batch_size = c.batch_size if c.val_batch_size is None else c.val_batch_size  # validate()/preflight explain
        c.val_batches = DEFAULT_VAL_BATCHES if c.val_batches is None else c.val_batches
        return
    samples = sum((n - 1) // c.seq_len for n in tokens)  # the whole validation stream
    cap = min(c.batch_size, (min(tokens) - 1) // c.seq_len)  # one rank must fit in each shard

    def batches(b: int) -> int:
        if c.val_batches is not None:
            return c.val_batches
        ranks = ranks_with_data(tokens, b, c.seq_len, c.num_workers)
        if ranks < 1:  # an explicit micro-batch no shard can hold: preflight names it
            return DEFAULT_VAL_BATCHES
        return max(1, min(DEFAULT_VAL_BATCHES, samples // (b * ranks)))

    def covered(b: int) -> int:  # distinct samples one evaluation reads
        ranks = ranks_with_data(tokens, b, c.seq_len, c.num_workers)
        return min(samples, b * ranks * batches(b))

    if c.val_batch_size is None:
        if cap < 1:  # shards shorter than T+1 tokens: preflight names them
            c.val_batch_size = c.batch_size
        else:  # most samples covered; among equals, the largest micro-batch (fewest batches)
            c.val_batch_size = max(range(1, cap + 1), key=lambda b: (covered(b), b))
    if c.val_batches is None:
        c.val_batches = batches(c.val_batch_size) if cap >= 1 else DEFAULT_VAL_BATCHES
    ranks = ranks_with_data(tokens, c.val_batch_size, c.seq_len, c.num_workers)
    if ranks >= 1:
        if (c.val_batch_size, c.val_batches, ranks) != (c.batch_size, DEFAULT_VAL_BATCHES,
                                                         c.num_workers):
            notes.append(f"validation: {c.val_batches} batch(es) of {c.val_batch_size} x "
                         f"{c.seq_len} tokens on {ranks} of {c.num_workers} rank(s), "
                         f"{covered(c.val_batch_size):,} of the {samples:,} validation samples "
                         f"(the validation shards hold {sum(tokens):,} tokens)")
