"""raygpt.checkpointing.runtime, the worker's side of a checkpoint: a real save through the loop
is durable before it is published, and a resume onto another world size reads only the old
shards it needs."""

import os

import torch

from raygpt.checkpointing.protocol import (
    MANIFEST, done_file, list_checkpoint_steps, model_file, state_file, step_dir,
)
from raygpt.storage import open_run_dir


# ---------------------------------------------------------------------- durable before published
def test_every_published_byte_is_fsynced_before_done_and_manifest(tmp_path, monkeypatch):
    """A real save (LocalSession: stage on the worker, copy into storage without an fsync, then
    finalize): every file of the checkpoint is fsynced where its rank wrote it, then again as
    stored, and the step directory and the run directory (the names) are fsynced, all before
    DONE is renamed into place (MANIFEST comes after DONE)."""
    from raygpt.loop import train
    from raygpt.session import LocalSession
    from tests.helpers import tiny_config

    events = []  # ("fsync", path) / ("rename", target), in order, from every thread
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **kw):
        events.append(("rename", os.path.abspath(dst)))
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    run_dir = (tmp_path / "run").resolve()
    cfg = tiny_config(run_dir, max_steps=4, checkpoint_every=2).resolve(0)
    train(cfg, LocalSession(open_run_dir(str(run_dir)), torch.device("cpu")))
    monkeypatch.undo()

    # private per-run staging roots: <tmp>/raygpt-stage-<label>-<random> (protocol.private_stage_root)
    stage_root = os.path.realpath(os.path.join(__import__("tempfile").gettempdir(), "raygpt-stage-"))
    steps = list_checkpoint_steps(open_run_dir(str(run_dir)))
    assert steps == [2, 4]
    for step in steps:
        sdir = run_dir / step_dir(step)
        done_at = events.index(("rename", str(sdir / done_file(step))))
        manifest_at = events.index(("rename", str(sdir / MANIFEST)))
        assert done_at < manifest_at
        before = events[:done_at]
        names = [n for n in os.listdir(sdir) if n not in (MANIFEST, done_file(step))]
        assert sorted(names) == sorted([model_file(step), state_file(step, 0)])
        for name in names:
            stored = before.index(("fsync", str(sdir / name)))  # as stored, before DONE
            staged = [i for i, (kind, p) in enumerate(before) if kind == "fsync"
                      and p.startswith(stage_root) and os.path.basename(p).split(".tmp")[0] == name]
            assert staged and staged[0] < stored, f"{name}: not fsynced where its rank wrote it"
        # the rank's private staging directory for this step: step_XXXXXXXX.tmp-<random>
        assert any(kind == "fsync" and p.startswith(stage_root) and
                   os.path.basename(p).split(".tmp")[0] == step_dir(step)
                   for kind, p in before), "the staged names"
        first_stored = min(before.index(("fsync", str(sdir / n))) for n in names)
        assert ("fsync", str(sdir)) in before[first_stored:], "the step directory's names"
        assert ("fsync", str(run_dir)) in before[first_stored:], "the step directory's own name"


def test_resharding_reads_rank_0_and_only_the_old_shards_that_overlap():
    from raygpt.checkpointing.runtime import old_ranks_needed
    from raygpt.optim import shard_range

    total = 1000
    # 4 ZeRO ranks (250 each) onto 2: rank 1 owns [500, 1000) = old ranks 2 and 3, plus rank 0
    assert old_ranks_needed(total, 4, 1, *shard_range(total, 1, 2, 1)) == [0, 2, 3]
    assert old_ranks_needed(total, 4, 1, *shard_range(total, 0, 2, 1)) == [0, 1]
    # 2 onto 3 (334 each): rank 1 owns [334, 668), across the old boundary at 500
    assert old_ranks_needed(total, 2, 1, *shard_range(total, 1, 3, 1)) == [0, 1]
    # onto one rank: every old shard, but not rank 63's, empty (64 * 16 > 1000: padding)
    assert old_ranks_needed(total, 64, 1, 0, total) == list(range(63))
    assert old_ranks_needed(total, 8, 0, 0, total) == [0]  # no ZeRO: rank 0 holds everything
    assert old_ranks_needed(total, 1, 1, 0, 500) == [0]
