"""llm.c's OutlierDetector against numpy, and raygpt's spike policy (monitor, rewind target,
rewind ledger), including exact state round trips."""

import json
import math
import random

import numpy as np
import pytest

from raygpt.config import SpikeConfig
from raygpt.train.outlier import (OUTLIER_DETECTOR_WINDOW_SIZE, OutlierDetector, RewindLedger,
                            SpikeMonitor, Verdict, rewind_target, robust_z)

W = OUTLIER_DETECTOR_WINDOW_SIZE


# ---------------------------------------------------------------------- OutlierDetector

def test_window_size_is_llmc_128():
    assert W == 128


@pytest.mark.parametrize("seed,loc,scale", [(0, 3.0, 0.2), (1, 10.0, 1.0), (2, -1.0, 5.0)])
def test_z_scores_match_numpy_over_last_128(seed, loc, scale):
    rng = np.random.default_rng(seed)
    values = rng.normal(loc, scale, 600)
    values[300] += 20 * scale  # one spike, so large z is covered too
    det = OutlierDetector()
    for i, v in enumerate(values):
        z = det.update(v)
        if i < W:
            assert math.isnan(z), i
            continue
        window = values[i - W + 1:i + 1]
        want = (v - window.mean()) / window.std()  # population std: divides by 128
        assert z == pytest.approx(want, rel=1e-7, abs=1e-9), i
    assert det.count == W


def test_first_128_are_nan_and_129th_is_finite():
    det = OutlierDetector()
    zs = [det.update(float(i % 7)) for i in range(W + 1)]
    assert all(math.isnan(z) for z in zs[:W])
    assert math.isfinite(zs[W])


def test_zero_deviation_gives_zero_not_nan():
    det = OutlierDetector()
    zs = [det.update(2.5) for _ in range(W + 5)]
    assert zs[W:] == [0.0] * 5


def test_evicts_oldest_and_divides_by_window_size():
    det = OutlierDetector()
    for _ in range(W):
        det.update(1.0)
    # window is now 127 ones and one 3.0: mean = 1 + 2/128, var = E[x^2] - mean^2
    z = det.update(3.0)
    mean = (127 + 3.0) / W
    var = (127 + 9.0) / W - mean * mean
    assert z == pytest.approx((3.0 - mean) / math.sqrt(var), rel=1e-12)
    assert det.index == 1 and det.buffer[0] == 3.0


def test_state_round_trip_is_bitwise():
    rng = random.Random(5)
    a = OutlierDetector()
    for _ in range(200):
        a.update(rng.gauss(4.0, 0.3))
    saved = json.loads(json.dumps(a.state_dict()))  # through JSON, as a checkpoint would
    b = OutlierDetector()
    b.load_state_dict(saved)
    assert b.sum == a.sum and b.sum_sq == a.sum_sq  # restored, not recomputed
    for _ in range(300):
        v = rng.gauss(4.0, 0.3)
        za, zb = a.update(v), b.update(v)
        assert za == zb  # bitwise, not approx


def test_state_restores_running_sums_not_a_recomputation():
    # huge values, then small ones: the running sums keep the rounding error of the evicted values
    rng = random.Random(0)
    a = OutlierDetector()
    for _ in range(W):
        a.update(rng.gauss(0.0, 1e6))
    for _ in range(300):
        a.update(rng.gauss(3.0, 0.1))
    state = a.state_dict()
    assert state["sum_sq"] != sum(v * v for v in state["buffer"])  # the drift is real
    b = OutlierDetector()
    b.load_state_dict(state)
    assert (b.sum, b.sum_sq) == (a.sum, a.sum_sq)
    assert b.update(3.2) == a.update(3.2)


def test_warming_up_state_round_trip():
    a = OutlierDetector()
    for i in range(10):
        a.update(float(i))
    b = OutlierDetector()
    b.load_state_dict(a.state_dict())
    assert b.count == 10 and b.index == 0
    zs_a = [a.update(float(i)) for i in range(200)]
    zs_b = [b.update(float(i)) for i in range(200)]
    assert sum(math.isnan(z) for z in zs_a) == W - 10
    assert np.array_equal(np.array(zs_a), np.array(zs_b), equal_nan=True)


def test_bad_detector_state_names_the_field():
    det = OutlierDetector()
    state = det.state_dict()
    with pytest.raises(ValueError, match="'buffer'"):
        det.load_state_dict({**state, "buffer": [0.0] * 64})
    with pytest.raises(ValueError, match="'count'"):
        det.load_state_dict({**state, "count": 129})
    with pytest.raises(ValueError, match="'index'"):
        det.load_state_dict({**state, "count": 5, "index": 3})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1e200])
def test_a_non_finite_or_huge_value_never_enters_the_window(bad):
    # llm.c's detector takes every value: one NaN makes its sums NaN for good and -sl/-sg never
    # skip again; raygpt's judges the value but keeps it out of the window
    rng = random.Random(3)
    values = [rng.gauss(3.0, 0.1) for _ in range(400)]
    a, b = OutlierDetector(), OutlierDetector()  # b never sees the bad value
    for i, v in enumerate(values):
        if i == 200:
            z = a.update(bad)
            assert math.isnan(z) if math.isnan(bad) else abs(z) > 1e3
        za, zb = a.update(v), b.update(v)
        assert za == zb or (i < W and math.isnan(za) and math.isnan(zb)), i
    assert math.isfinite(a.sum) and math.isfinite(a.sum_sq) and a.is_clean()
    assert a.update(3.0 + 20 * 0.1) > 5  # a later spike is still seen
    saved = json.loads(json.dumps(a.state_dict()))
    assert all(math.isfinite(v) for v in saved["buffer"]) and math.isfinite(saved["sum_sq"])


def test_a_bad_value_while_filling_is_not_counted():
    det = OutlierDetector()
    det.update(1.0)
    assert math.isnan(det.update(float("nan")))
    assert det.count == 1 and det.window() == [1.0]


def test_a_poisoned_detector_from_an_old_checkpoint_is_repaired_and_said_so():
    rng = random.Random(4)
    values = [rng.gauss(3.0, 0.1) for _ in range(300)]
    old = OutlierDetector()
    for v in values[:150]:
        old.update(v)
    # what raygpt before the fix (and llm.c) did with a NaN: into the sums
    old.sum, old.sum_sq = math.nan, math.nan
    old.buffer[old.index] = math.nan
    state = {"window_size": W, "buffer": old.buffer, "count": old.count, "index": old.index,
             "sum": old.sum, "sum_sq": old.sum_sq}
    det = OutlierDetector()
    det.load_state_dict(json.loads(json.dumps(state)))
    assert det.repair_note and "rebuilt from the 127 finite" in det.repair_note
    assert det.is_clean() and det.count == W - 1
    ref = OutlierDetector()  # the same window without the NaN, fed fresh
    for v in det.window():
        ref.update(v)
    zs = [(det.update(v), ref.update(v)) for v in values[150:]]
    assert math.isnan(zs[0][0]) and math.isnan(zs[0][1])  # the 128th value fills the window
    assert all(za == zb for za, zb in zs[1:])
    assert det.update(5.0) > 5  # -sl would skip again


def test_sums_poisoned_after_the_nan_was_evicted_are_rebuilt_from_the_window():
    det = OutlierDetector()
    for i in range(W):
        det.update(float(i % 5))
    state = {**det.state_dict(), "sum": math.nan}
    fresh = OutlierDetector()
    fresh.load_state_dict(state)
    assert fresh.repair_note and fresh.count == W and fresh.is_clean()
    assert fresh.sum == pytest.approx(det.sum)


def test_a_poisoned_detector_is_never_saved():
    det = OutlierDetector()
    det.sum = math.inf
    with pytest.raises(ValueError, match="poisoned"):
        det.state_dict()


def test_judge_keeps_skipping_outliers_after_a_nan_step():
    from raygpt.config import TrainConfig
    from raygpt.train.state import TrainState

    c = TrainConfig(skip_update_lossz=3.0, skip_update_gradz=3.0)
    state = TrainState.fresh(c)
    rng = random.Random(6)
    for step in range(200):
        state.judge(c, step, rng.gauss(3.0, 0.05), rng.gauss(1.0, 0.05))
    assert state.judge(c, 200, math.nan, math.nan).kind == "skip"  # non-finite: skipped
    assert state.judge(c, 201, math.inf, 1.0).kind == "skip"
    assert state.judge(c, 202, 3.0, 1.0).kind == "ok"
    v = state.judge(c, 203, 4.0, 1.0)
    assert v.kind == "skip" and "loss z-score" in v.reason
    v = state.judge(c, 204, 3.0, 9.0)
    assert v.kind == "skip" and "grad-norm z-score" in v.reason
    extras = state.extras()  # what a checkpoint carries: clean
    assert math.isfinite(extras["loss_detector"]["sum"])
    assert math.isfinite(extras["grad_detector"]["sum_sq"])


# ---------------------------------------------------------------------- SpikeMonitor

def cfg(**kw):
    base = dict(enabled=True, window=16, min_history=8, soft_z=6.0, hard_z=20.0, gnorm_mult=10.0,
                max_consecutive=2, safety_steps=1, max_rewinds=3, lr_scale_decay=0.5,
                min_lr_scale=0.2)
    base.update(kw)
    return SpikeConfig(**base)


def warmed(c=None, n=16):
    """A monitor fed n clean steps of loss 3.0 + 0.01 k and gnorm 1.0 + 0.05 k, k cycling through
    -2..2: median 3.0, MAD 0.01, scaled MAD 0.014826, so a loss of 3.15 has z ~ 10 (soft) and 5.0
    z ~ 135 (hard). Returns (monitor, next step)."""
    m = SpikeMonitor(c or cfg())
    for step in range(n):
        k = (3 * step) % 5 - 2  # -2..2 in a fixed cycle
        v = m.check(step, 3.0 + 0.01 * k, 1.0 + 0.05 * k)
        assert v.kind == "ok"
    return m, n


def test_robust_z_median_and_scaled_mad():
    values = [1.0, 2.0, 3.0, 4.0, 100.0]  # median 3, |dev| = 2,1,0,1,97 -> MAD 1
    assert robust_z(6.0, values) == pytest.approx(3.0 / 1.4826)
    assert robust_z(3.0 + 1e-4, [3.0] * 8) == pytest.approx(0.1)  # MAD 0: floored at 1e-3


def test_no_verdict_before_min_history_except_non_finite():
    m = SpikeMonitor(cfg())
    for step in range(7):
        v = m.check(step, 3.0 + 100 * step, 1.0 + 1000 * step)  # wild, but no baseline yet
        assert v.kind == "ok" and math.isnan(v.loss_z)
    v = m.check(7, float("nan"), 1.0)
    assert v.kind == "rewind" and v.spike_start == 7


def test_isolated_outlier_is_skipped_and_kept_out_of_the_window():
    m, step = warmed()
    before = list(m.losses)
    v = m.check(step, 3.15, 1.0)
    assert v.kind == "skip" and v.loss_z > 6.0 and v.spike_start == step
    assert "soft_z" in v.reason
    assert list(m.losses) == before  # the spike did not enter the baseline
    ok = m.check(step + 1, 3.0, 1.0)
    assert ok.kind == "ok" and m.consecutive == 0 and m.spike_start is None
    assert list(m.losses)[-1] == 3.0


def test_grad_norm_outlier_is_skipped():
    m, step = warmed()
    v = m.check(step, 3.0, 50.0)
    assert v.kind == "skip" and v.gnorm_ratio > 10.0 and "grad norm" in v.reason
    m2, step = warmed(cfg(gnorm_mult=0.0))
    assert m2.check(step, 3.0, 50.0).kind == "ok"  # gnorm_mult 0 turns the grad-norm test off


def test_loss_drop_is_not_a_spike():
    m, step = warmed()
    assert m.check(step, 2.0, 1.0).kind == "ok"


def test_consecutive_outliers_turn_into_a_rewind_from_the_first():
    m, step = warmed()  # max_consecutive = 2
    kinds = [m.check(step + i, 3.15, 1.0) for i in range(3)]
    assert [v.kind for v in kinds] == ["skip", "skip", "rewind"]
    assert all(v.spike_start == step for v in kinds)
    assert "3 outliers in a row" in kinds[2].reason


def test_ok_resets_the_run_of_outliers():
    m, step = warmed()
    assert m.check(step, 3.15, 1.0).kind == "skip"
    assert m.check(step + 1, 3.15, 1.0).kind == "skip"
    assert m.check(step + 2, 3.0, 1.0).kind == "ok"
    v = m.check(step + 3, 3.15, 1.0)
    assert v.kind == "skip" and v.spike_start == step + 3


@pytest.mark.parametrize("loss,gnorm", [(float("nan"), 1.0), (float("inf"), 1.0),
                                        (3.0, float("nan")), (3.0, float("inf"))])
def test_non_finite_rewinds_at_once(loss, gnorm):
    m, step = warmed()
    v = m.check(step, loss, gnorm)
    assert v.kind == "rewind" and "non-finite" in v.reason and v.spike_start == step
    assert len(m.losses) == 16 and all(math.isfinite(x) for x in m.losses)


def test_a_monitor_window_with_a_non_finite_step_is_repaired_on_load():
    m, step = warmed()
    state = json.loads(json.dumps(m.state_dict()))
    state["losses"][3] = math.nan
    state["gnorms"][5] = math.inf
    b = SpikeMonitor(cfg())
    b.load_state_dict(state)
    assert b.repair_note and "dropped 2 non-finite step(s) of 16" in b.repair_note
    assert len(b.losses) == 14 and all(math.isfinite(v) for v in (*b.losses, *b.gnorms))
    assert b.check(step, 3.0, 1.0).kind == "ok" and b.check(step + 1, 5.0, 1.0).kind == "rewind"
    b.losses.append(math.nan)
    with pytest.raises(ValueError, match="poisoned"):
        b.state_dict()


def test_hard_z_rewinds_at_once():
    m, step = warmed()
    v = m.check(step, 5.0, 1.0)
    assert v.loss_z > 20.0 and v.kind == "rewind" and "hard_z" in v.reason


def test_window_keeps_the_last_clean_steps():
    m, step = warmed(n=40)
    assert len(m.losses) == 16 and len(m.gnorms) == 16


def test_monitor_state_round_trip_is_exact():
    a, step = warmed(n=30)
    a.check(step, 3.15, 1.0)  # one outlier in flight
    saved = json.loads(json.dumps(a.state_dict()))
    b = SpikeMonitor(cfg())
    b.load_state_dict(saved)
    assert b.consecutive == 1 and b.spike_start == step
    rng = random.Random(9)
    for i in range(1, 40):
        loss = 3.0 + rng.uniform(-0.01, 0.01) + (0.6 if i % 7 == 0 else 0.0)
        va, vb = a.check(step + i, loss, 1.0), b.check(step + i, loss, 1.0)
        assert va == vb


def test_monitor_state_names_bad_fields():
    m = SpikeMonitor(cfg())
    good = m.state_dict()
    with pytest.raises(ValueError, match="'window'"):
        m.load_state_dict({**good, "window": 32})
    with pytest.raises(ValueError, match="'losses/gnorms'"):
        m.load_state_dict({**good, "losses": [1.0], "gnorms": []})
    with pytest.raises(ValueError, match="'spike_start'"):
        m.load_state_dict({**good, "consecutive": 2, "spike_start": None})


def test_verdict_kind_is_checked():
    with pytest.raises(ValueError, match="Verdict.kind"):
        Verdict("skip_step", 0.0, 1.0, "")


# ---------------------------------------------------------------------- rewind policy

def test_rewind_target_newest_checkpoint_before_the_spike():
    steps = [0, 20, 40, 60]
    assert rewind_target(steps, 45, 1) == 40
    assert rewind_target(steps, 41, 1) == 40
    assert rewind_target(steps, 40, 1) == 20   # the checkpoint at 40 is not strictly before
    assert rewind_target(steps, 40, 0) == 40
    assert rewind_target(steps, 60, 25) == 20
    assert rewind_target([20, 40], 10, 1) is None
    assert rewind_target([], 10, 1) is None
    assert rewind_target([60, 0, 40, 20], 59, 1) == 40  # order of the listing does not matter


def test_ledger_lowers_lr_scale_when_a_region_spikes_again():
    c = cfg(max_rewinds=5, lr_scale_decay=0.5, min_lr_scale=0.1)
    ledger = RewindLedger()
    scale, esc = ledger.record_rewind(100, 103, [(0, 800, 832)], c)
    assert (scale, esc) == (1.0, None)                  # first time: the data is blamed
    scale, esc = ledger.record_rewind(200, 201, [(0, 1600, 1616)], c)
    assert (scale, esc) == (1.0, None)                  # a different region
    scale, esc = ledger.record_rewind(103, 106, [(0, 824, 848)], c)
    assert scale == 0.5 and esc is None                 # overlaps 100-103: data was not the cause
    assert ledger.rewinds == 3 and ledger.lr_scale == 0.5
    assert ledger.skipped_ranges() == [(0, 800, 832), (0, 1600, 1616), (0, 824, 848)]


def test_ledger_escalates_past_max_rewinds():
    c = cfg(max_rewinds=2)
    ledger = RewindLedger()
    assert ledger.record_rewind(10, 11, [], c)[1] is None
    assert ledger.record_rewind(50, 51, [], c)[1] is None
    _, esc = ledger.record_rewind(90, 91, [], c)
    assert esc is not None and "--spike-max-rewinds 2" in esc and "rewind 3" in esc


def test_ledger_escalates_when_lr_scale_falls_below_the_floor():
    c = cfg(max_rewinds=10, lr_scale_decay=0.5, min_lr_scale=0.2)
    ledger = RewindLedger()
    ledger.record_rewind(10, 12, [], c)
    assert ledger.record_rewind(11, 12, [], c) == (0.5, None)
    assert ledger.record_rewind(12, 12, [], c) == (0.25, None)
    scale, esc = ledger.record_rewind(10, 10, [], c)
    assert scale == 0.125 and "--spike-min-lr-scale 0.2" in esc


def test_ledger_state_round_trip():
    c = cfg(max_rewinds=10)
    a = RewindLedger()
    a.record_rewind(10, 12, [(1, 5, 9)], c)
    a.record_rewind(11, 14, [(1, 9, 13), (2, 0, 4)], c)
    b = RewindLedger()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    assert b.record_rewind(12, 12, [], c) == a.record_rewind(12, 12, [], c)
    with pytest.raises(ValueError, match="'lr_scale'"):
        b.load_state_dict({**a.state_dict(), "lr_scale": 0.0})
    with pytest.raises(ValueError, match="history\\[0\\]"):
        b.load_state_dict({**a.state_dict(), "history": [{"region_start": 1}]})


# ---------------------------------------------------------------------- boundaries and errors
# (written against the survivors of a mutmut run, bench/results/mutants.md: every decision at its
# threshold, every value a verdict carries, every field a checkpoint holds)

def bad_state(load, state, owner, field, *fragments):
    """load(state) must refuse it with a ValueError that says whose state and which field, and
    what was expected / found (the fragments), so a user can fix the checkpoint."""
    with pytest.raises(ValueError) as e:
        load(state)
    msg = str(e.value)
    assert msg.startswith(f"{owner} state"), msg
    assert f"'{field}'" in msg, msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_a_value_of_exactly_max_window_value_stays_out_of_the_window():
    from raygpt.train.outlier import MAX_WINDOW_VALUE, admissible
    assert admissible(math.nextafter(MAX_WINDOW_VALUE, 0.0))
    assert not admissible(MAX_WINDOW_VALUE) and not admissible(-MAX_WINDOW_VALUE)
    det = OutlierDetector()
    det.update(1.0)
    det.update(MAX_WINDOW_VALUE)
    det.update(-MAX_WINDOW_VALUE)
    assert det.count == 1 and det.window() == [1.0]


def test_an_inadmissible_value_gets_its_z_against_the_full_window():
    # 64 zeros and 64 x 2e149: mean 1e149, std 1e149; 2e150 is too large to enter the window but
    # is judged as llm.c would judge it: z = (2e150 - 1e149) / 1e149 = 19
    det = OutlierDetector()
    for i in range(W):
        det.update(0.0 if i % 2 else 2e149)
    before = det.state_dict()
    assert det.update(2e150) == pytest.approx(19.0, rel=1e-12)
    assert det.update(-2e150) == pytest.approx(-21.0, rel=1e-12)
    assert det.update(math.inf) == math.inf
    assert math.isnan(det.update(math.nan))
    assert det.state_dict() == before  # judged, never entered


def test_an_inadmissible_value_against_a_flat_window_is_nan_not_a_crash():
    det = OutlierDetector()
    for _ in range(W):
        det.update(2.5)  # exact in binary: variance exactly 0
    for bad in (math.inf, -math.inf, 1e200, math.nan):
        assert math.isnan(det.update(bad)), bad
    assert det.update(2.5) == 0.0  # an admissible value against a zero std: z 0


def test_a_variance_that_rounds_below_zero_gives_nan_not_a_crash():
    # 128 x 0.3: sum_sq / 128 - mean^2 rounds to -5.6e-17; C's sqrt gives NaN, so must we
    det = OutlierDetector()
    for _ in range(W):
        det.update(0.3)
    assert det.sum_sq / W - (det.sum / W) ** 2 < 0.0
    assert math.isnan(det.update(math.inf))   # judged against the window as it stands
    assert math.isnan(det.update(0.3))        # entered: the variance is still below zero
    assert det.count == W and det.is_clean()


def test_window_is_oldest_first_once_it_wraps():
    det = OutlierDetector()
    for i in range(W + 2):
        det.update(float(i))
    assert det.window() == [float(i) for i in range(2, W + 2)]
    assert det.index == 2
    det2 = OutlierDetector()
    for i in range(W):
        det2.update(float(i))
    assert det2.window() == [float(i) for i in range(W)] and det2.index == 0


@pytest.mark.parametrize("n_values", [0, 1, W - 1, W, W + 1, 3 * W + 17])
def test_detector_round_trip_at_every_fill_level(n_values):
    # a checkpoint can be taken at any step: fresh, filling, just full, wrapped many times
    rng = random.Random(n_values)
    a = OutlierDetector()
    assert a.repair_note is None  # only a repairing load sets it
    for _ in range(n_values):
        a.update(rng.gauss(3.0, 0.2))
    saved = json.loads(json.dumps(a.state_dict()))
    assert saved["window_size"] == W  # so a detector of another window refuses it
    b = OutlierDetector()
    b.load_state_dict(saved)
    assert b.repair_note is None
    assert (b.count, b.index, b.sum, b.sum_sq) == (a.count, a.index, a.sum, a.sum_sq)
    assert b.window() == a.window()
    for _ in range(W + 5):
        v = rng.gauss(3.0, 0.2)
        za, zb = a.update(v), b.update(v)
        assert za == zb or (math.isnan(za) and math.isnan(zb))
    assert b.state_dict() == a.state_dict()


def test_a_detector_state_without_window_size_loads_as_128():
    a = OutlierDetector()
    for i in range(5):
        a.update(float(i))
    state = a.state_dict()
    del state["window_size"]
    b = OutlierDetector()
    b.load_state_dict(state)
    assert b.window() == a.window()


def test_every_malformed_detector_field_is_named():
    det = OutlierDetector()
    for _ in range(W + 3):
        det.update(1.0)
    good = det.state_dict()
    load, o = OutlierDetector().load_state_dict, "OutlierDetector"
    bad_state(load, {**good, "window_size": 64}, o, "window_size", "expected 128", "found 64")
    bad_state(load, {**good, "buffer": [0.0] * 64}, o, "buffer", "a list of 128 floats",
              "a list of 64")
    bad_state(load, {**good, "buffer": None}, o, "buffer", "found 'NoneType'")
    bad_state(load, {**good, "buffer": "1,2"}, o, "buffer", "found 'str'")
    bad_state(load, {**good, "count": 129}, o, "count", "[0, 128]", "found 129")
    bad_state(load, {**good, "count": -1}, o, "count", "found -1")
    bad_state(load, {**good, "count": 5.0}, o, "count", "found 5.0")
    bad_state(load, {**good, "index": W}, o, "index", "[0, 128)", "found 128")
    bad_state(load, {**good, "index": -1}, o, "index", "found -1")
    bad_state(load, {**good, "count": 5, "index": 3}, o, "index", "0 while filling", "found 3")
    for key in ("sum", "sum_sq"):
        bad_state(load, {**good, key: "1.0"}, o, key, "a float", "found '1.0'")
        bad_state(load, {k: v for k, v in good.items() if k != key}, o, key, "found None")


def test_the_repair_note_says_what_was_poisoned():
    det = OutlierDetector()
    for i in range(W):
        det.update(float(i % 5))
    state = det.state_dict()
    state["buffer"][7] = math.inf
    state["sum"] = math.nan
    fresh = OutlierDetector()
    fresh.load_state_dict(state)
    assert "sum nan" in fresh.repair_note
    assert "1 of 128 window values not finite" in fresh.repair_note
    assert fresh.window() == [float(i % 5) for i in range(W) if i != 7]  # order kept
    fresh.load_state_dict(det.state_dict())  # a clean state clears the note
    assert fresh.repair_note is None


def test_verdict_kind_error_lists_the_kinds():
    with pytest.raises(ValueError, match="ok \\| skip \\| rewind \\| escalate"):
        Verdict("fine", 0.0, 1.0, "")


def flat(c, n, loss=3.0, gnorm=1.0):
    """A monitor fed n clean steps of one loss and grad norm (MAD 0: the z denominator is the
    1e-3 floor)."""
    m = SpikeMonitor(c)
    for step in range(n):
        assert m.check(step, loss, gnorm).kind == "ok"
    return m, n


def test_fresh_monitor_non_finite_first_step_starts_the_spike_there():
    m = SpikeMonitor(cfg())
    assert m.repair_note is None and m.consecutive == 0 and m.spike_start is None
    v = m.check(0, math.nan, 1.0)
    assert v.kind == "rewind" and v.spike_start == 0 and m.consecutive == 1
    assert math.isnan(v.loss_z) and math.isnan(v.gnorm_ratio)


def test_warming_up_verdict_and_the_first_judged_step():
    c = cfg(min_history=8)
    m = SpikeMonitor(c)
    for step in range(8):
        v = m.check(step, 3.0, 1.0)
        assert v.kind == "ok" and math.isnan(v.loss_z) and math.isnan(v.gnorm_ratio)
        assert f"({step + 1}/8 clean steps)" in v.reason
    v = m.check(8, 3.5, 1.0)  # exactly min_history clean steps: judged now
    assert v.kind == "rewind" and v.spike_start == 8 and v.loss_z == pytest.approx(500.0)
    assert v.gnorm_ratio == 1.0


def test_ok_verdict_carries_z_and_grad_norm_ratio():
    m, step = flat(cfg(), 16, gnorm=0.5)
    v = m.check(step, 3.001, 0.75)
    assert v == Verdict("ok", pytest.approx(1.0), 1.5, "")
    m, step = flat(cfg(), 16, gnorm=2.0)
    assert m.check(step, 2.999, 3.0).gnorm_ratio == 1.5


def test_loss_thresholds_exactly_at_and_just_past():
    # thresholds set to the z the step will have: z > soft_z / hard_z counts, z == does not
    base, _ = flat(cfg(), 16)
    z = robust_z(3.01, base.losses)
    cases = [(dict(soft_z=z, hard_z=z + 100), "ok"),
             (dict(soft_z=math.nextafter(z, 0.0), hard_z=z + 100), "skip"),
             (dict(soft_z=z - 1, hard_z=z), "skip"),
             (dict(soft_z=z - 1, hard_z=math.nextafter(z, 0.0)), "rewind")]
    for kw, want in cases:
        m, step = flat(cfg(**kw), 16)
        v = m.check(step, 3.01, 1.0)
        assert v.kind == want and v.loss_z == z, (kw, v)
        if want != "ok":
            assert v.spike_start == step and v.gnorm_ratio == 1.0


def test_grad_norm_threshold_exactly_at_and_just_past():
    m, step = flat(cfg(gnorm_mult=10.0), 16, gnorm=2.0)  # threshold 10 x median 2 = 20
    assert m.check(step, 3.0, 20.0).kind == "ok"
    v = m.check(step + 1, 3.0, math.nextafter(20.0, 30.0))
    assert v.kind == "skip" and v.gnorm_ratio == pytest.approx(10.0)
    assert m.check(step + 2, 3.0, 19.0).kind == "ok"
    assert m.check(step + 3, 3.0, 10.0).kind == "ok"  # 10 x median, not 10 / median
    # a multiplier at or below 1 still turns the test on
    m, step = flat(cfg(gnorm_mult=1.0), 16)
    assert m.check(step, 3.0, 1.5).kind == "skip"


def test_grad_norm_ratio_against_a_window_of_zero_norms():
    m, step = flat(cfg(), 16, gnorm=0.0)
    v = m.check(step, 3.0, 0.0)
    assert v.kind == "ok" and v.gnorm_ratio == 0.0
    v = m.check(step + 1, 3.0, 0.5)
    assert v.kind == "skip" and v.gnorm_ratio == math.inf
    m, step = flat(cfg(), 16, gnorm=0.5)  # a median below 1 divides as any other
    assert m.check(step, 3.0, 0.75).gnorm_ratio == 1.5


def test_a_step_that_is_both_outliers_says_both():
    m, step = flat(cfg(), 16)
    v = m.check(step, 3.01, 50.0)
    assert v.kind == "skip"
    assert "soft_z 6.0, grad norm" in v.reason
    m, step = flat(cfg(max_consecutive=0), 16)
    v = m.check(step, 3.01, 50.0)
    assert v.kind == "rewind" and "soft_z 6.0, grad norm" in v.reason


def test_max_consecutive_zero_rewinds_the_first_outlier_from_its_step():
    m, step = flat(cfg(max_consecutive=0), 16)
    v = m.check(step, 3.01, 1.0)
    assert v.kind == "rewind" and v.spike_start == step
    assert v.loss_z == pytest.approx(10.0) and v.gnorm_ratio == 1.0
    assert "1 outliers in a row (> max_consecutive 0)" in v.reason


def test_monitor_round_trip_of_a_full_window_with_varying_grad_norms():
    rng = random.Random(11)
    a = SpikeMonitor(cfg())
    for step in range(40):  # a full, wrapped window; the grad norm drifts down
        assert a.check(step, 3.0 + rng.uniform(-0.01, 0.01), 2.0 - 0.03 * step).kind == "ok"
    saved = json.loads(json.dumps(a.state_dict()))
    b = SpikeMonitor(cfg())
    b.load_state_dict(saved)
    assert b.repair_note is None
    assert list(b.losses) == list(a.losses) and list(b.gnorms) == list(a.gnorms)
    for step in range(40, 80):
        loss, gnorm = 3.0 + rng.uniform(-0.01, 0.01), 0.8 - 0.005 * (step - 40)
        assert a.check(step, loss, gnorm) == b.check(step, loss, gnorm)
        assert len(b.gnorms) == len(b.losses) == 16
    assert b.state_dict() == a.state_dict()


def test_a_fresh_monitor_round_trips():
    a = SpikeMonitor(cfg())
    b = SpikeMonitor(cfg())
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # a checkpoint at step 0
    assert b.state_dict() == a.state_dict() and b.repair_note is None


def test_every_malformed_monitor_field_is_named():
    m, _ = warmed()
    good = m.state_dict()
    load, o = SpikeMonitor(cfg()).load_state_dict, "SpikeMonitor"
    bad_state(load, {**good, "window": 32}, o, "window", "16 (this run's window)", "found 32")
    bad_state(load, {**good, "losses": [1.0], "gnorms": []}, o, "losses/gnorms",
              "two lists of equal length <= window 16", "found (1, 0)")
    bad_state(load, {**good, "losses": None}, o, "losses/gnorms", "found (None, 16)")
    bad_state(load, {**good, "gnorms": None}, o, "losses/gnorms", "found (16, None)")
    bad_state(load, {**good, "losses": [1.0] * 17, "gnorms": [1.0] * 17}, o, "losses/gnorms",
              "found (17, 17)")
    bad_state(load, {**good, "consecutive": -1, "spike_start": 3}, o, "consecutive",
              "an integer >= 0", "found -1")
    bad_state(load, {**good, "consecutive": 1.0, "spike_start": 3}, o, "consecutive",
              "found 1.0")
    bad_state(load, {**good, "consecutive": 2, "spike_start": None}, o, "spike_start",
              "a step when consecutive > 0, else None", "found None")
    bad_state(load, {**good, "consecutive": 0, "spike_start": 5}, o, "spike_start", "found 5")
    bad_state(load, {**good, "consecutive": 1, "spike_start": "5"}, o, "spike_start",
              "found '5'")


def test_a_poisoned_monitor_is_never_saved_and_says_why():
    m, _ = warmed()
    m.gnorms.append(math.inf)
    with pytest.raises(ValueError) as e:
        m.state_dict()
    assert str(e.value).startswith("SpikeMonitor state: losses/gnorms")
    assert "refusing to save a poisoned window" in str(e.value)


def test_an_inverted_rewind_region_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"region_start <= region_end, found \[12, 10\]"):
        RewindLedger().record_rewind(12, 10, [], cfg())


def test_ledger_escalates_below_the_lr_floor_not_at_it():
    c = cfg(max_rewinds=10, lr_scale_decay=0.5, min_lr_scale=0.25)
    ledger = RewindLedger()
    ledger.record_rewind(10, 12, [], c)
    assert ledger.record_rewind(10, 12, [], c) == (0.5, None)
    assert ledger.record_rewind(10, 12, [], c) == (0.25, None)  # at the floor: still runs
    scale, esc = ledger.record_rewind(10, 12, [], c)
    assert scale == 0.125 and "lr_scale 0.125 is below --spike-min-lr-scale 0.25" in esc


def test_a_fresh_ledger_round_trips():
    a = RewindLedger()  # a checkpoint before any rewind: rewinds 0, lr_scale 1.0
    b = RewindLedger()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict() == {"rewinds": 0, "lr_scale": 1.0, "history": []}


def test_every_malformed_ledger_field_is_named():
    c = cfg(max_rewinds=10)
    a = RewindLedger()
    a.record_rewind(10, 12, [(1, 5, 9)], c)
    good = a.state_dict()
    load, o = RewindLedger().load_state_dict, "RewindLedger"
    bad_state(load, {**good, "rewinds": -1}, o, "rewinds", "an integer >= 0", "found -1")
    bad_state(load, {**good, "rewinds": 1.0}, o, "rewinds", "found 1.0")
    bad_state(load, {**good, "lr_scale": 1.5}, o, "lr_scale", "a value in (0, 1]", "found 1.5")
    bad_state(load, {**good, "lr_scale": 0.0}, o, "lr_scale", "found 0.0")
    bad_state(load, {**good, "lr_scale": "1"}, o, "lr_scale", "found '1'")
    bad_state(load, {**good, "history": "none"}, o, "history", "a list of rewinds",
              "found 'none'")
    bad_state(load, {**good, "history": [{"region_start": 1}]}, o, "history[0]",
              "region_start, region_end and skipped_ranges")
