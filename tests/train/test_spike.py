"""Loss-spike recovery in the loop (LocalSession): a NaN spike rewinds once to the checkpoint
before it, skips its data window for good, and a spike that comes back lowers lr_scale and,
past the limit, stops the run with a clear error."""

import math

import pytest
import torch

from raygpt.checkpointing import protocol as ck
from raygpt.config import SpikeConfig
from raygpt.llmc.state_file import read_state_file
from raygpt.storage import open_run_dir
from raygpt.train.faults import InjectedFault
from raygpt.train.loop import TrainingStopped, train
from raygpt.train.session import LocalSession
from tests.helpers import records, tiny_config, train_losses


def run_local(cfg):
    return train(cfg.resolve(0), LocalSession(open_run_dir(cfg.output_dir), torch.device("cpu")))


def spike_config(run_dir, **kw):
    spike = SpikeConfig(enabled=True, min_history=4, window=8, safety_steps=1, max_rewinds=2)
    return tiny_config(run_dir, **{"max_steps": 12, "checkpoint_every": 2, "spike": spike, **kw})


def test_one_spike_one_rewind_and_its_window_is_skipped_for_good(tmp_path):
    # -nk 0: it reads checkpoint 6 at the end, which the default retention lets go
    summary = run_local(spike_config(tmp_path, fault="nan:rank=0,step=7", checkpoints_keep=0))
    assert summary["rewinds"] == 1 and summary["step"] == 12
    rewinds = [r for r in records(tmp_path) if r["kind"] == "rewind"]
    assert len(rewinds) == 1
    rw = rewinds[0]
    assert rw["step"] == 7 and rw["to_step"] == 6 and rw["lr_scale"] == 1.0
    window = [tuple(w) for w in rw["window"]]
    assert sum(end - start for _, start, end in window) == 4  # the step's 4 samples
    losses = train_losses(tmp_path)
    assert sorted(losses) == list(range(12)) and all(l == l for l in losses.values())
    # every checkpoint written after the rewind carries the window in its skip list
    rd = open_run_dir(str(tmp_path))
    n = ck.read_manifest(rd, 12)["num_parameters"]
    sf = read_state_file(rd.read_bytes("step_00000012/state_00000012_00000.bin"), num_parameters=n)
    assert set(window) <= {tuple(r) for r in sf.loader_state["skip_ranges"]}
    sf6 = read_state_file(rd.read_bytes("step_00000006/state_00000006_00000.bin"), num_parameters=n)
    assert not sf6.loader_state["skip_ranges"]
    # the rewind abandoned the trajectory checkpoint 6 was saved on, back to step 6: 6 stays
    # valid, and the checkpoints after it belong to the new trajectory
    [abandoned] = ck.read_abandoned_trajectories(rd)
    assert abandoned["to_step"] == 6
    assert ck.read_manifest(rd, 6)["extra"]["trajectory"] == abandoned["trajectory"]
    assert ck.read_manifest(rd, 12)["extra"]["trajectory"] != abandoned["trajectory"]


def test_resume_after_a_rewind_keeps_skipping_the_window(tmp_path):
    run_local(spike_config(tmp_path, fault="nan:rank=0,step=7", max_steps=10))
    first = train_losses(tmp_path)
    # the last checkpoint (10) carries the window in its skip list and the rewind in its ledger
    rd = open_run_dir(str(tmp_path))
    n = ck.read_manifest(rd, 10)["num_parameters"]
    sf = read_state_file(rd.read_bytes("step_00000010/state_00000010_00000.bin"), num_parameters=n)
    rewinds = [r for r in records(tmp_path) if r["kind"] == "rewind"]
    assert {tuple(w) for w in rewinds[0]["window"]} <= {tuple(r) for r in sf.loader_state["skip_ranges"]}
    assert sf.extras["ledger"]["rewinds"] == 1
    assert first.keys() == set(range(10))


def test_a_region_that_spikes_again_lowers_lr_scale_then_escalates(tmp_path):
    cfg = spike_config(tmp_path, fault="nan:rank=0,step=7,every=1")
    with pytest.raises(TrainingStopped, match="exceeds --spike-max-rewinds 2"):
        run_local(cfg)
    rewinds = [r for r in records(tmp_path) if r["kind"] == "rewind"]
    assert [r["lr_scale"] for r in rewinds] == [1.0, 0.7, pytest.approx(0.49)]
    assert all(r["to_step"] == 6 for r in rewinds)


def test_without_the_monitor_a_nan_step_is_skipped_not_rewound(tmp_path):
    summary = run_local(tiny_config(tmp_path, max_steps=8, fault="nan:rank=0,step=5"))
    assert summary["rewinds"] == 0 and summary["skips"] == 1


def test_a_nan_step_never_reaches_a_checkpointed_detector(tmp_path):
    # -sl/-sg on, no spike monitor: the NaN step is skipped and kept out of both z-score windows,
    # so the checkpoints after it carry clean detectors (llm.c's would carry NaN sums for good)
    summary = run_local(tiny_config(tmp_path, max_steps=8, checkpoint_every=4, skip_update_lossz=6,
                                    skip_update_gradz=6, fault="nan:rank=0,step=2"))
    assert summary["skips"] == 1
    rd = open_run_dir(str(tmp_path))
    manifest = ck.read_manifest(rd, 8)
    sf = read_state_file(rd.read_bytes(f"{ck.step_dir(8)}/{ck.state_file(8, 0)}"),
                         num_parameters=manifest["num_parameters"])
    for name in ("loss_detector", "grad_detector"):
        det = sf.extras[name]
        assert det["count"] == 7, name  # steps 0-7 less the NaN one
        assert all(math.isfinite(det[k]) for k in ("sum", "sum_sq")), det
        assert all(math.isfinite(v) for v in det["buffer"][:7])


# ---------------------------------------------------------------------- the rewind's target


class FakeClock:
    """time for choose_rewind_target: sleep advances it, and the driver's DONE for a reported
    step lands when the clock passes the given time."""

    def __init__(self, verified, lands_at=None):
        self.now, self.verified, self.lands_at = 0.0, list(verified), dict(lands_at or {})

    def sleep(self, s):
        self.now += s

    def verified_steps(self):
        return self.verified + [s for s, t in self.lands_at.items() if self.now >= t]

    def completed(self, step):
        return step in self.verified_steps()


def test_a_rewind_waits_for_a_reported_checkpoint_the_driver_has_not_completed_yet():
    from raygpt.checkpointing.runtime import choose_rewind_target
    c = FakeClock([2, 4], lands_at={6: 0.35})  # 6 was reported, its DONE is on its way
    assert choose_rewind_target([2, 4, 6], c.verified_steps, c.completed, 7, 1, wait_s=60,
                                clock=lambda: c.now, sleep=c.sleep) == 6
    assert 0.35 <= c.now < 1.0


def test_a_rewind_settles_for_the_newest_verified_when_a_report_never_completes(capsys):
    from raygpt.checkpointing.runtime import choose_rewind_target
    c = FakeClock([2, 4])
    assert choose_rewind_target([2, 4, 6], c.verified_steps, c.completed, 7, 1, wait_s=5,
                                clock=lambda: c.now, sleep=c.sleep) == 4
    # a warning: stderr, like every raygpt warning (raygpt.runlog.console)
    assert "checkpoint 6 was reported but not completed within 5 s" in capsys.readouterr().err
    # nothing newer reported than what is verified: no wait at all
    c = FakeClock([2, 4])
    assert choose_rewind_target([2, 4], c.verified_steps, c.completed, 7, 1, wait_s=5,
                                clock=lambda: c.now, sleep=c.sleep) == 4 and c.now == 0


# ---------------------------------------------------------------------- a rewind survives a crash
def test_a_crash_between_a_rewind_and_the_next_checkpoint_keeps_the_rewinds_decision(tmp_path):
    """NaN at step 9 rewinds to checkpoint 6 (safety 3), abandoning checkpoint 8; the process
    dies at step 7 of the re-run, before any checkpoint carries the rewind. -y 1 resumes from
    6, which predates the rewind: the decision recorded in the run directory still applies, so
    the window stays skipped and the losses equal the same run without the crash. Retention
    is the default's all along (-nk 3, -nm 4 for -n 2 -x 12): it deleted 2 at 8's commit,
    before the rewind, and 6 at 12's, after the resume."""
    spike = SpikeConfig(enabled=True, min_history=4, window=8, safety_steps=3, max_rewinds=2)
    kw = dict(max_steps=12, checkpoint_every=2, spike=spike)
    run_local(tiny_config(tmp_path / "ref", **kw, fault="nan:rank=0,step=9"))
    crash = tiny_config(tmp_path / "crash", **kw,
                        fault="nan:rank=0,step=9;raise:rank=0,step=7,visit=2")
    with pytest.raises(InjectedFault):
        run_local(crash)
    rd = open_run_dir(str(tmp_path / "crash"))
    # 2 went by retention (8 made it the fourth), 8 with the abandoned trajectory
    assert ck.list_checkpoint_steps(rd) == [4, 6]
    [decision] = ck.read_abandoned_trajectories(rd)
    assert decision["to_step"] == 6 and decision["ledger"]["rewinds"] == 1
    assert decision["skip_ranges"]
    summary = run_local(crash.with_overrides({"resume": 1}))
    assert summary["rewinds"] == 1 and summary["step"] == 12
    assert train_losses(tmp_path / "crash") == train_losses(tmp_path / "ref")
    resumes = [r for r in records(tmp_path / "crash") if r["kind"] == "resume"]
    assert resumes[-1]["resumed_from"] == 6
    # after the resume: the last three and the major 4 (-nm 4: 4, 8, 12)
    assert ck.list_checkpoint_steps(rd) == [4, 8, 10, 12] == ck.list_checkpoint_steps(
        open_run_dir(str(tmp_path / "ref")))


def test_resume_passes_over_a_checkpoint_a_rewind_abandoned_but_did_not_delete(tmp_path):
    """A crash between the rewind's record and its deletions leaves an abandoned checkpoint
    complete on disk: resume goes back to the rewind's target instead."""
    spike = SpikeConfig(enabled=True, min_history=4, window=8, safety_steps=3, max_rewinds=2)
    # checkpoints written inline: the crash at step 9 must find checkpoint 8 complete, which an
    # async write still in flight on a loaded machine need not be
    kw = dict(max_steps=12, checkpoint_every=2, spike=spike, async_checkpoint=False)
    run_local(tiny_config(tmp_path / "ref", **kw, fault="nan:rank=0,step=9"))
    crash = tiny_config(tmp_path / "crash", **kw, fault="raise:rank=0,step=9")
    with pytest.raises(InjectedFault):
        run_local(crash)
    rd = open_run_dir(str(tmp_path / "crash"))
    assert ck.list_checkpoint_steps(rd) == [4, 6, 8]  # 2 went by the default retention
    # what the reference run's rewind recorded, as if this run had crashed right after it
    [decision] = ck.read_abandoned_trajectories(open_run_dir(str(tmp_path / "ref")))
    trajectory = ck.read_manifest(rd, 8)["extra"]["trajectory"]
    ck.record_abandoned_trajectory(rd, trajectory, 6, ledger=decision["ledger"],
                                   skip_ranges=decision["skip_ranges"])
    summary = run_local(crash.with_overrides({"resume": 1, "fault": ""}))
    resumes = [r for r in records(tmp_path / "crash") if r["kind"] == "resume"]
    assert resumes[-1]["resumed_from"] == 6 and summary["rewinds"] == 1
    ref = train_losses(tmp_path / "ref")
    assert {s: l for s, l in train_losses(tmp_path / "crash").items() if s >= 6} == \
        {s: l for s, l in ref.items() if s >= 6}
