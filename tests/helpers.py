"""Small shared pieces for the tests: tiny configs and reading a run's records."""

from __future__ import annotations

import json
from pathlib import Path

from raygpt.config import TrainConfig


def tiny_config(run_dir, **overrides) -> TrainConfig:
    """A depth-2 model on short sequences: a few tens of ms per micro-step on one CPU thread."""
    base = dict(model="d2", batch_size=4, seq_len=32, max_steps=12, val_every=0, val_batches=2,
                sample_every=0, gen_tokens=8, checkpoint_every=4, output_dir=str(run_dir),
                device="cpu", num_workers=1, compile=False, warmup_steps=2)
    base.update(overrides)
    return TrainConfig(**base)


def records(run_dir) -> list[dict]:
    path = Path(run_dir) / "loss_history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_losses(run_dir, attempt=None) -> dict[int, float]:
    """{step: loss} of the train records (the latest attempt of each step wins)."""
    out = {}
    for r in records(run_dir):
        if r["kind"] == "train" and (attempt is None or r["attempt"] == attempt):
            out[r["step"]] = r["loss"]
    return out


def samples_seen(run_dir) -> list[tuple[int, int]]:
    """Every (shard, sample) the final loss curve trained on (latest attempt of each step), from
    the train records of a run with record_samples on."""
    by_step = {}
    for r in records(run_dir):
        if r["kind"] == "train":
            by_step[r["step"]] = r["samples"]
    return sorted((shard, i) for ranges in by_step.values() for shard, a, b in ranges
                  for i in range(a, b))


def memory_fs():
    """fsspec's in-memory filesystem as a pyarrow FileSystem: a non-local run-dir store for tests
    (process-global: give every test its own root)."""
    import fsspec
    import pyarrow.fs as pafs

    return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))
