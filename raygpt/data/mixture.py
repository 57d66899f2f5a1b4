"""Corpora mixed by weight: several sources of llm.c shards (-i NAME=WEIGHT:GLOB, the syntax is
raygpt.config.mixture's), each read by its own llm.c loader (its shard order, its shuffling, its
epochs: raygpt.data.loader), drawn into one global sample stream.

The schedule is a pure function of the global sample index g: source s draws g when
u_g = (offset + g * A) mod 2**64 falls in s's slice of [0, 2**64), the slices in proportion to
the weights in -i's order (A = 2**64 / golden ratio, odd; offset drawn from the seed). This is
the golden ratio's Kronecker sequence: the points of any run of N consecutive indices fall into
an interval within about log N of their expected count (its discrepancy, bounded by the
three-gap theorem), so every window of 1,000 samples holds each source within a few samples of
its weight; a weight of 0 is an empty slice and is never drawn. Nothing but g decides, so a
resume, on any number of ranks, needs only how many samples were drawn.

Shard ids are global: source s's shard i is offset_s + i (sources in -i's order), so the skip
list, the samples a step trained on and a rewind's window each name one shard.

State: the first source's cursor fills llm.c's fields of the state file, as a run of that glob
alone would, and "mixture" in raygpt's trailer (MIXTURE_VERSION; `mixture_state` writes it,
`read_mixture_state` reads it) holds every source's: samples drawn, epoch, shard and sample
position.
"""

from __future__ import annotations

import dataclasses
import typing
from fractions import Fraction

import numpy as np

from raygpt.config.mixture import Source, parse
from raygpt.data.loader import BatchStream, DistributedDataLoader, _Prefetched, merge_ranges

if typing.TYPE_CHECKING:
    import torch

GOLDEN = 0x9E3779B97F4A7C15  # round(2**64 / golden ratio), odd: every u_g differs in 2**64 steps
_OFFSET_STREAM = 0x6D6978  # "mix": the seed's generator for the schedule's offset
MIXTURE_VERSION = 1


# ---------------------------------------------------------------------------- the schedule (pure)

@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which source draws each global sample: `sources[k]` owns [edges[k-1], edges[k]) of
    [0, 2**64) (edges exact, from the weights as fractions); only sources of weight > 0."""

    sources: np.ndarray  # int64 source indices (weight > 0), in -i's order
    edges: np.ndarray  # uint64 inner edges, len(sources) - 1
    offset: int

    @classmethod
    def of(cls, weights: list[float], seed: int) -> "Schedule":
        drawn = [i for i, w in enumerate(weights) if w > 0]
        total = sum(exact(weights[i]) for i in drawn)
        cum, edges = Fraction(0), []
        for i in drawn[:-1]:  # each inner edge < 2**64: a positive weight follows it
            cum += exact(weights[i])
            edges.append(int(cum * 2**64 / total))
        offset = int(np.random.Generator(np.random.MT19937([seed, _OFFSET_STREAM])).integers(
            0, 2**64, dtype=np.uint64))
        return cls(np.array(drawn, dtype=np.int64), np.array(edges, dtype=np.uint64), offset)

    def draws(self, start: int, n: int) -> np.ndarray:
        """The source of each global sample in [start, start + n): (n,) int64."""
        g = np.arange(start, start + n, dtype=np.uint64)
        with np.errstate(over="ignore"):  # arithmetic mod 2**64 is the point
            u = g * np.uint64(GOLDEN) + np.uint64(self.offset)
        return self.sources[np.searchsorted(self.edges, u, side="right")]


def exact(weight: float) -> Fraction:
    """A weight as the decimal it reads as (0.1 is 1/10, not the float nearest it)."""
    return Fraction(repr(float(weight)))


def epoch_samples(samples_per_epoch: list[int], weights: list[float]) -> int:
    """Global samples drawn before the first source of weight > 0 has drawn one epoch (what
    -x -1 trains on for a mixture): min over them of samples_s * sum(weights) / weight_s."""
    total = sum(exact(w) for w in weights)
    return min(int(n * total / exact(w))
               for n, w in zip(samples_per_epoch, weights) if w > 0)


# ---------------------------------------------------------------------------- the loader

def train_loader(spec: str, B: int, T: int, rank: int, world: int, **kw):
    """The training loader of an -i value: llm.c's loader over one glob (also for one weighted
    source alone: the same batches and state files), or a mixture of several."""
    sources = parse(spec)
    if sources is None or len(sources) == 1:
        return DistributedDataLoader(spec if sources is None else sources[0].pattern, B, T,
                                     rank, world, **kw)
    return MixedDataLoader(sources, B, T, rank, world, **kw)


class MixedDataLoader(BatchStream):
    """Several llm.c loaders drawn by weight, for rank `rank` of `world`: `next_batch()` takes
    the next world*B samples of the global stream and returns this rank's rows [rank*B,
    (rank+1)*B) as (x, y), like DistributedDataLoader, whose surface it has."""

    def __init__(self, sources: list[Source], B: int, T: int, rank: int, world: int, *,
                 shuffle: bool = False, seed: int = 1337, cache=None,
                 vocab_size: int | None = None, max_open_shards: int | None = None):
        if world < 1 or not 0 <= rank < world or B < 1:
            raise ValueError(f"MixedDataLoader: expected B >= 1 and 0 <= rank < world, found "
                             f"B={B}, rank={rank}, world={world}")
        self.names = [s.name for s in sources]
        self.weights = [s.weight for s in sources]
        self.pattern = "\n".join(f"{s.name}={s.weight_text}:{s.pattern}" for s in sources)
        self.B, self.T, self.rank, self.world = int(B), int(T), int(rank), int(world)
        self.seed, self.vocab_size = int(seed), vocab_size
        # each source is one rank's stream of single samples: the mixture strides the ranks
        self.loaders = [DistributedDataLoader(s.pattern, 1, T, 0, 1, shuffle=shuffle, seed=seed,
                                              cache=cache, vocab_size=vocab_size,
                                              max_open_shards=max_open_shards) for s in sources]
        self.schedule = Schedule.of(self.weights, self.seed)
        counts = [loader.num_shards for loader in self.loaders]
        self.shard_offset = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.owner = np.repeat(np.arange(len(counts)), counts)  # global shard id -> source
        self.paths = [p for loader in self.loaders for p in loader.paths]
        self.drawn = 0  # global samples drawn: the schedule's cursor
        self.drawn_per_source = np.zeros(len(sources), dtype=np.int64)
        self._skip: list[tuple[int, int, int]] = []
        self._skip_version = 0
        self._prefetched: _Prefetched | None = None
        self._new_epochs: list[tuple[str, int]] = []  # (source, epoch) begun since the last report
        self.last_global_samples = np.zeros((0, 2), dtype=np.int64)

    @property
    def num_shards(self) -> int:
        return len(self.paths)

    @property
    def samples_per_epoch(self) -> int:
        """Global samples until the first source (weight > 0) has drawn one epoch of its own."""
        return epoch_samples([loader.samples_per_epoch for loader in self.loaders], self.weights)

    @property
    def tokens_per_epoch(self) -> int:
        return self.samples_per_epoch * self.T

    @property
    def open_shards(self) -> int:
        return sum(loader.open_shards for loader in self.loaders)

    # ------------------------------------------------------------------ batches
    def _take_global_samples(self, n: int) -> np.ndarray:
        """Consume the next n samples of the global stream: (n, 2) of (global shard, sample)."""
        picks = self.schedule.draws(self.drawn, n)
        out = np.empty((n, 2), dtype=np.int64)
        for s in np.unique(picks):
            rows = np.flatnonzero(picks == s)
            local = self.loaders[s]._take_global_samples(len(rows))  # in its own llm.c order
            out[rows, 0] = local[:, 0] + self.shard_offset[s]
            out[rows, 1] = local[:, 1]
        self.drawn += n
        self.drawn_per_source += np.bincount(picks, minlength=len(self.loaders))
        return out

    def next_batch(self, device: torch.device | str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """BatchStream's, noting each source that began a new epoch (for the log's line)."""
        epochs = [loader.epoch for loader in self.loaders]
        batch = super().next_batch(device)
        self._new_epochs += [(self.names[s], loader.epoch) for s, loader in enumerate(self.loaders)
                             if loader.epoch > epochs[s]]
        return batch

    def _shard_tokens(self, shard: int) -> np.ndarray:
        s = int(self.owner[shard])
        return self.loaders[s]._shard_tokens(shard - int(self.shard_offset[s]))

    def _bad_token(self, shard: int, samples: np.ndarray, window: np.ndarray) -> None:
        s = int(self.owner[shard])
        self.loaders[s]._bad_token(shard - int(self.shard_offset[s]), samples, window)

    # the schedule's cursor and the skip list fix the next samples (each source's cursor follows
    # from them, restored or advanced together)
    def _cursor_key(self) -> tuple:
        return (self.drawn, self._skip_version)

    def _save_cursor(self) -> tuple:
        return (self.drawn, self.drawn_per_source.copy(),
                [loader._save_cursor() for loader in self.loaders])

    def _restore_cursor(self, saved: tuple) -> None:
        self.drawn, per_source, cursors = saved
        self.drawn_per_source = per_source.copy()
        for loader, cursor in zip(self.loaders, cursors):
            loader._restore_cursor(cursor)

    def report(self) -> dict:
        """The tokens each source has given (T per sample drawn) and the epochs sources began
        since the last report (a source that ran out starts its next: the log says so)."""
        news, self._new_epochs = self._new_epochs, []
        return {"source_tokens": {name: int(n) * self.T
                                  for name, n in zip(self.names, self.drawn_per_source)},
                "new_epochs": news}

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()

    # ------------------------------------------------------------------ skip list
    @property
    def skip_ranges(self) -> list[tuple[int, int, int]]:
        return list(self._skip)

    def add_skip_ranges(self, ranges) -> None:
        """Remove (global shard, start, end) ranges from the stream, each from its source's."""
        self._set_skip(merge_ranges(list(self._skip) + list(ranges)))

    def _set_skip(self, merged: list[tuple[int, int, int]]) -> None:
        per_source: list[list] = [[] for _ in self.loaders]
        for shard, start, end in merged:
            if not 0 <= shard < self.num_shards:
                raise ValueError(f"skip range {(shard, start, end)}: shard: expected an id in "
                                 f"[0, {self.num_shards}) (the shards of every source of -i), "
                                 f"found {shard}")
            s = int(self.owner[shard])
            per_source[s].append((shard - int(self.shard_offset[s]), start, end))
        for loader, ranges in zip(self.loaders, per_source):
            loader._set_skip(merge_ranges(ranges))
        self._skip = merged
        self._skip_version += 1

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The first source's cursor in llm.c's fields, the global skip list, and every
        source's cursor under "mixture" (independent of rank and world size)."""
        d = self.loaders[0].state_dict()
        d.update(skip_ranges=[list(r) for r in self._skip], num_shards=self.num_shards,
                 mixture=mixture_state(self))
        return d

    def load_state_dict(self, d: dict) -> None:
        """Restore every source's cursor, the schedule's and the skip list from `state_dict()`
        (any rank, any world size); ValueError naming the field that does not fit this run."""
        if not isinstance(d.get("mixture"), dict):
            raise ValueError(f"loader state: mixture: expected the sources {self.names} of -i "
                             f"(a checkpoint of this mixture), found the state of one plain glob")
        drawn, cursors = read_mixture_state(d["mixture"], self.names, self.weights,
                                            [loader.num_shards for loader in self.loaders])
        self._set_skip(merge_ranges(tuple(r) for r in d["skip_ranges"]))
        for loader, (_, epoch, shard_pos, sample_pos) in zip(self.loaders, cursors):
            loader.seek(epoch, shard_pos, sample_pos)
        self.drawn = drawn
        self.drawn_per_source = np.array([c[0] for c in cursors], dtype=np.int64)
        self.last_global_samples = np.zeros((0, 2), dtype=np.int64)
        self._new_epochs = []


def mixture_state(m: MixedDataLoader) -> dict:
    """The mixture's part of the loader state (the state file's trailer JSON), version
    MIXTURE_VERSION; `read_mixture_state` is its reader."""
    return {"version": MIXTURE_VERSION, "drawn": int(m.drawn), "sources": [
        {"name": name, "weight": weight, "num_shards": loader.num_shards, "drawn": int(n),
         "epoch": int(loader.epoch), "shard_pos": int(loader.shard_pos),
         "sample_pos": int(loader.sample_pos)}
        for name, weight, loader, n in zip(m.names, m.weights, m.loaders, m.drawn_per_source)]}


def read_mixture_state(d: dict, names: list[str], weights: list[float],
                       num_shards: list[int]) -> tuple[int, list[tuple[int, int, int, int]]]:
    """(samples drawn, [(drawn, epoch, shard_pos, sample_pos)] per source) of a stored
    mixture, checked against this run's sources; ValueError naming the field otherwise."""
    def need(ok: bool, field: str, expected, found) -> None:
        if not ok:
            raise ValueError(f"loader state: mixture.{field}: expected {expected}, found {found!r}")

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    need(d.get("version") == MIXTURE_VERSION, "version", MIXTURE_VERSION, d.get("version"))
    stored = d.get("sources")
    need(isinstance(stored, list) and all(isinstance(s, dict) for s in stored)
         and [s.get("name") for s in stored] == names, "sources",
         f"the sources {names} of -i, in that order", stored if not isinstance(stored, list)
         else [s.get("name") if isinstance(s, dict) else s for s in stored])
    out = []
    for s, weight, shards in zip(stored, weights, num_shards):
        name = s["name"]
        need(s.get("weight") == weight, f"{name}.weight", f"{weight} (this run's -i; a new mix "
             f"is a new run)", s.get("weight"))
        need(s.get("num_shards") == shards, f"{name}.num_shards",
             f"{shards} (files matching its glob)", s.get("num_shards"))
        for field in ("drawn", "epoch", "shard_pos", "sample_pos"):
            need(count(s.get(field)), f"{name}.{field}", "an integer >= 0", s.get(field))
        out.append((s["drawn"], s["epoch"], s["shard_pos"], s["sample_pos"]))
    need(count(d.get("drawn")) and d["drawn"] == sum(c[0] for c in out), "drawn",
         "an integer, the sum of the sources' drawn", d.get("drawn"))
    return d["drawn"], out
