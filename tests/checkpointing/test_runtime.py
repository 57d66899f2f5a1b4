"""raygpt.checkpointing.runtime, the worker's side of a checkpoint: a real save through the loop
is durable before it is published, and a resume onto another world size reads only the old
shards it needs."""

import hashlib
import os

import pytest
import torch

from raygpt.checkpointing.protocol import (
    MANIFEST, done_file, list_checkpoint_steps, model_file, state_file, step_dir,
)
from raygpt.storage import open_run_dir


# ---------------------------------------------------------------------- staging roots
def test_a_run_sweeps_the_staging_roots_dead_workers_left_beside_its_training(tmp_path,
                                                                              monkeypatch):
    """A real run's first save removes, on a thread of its own, the staging root a SIGKILLed
    process left 10 minutes ago (Ray ends its workers without exit handlers), and keeps its own."""
    import tempfile
    import threading

    from raygpt.checkpointing.staging import STAGE_STALE_S
    from raygpt.checkpointing.runtime import STAGE_SWEEP_THREAD
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession
    from tests.checkpointing.test_protocol import _age, _stage_root_of_a_killed_process
    from tests.helpers import tiny_config

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    dead = _stage_root_of_a_killed_process(tmp)
    _age(dead, STAGE_STALE_S + 5)
    run_dir = (tmp_path / "run").resolve()
    cfg = tiny_config(run_dir, max_steps=2, checkpoint_every=2).resolve(0)
    train(cfg, LocalSession(open_run_dir(str(run_dir)), torch.device("cpu")))
    for t in threading.enumerate():
        if t.name == STAGE_SWEEP_THREAD:
            t.join(timeout=60)
    assert not dead.exists()
    own = [p for p in tmp.iterdir() if p.name.startswith("raygpt-stage-")]
    assert len(own) == 1 and own[0].name.startswith(f"raygpt-stage-r0-{os.getpid()}-")


# ---------------------------------------------------------------------- durable before published
def test_every_published_byte_is_fsynced_before_done_and_manifest(tmp_path, monkeypatch):
    """A real save (LocalSession: stage on the worker, copy into storage without an fsync, then
    finalize): every file of the checkpoint is fsynced where its rank wrote it, then again as
    stored, and the step directory and the run directory (the names) are fsynced, all before
    DONE is renamed into place (MANIFEST comes after DONE)."""
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    events = []  # ("fsync", path) / ("rename", target), in order, from every thread
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **kw):
        where = os.readlink(f"/proc/self/fd/{kw['dst_dir_fd']}") if kw.get("dst_dir_fd") else ""
        events.append(("rename", os.path.abspath(os.path.join(where, dst))))  # dst: a name in it
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
    from raygpt.checkpointing.reading import old_ranks_needed
    from raygpt.train.optim import shard_range

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


# ---------------------------------------------------------------------- the early read of a resume
def test_a_resume_loads_the_files_its_early_read_hashed_while_the_model_was_built(tmp_path,
                                                                                  monkeypatch):
    """build_run starts reading.ResumeRead before the model is built: the resume's files are read
    and checked on that thread only (restore_latest reads nothing itself), and the resumed losses
    are the uninterrupted run's, as floats."""
    import threading

    from raygpt.checkpointing import reading, runtime
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config, train_losses

    def run(run_dir, **kw):
        cfg = tiny_config(run_dir, max_steps=12, async_checkpoint=False, **kw).resolve(0)
        return train(cfg, LocalSession(open_run_dir(str(run_dir)), torch.device("cpu")))

    from raygpt.train.faults import InjectedFault

    run(tmp_path / "whole")
    with pytest.raises(InjectedFault):  # checkpoint 8 saved, the attempt lost at step 9
        run(tmp_path / "run", fault="raise:rank=0,step=9")
    readers = []
    real = reading.fetch_verified

    def fetch_verified(*a, **kw):
        readers.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(runtime, "fetch_verified", fetch_verified)  # restore_latest's reads
    monkeypatch.setattr(reading, "fetch_verified", fetch_verified)  # the early read's
    run(tmp_path / "run", resume=1)
    assert readers == ["raygpt-resume-read"]
    # the state file's pieces are in MANIFEST, each the sha256 of its bytes (what the resume
    # checked, in parallel)
    from raygpt.checkpointing.protocol import read_manifest

    entry = read_manifest(open_run_dir(str(tmp_path / "run")), 8)["files"][state_file(8, 0)]
    data = (tmp_path / "run" / step_dir(8) / state_file(8, 0)).read_bytes()
    n = entry["piece_bytes"]
    assert entry["piece_sha256"] == [hashlib.sha256(data[lo:lo + n]).hexdigest()
                                     for lo in range(0, len(data), n)]
    whole, resumed = train_losses(tmp_path / "whole"), train_losses(tmp_path / "run", attempt=2)
    assert min(resumed) == 8 and resumed == {s: l for s, l in whole.items() if s >= 8}


def test_the_early_read_hands_its_files_over_only_for_the_checkpoint_and_files_asked(tmp_path):
    """ResumeRead guesses the newest resumable checkpoint and this rank's own files; take() gives
    the bytes (the stored ones) for exactly that checkpoint, MANIFEST and file list, once, and
    None for anything else, so restore_latest then reads what it needs itself."""
    from raygpt.checkpointing.protocol import read_manifest
    from raygpt.checkpointing.reading import ResumeRead
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    cfg = tiny_config(tmp_path / "run", max_steps=8, async_checkpoint=False).resolve(0)
    train(cfg, LocalSession(open_run_dir(str(tmp_path / "run")), torch.device("cpu")))
    run_dir = open_run_dir(str(tmp_path / "run"))
    m4, m8 = read_manifest(run_dir, 4), read_manifest(run_dir, 8)
    names = [state_file(8, 0), model_file(8)]  # fp32 on the CPU: the weights are the model file's
    assert ResumeRead(cfg, run_dir, 0, 1).take(4, m4, [state_file(4, 0), model_file(4)]) is None
    assert ResumeRead(cfg, run_dir, 0, 1).take(8, m8, names[:1]) is None
    assert ResumeRead(cfg, run_dir, 0, 2).take(8, m8, names) is None  # another world: no guess
    early = ResumeRead(cfg, run_dir, 0, 1)
    files, sources = early.take(8, m8, names)
    assert files == {n: (tmp_path / "run" / step_dir(8) / n).read_bytes() for n in names}
    assert set(sources) == set(names)
    assert early.take(8, m8, names) is None  # handed over once
