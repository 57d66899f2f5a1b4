"""Learning-rate schedules: one pure function of the step per kind, as llm.c's llmc/schedulers.h.

Resume restores only `step`; the learning rate is recomputed from it (no scheduler object to
save). The kinds are llm.c's four:

    warmup (cosine, linear, wsd; 1-based):  lr = peak * (step + 1) / warmup
    cosine:    r = (step - warmup) / (total - warmup);  lr = min + 0.5 (1 + cos(pi r)) (peak - min)
    linear:    r = (step - warmup) / (total - warmup);  lr = peak - r (peak - min)
    constant:  lr = peak                         (no warmup, as llm.c)
    wsd:       plateau at peak until dp = (int)(0.8f * total), then
               r = (step - dp) / (total - dp);  lr = min + (1 - sqrt(r)) (peak - min)

with min = peak * final_lr_frac. llm.c computes in C `float`; so do we, operation by operation in
numpy.float32 (int -> float conversions included), so the values agree with llm.c's to the last
bit except where its cosf and our cos differ by an ulp, and the WSD boundary step is the same even
where float32 rounding of 0.8f * total differs from the exact 4/5 (totals above ~2^24).
The returned value is a Python float holding that float32 value.
"""

from __future__ import annotations

import math

import numpy as np

_F = np.float32


def _check(step: int, warmup_steps: int, total_steps: int) -> None:
    if total_steps < 1:
        raise ValueError(f"learning rate schedule: total_steps must be >= 1, found {total_steps}")
    if warmup_steps < 0:
        raise ValueError(f"learning rate schedule: warmup_steps must be >= 0, found {warmup_steps}")
    if step < 0 or step > total_steps:
        raise ValueError(f"learning rate schedule: step must be in [0, total_steps={total_steps}], "
                         f"found {step}")


def _warmup(step: int, peak: np.float32, warmup_steps: int) -> np.float32:
    # llm.c: learning_rate * ((float)(step + 1)) / warmup_iterations  (left to right, in float)
    return peak * _F(step + 1) / _F(warmup_steps)


def _decay_ratio(step: int, start: int, total_steps: int, kind: str) -> np.float32:
    # llm.c: ((float)(step - start)) / (total - start), an int denominator converted to float.
    if total_steps == start:
        raise ValueError(f"learning rate schedule {kind!r}: the decay phase starts at step "
                         f"{start} = total_steps, so it has zero length (expected warmup_steps "
                         f"< total_steps)")
    ratio = _F(step - start) / _F(total_steps - start)
    assert _F(0.0) <= ratio <= _F(1.0), f"{kind} decay ratio {ratio} outside [0, 1] at step {step}"
    return ratio


def learning_rate_cosine(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int,
                         final_lr_frac: float) -> float:
    """Linear warmup, then cosine decay from peak_lr to peak_lr * final_lr_frac at total_steps."""
    _check(step, warmup_steps, total_steps)
    peak = _F(peak_lr)
    if step < warmup_steps:
        return float(_warmup(step, peak, warmup_steps))
    ratio = _decay_ratio(step, warmup_steps, total_steps, "cosine")
    # llm.c: cosf(M_PI * decay_ratio): the product is in double (M_PI is a double), cosf takes it
    # rounded to float. cos in double rounded to float is within an ulp of cosf.
    angle = _F(math.pi * float(ratio))
    coeff = _F(0.5) * (_F(1.0) + _F(math.cos(float(angle))))  # 1 -> 0
    min_lr = peak * _F(final_lr_frac)
    return float(min_lr + coeff * (peak - min_lr))


def learning_rate_linear(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int,
                         final_lr_frac: float) -> float:
    """Linear warmup, then linear decay from peak_lr to peak_lr * final_lr_frac at total_steps."""
    _check(step, warmup_steps, total_steps)
    peak = _F(peak_lr)
    if step < warmup_steps:
        return float(_warmup(step, peak, warmup_steps))
    ratio = _decay_ratio(step, warmup_steps, total_steps, "linear")
    min_lr = peak * _F(final_lr_frac)
    return float(peak - ratio * (peak - min_lr))


def learning_rate_constant(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int,
                           final_lr_frac: float) -> float:
    """peak_lr at every step. As llm.c, the constant schedule has no warmup."""
    _check(step, warmup_steps, total_steps)
    return float(_F(peak_lr))


def wsd_decay_start(total_steps: int) -> int:
    """The first step of WSD's decay phase: llm.c's (int)(0.8f * train_num_batches), in float32.
    Checkpoint retention keeps the last checkpoint before this step (a WSD sweep's
    cooldown branches start from it)."""
    return int(_F(0.8) * _F(total_steps))


def learning_rate_wsd(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int,
                      final_lr_frac: float) -> float:
    """Warmup, stable plateau at peak_lr, then a 1 - sqrt decay over the last 20% of the steps
    (Hagele et al. 2024, as llm.c). Usually run with final_lr_frac = 0."""
    _check(step, warmup_steps, total_steps)
    peak = _F(peak_lr)
    decay_point = wsd_decay_start(total_steps)
    if step < warmup_steps:
        # llm.c's WSD divides first, then multiplies (the other kinds multiply first): keep it
        return float(peak * (_F(step + 1) / _F(warmup_steps)))
    if step < decay_point:
        return float(peak)
    ratio = _decay_ratio(step, decay_point, total_steps, "wsd")
    min_lr = peak * _F(final_lr_frac)
    return float(min_lr + (_F(1.0) - np.sqrt(ratio)) * (peak - min_lr))


_SCHEDULES = {
    "cosine": learning_rate_cosine,
    "linear": learning_rate_linear,
    "constant": learning_rate_constant,
    "wsd": learning_rate_wsd,
}
# the one list of schedule names: -k's choices and a sweep's default space read it
KINDS = tuple(_SCHEDULES)


def learning_rate(kind: str, step: int, *, peak_lr: float, warmup_steps: int, total_steps: int,
                  final_lr_frac: float) -> float:
    """The learning rate of schedule `kind` at 0-based `step` (llm.c's get_learning_rate).
    An unknown kind is an error, never a fallback to another schedule."""
    fn = _SCHEDULES.get(kind)
    if fn is None:
        raise ValueError(f"unknown learning rate schedule {kind!r}; expected one of "
                         f"{' | '.join(KINDS)}")
    return fn(step, peak_lr=peak_lr, warmup_steps=warmup_steps, total_steps=total_steps,
              final_lr_frac=final_lr_frac)
