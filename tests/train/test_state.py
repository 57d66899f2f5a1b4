"""TrainState: llm.c's seed and counters, the -sl / -sg skip in judge() with the spike monitor
in front of it, and the extras that carry every policy window through a checkpoint.

Pure unit tests (no model, no Ray); written against bench/mutants.sh's survivors of state.py.
"""

import json
import math

import pytest

from raygpt.config import SpikeConfig, TrainConfig
from raygpt.train.outlier import OUTLIER_DETECTOR_WINDOW_SIZE, OutlierDetector
from raygpt.train.state import RNG_SEED_BASE, TrainState

N = OUTLIER_DETECTOR_WINDOW_SIZE


def window_values(i: int) -> float:
    """A window with a spread (1, 2, 3 repeating: mean about 2, std about 0.8; the spike
    monitor's MAD is never 0 either)."""
    return 1.0 + i % 3


def filled(cfg: TrainConfig) -> TrainState:
    """A state whose two detectors have seen a full window (losses and norms alike)."""
    st = TrainState.fresh(cfg)
    for i in range(N):
        assert st.judge(cfg, i, window_values(i), window_values(i)).kind == "ok"
    return st


def twin_z(value: float) -> float:
    """The z-score the filled state's detectors give `value` next, from a detector of its own."""
    det = OutlierDetector()
    for i in range(N):
        det.update(window_values(i))
    return det.update(value)


def test_seed_base_is_llmc_and_fresh_state_offsets_it_by_the_run_seed():
    assert RNG_SEED_BASE == 13371337  # llm.c's constant: the same bf16 rounding as llm.c
    st = TrainState()
    assert (st.step, st.rng_state, st.rng_state_last_update) == (0, RNG_SEED_BASE, RNG_SEED_BASE)
    assert (st.tokens_seen, st.skips, st.clipped, st.monitor, st.lr_scale) == (0, 0, 0, None, 1.0)
    assert st.save_requested is False and st.spike_samples == []
    cfg = TrainConfig(seed=42)
    st = TrainState.fresh(cfg)
    assert st.rng_state == st.rng_state_last_update == RNG_SEED_BASE + 42
    assert st.monitor is None
    st = TrainState.fresh(TrainConfig(seed=7, spike=SpikeConfig(enabled=True, window=8)))
    assert st.monitor is not None and st.monitor.cfg.window == 8


def test_fresh_states_do_not_share_windows():
    a, b = TrainState(), TrainState()
    a.loss_detector.update(1.0)
    a.ledger.lr_scale = 0.5
    assert b.loss_detector.count == 0 and b.lr_scale == 1.0


def test_lr_scale_is_the_ledgers():
    st = TrainState()
    st.ledger.lr_scale = 0.49
    assert st.lr_scale == 0.49


def test_advance_counts_the_step_its_tokens_and_a_clip():
    st = TrainState()
    st.advance(96, clipped=True)
    st.advance(32, clipped=False)
    st.advance(64, clipped=True)
    assert (st.step, st.tokens_seen, st.clipped, st.skips) == (3, 192, 2, 0)


def test_nothing_is_skipped_while_the_windows_fill():
    """-sl / -sg need a finite z: before 128 values even a huge loss is applied."""
    cfg = TrainConfig(skip_update_lossz=0.5, skip_update_gradz=0.5)
    st = TrainState.fresh(cfg)
    for i in range(N - 1):
        st.judge(cfg, i, window_values(i), window_values(i))
    v = st.judge(cfg, N - 1, 1e6, 1e6)  # the 128th value: the window is full only after it
    assert v.kind == "ok" and v.reason == "" and math.isnan(v.loss_z) and math.isnan(v.gnorm_ratio)


@pytest.mark.parametrize("which", ["loss", "norm"])
def test_a_z_score_skips_just_past_the_threshold_not_at_it(which):
    loss, norm = (9.0, 2.0) if which == "loss" else (2.0, 9.0)
    z = twin_z(9.0)
    z_other = twin_z(2.0)
    assert z > 1.5  # a clear outlier, so the thresholds below are all above 1
    knob = "skip_update_lossz" if which == "loss" else "skip_update_gradz"

    at = TrainConfig(**{knob: z})
    v = filled(at).judge(at, N, loss, norm)
    assert v.kind == "ok" and v.reason == ""
    assert v.loss_z == (z if which == "loss" else z_other) and math.isnan(v.gnorm_ratio)

    past = TrainConfig(**{knob: z * 0.999})
    v = filled(past).judge(past, N, loss, norm)
    assert v.kind == "skip" and math.isnan(v.gnorm_ratio)
    # the verdict carries the loss z either way (the loop logs it)
    assert v.loss_z == (z if which == "loss" else z_other)
    name = "loss z-score" if which == "loss" else "grad-norm z-score"
    assert v.reason == f"{name} {z:.2f} > {z * 0.999}"

    # a threshold below 1 is a threshold too (only 0 is off)
    low = TrainConfig(**{knob: 0.5})
    assert filled(low).judge(low, N, loss, norm).kind == "skip"


def test_zero_thresholds_are_off():
    cfg = TrainConfig(skip_update_lossz=0.0, skip_update_gradz=0.0)
    v = filled(cfg).judge(cfg, N, 50.0, 50.0)
    assert v.kind == "ok" and v.loss_z == twin_z(50.0) > 10


def test_a_below_mean_value_is_not_an_outlier():
    """z is signed: a loss drop (negative z) never exceeds a positive threshold."""
    cfg = TrainConfig(skip_update_lossz=0.5, skip_update_gradz=0.5)
    v = filled(cfg).judge(cfg, N, -5.0, 2.0)
    assert v.kind == "ok" and v.loss_z == twin_z(-5.0) < -1


@pytest.mark.parametrize("loss, norm", [(math.nan, 1.0), (1.0, math.inf), (math.inf, math.nan)])
def test_a_non_finite_loss_or_norm_is_skipped_without_the_spike_policy(loss, norm):
    cfg = TrainConfig()  # -sl / -sg off: the non-finite skip does not depend on them
    st = TrainState.fresh(cfg)
    v = st.judge(cfg, 0, loss, norm)
    assert v.kind == "skip" and v.reason == f"non-finite loss {loss} or norm {norm}"
    assert math.isnan(v.loss_z) and math.isnan(v.gnorm_ratio)
    # a non-finite value never entered its detector's window (a finite one did)
    assert st.loss_detector.count == int(math.isfinite(loss))
    assert st.grad_detector.count == int(math.isfinite(norm))


def test_a_non_finite_z_never_skips():
    """A finite value beyond MAX_WINDOW_VALUE gets a z against the window but never enters it;
    with a flat window (std 0) its z is NaN, which must not count as past the threshold."""
    cfg = TrainConfig(skip_update_lossz=1.0, skip_update_gradz=1.0)
    st = TrainState.fresh(cfg)
    for i in range(N):
        st.judge(cfg, i, 2.0, 2.0)
    v = st.judge(cfg, N, 1e200, 2.0)
    assert v.kind == "ok" and math.isnan(v.loss_z)


def test_the_spike_monitors_verdict_comes_first():
    spike = SpikeConfig(enabled=True, window=8, min_history=4)
    cfg = TrainConfig(spike=spike)
    st = TrainState.fresh(cfg)
    v = st.judge(cfg, 0, math.nan, 1.0)
    assert v.kind == "rewind" and v.spike_start == 0  # not the plain non-finite skip
    # its ok falls through to -sl: a monitor blind to loss z (huge soft/hard z, no gnorm test)
    # still lets the z-score skip act
    spike = SpikeConfig(enabled=True, window=8, min_history=4, soft_z=1e9, hard_z=1e9,
                        gnorm_mult=0.0)
    cfg = TrainConfig(spike=spike, skip_update_lossz=1.0)
    st = filled(cfg)
    assert st.monitor.consecutive == 0 and len(st.monitor.losses) == 8
    v = st.judge(cfg, N, 9.0, 2.0)
    assert v.kind == "skip" and v.reason.startswith("loss z-score")


def trained(cfg: TrainConfig) -> TrainState:
    st = filled(cfg)
    for i in range(N, N + 37):  # wrap the detectors' cursors, vary the values
        st.judge(cfg, i, 2.0 + 0.01 * i, 1.0 + 0.03 * (i % 5))
    st.tokens_seen, st.skips, st.clipped = 123456, 3, 17
    st.ledger.record_rewind(10, 12, [(0, 5, 9)], cfg.spike)
    st.ledger.record_rewind(11, 13, [(1, 2, 3)], cfg.spike)  # overlaps: lr_scale decays
    return st


@pytest.mark.parametrize("spike", [False, True])
def test_extras_round_trip_restores_every_window_and_counter(spike):
    cfg = TrainConfig(spike=SpikeConfig(enabled=spike, window=16, min_history=4),
                      skip_update_lossz=3.0)
    st = trained(cfg)
    extras = json.loads(json.dumps(st.extras()))  # through the state file's JSON trailer
    assert (extras["tokens_seen"], extras["skips"], extras["clipped"]) == (123456, 3, 17)
    assert (extras["monitor"] is None) == (not spike)
    back = TrainState.fresh(cfg)
    assert back.load_extras(extras) == []
    assert back.extras() == st.extras()
    assert (back.tokens_seen, back.skips, back.clipped) == (123456, 3, 17)
    assert back.lr_scale == st.lr_scale == pytest.approx(0.7)
    for d in ("loss_detector", "grad_detector"):
        assert getattr(back, d).state_dict() == getattr(st, d).state_dict()
    if spike:
        assert list(back.monitor.losses) == list(st.monitor.losses) and len(st.monitor.losses)
    # the restored state judges the next steps exactly as the original
    for i in range(N + 37, N + 45):
        a = st.judge(cfg, i, 2.5 + i % 3, 1.2)
        b = back.judge(cfg, i, 2.5 + i % 3, 1.2)
        assert (a.kind, a.loss_z, a.reason) == (b.kind, b.loss_z, b.reason)


def test_extras_without_a_monitor_leave_a_fresh_monitor_in_place():
    """A checkpoint of a run without --spike, resumed with it: the monitor starts fresh."""
    plain = TrainConfig()
    extras = json.loads(json.dumps(trained(plain).extras()))
    cfg = TrainConfig(spike=SpikeConfig(enabled=True, window=16, min_history=4))
    back = TrainState.fresh(cfg)
    assert back.load_extras(extras) == []
    assert len(back.monitor.losses) == 0 and back.loss_detector.count == N


def test_load_extras_names_each_repaired_window():
    cfg = TrainConfig(spike=SpikeConfig(enabled=True, window=16, min_history=4))
    extras = json.loads(json.dumps(trained(cfg).extras()))
    extras["grad_detector"]["sum"] = math.nan  # an older raygpt's poisoned save
    extras["monitor"]["losses"][0] = math.inf
    back = TrainState.fresh(cfg)
    notes = back.load_extras(extras)
    assert len(notes) == 2
    assert notes[0] == f"grad-norm outlier detector (-sg): {back.grad_detector.repair_note}"
    assert notes[1] == f"spike monitor: {back.monitor.repair_note}"
    assert back.grad_detector.repair_note and back.monitor.repair_note
    extras = json.loads(json.dumps(trained(cfg).extras()))
    extras["loss_detector"]["sum_sq"] = math.inf
    notes = TrainState.fresh(cfg).load_extras(extras)
    assert len(notes) == 1 and notes[0].startswith("loss outlier detector (-sl): poisoned")
