"""llm.c token shards and the distributed data loader that reads them.

The shards' on-disk format (llm.c's) is raygpt.llmc.shards'.

`DistributedDataLoader` owns the data order, which is a pure function of (seed, global cursor):

  * a *sample* is T+1 tokens at offset sample_idx*T of a shard (llm.c's stride), so a shard of
    ntok tokens has (ntok-1)//T samples;
  * epoch e visits the shards in `shard_order(seed, e)` and, inside a shard visit, the samples in
    `sample_order(seed, e, shard)`; with shuffle both come from MT19937 generators seeded by
    [seed, e] and [seed, e, shard], so nothing needs to be replayed to restore them;
  * the *global stream* is the concatenation of those per-shard orders, epoch after epoch without
    end, with the samples of the persisted skip list left out;
  * each `next_batch()` takes the next world*B samples of the stream, and rank r gets the rows
    [r*B, (r+1)*B) of that global micro-batch; `prefetch()` builds that batch ahead of time
    (the loop calls it during the backward pass) without moving the cursor.

The loader state (`state_dict`) is that global cursor, so it does not depend on the number of
ranks: a run can resume on a different world size and see the same global sample sequence.

Where the shards are is raygpt.data.sources': local shards are memory-mapped where they lie;
shards of an s3:// or gs:// pattern are read from the node's cache (`ShardCache`), and since the
order is a pure function the loader asks for the next shard of the stream, fetched on a
background thread, as soon as it starts the current one.
"""

from __future__ import annotations

import collections
import dataclasses
import typing

import numpy as np

from raygpt.data.sources import ShardCache, ShardFetcher, list_shards
from raygpt.llmc.shards import ShardError, read_shard

if typing.TYPE_CHECKING:
    import torch

# What a loader of shards in a bucket holds in the node's cache at once (never evicted while
# held): the shard it reads and the one before (a global batch may straddle them), and the one
# it is entering with the next (fetched ahead). The cache must hold at least this many.
SHARDS_HELD = 4


def tokens_needed(B: int, T: int, world: int) -> int:
    """Tokens every shard must hold for a loader of `world` ranks at micro-batch B x T: one
    global micro-batch plus the target of its last token (llm.c's B*T*world+1)."""
    return B * T * world + 1


def ranks_with_data(shard_tokens: list[int], B: int, T: int, world: int) -> int:
    """How many of `world` ranks a loader at B x T can serve (each shard must hold
    tokens_needed(B, T, ranks)); 0 when not even one. Validation uses this: on a validation set
    smaller than world * B samples, the ranks beyond it sit validation out."""
    return max(0, min(world, (min(shard_tokens) - 1) // (B * T)))


# ---------------------------------------------------------------------------- data order (pure)

def shard_order(seed: int, epoch: int, num_shards: int, shuffle: bool) -> np.ndarray:
    """The order in which epoch `epoch` visits the shards (int64 shard ids)."""
    if not shuffle:
        return np.arange(num_shards, dtype=np.int64)
    return np.random.Generator(np.random.MT19937([seed, epoch])).permutation(num_shards)


def sample_order(seed: int, epoch: int, shard: int, num_samples: int,
                 shuffle: bool) -> tuple[np.ndarray, dict]:
    """The order of the samples of shard `shard` in epoch `epoch` (int64 sample indices), and the
    MT19937 state {"key": uint32[624], "pos": int} of the generator after drawing it (a fresh
    MT19937([seed]) without shuffle, the llm.c state file's shuffle_rng slot)."""
    if not shuffle:
        bitgen = np.random.MT19937([seed])
        order = np.arange(num_samples, dtype=np.int64)
    else:
        bitgen = np.random.MT19937([seed, epoch, shard])
        order = np.random.Generator(bitgen).permutation(num_samples)
    st = bitgen.state["state"]
    return order, {"key": np.array(st["key"], dtype=np.uint32), "pos": int(st["pos"])}


def merge_ranges(ranges) -> list[tuple[int, int, int]]:
    """Sort (shard, start, end) ranges (end exclusive) and merge overlapping or touching ones."""
    out: list[list[int]] = []
    for shard, start, end in sorted((int(s), int(a), int(b)) for s, a, b in ranges):
        if out and out[-1][0] == shard and start <= out[-1][2]:
            out[-1][2] = max(out[-1][2], end)
        else:
            out.append([shard, start, end])
    return [tuple(r) for r in out]


def samples_to_ranges(samples) -> list[tuple[int, int, int]]:
    """Merge an (N, 2) array of (shard, sample_idx) into sorted contiguous (shard, start, end)
    ranges, end exclusive -- the form the skip list takes."""
    s = np.asarray(samples, dtype=np.int64).reshape(-1, 2)
    return merge_ranges((shard, idx, idx + 1) for shard, idx in s.tolist())


def gather(mine: np.ndarray, T: int, device, tokens_of, vocab_size: int | None,
           bad_token) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of the (shard, sample_idx) rows `mine`, (rows, T) int64 each, on `device` (None:
    the CPU): `tokens_of(shard)` maps a shard, `bad_token(shard, samples, window)` raises for
    a token id at or past `vocab_size`. For a CUDA device the (rows, T+1) window is gathered
    straight into page-locked memory and sent in one asynchronous copy."""
    # torch is imported here, where batches are built, so that the driver's checks of shard
    # headers (raygpt.config.preflight, before Ray starts) do not pay for importing it
    import torch

    to_cuda = device is not None and torch.device(device).type == "cuda"
    # the caching host allocator does not hand this block out again before the copy is done
    data = torch.empty((len(mine), T + 1), dtype=torch.int64, pin_memory=to_cuda)
    buf = data.numpy()
    window = np.arange(T + 1, dtype=np.int64)
    for shard in np.unique(mine[:, 0]):
        rows = np.flatnonzero(mine[:, 0] == shard)
        tokens = tokens_of(int(shard))
        # (rows, T+1) token offsets: sample i covers tokens [i*T, i*T + T].
        buf[rows] = tokens[mine[rows, 1][:, None] * T + window[None, :]]
        if vocab_size is not None and buf[rows].max() >= vocab_size:
            bad_token(int(shard), mine[rows, 1], buf[rows])
    if device is not None:
        data = data.to(device, non_blocking=to_cuda)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


# ---------------------------------------------------------------------------- the loader

@dataclasses.dataclass(frozen=True)
class _Prefetched:
    """A batch prepared ahead by a loader's `prefetch` (this one's, or a mixture's), valid at cursor
    `key` only."""
    key: tuple
    device: object
    cursor_after: tuple
    samples: np.ndarray
    batch: tuple


_STATE_KEYS = ("epoch", "shard_pos", "sample_pos", "should_shuffle", "shard_indices",
               "shard_num_samples", "intra_shard_indices", "shuffle_rng", "skip_ranges", "seed",
               "num_shards")


class BatchStream:
    """What every loader of global micro-batches shares: the next batch, made ahead by
    `prefetch`, this rank's rows gathered from the shards. A loader provides its stream of
    global samples (`_take_global_samples`), its cursor (`_cursor_key`, `_save_cursor`,
    `_restore_cursor`), and its shards' tokens (`_shard_tokens`, `_bad_token`); it sets B, T,
    rank, world, vocab_size, `_prefetched` and `last_global_samples`."""

    def next_batch(self, device: torch.device | str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Consume the next global micro-batch (world*B samples); return this rank's (x, y),
        (B, T) int64 each, on `device` (default: the CPU). For a CUDA device the (B, T+1)
        window is gathered straight into page-locked memory and sent in one asynchronous copy,
        so the host never waits for the GPU here (the loop's step stays free of syncs). If
        `prefetch(device)` prepared exactly this batch, it is handed out without more work."""
        ready, self._prefetched = self._prefetched, None
        if ready is not None and ready.key == self._cursor_key() and ready.device == device:
            self._restore_cursor(ready.cursor_after)
            samples, batch = ready.samples, ready.batch
        else:
            samples = self._take_global_samples(self.world * self.B)
            batch = self._gather(samples, device)
        self.last_global_samples = samples
        return batch

    def prefetch(self, device: torch.device | str | None = None) -> None:
        """Prepare the batch the next `next_batch(device)` will return (the host's gather and the
        copy to `device` are started now) without consuming it: the cursor, `state_dict()` and
        `last_global_samples` are unchanged. The loop calls this while the GPU runs the
        backward pass, so the gather is off the step's critical path. A later change of
        position or skip list (a resume, a rewind) makes the prepared batch stale; it is then
        dropped and the batch built afresh."""
        key, before = self._cursor_key(), self._save_cursor()
        samples = self._take_global_samples(self.world * self.B)
        after = self._save_cursor()
        self._restore_cursor(before)
        self._prefetched = _Prefetched(key, device, after, samples, self._gather(samples, device))

    def _gather(self, samples: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
        return gather(samples[self.rank * self.B:(self.rank + 1) * self.B], self.T, device,
                      self._shard_tokens, self.vocab_size, self._bad_token)


class DistributedDataLoader(BatchStream):
    """llm.c's DataLoader over a glob of token shards, for rank `rank` of `world`.

    `next_batch()` returns (x, y), int64 tensors of shape (B, T) with y = x shifted by one token.
    """

    MAX_OPEN_SHARDS = 16  # memory maps (each holds a file descriptor) kept open at once
    # a mapped shard of a remote pattern is held in the node's cache (SHARDS_HELD): the stream
    # needs the shard it is in and the one before it (a global batch can straddle the two)
    MAX_OPEN_REMOTE_SHARDS = 2

    def __init__(self, pattern: str, B: int, T: int, rank: int, world: int, *,
                 shuffle: bool = False, seed: int = 1337, max_open_shards: int | None = None,
                 cache: ShardCache | None = None, vocab_size: int | None = None):
        if B < 1 or T < 1:
            raise ValueError(f"DistributedDataLoader: B and T: expected integers >= 1, found B={B}, T={T}")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"DistributedDataLoader: rank/world: expected 0 <= rank < world, "
                             f"found rank={rank}, world={world}")
        self.pattern = pattern
        self.B, self.T, self.rank, self.world = int(B), int(T), int(rank), int(world)
        self.should_shuffle = bool(shuffle)
        self.seed = int(seed)
        # token ids must index the model's embedding: a shard of another tokenizer is bad input
        self.vocab_size = None if vocab_size is None else int(vocab_size)

        # Validate every shard before any batch is served: a bad shard deep in the glob must not
        # surface hours into a run (headers only: one range read each on an object store).
        self.source = list_shards(pattern)
        self.paths = [shard.uri for shard in self.source.shards]
        min_tokens = tokens_needed(self.B, self.T, self.world)
        num_tokens = []
        for i, path in enumerate(self.paths):
            ntok = self.source.header_tokens(i)
            if ntok < min_tokens:
                raise ShardError(f"{path}: token count (header[2]): expected at least "
                                 f"B*T*world+1 = {self.B}*{self.T}*{self.world}+1 = {min_tokens}, "
                                 f"found {ntok}")
            num_tokens.append(ntok)
        self.num_tokens = np.array(num_tokens, dtype=np.int64)
        self.num_samples = (self.num_tokens - 1) // self.T  # per shard
        # shard id -> memmap, opened on demand, least recently used closed past the bound: a
        # glob of thousands of shards must not hold a descriptor per shard (the limit is often
        # 1,024). The stream visits one shard at a time, so a small bound costs no reopening.
        local = self.source.caps.local_paths
        self.max_open_shards = int(max_open_shards or (
            self.MAX_OPEN_SHARDS if local else self.MAX_OPEN_REMOTE_SHARDS))
        if self.max_open_shards < 1:
            raise ValueError(f"DistributedDataLoader: max_open_shards: expected an integer >= 1, "
                             f"found {max_open_shards}")
        self._tokens: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        # remote shards: fetched into the node's cache ahead of the stream, held while mapped
        self._fetcher = None if local else ShardFetcher(self.source, cache or ShardCache())
        self._held: dict[int, object] = {}  # shard id -> CachedShard, while mapped

        self._skip: list[tuple[int, int, int]] = []
        self._skip_version = 0
        self._prefetched: _Prefetched | None = None
        self._skip_mask: dict[int, np.ndarray] = {}  # shard id -> bool[num_samples], True = skip
        self.last_global_samples = np.zeros((0, 2), dtype=np.int64)
        self.reset()

    # ------------------------------------------------------------------ sizes
    @property
    def num_shards(self) -> int:
        return len(self.paths)

    @property
    def samples_per_epoch(self) -> int:
        """Samples in one epoch of the stream, after the skip list."""
        skipped = sum(end - start for _, start, end in self._skip)
        return int(self.num_samples.sum()) - skipped

    @property
    def tokens_per_epoch(self) -> int:
        """Target tokens in one epoch: T per sample (the +1 token of a sample is only context)."""
        return self.samples_per_epoch * self.T

    # ------------------------------------------------------------------ cursor
    def reset(self) -> None:
        """Rewind to the start of epoch 0; the skip list stays."""
        self._set_cursor(epoch=0, shard_pos=0, sample_pos=0)

    def _set_cursor(self, epoch: int, shard_pos: int, sample_pos: int) -> None:
        self.epoch, self.shard_pos, self.sample_pos = epoch, shard_pos, sample_pos
        self.shard_indices = shard_order(self.seed, epoch, self.num_shards, self.should_shuffle)
        self._load_shard_visit()

    def _load_shard_visit(self) -> None:
        shard = int(self.shard_indices[self.shard_pos])
        self.intra_shard_indices, self.shuffle_rng = sample_order(
            self.seed, self.epoch, shard, int(self.num_samples[shard]), self.should_shuffle)
        if self._fetcher is not None:  # this shard and the stream's next one, in that order
            self._fetcher.want([shard, self._next_shard()])

    def _next_shard(self) -> int:
        """The shard the stream visits after the current one (a pure function of the cursor)."""
        if self.shard_pos + 1 < self.num_shards:
            return int(self.shard_indices[self.shard_pos + 1])
        return int(shard_order(self.seed, self.epoch + 1, self.num_shards, self.should_shuffle)[0])

    def _advance_shard(self) -> None:
        # llm.c's dataloader_advance_: next shard of this epoch, or the first of the next epoch.
        self.shard_pos += 1
        self.sample_pos = 0
        if self.shard_pos >= self.num_shards:
            self.epoch += 1
            self.shard_pos = 0
            self.shard_indices = shard_order(self.seed, self.epoch, self.num_shards, self.should_shuffle)
        self._load_shard_visit()

    def _take_global_samples(self, n: int) -> np.ndarray:
        """Consume the next n samples of the skip-filtered stream: (n, 2) of (shard, sample_idx)."""
        out = np.empty((n, 2), dtype=np.int64)
        filled = 0
        while filled < n:
            if self.sample_pos >= len(self.intra_shard_indices):
                self._advance_shard()
                continue
            shard = int(self.shard_indices[self.shard_pos])
            need = n - filled
            rest = self.intra_shard_indices[self.sample_pos:]
            mask = self._skip_mask.get(shard)
            if mask is None:
                taken = rest[:need]
                consumed = len(taken)
            else:
                # positions (within `rest`) of the first `need` samples not on the skip list; the
                # cursor moves just past the last one taken.
                keep = np.flatnonzero(~mask[rest])[:need]
                taken = rest[keep]
                consumed = int(keep[-1]) + 1 if len(keep) == need else len(rest)
            out[filled:filled + len(taken), 0] = shard
            out[filled:filled + len(taken), 1] = taken
            filled += len(taken)
            self.sample_pos += consumed
        return out

    def _bad_token(self, shard: int, samples: np.ndarray, window: np.ndarray) -> None:
        """ShardError (bad input, never retried) naming the shard, the sample, the token id."""
        row, col = np.unravel_index(int(np.argmax(window)), window.shape)
        raise ShardError(f"{self.paths[shard]}: token {int(samples[row]) * self.T + int(col):,}: "
                         f"expected a token id below the model's vocabulary of "
                         f"{self.vocab_size:,}, found {int(window[row, col]):,} (shards of "
                         f"another tokenizer?)")

    # What fixes the next samples: the position in the stream and the skip list (the orders are
    # functions of seed, epoch and shard). The skip list is versioned, as it is replaced whole.
    def _cursor_key(self) -> tuple:
        return (self.epoch, self.shard_pos, self.sample_pos, self._skip_version)

    def _save_cursor(self) -> tuple:
        return (self.epoch, self.shard_pos, self.sample_pos, self.shard_indices,
                self.intra_shard_indices, self.shuffle_rng)

    def _restore_cursor(self, saved: tuple) -> None:
        (self.epoch, self.shard_pos, self.sample_pos, self.shard_indices,
         self.intra_shard_indices, self.shuffle_rng) = saved

    def _shard_tokens(self, shard: int) -> np.ndarray:
        tokens = self._tokens.get(shard)
        if tokens is not None:
            self._tokens.move_to_end(shard)
            return tokens
        if self._fetcher is None:
            tokens = read_shard(self.paths[shard])
        else:  # from the node's cache, held there while mapped
            self._held[shard] = self._fetcher.take(shard)
            tokens = read_shard(self._held[shard].path)
        if len(tokens) != self.num_tokens[shard]:
            raise ShardError(f"{self.paths[shard]}: token count (header[2]): expected "
                             f"{int(self.num_tokens[shard])} (as validated at start), found "
                             f"{len(tokens)} -- the file changed under the loader")
        self._tokens[shard] = tokens
        while len(self._tokens) > self.max_open_shards:
            # dropping the last reference unmaps it and closes its descriptor (batches are
            # gathered into copies, so no view of it outlives this)
            dropped, _ = self._tokens.popitem(last=False)
            if dropped in self._held:
                self._held.pop(dropped).close()  # the cache may evict it now
        return tokens

    def close(self) -> None:
        """Unmap every shard and, for a remote pattern, stop the background fetches and let the
        node's cache evict what this loader held."""
        self._tokens.clear()
        for held in self._held.values():
            held.close()
        self._held.clear()
        if self._fetcher is not None:
            self._fetcher.close()

    @property
    def open_shards(self) -> int:
        """Shards mapped right now (at most `max_open_shards`)."""
        return len(self._tokens)

    def seek(self, epoch: int, shard_pos: int, sample_pos: int) -> None:
        """Move the cursor to sample_pos of the shard_pos-th shard of epoch `epoch` (how a
        mixture restores each source's cursor: raygpt.data.mixture); ValueError naming the
        field out of this loader's range, with nothing changed."""
        where = f"loader state for {self.pattern!r}"
        if not (isinstance(epoch, int) and epoch >= 0):
            raise ValueError(f"{where}: epoch: expected an integer >= 0, found {epoch!r}")
        if not (isinstance(shard_pos, int) and 0 <= shard_pos < self.num_shards):
            raise ValueError(f"{where}: shard_pos: expected an integer in [0, {self.num_shards}), "
                             f"found {shard_pos!r}")
        shard = int(shard_order(self.seed, epoch, self.num_shards, self.should_shuffle)[shard_pos])
        n = int(self.num_samples[shard])
        if not (isinstance(sample_pos, int) and 0 <= sample_pos <= n):
            raise ValueError(f"{where}: sample_pos: expected an integer in [0, {n}] (samples of "
                             f"{self.paths[shard]} at T={self.T}), found {sample_pos!r}")
        self._set_cursor(epoch, shard_pos, sample_pos)
        self.last_global_samples = np.zeros((0, 2), dtype=np.int64)

    def report(self) -> dict | None:
        """What the loss history records of the data at a step beyond the tokens: nothing for
        one glob (a mixture's tokens per source and its sources' new epochs: data.mixture)."""
        return None

    # ------------------------------------------------------------------ skip list
    @property
    def skip_ranges(self) -> list[tuple[int, int, int]]:
        return list(self._skip)

    def add_skip_ranges(self, ranges) -> None:
        """Remove the samples of (shard, start, end) ranges (end exclusive) from the stream, in
        every epoch. The cursor is unaffected: it indexes the unfiltered sample order."""
        self._set_skip(merge_ranges(list(self._skip) + list(ranges)))

    def _set_skip(self, merged: list[tuple[int, int, int]]) -> None:
        for shard, start, end in merged:
            if not 0 <= shard < self.num_shards:
                raise ValueError(f"skip range {(shard, start, end)}: shard: expected an id in "
                                 f"[0, {self.num_shards}) for pattern {self.pattern!r}, found {shard}")
            n = int(self.num_samples[shard])
            if not 0 <= start < end <= n:
                raise ValueError(f"skip range {(shard, start, end)} of {self.paths[shard]}: "
                                 f"expected 0 <= start < end <= {n} (samples in the shard at "
                                 f"T={self.T}), found start={start}, end={end}")
        masks: dict[int, np.ndarray] = {}
        for shard, start, end in merged:
            if shard not in masks:
                masks[shard] = np.zeros(int(self.num_samples[shard]), dtype=bool)
            masks[shard][start:end] = True
        remaining = int(self.num_samples.sum()) - sum(e - s for _, s, e in merged)
        need = self.world * self.B
        if remaining < need:
            raise ValueError(f"skip list: would leave {remaining} samples per epoch of "
                             f"{self.pattern!r}, expected at least world*B = {self.world}*{self.B} "
                             f"= {need}")
        self._skip, self._skip_mask = merged, masks
        self._skip_version += 1

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The global cursor (independent of rank and world size) and the shuffle state, in the
        llm.c state file's terms (current_shard_idx = shard_pos, current_sample_idx = sample_pos)."""
        return {
            "epoch": int(self.epoch),
            "shard_pos": int(self.shard_pos),
            "sample_pos": int(self.sample_pos),
            "should_shuffle": bool(self.should_shuffle),
            "shard_indices": np.asarray(self.shard_indices, dtype=np.int32).copy(),
            "shard_num_samples": int(len(self.intra_shard_indices)),
            "intra_shard_indices": np.asarray(self.intra_shard_indices, dtype=np.int32).copy(),
            "shuffle_rng": {"key": self.shuffle_rng["key"].copy(), "pos": int(self.shuffle_rng["pos"])},
            "skip_ranges": [list(r) for r in self._skip],
            "seed": int(self.seed),
            "num_shards": int(self.num_shards),
        }

    def load_state_dict(self, d: dict) -> None:
        """Restore a cursor from `state_dict()` (any rank, any world size). The skip list is
        replaced by the stored one. Nothing changes unless the whole state checks out."""
        missing = [k for k in _STATE_KEYS if k not in d]
        if missing:
            raise ValueError(f"loader state: missing field(s) {missing}; expected {list(_STATE_KEYS)}")
        where = f"loader state for {self.pattern!r}"

        def need(ok: bool, field: str, expected, found) -> None:
            if not ok:
                raise ValueError(f"{where}: {field}: expected {expected}, found {found}")

        need(int(d["seed"]) == self.seed, "seed", f"{self.seed} (this run)", d["seed"])
        need(int(d["num_shards"]) == self.num_shards, "num_shards",
             f"{self.num_shards} (files matching the pattern)", d["num_shards"])
        need(bool(d["should_shuffle"]) == self.should_shuffle, "should_shuffle",
             f"{self.should_shuffle} (this run)", d["should_shuffle"])
        epoch, shard_pos, sample_pos = int(d["epoch"]), int(d["shard_pos"]), int(d["sample_pos"])
        need(epoch >= 0, "epoch", "an integer >= 0", epoch)
        need(0 <= shard_pos < self.num_shards, "shard_pos", f"an integer in [0, {self.num_shards})",
             shard_pos)

        order = shard_order(self.seed, epoch, self.num_shards, self.should_shuffle)
        need(np.array_equal(np.asarray(d["shard_indices"]), order), "shard_indices",
             f"the shard order recomputed for seed {self.seed}, epoch {epoch}", d["shard_indices"])
        shard = int(order[shard_pos])
        n = int(self.num_samples[shard])
        need(int(d["shard_num_samples"]) == n, "shard_num_samples",
             f"{n} (samples of {self.paths[shard]} at T={self.T}; was the state saved with "
             f"another seq_len or other shards?)", d["shard_num_samples"])
        need(0 <= sample_pos <= n, "sample_pos", f"an integer in [0, {n}]", sample_pos)
        intra, rng = sample_order(self.seed, epoch, shard, n, self.should_shuffle)
        need(np.array_equal(np.asarray(d["intra_shard_indices"]), intra), "intra_shard_indices",
             f"the sample order recomputed for seed {self.seed}, epoch {epoch}, shard {shard}",
             "a different permutation")
        stored_rng = d["shuffle_rng"]
        need(np.array_equal(np.asarray(stored_rng["key"], dtype=np.uint32), rng["key"])
             and int(stored_rng["pos"]) == rng["pos"], "shuffle_rng",
             f"the MT19937 state recomputed for seed {self.seed}, epoch {epoch}, shard {shard}",
             "a different state")

        self._set_skip(merge_ranges(tuple(r) for r in d["skip_ranges"]))
        self.epoch, self.shard_pos, self.sample_pos = epoch, shard_pos, sample_pos
        self.shard_indices, self.intra_shard_indices, self.shuffle_rng = order, intra, rng
        self.last_global_samples = np.zeros((0, 2), dtype=np.int64)
        if self._fetcher is not None:  # the resumed shard and the next one, fetched from now
            self._fetcher.want([shard, self._next_shard()])
