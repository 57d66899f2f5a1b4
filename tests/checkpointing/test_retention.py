"""Retention by default keeps a disk (raygpt.checkpointing.retention, applied by the store): the
pure rule for -nm when it is unset, the policy it makes, and the user's path: `raygpt train`
with no retention flag leaves the last three checkpoints and the major ones."""

from __future__ import annotations

import pytest

from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing.retention import (DEFAULT_KEEP_LAST, RetentionPolicy,
                                            default_keep_every, policy_for, to_delete)
from raygpt.config import TrainConfig
from raygpt.storage import open_run_dir
from tests.test_cli import sh


@pytest.mark.parametrize("every, steps, expected", [
    (2, 12, 4),          # a quarter of 12 is 3: the next multiple of 2
    (4, 12, 4),          # -n itself when a quarter is below it
    (5000, 18865, 5000),  # llm.c's GPT-2 124M: 5000, 10000, 15000
    (250, 18865, 4750),  # 4716 rounded up to a multiple of 250
    (100, 400, 100),     # exactly a quarter
    (0, 100, 0),         # -n 0: only the last checkpoint is written
    (50, -1, 0)])        # no length known
def test_the_default_major_interval_is_a_quarter_of_the_run_in_multiples_of_n(every, steps,
                                                                               expected):
    assert default_keep_every(every, steps) == expected


def test_the_defaults_keep_three_and_about_four_majors_and_the_knobs_win():
    cfg = TrainConfig()
    assert (cfg.checkpoints_keep, cfg.major_checkpoint_every) == (DEFAULT_KEEP_LAST, None) == (3, None)
    policy = policy_for(keep_last=3, keep_every=None, checkpoint_every=500, max_steps=18865,
                        wsd_decay_start=None)
    assert policy == RetentionPolicy(keep_last=3, keep_every=5000, wsd_decay_start=None)
    steps = list(range(500, 18865, 500)) + [18865]
    kept = sorted(set(steps) - set(to_delete(policy, steps, newest_verified=18865)))
    assert kept == [5000, 10000, 15000, 18000, 18500, 18865]
    # -nm 0: the last three only; -nk 0: everything; a WSD decay's last one before it stays
    assert policy_for(keep_last=3, keep_every=0, checkpoint_every=500, max_steps=18865,
                      wsd_decay_start=None).keep_every == 0
    assert to_delete(RetentionPolicy(keep_last=0), steps, 18865) == []
    wsd = RetentionPolicy(keep_last=2, keep_every=0, wsd_decay_start=15250)
    assert sorted(set(steps) - set(to_delete(wsd, steps, 18865))) == [15000, 18500, 18865]


def test_train_with_no_retention_flag_keeps_the_last_three_and_the_majors(tmp_path):
    """The user's command line, no -nk/-nm: -n 2 -x 12 writes 2, 4, ..., 12 and keeps 4 and 8
    (-nm 4, a quarter of the run) and the last three; --help states the rule."""
    run = tmp_path / "run"
    out = sh("-m", "raygpt", "train", "--cpu", "-e", "d2", "-b", "4", "-t", "32", "-x", "12",
             "-n", "2", "-v", "0", "-s", "0", "--num-workers", "1", "-o", str(run))
    assert out.returncode == 0, out.stderr[-3000:]
    rd = open_run_dir(str(run))
    assert ck.list_checkpoint_steps(rd) == [4, 8, 10, 12]
    assert all(not ck.verify_checkpoint(rd, s) for s in (4, 8, 10, 12))
    text = " ".join(sh("-m", "raygpt", "train", "--help").stdout.split())
    assert "0 keeps all. Default: 3." in text
    assert "Default: the smallest multiple of -n at or above a quarter of -x" in text


def test_the_committing_side_adds_the_configs_facts_and_policy_to_rank_0s_report(tmp_path):
    """CommitFacts (the driver's, or the single process's): rank 0 reports only what the
    workers know; the fingerprints, the identity and the retention policy come from the config
    there, the policy from the run's length rank 0 reported (-x -1 is counted by the loader)."""
    import pickle

    from raygpt.checkpointing.finalize import CommitFacts
    from raygpt.checkpointing.fingerprints import run_fingerprints
    from raygpt.train.schedule import wsd_decay_start
    from tests.helpers import tiny_config

    cfg = tiny_config(tmp_path, checkpoint_every=2).resolve(0)
    facts = pickle.loads(pickle.dumps(CommitFacts(cfg)))  # Ray ships it to its controller
    reported = {"step": 6, "world_size": 1, "num_parameters": 7, "max_steps": 12,
                "extra": {"trajectory": "t"}}
    meta = facts.complete(reported)
    assert meta == {**run_fingerprints(cfg), "config_identity": cfg.identity(), **reported,
                    "retention": {"keep_last": 3, "keep_every": 4, "wsd_decay_start": None}}
    wsd = tiny_config(tmp_path, checkpoint_every=5, scheduler="wsd", checkpoints_keep=2,
                      major_checkpoint_every=0).resolve(0)
    assert CommitFacts(wsd).complete({**reported, "max_steps": 40})["retention"] == {
        "keep_last": 2, "keep_every": 0, "wsd_decay_start": wsd_decay_start(40)}
