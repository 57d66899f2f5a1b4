"""What the loop does to the weights, checked on the weights and the optimizer's inputs rather
than on what the run recorded about itself (LocalSession, no Ray, a d2 model, seconds each).

Each test here was written against a single-line breakage of the loop that the rest of the suite
let through (issue 26): clipping switched off, lr_scale not applied after a rewind, the -sl/-sg
skip never firing once the detectors' window is full, policy state not restored on resume,
retention deleting nothing, the bf16 working weights re-derived with the wrong RNG seed. The
mutation-testing script (bench/mutants.sh) runs these with the other fast loop tests.
"""

import dataclasses
import json
import signal

import numpy as np
import pytest
import torch

from raygpt.checkpointing import protocol as ck
from raygpt.config import SpikeConfig
from raygpt.llmc.state_file import read_state_file
from raygpt.model.gpt import GPT
from raygpt.storage import open_run_dir
from raygpt.train import outlier
from raygpt.train.faults import InjectedFault
from raygpt.train.loop import TrainingStopped, build_model, train
from raygpt.train.loop_tasks import sample_text
from raygpt.train.schedule import learning_rate
from raygpt.train.session import LocalSession
from tests.helpers import records, tiny_config, train_losses


def run_local(cfg, resolved=False):
    cfg = cfg if resolved else cfg.resolve(0)
    return train(cfg, LocalSession(open_run_dir(cfg.output_dir), torch.device("cpu")))


def state_file(run_dir, step):
    rd = open_run_dir(str(run_dir))
    n = ck.read_manifest(rd, step)["num_parameters"]
    return read_state_file(rd.read_bytes(f"{ck.step_dir(step)}/{ck.state_file(step, 0)}"),
                           num_parameters=n)


def train_records(run_dir):
    return [r for r in records(run_dir) if r["kind"] == "train"]


# ---------------------------------------------------------------------- gradient clipping


@pytest.mark.parametrize("grad_clip", [1.0, 100.0])
def test_the_first_update_moves_m_by_the_clipped_gradient(tmp_path, grad_clip):
    """From m = 0, AdamW's first update leaves m = (1 - beta1) * grad_scale * g, so ||m|| /
    (1 - beta1) is the norm of the gradient the update applied: the clip when the norm is above
    it (a fresh d2 model's is 1.5-3), the norm itself when the clip is out of reach."""
    cfg = tiny_config(tmp_path, max_steps=1, checkpoint_every=1)
    run_local(cfg)
    [rec] = train_records(tmp_path)
    norm = rec["norm"]
    applied = float(np.linalg.norm(state_file(tmp_path, 1).m.astype(np.float64))) / (1 - cfg.beta1)
    if grad_clip == 1.0:
        assert norm > 1.2 * grad_clip  # the premise: this step clips
        assert applied == pytest.approx(grad_clip, rel=1e-4)
    else:
        run_local(cfg.with_overrides({"output_dir": str(tmp_path / "noclip"), "grad_clip": grad_clip}))
        unclipped = float(np.linalg.norm(state_file(tmp_path / "noclip", 1).m.astype(np.float64)))
        assert unclipped / (1 - cfg.beta1) == pytest.approx(norm, rel=1e-4)


# ---------------------------------------------------------------------- lr_scale after a rewind


def test_a_rewind_that_lowers_lr_scale_lowers_the_rate_adamw_is_given(tmp_path, monkeypatch):
    """The region spikes three times: rewinds with lr_scale 1.0, 0.7, then the stop. Between the
    second and the third, step 6 is trained again, and the optimizer kernel must be handed
    0.7 x the schedule's rate (read where AdamW passes it to the update, not from the log)."""
    from raygpt.train import optim
    used = []
    update = optim.ops.adamw_update

    def recording_update(*args, lr, **kw):
        used.append(lr)
        return update(*args, lr=lr, **kw)

    monkeypatch.setattr(optim.ops, "adamw_update", recording_update)
    spike = SpikeConfig(enabled=True, min_history=4, window=8, safety_steps=1, max_rewinds=2)
    cfg = tiny_config(tmp_path, max_steps=12, checkpoint_every=2, spike=spike,
                      fault="nan:rank=0,step=7,every=1").resolve(0)
    with pytest.raises(TrainingStopped):
        run_local(cfg, resolved=True)
    rewinds = [r for r in records(tmp_path) if r["kind"] == "rewind"]
    assert [r["lr_scale"] for r in rewinds] == [1.0, 0.7, pytest.approx(0.49)]

    def scheduled(step):
        return learning_rate(cfg.scheduler, step, peak_lr=cfg.learning_rate,
                             warmup_steps=cfg.warmup_steps, total_steps=12,
                             final_lr_frac=cfg.final_lr_frac)
    # steps 0-6 at full rate, step 6 again after rewind 1 (1.0), step 6 after rewind 2 (0.7)
    assert len(used) == 9
    assert used[:7] == [scheduled(s) for s in range(7)]
    assert used[7] == scheduled(6)
    assert used[8] == pytest.approx(0.7 * scheduled(6), rel=1e-12) and used[8] != used[7]


# ---------------------------------------------------------------------- -sl / -sg past the window

SPIKE_CALL = 16  # the first step judged against a full window of 16 (steps 0-15 fill it)


def spiking_forward(monkeypatch, factor=20.0):
    """Multiply the loss of one training step by `factor`: a finite outlier in both the loss and
    (the backward pass scales too) the grad norm."""
    forward, calls = GPT.forward, []

    def forward_with_spike(self, idx, targets=None, **kw):
        out = forward(self, idx, targets, **kw)
        if targets is None or not self.training:
            return out
        calls.append(1)
        if len(calls) - 1 == SPIKE_CALL:
            return out[0] * factor, out[1]
        return out

    monkeypatch.setattr(GPT, "forward", forward_with_spike)


@pytest.mark.parametrize("flag", ["skip_update_lossz", "skip_update_gradz"])
def test_a_z_score_outlier_is_skipped_once_the_window_is_full(tmp_path, monkeypatch, flag):
    """llm.c's detectors return z only after a full window (128 values); shrunk to 16 here so
    the run gets past it in 17 steps. A finite spike at step 16 must be skipped (one skip, its
    update dropped), every other step trained."""
    monkeypatch.setattr(outlier, "OUTLIER_DETECTOR_WINDOW_SIZE", 16)  # max z over 16: sqrt(15)
    spiking_forward(monkeypatch)
    summary = run_local(tiny_config(tmp_path, max_steps=17, checkpoint_every=0, **{flag: 3.0}))
    assert summary["skips"] == 1
    verdicts = {r["step"]: r["verdict"] for r in train_records(tmp_path)}
    assert verdicts[SPIKE_CALL] == "skip"
    assert all(v == "ok" for s, v in verdicts.items() if s != SPIKE_CALL)
    [skip] = [r for r in records(tmp_path) if r["kind"] == "skip"]
    assert ("loss z-score" if flag == "skip_update_lossz" else "grad-norm z-score") in skip["reason"]


# ---------------------------------------------------------------------- policy state on resume


def test_resume_restores_the_detectors_monitor_and_counters(tmp_path):
    """A run that crashes and resumes ends with the same policy state as one that did not: the
    z-score detectors, the spike monitor's windows and the counters come back from the
    checkpoint, not fresh (a fresh detector would count 4 values where the run saw 8)."""
    spike = SpikeConfig(enabled=True, min_history=4, window=8)
    kw = dict(max_steps=8, checkpoint_every=4, spike=spike, skip_update_lossz=6.0,
              skip_update_gradz=6.0)
    run_local(tiny_config(tmp_path / "full", **kw))
    # checkpoint 4 written inline, so the crash at step 6 finds it and the resume starts there
    crash = tiny_config(tmp_path / "crash", **kw, fault="raise:rank=0,step=6",
                        async_checkpoint=False)
    with pytest.raises(InjectedFault):
        run_local(crash)
    run_local(crash.with_overrides({"resume": 1}))
    assert [r["resumed_from"] for r in records(tmp_path / "crash") if r["kind"] == "resume"] == [4]
    full, resumed = state_file(tmp_path / "full", 8), state_file(tmp_path / "crash", 8)
    assert full.extras["loss_detector"]["count"] == 8 and full.extras["monitor"]["losses"]
    assert resumed.extras == full.extras
    assert (resumed.rng_state, resumed.rng_state_last_update) == (full.rng_state,
                                                                  full.rng_state_last_update)


# ---------------------------------------------------------------------- retention in a real run


def test_retention_deletes_the_checkpoints_it_lets_go(tmp_path):
    """-nk 2 -nm 4 in a real run: the run directory keeps the last two checkpoints and every 4th;
    the others (step 2) are gone from disk, not just from a list."""
    run_local(tiny_config(tmp_path, max_steps=8, checkpoint_every=2, checkpoints_keep=2,
                          major_checkpoint_every=4, async_checkpoint=False))
    on_disk = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert on_disk == [ck.step_dir(s) for s in (4, 6, 8)]
    assert ck.list_checkpoint_steps(open_run_dir(str(tmp_path))) == [4, 6, 8]


# ---------------------------------------------------------------------- bf16 + fp32 master on CPU


def bf16_config(run_dir, **kw):
    """The GPU default (bf16 working weights, fp32 master, stochastic rounding) on the CPU: the
    config refuses bf16 on CPU for real runs (slow), so the resolved config is changed after its
    checks; the update and rounding then run through the PyTorch reference ops."""
    # 3 steps, a checkpoint after each: the reference ops' stochastic rounding hashes every
    # parameter in Python-level torch ops (seconds a step on one thread), so few updates
    cfg = tiny_config(run_dir, max_steps=3, checkpoint_every=1, async_checkpoint=False,
                      **kw).resolve(0)
    return dataclasses.replace(cfg, precision="bf16")


def test_bf16_master_weights_resume_bit_exact_on_cpu(tmp_path):
    """The resume re-derives the bf16 working weights from the fp32 master with the seed of the
    last update (rng_state_last_update): the resumed run's losses and final weights equal the
    uninterrupted run's bit for bit."""
    run_local(bf16_config(tmp_path / "full"), resolved=True)
    crashed = bf16_config(tmp_path / "crashed", fault="raise:rank=0,step=2")
    with pytest.raises(InjectedFault):
        run_local(crashed, resolved=True)
    run_local(dataclasses.replace(crashed, resume=1), resolved=True)
    a, b = train_losses(tmp_path / "full"), train_losses(tmp_path / "crashed", attempt=2)
    assert sorted(b) == [2] and b[2] == a[2], (a, b)  # from checkpoint 2's re-derived weights
    assert state_file(tmp_path / "full", 3).master is not None
    name = f"{ck.step_dir(3)}/{ck.model_file(3)}"
    assert (open_run_dir(str(tmp_path / "full")).read_bytes(name)
            == open_run_dir(str(tmp_path / "crashed")).read_bytes(name))


# ---------------------------------------------------------------------- the caller's process


def test_train_hands_back_the_callers_signal_handlers(tmp_path):
    """train() installs SIGTERM / SIGUSR1 handlers that only set flags; once it returns, or
    raises, the caller's handlers are back (a pytest process otherwise swallows SIGTERM)."""
    mine = {s: (lambda signum, frame: None) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    before = {s: signal.signal(s, h) for s, h in mine.items()}
    try:
        run_local(tiny_config(tmp_path / "ok", max_steps=2, fault="sigusr1:rank=0,step=1"))
        assert {s: signal.getsignal(s) for s in mine} == mine
        with pytest.raises(InjectedFault):
            run_local(tiny_config(tmp_path / "raised", max_steps=4, fault="raise:rank=0,step=2"))
        assert {s: signal.getsignal(s) for s in mine} == mine
    finally:
        for s, h in before.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------- the text sampler


def samples(run_dir) -> dict:
    from raygpt.runlog.history import SAMPLES
    path = run_dir / SAMPLES
    return {r["step"]: r["text"] for r in map(json.loads, path.read_text().splitlines())}


def test_the_sampler_writes_reproducible_text_at_its_steps(tmp_path):
    """-s 2: a sample at steps 2 and 4 (the last) in the run's samples file; sample_text is
    seeded by the step (the same text for the same step) and leaves the model training."""
    cfg = tiny_config(tmp_path / "a", max_steps=4, sample_every=2, gen_tokens=6,
                      checkpoint_every=0)
    run_local(cfg)
    written = samples(tmp_path / "a")
    assert sorted(written) == [2, 4] and all(isinstance(t, str) and t for t in written.values())
    # sample_text on its own: seeded by the step, and the model is left in training mode
    resolved, cpu = cfg.resolve(0), torch.device("cpu")
    model = build_model(resolved, cpu)
    texts = {step: sample_text(model, resolved, cpu, step) for step in (2, 3)}
    assert texts[2] == sample_text(model, resolved, cpu, 2) and texts[2] != texts[3]
    assert model.training
