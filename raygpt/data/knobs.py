"""The data component's knobs: the token shards, the batch and the seed (-i -j -b -t -d), with
their defaults from the hardware and the shards (raygpt.data.fit) and their checks."""

from __future__ import annotations

import glob
import math
from dataclasses import dataclass
from pathlib import Path

from raygpt.config import mixture  # -i's syntax: one glob, or sources mixed by weight
from raygpt.config.knobs import knob, need
from raygpt.config.paths import _remote, shards_with_endpoint
from raygpt.data import fit

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # raygpt/
DATA_DIR = PACKAGE_DIR / "data_files"
DEFAULT_TRAIN = str(DATA_DIR / "tiny_shakespeare_train.bin")
DEFAULT_VAL = str(DATA_DIR / "tiny_shakespeare_val.bin")


@dataclass
class DataConfig:
    """What the loader reads and how much of it a step takes."""

    input_bin: str = knob(DEFAULT_TRAIN, section="data", short="-i", metavar="GLOB",
                          from_file=True,  # read as data; a URI from a file carries no options
                          action=mixture.AddSource,
                          hints=("--train-data", "--train-bin", "--data"))
    """Glob of llm.c train token shards (-i): local files, or an s3:// or gs:// URI glob whose
    shards each node fetches into its cache (--shard-cache-dir). Or corpora mixed by weight,
    NAME=WEIGHT:GLOB once per -i (each global batch draws from them in proportion)."""
    input_val_bin: str = knob(DEFAULT_VAL, section="data", short="-j", metavar="GLOB",
                              from_file=True, hints=("--val-data", "--val-bin"))
    """Glob of llm.c validation token shards (-j), local or s3:// / gs://; empty turns
    validation off."""
    shard_cache_gb: float = knob(50.0, section="data", metavar="GB", may_change_on_resume=True)
    """Disk each node may fill with the shards of an s3:// or gs:// -i/-j, least recently used
    evicted first (the shards workers are reading stay); must hold a few of the largest."""
    shard_cache_dir: str = knob("", section="data", metavar="DIR", may_change_on_resume=True)
    """Where each node caches the shards of an s3:// or gs:// -i/-j: a directory private to the
    user (made 0700; refused if another user owns it or it is a symlink). Default:
    raygpt_shards_<uid> in the temp directory. Local shards are read in place."""
    shuffle: bool = knob(True, section="data", long="--no-shuffle")
    """Deterministic shuffling of shard order and of samples within a shard (train only)."""
    batch_size: int | None = knob(None, section="data", short="-b",
                                  hints=("--micro-batch-size", "--bs"))
    """Micro-batch size per worker, B. Default: 16 on GPUs, 8 on CPUs, made smaller when the
    train shards cannot hold B*T*workers+1 tokens (llm.c's loader rule)."""
    seq_len: int | None = knob(None, section="data", short="-t",
                               hints=("--block-size", "--seq-length", "--context-length"))
    """Sequence length, T. Default: 1024 on GPUs, 64 on CPUs (at most a model file's
    max_seq_len)."""
    total_batch_size: int = knob(-1, section="data", short="-d",
                                 hints=("--global-batch-size", "--tokens-per-step"))
    """Tokens per optimizer step across all workers (-d); -1 means B*T*world (no accumulation)."""
    seed: int = knob(1337, section="data")
    """Seeds init, the data shuffle and stochastic rounding."""


    def grad_accum_steps(self, world: int) -> int:
        tokens_per_micro = self.batch_size * self.seq_len * world
        return self.total_batch_size // tokens_per_micro

    def effective_total_batch(self, world: int) -> int:
        if self.total_batch_size > 0:
            return self.total_batch_size
        return self.batch_size * self.seq_len * world

    def resolve_data(self, *, on_gpu: bool, workers: int, block_size: int,
                     endpoint: str, notes: list[str]) -> None:
        """Fill T, B and -d where unset: T at most the model's block size, a B the train shards
        can feed on `workers` (a note says when it had to shrink). Shards in a bucket carry the
        run's endpoint, as the run directory does (every process opens them from one string)."""
        self.input_bin = mixture.with_patterns(
            self.input_bin, lambda flag, p: shards_with_endpoint(flag, p, endpoint))
        self.input_val_bin = shards_with_endpoint("-j/--input-val-bin", self.input_val_bin,
                                                  endpoint)
        if self.seq_len is None:
            self.seq_len = min(1024 if on_gpu else 64, block_size)
        if self.batch_size is None:
            self.batch_size = fit.fit_batch_size(self.input_bin, self.seq_len, workers,
                                                 16 if on_gpu else 8, notes)
        if self.total_batch_size == -1:
            self.total_batch_size = self.batch_size * self.seq_len * workers

    def validate_data(self, *, workers: range) -> None:
        """ConfigError naming the first data knob that cannot be used; -d must divide into
        micro-batches on every world size in `workers` (elastic runs shrink)."""
        need(self.batch_size >= 1, "-b/--batch-size", "an integer >= 1", self.batch_size)
        need(1 <= self.seq_len <= 1024, "-t/--seq-len", "an integer in [1, 1024]", self.seq_len)
        for world in workers:
            micro = self.batch_size * self.seq_len * world
            need(self.total_batch_size > 0 and self.total_batch_size % micro == 0,
                 "-d/--total-batch-size",
                 f"a positive multiple of B*T*world = {self.batch_size}*{self.seq_len}*{world}"
                 f" = {micro}", self.total_batch_size)
        # a local glob must match here; a bucket's is listed by raygpt.config.preflight (one line
        # naming the URI when it matches nothing or the store does not answer)
        for flag, pattern in mixture.flags_and_patterns(self.input_bin):  # (its syntax too)
            need(_remote(pattern) or bool(glob.glob(pattern)), flag, "a glob matching at least "
                 "one llm.c token shard (local, s3:// or gs://)", pattern)
        if self.input_val_bin:
            need(_remote(self.input_val_bin) or bool(glob.glob(self.input_val_bin)),
                 "-j/--input-val-bin", "a glob matching at least one llm.c token shard (local, "
                 "s3:// or gs://; or '' to turn validation off)", self.input_val_bin)
        need(isinstance(self.shard_cache_gb, (int, float)) and math.isfinite(self.shard_cache_gb)
             and self.shard_cache_gb > 0, "--shard-cache-gb", "a number of GB > 0",
             self.shard_cache_gb)
