"""raygpt.train.schedule against llm.c's float arithmetic: golden values, an independent float32
transcription, hand-computed values, and the errors."""

import math

import numpy as np
import pytest

from raygpt.train.schedule import (KINDS, learning_rate, learning_rate_wsd,
                             wsd_decay_start)

# Printed with %.9g by a C program computing llm.c's schedulers.h formulas in `float`
# (gcc -O2, glibc cosf), lr_scheduler_init(kind, 1e-3f, 100, 1000, 0.0f).
GOLDEN_A = {
    "cosine": {0: 1.00000007e-05, 50: 0.000510000042, 99: 0.00100000005, 100: 0.00100000005,
               500: 0.000586824142, 799: 0.000118101991, 800: 0.00011697779,
               900: 3.01536929e-05, 999: 3.03983705e-09, 1000: 0.0},
    "linear": {0: 1.00000007e-05, 50: 0.000510000042, 99: 0.00100000005, 100: 0.00100000005,
               500: 0.000555555569, 799: 0.000223333365, 800: 0.000222222239,
               900: 0.000111111091, 999: 1.11106783e-06, 1000: 0.0},
    "wsd": {0: 1.00000007e-05, 50: 0.000510000042, 99: 0.00100000005, 100: 0.00100000005,
            500: 0.00100000005, 799: 0.00100000005, 800: 0.00100000005,
            900: 0.000292893237, 999: 2.50315679e-06, 1000: 0.0},
    "constant": {0: 0.00100000005, 99: 0.00100000005, 500: 0.00100000005, 1000: 0.00100000005},
}
# The same C program, lr_scheduler_init(kind, 6e-4f, 700, 19560, 0.1f) (GPT-2 124M on 10B tokens).
# Step 9 differs between cosine and wsd in the last bits: llm.c's WSD warmup divides before it
# multiplies, the others multiply first.
GOLDEN_B = {
    "cosine": {0: 8.57142879e-07, 9: 8.57142822e-06, 699: 0.000600000028, 701: 0.000600000028,
               9000: 0.00038052228, 15648: 0.000115325456, 19559: 6.00000021e-05,
               19560: 6.00000021e-05},
    "linear": {0: 8.57142879e-07, 9: 8.57142822e-06, 699: 0.000600000028, 701: 0.00059997139,
               9000: 0.000362354214, 15648: 0.000172008469, 19559: 6.00286294e-05,
               19560: 5.99999912e-05},
    "wsd": {0: 8.57142879e-07, 9: 8.57142913e-06, 699: 0.000600000028, 701: 0.000600000028,
            15647: 0.000600000028, 15648: 0.000600000028, 19559: 6.00690437e-05,
            19560: 6.00000021e-05},
}


def lr(kind, step, peak, warmup, total, frac):
    return learning_rate(kind, step, peak_lr=peak, warmup_steps=warmup, total_steps=total,
                         final_lr_frac=frac)


def rel_err(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("golden,args", [(GOLDEN_A, (1e-3, 100, 1000, 0.0)),
                                         (GOLDEN_B, (6e-4, 700, 19560, 0.1))])
def test_golden_values_from_c_float(golden, args):
    for kind, points in golden.items():
        for step, want in points.items():
            got = lr(kind, step, *args)
            if want == 0.0:
                assert got == 0.0, (kind, step, got)
            else:
                assert rel_err(got, want) < 1e-6, (kind, step, got, want)
            if kind != "cosine":  # no transcendental: every float op is IEEE, so bitwise equal
                assert np.float32(got) == np.float32(want), (kind, step, got, want)


def transcription(kind, peak, warmup, total, frac):
    """Independent vectorised float32 transcription of llm.c's llmc/schedulers.h over all steps."""
    f = np.float32
    steps = np.arange(total + 1)
    peak, frac = f(peak), f(frac)
    min_lr = peak * frac
    out = np.empty(total + 1, dtype=np.float32)
    if kind == "constant":
        out[:] = peak
        return out
    if kind == "wsd":
        dp = int(f(0.8) * f(total))
        out[:] = peak
        w = steps < warmup
        out[w] = peak * ((steps[w] + 1).astype(np.float32) / f(warmup))
        d = steps >= max(dp, warmup)
        r = (steps[d] - dp).astype(np.float32) / f(total - dp)
        out[d] = min_lr + (f(1) - np.sqrt(r)) * (peak - min_lr)
        return out
    w = steps < warmup
    out[w] = peak * (steps[w] + 1).astype(np.float32) / f(warmup)
    r = (steps[~w] - warmup).astype(np.float32) / f(total - warmup)
    if kind == "cosine":
        angle = (np.pi * r.astype(np.float64)).astype(np.float32)
        coeff = f(0.5) * (f(1) + np.cos(angle.astype(np.float64)).astype(np.float32))
        out[~w] = min_lr + coeff * (peak - min_lr)
    else:
        out[~w] = peak - r * (peak - min_lr)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("args", [(1e-3, 100, 1000, 0.0), (6e-4, 20, 200, 0.1),
                                  (1e-3, 10, 150, 0.1), (3e-4, 0, 37, 0.25), (7.7e-4, 3, 7, 0.0),
                                  (2e-4, 170, 180, 0.5)])
def test_matches_independent_float32_transcription(kind, args):
    peak, warmup, total, frac = args
    want = transcription(kind, *args)
    for step in range(total + 1):
        got = lr(kind, step, *args)
        assert np.float32(got) == want[step], (kind, args, step, got, want[step])
        assert got == float(np.float32(got))  # the value is a float32 value, as llm.c's


def test_seed_000_hand_values():
    args = (1e-3, 100, 1000, 0.0)
    assert rel_err(lr("wsd", 0, *args), 1e-5) < 1e-6        # (0 + 1) / 100, not 0
    assert rel_err(lr("wsd", 99, *args), 1e-3) < 1e-6       # warmup ends
    for step in (100, 500, 799, 800):                       # plateau; decay_ratio 0 at 800
        assert rel_err(lr("wsd", step, *args), 1e-3) < 1e-6
    # 1 - sqrt(199/200) cancels: float32 (llm.c's sqrtf of 0.995f) keeps ~5 digits of it, so the
    # float32 value is 1e-5 away from exact math in relative terms yet equal to llm.c's to the bit.
    exact = 1e-3 * (1 - math.sqrt(199 / 200))
    got = lr("wsd", 999, *args)
    assert rel_err(got, exact) < 2e-5
    assert abs(got - exact) < 1e-7 * 1e-3
    assert np.float32(got) == np.float32(2.50315679e-06)
    # cosine and linear: the same warmup, then their own decay
    for kind in ("cosine", "linear"):
        assert rel_err(lr(kind, 0, *args), 1e-5) < 1e-6
        assert rel_err(lr(kind, 100, *args), 1e-3) < 1e-6
    assert rel_err(lr("cosine", 550, *args), 1e-3 * 0.5) < 1e-6   # halfway through the decay
    assert rel_err(lr("linear", 550, *args), 1e-3 * 0.5) < 1e-6
    assert lr("linear", 1000, 1e-3, 100, 1000, 0.1) == pytest.approx(1e-4, rel=1e-6)
    assert lr("cosine", 1000, 1e-3, 100, 1000, 0.1) == pytest.approx(1e-4, rel=1e-6)
    assert lr("constant", 0, *args) == pytest.approx(1e-3, rel=1e-6)  # no warmup, as llm.c


def test_wsd_decay_start_is_float32_truncation():
    assert wsd_decay_start(1000) == 800
    assert wsd_decay_start(19560) == 15648
    assert wsd_decay_start(7) == 5 and wsd_decay_start(1) == 0
    # Above ~2^24 float32 rounding of 0.8f * n lands past the exact 4n/5: llm.c's boundary wins.
    n = 16777116
    assert n * 4 // 5 == 13421692
    assert wsd_decay_start(n) == 13421693
    # and the schedule uses that boundary: the plateau still holds at the exact-math boundary
    peak = 1e-3
    assert learning_rate_wsd(13421692, peak_lr=peak, warmup_steps=0, total_steps=n,
                             final_lr_frac=0.0) == float(np.float32(peak))


def test_unknown_kind_raises_naming_it_and_the_allowed_ones():
    with pytest.raises(ValueError) as e:
        lr("cosin", 0, 1e-3, 10, 100, 0.0)
    assert str(e.value) == ("unknown learning rate schedule 'cosin'; expected one of "
                            + " | ".join(KINDS))


@pytest.mark.parametrize("kind", KINDS)
def test_step_outside_the_run_raises(kind):
    with pytest.raises(ValueError, match="step must be in"):
        lr(kind, 1001, 1e-3, 100, 1000, 0.0)
    with pytest.raises(ValueError, match="step must be in"):
        lr(kind, -1, 1e-3, 100, 1000, 0.0)
    assert lr(kind, 1000, 1e-3, 100, 1000, 0.0) >= 0.0  # the last step itself is allowed


def test_bad_lengths_raise():
    with pytest.raises(ValueError, match="total_steps"):
        lr("cosine", 0, 1e-3, 0, 0, 0.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        lr("linear", 0, 1e-3, -1, 10, 0.0)
    # warmup == total: the decay phase has no length, so step == total has no defined value
    # ...and the error names the schedule it came from (the decay phase is shared code)
    for kind in ("cosine", "linear"):
        with pytest.raises(ValueError, match=f"schedule '{kind}': the decay phase .* zero length"):
            lr(kind, 10, 1e-3, 10, 10, 0.0)
    assert lr("cosine", 9, 1e-3, 10, 10, 0.0) == pytest.approx(1e-3, rel=1e-6)


def test_wsd_decays_from_its_decay_point_on_not_after_it():
    """llm.c's WSD holds the plateau while step < decay_point and computes the decay at
    decay_point itself: min + (1 - sqrt(0)) * (peak - min), which in float32 is not always
    peak (here one ulp above it: peak - min rounds). A schedule that held the plateau through
    decay_point would return peak exactly (found by bench/mutants.sh: `<` -> `<=` survived)."""
    d = wsd_decay_start(100)
    args = dict(peak_lr=1e-4, warmup_steps=10, total_steps=100, final_lr_frac=0.1)
    peak = float(np.float32(1e-4))
    assert learning_rate_wsd(d - 1, **args) == peak
    at = learning_rate_wsd(d, **args)
    p, m = np.float32(1e-4), np.float32(1e-4) * np.float32(0.1)
    assert at == float(m + (np.float32(1.0) - np.sqrt(np.float32(0.0))) * (p - m)) and at != peak


@pytest.mark.parametrize("kind", KINDS)
def test_a_one_step_run_has_a_schedule(kind):
    """total_steps=1 is the smallest legal run (-x 1): its one step, after no warmup, is at the
    peak rate for every kind."""
    assert lr(kind, 0, 1e-3, 0, 1, 0.0) == pytest.approx(1e-3, rel=1e-6)
