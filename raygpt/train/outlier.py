"""Loss and grad-norm outliers: llm.c's z-score `OutlierDetector` and raygpt's spike policy
(skip isolated outliers, rewind sustained spikes, escalate to a human).

Two layers, both pure (no I/O, no torch), both with exact `state_dict()` / `load_state_dict()` so a
resumed run judges every step exactly as the uninterrupted run would have:

- `OutlierDetector`: llmc/outlier_detector.h. Mean and std over a sliding window of the last 128
  values, kept as running sums in double precision; it drives llm.c's `-sl` / `-sg` skips.
- `SpikeMonitor`: a graded response. A robust baseline (median and MAD of the last
  `window` clean losses, median of their grad norms) gives a verdict per step: "ok", "skip" (an
  isolated outlier: drop the update, the step still advances) or "rewind" (non-finite, past the
  hard threshold, or more than `max_consecutive` outliers in a row). `rewind_target` picks the
  checkpoint to go back to and `RewindLedger` decides when repeated rewinds lower the learning
  rate (`lr_scale`) or must escalate to a human.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from raygpt.config import SpikeConfig

OUTLIER_DETECTOR_WINDOW_SIZE = 128
MAX_WINDOW_VALUE = 1e150
"""Values at or above this magnitude stay out of the detector's window: 128 squares of 1e150 sum
to 1.3e302, well inside a double, so the running sums can never overflow to inf (and then NaN)."""


def admissible(x: float) -> bool:
    """Whether x may enter a detector's window: finite and below MAX_WINDOW_VALUE in magnitude."""
    return math.isfinite(x) and abs(x) < MAX_WINDOW_VALUE


class OutlierDetector:
    """llm.c's OutlierDetector: `update(x)` returns the z-score of x against the window that ends
    with x, or NaN while fewer than 128 values have been seen.

    While filling, x goes to buffer[count]; afterwards the value at the circular cursor `index` is
    evicted (subtracted from sum and sum_sq), x is written there and added, and index advances.
    Statistics always divide by the window size:
        mean = sum / 128,  var = sum_sq / 128 - mean^2,  z = (x - mean) / sqrt(var)
    and z is 0.0 when the std is exactly 0. The sums are running doubles (Python floats are C
    doubles), so they carry llm.c's rounding history; `state_dict` saves them as they are rather
    than recomputing them from the buffer, which keeps resumed z-scores bitwise equal. A variance
    that rounds below zero gives NaN, as C's sqrt does.

    Where raygpt departs from llm.c: a value that is not finite, or so large that its square
    could overflow the running sums (|x| >= MAX_WINDOW_VALUE), never enters the window. In llm.c
    one NaN loss makes sum and sum_sq NaN for the rest of the run (evicting it computes NaN - NaN),
    every later z is NaN and -sl / -sg never skip again; the poisoned sums would also be saved in
    every checkpoint. Such a value gets its z against the window as it stands (NaN for NaN, and
    nothing is entered or evicted), and `load_state_dict` repairs a detector poisoned by an older
    raygpt (see `repair_note`).
    """

    def __init__(self) -> None:
        self.buffer = [0.0] * OUTLIER_DETECTOR_WINDOW_SIZE
        self.count = 0   # values seen, saturating at the window size
        self.index = 0   # circular write cursor once the window is full
        self.sum = 0.0
        self.sum_sq = 0.0
        self.repair_note: str | None = None  # set by load_state_dict when it had to repair

    def update(self, value: float) -> float:
        x = float(value)
        n = OUTLIER_DETECTOR_WINDOW_SIZE
        if not admissible(x):
            # judged against the window as it stands; entering it would poison the sums
            if self.count < n:
                return math.nan
            mean = self.sum / n
            variance = self.sum_sq / n - mean * mean
            std_dev = math.sqrt(variance) if variance >= 0.0 else math.nan
            return math.nan if math.isnan(x) or std_dev == 0.0 else (x - mean) / std_dev
        if self.count < n:
            self.buffer[self.count] = x
            self.sum += x
            self.sum_sq += x * x
            self.count += 1
            return math.nan  # not enough data yet; callers skip only on a finite z
        old = self.buffer[self.index]
        self.sum -= old
        self.sum_sq -= old * old
        self.buffer[self.index] = x
        self.sum += x
        self.sum_sq += x * x
        self.index = (self.index + 1) % n
        mean = self.sum / n
        variance = self.sum_sq / n - mean * mean
        std_dev = math.sqrt(variance) if variance >= 0.0 else math.nan
        if std_dev == 0.0:
            return 0.0
        return (x - mean) / std_dev

    def state_dict(self) -> dict:
        # update() and load_state_dict() keep the sums clean; a checkpoint must never carry
        # poisoned ones, so a broken invariant stops the save rather than being written
        if not self.is_clean():
            raise ValueError(f"OutlierDetector state: sum {self.sum!r} / sum_sq {self.sum_sq!r}: "
                             f"expected finite running sums of finite values; refusing to save a "
                             f"poisoned detector")
        return {"window_size": OUTLIER_DETECTOR_WINDOW_SIZE, "buffer": list(self.buffer),
                "count": self.count, "index": self.index, "sum": self.sum, "sum_sq": self.sum_sq}

    def load_state_dict(self, state: dict) -> None:
        n = OUTLIER_DETECTOR_WINDOW_SIZE
        _expect(state.get("window_size", n) == n, "OutlierDetector", "window_size", n,
                state.get("window_size"))
        buffer = state.get("buffer")
        _expect(isinstance(buffer, list) and len(buffer) == n, "OutlierDetector", "buffer",
                f"a list of {n} floats", type(buffer).__name__ if not isinstance(buffer, list)
                else f"a list of {len(buffer)}")
        count, index = state.get("count"), state.get("index")
        _expect(isinstance(count, int) and 0 <= count <= n, "OutlierDetector", "count",
                f"an integer in [0, {n}]", count)
        _expect(isinstance(index, int) and 0 <= index < n and (count == n or index == 0),
                "OutlierDetector", "index", f"an integer in [0, {n}) (0 while filling)", index)
        for key in ("sum", "sum_sq"):
            _expect(isinstance(state.get(key), (int, float)), "OutlierDetector", key, "a float",
                    state.get(key))
        self.buffer = [float(v) for v in buffer]
        self.count, self.index = count, index
        self.sum, self.sum_sq = float(state["sum"]), float(state["sum_sq"])
        self.repair_note = None
        if not self.is_clean():
            self._repair()

    def is_clean(self) -> bool:
        """Finite running sums over admissible window values (what update() guarantees)."""
        return (math.isfinite(self.sum) and math.isfinite(self.sum_sq)
                and all(admissible(v) for v in self.window()))

    def window(self) -> list[float]:
        """The values in the window, oldest first."""
        if self.count < OUTLIER_DETECTOR_WINDOW_SIZE:
            return self.buffer[:self.count]
        return self.buffer[self.index:] + self.buffer[:self.index]

    def _repair(self) -> None:
        """A detector saved poisoned (by a raygpt before this fix, as llm.c would): rebuild it
        from the admissible values of its window, oldest first, and say what was done. The
        rebuilt sums are a fresh computation, so z-scores from here differ in the last bits from
        the never-poisoned detector that cannot be recovered."""
        values = self.window()
        kept = [v for v in values if admissible(v)]
        was = f"sum {self.sum!r}, sum_sq {self.sum_sq!r}"
        self.buffer = [0.0] * OUTLIER_DETECTOR_WINDOW_SIZE
        self.count = self.index = 0
        self.sum = self.sum_sq = 0.0
        for v in kept:
            self.update(v)
        self.repair_note = (f"poisoned by a non-finite value ({was}, {len(values) - len(kept)} "
                            f"of {len(values)} window values not finite); rebuilt from the "
                            f"{len(kept)} finite ones")


def _expect(ok: bool, owner: str, field: str, expected, found) -> None:
    if not ok:
        raise ValueError(f"{owner} state: field {field!r}: expected {expected}, found {found!r}")


# ---------------------------------------------------------------------- the spike policy

MAD_TO_STD = 1.4826
"""MAD * 1.4826 estimates the std of normally distributed values (1 / Phi^-1(3/4))."""
MAD_FLOOR = 1e-3
"""Floor of the scaled MAD, max(mad, 1e-3): a flat loss curve must not turn a
tiny wiggle into a huge z."""

VERDICT_KINDS = ("ok", "skip", "rewind", "escalate")


@dataclass(frozen=True)
class Verdict:
    """What the loop does with this step. "ok": apply the update; "skip": drop the update, the step
    still advances; "rewind": reload the checkpoint before `spike_start` and skip its data;
    "escalate": stop the run with `reason` (the loop makes this one from `RewindLedger`'s answer;
    the monitor itself never returns it)."""

    kind: str
    loss_z: float
    """Robust z of the loss: (loss - median) / max(1.4826 MAD, 1e-3); NaN before min_history."""
    gnorm_ratio: float
    """gnorm / median clean grad norm; NaN before min_history."""
    reason: str
    spike_start: int | None = None
    """First step of the current run of outliers (the rewind goes to before it); None when ok."""

    def __post_init__(self) -> None:
        if self.kind not in VERDICT_KINDS:
            raise ValueError(f"Verdict.kind: expected one of {' | '.join(VERDICT_KINDS)}, "
                             f"found {self.kind!r}")


def robust_z(loss: float, clean_losses) -> float:
    """(loss - median) / max(1.4826 * MAD, MAD_FLOOR) over the clean window."""
    med = statistics.median(clean_losses)
    mad = statistics.median(abs(v - med) for v in clean_losses)
    return (loss - med) / max(MAD_TO_STD * mad, MAD_FLOOR)


class SpikeMonitor:
    """The spike monitor: `check(step, loss, gnorm)` once per step, before the update.

    Order of the tests, first match wins:
      1. loss or gnorm not finite                          -> rewind
      2. fewer than min_history clean steps                -> ok (the baseline is not ready)
      3. loss z > hard_z                                   -> rewind
      4. loss z > soft_z, or gnorm > gnorm_mult * median   -> outlier: skip while this is at
         most the max_consecutive-th outlier in a row, rewind after that
      5. otherwise                                         -> ok
    Only ok steps enter the windows (a spike must not drag the baseline up), and an ok step resets
    the run of outliers. Only loss increases count: a sudden drop is not a spike.
    """

    def __init__(self, cfg: SpikeConfig) -> None:
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)   # clean losses, oldest first
        self.gnorms: deque[float] = deque(maxlen=cfg.window)   # their grad norms
        self.consecutive = 0                 # outliers in a row up to the last step checked
        self.spike_start: int | None = None  # first step of that run of outliers
        self.repair_note: str | None = None  # set by load_state_dict when it had to repair

    def check(self, step: int, loss: float, gnorm: float) -> Verdict:
        loss, gnorm = float(loss), float(gnorm)
        cfg = self.cfg
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            return self._outlier(step, "rewind", math.nan, math.nan,
                                 f"non-finite loss {loss} or grad norm {gnorm} at step {step}")
        if len(self.losses) < cfg.min_history:
            self._clean(loss, gnorm)
            return Verdict("ok", math.nan, math.nan, f"baseline warming up "
                           f"({len(self.losses)}/{cfg.min_history} clean steps)")
        z = robust_z(loss, self.losses)
        median_gnorm = statistics.median(self.gnorms)
        ratio = gnorm / median_gnorm if median_gnorm > 0 else (math.inf if gnorm > 0 else 0.0)
        if z > cfg.hard_z:
            return self._outlier(step, "rewind", z, ratio,
                                 f"loss {loss:.4f} at step {step} has robust z {z:.2f} > hard_z "
                                 f"{cfg.hard_z}")
        loss_out = z > cfg.soft_z
        gnorm_out = cfg.gnorm_mult > 0 and gnorm > cfg.gnorm_mult * median_gnorm
        if loss_out or gnorm_out:
            why = []
            if loss_out:
                why.append(f"loss z {z:.2f} > soft_z {cfg.soft_z}")
            if gnorm_out:
                why.append(f"grad norm {gnorm:.4g} = {ratio:.2f} x median > gnorm_mult "
                           f"{cfg.gnorm_mult}")
            run = self.consecutive + 1
            if run <= cfg.max_consecutive:
                return self._outlier(step, "skip", z, ratio,
                                     f"outlier {run}/{cfg.max_consecutive} in a row at step "
                                     f"{step}: {', '.join(why)}")
            return self._outlier(step, "rewind", z, ratio,
                                 f"{run} outliers in a row (> max_consecutive "
                                 f"{cfg.max_consecutive}) ending at step {step}: {', '.join(why)}")
        self._clean(loss, gnorm)
        return Verdict("ok", z, ratio, "")

    def _clean(self, loss: float, gnorm: float) -> None:
        self.losses.append(loss)
        self.gnorms.append(gnorm)
        self.consecutive = 0
        self.spike_start = None

    def _outlier(self, step: int, kind: str, z: float, ratio: float, reason: str) -> Verdict:
        if self.consecutive == 0:
            self.spike_start = step
        self.consecutive += 1
        return Verdict(kind, z, ratio, reason, self.spike_start)

    def state_dict(self) -> dict:
        if not all(math.isfinite(v) for v in (*self.losses, *self.gnorms)):
            raise ValueError("SpikeMonitor state: losses/gnorms: expected finite values only; "
                             "refusing to save a poisoned window")
        return {"window": self.cfg.window, "losses": list(self.losses), "gnorms": list(self.gnorms),
                "consecutive": self.consecutive, "spike_start": self.spike_start}

    def load_state_dict(self, state: dict) -> None:
        w = self.cfg.window
        _expect(state.get("window") == w, "SpikeMonitor", "window", f"{w} (this run's window)",
                state.get("window"))
        losses, gnorms = state.get("losses"), state.get("gnorms")
        _expect(isinstance(losses, list) and isinstance(gnorms, list)
                and len(losses) == len(gnorms) <= w, "SpikeMonitor", "losses/gnorms",
                f"two lists of equal length <= window {w}",
                (None if losses is None else len(losses), None if gnorms is None else len(gnorms)))
        consecutive, start = state.get("consecutive"), state.get("spike_start")
        _expect(isinstance(consecutive, int) and consecutive >= 0, "SpikeMonitor", "consecutive",
                "an integer >= 0", consecutive)
        _expect((start is None) == (consecutive == 0) and (start is None or isinstance(start, int)),
                "SpikeMonitor", "spike_start", "a step when consecutive > 0, else None", start)
        pairs = [(float(a), float(b)) for a, b in zip(losses, gnorms)]
        clean = [(a, b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
        # check() never lets a non-finite step into the windows; one found here was written by
        # something else (a hand-edited or foreign checkpoint): it would turn every median and
        # MAD after it into NaN, so it is dropped, and said so
        self.repair_note = (None if len(clean) == len(pairs) else
                            f"dropped {len(pairs) - len(clean)} non-finite step(s) of "
                            f"{len(pairs)} from the clean-loss window")
        self.losses = deque((a for a, _ in clean), maxlen=w)
        self.gnorms = deque((b for _, b in clean), maxlen=w)
        self.consecutive, self.spike_start = consecutive, start


def rewind_target(checkpoint_steps, spike_start: int, safety_steps: int) -> int | None:
    """The newest checkpoint step <= spike_start - safety_steps, or None when there is none.
    A checkpoint at step N holds the state before step N's update, so N == spike_start would
    already be clean; safety_steps >= 1 also leaves out the steps where the grad norm was rising
    before the loss moved."""
    limit = spike_start - safety_steps
    eligible = [s for s in checkpoint_steps if s <= limit]
    return max(eligible) if eligible else None


@dataclass
class RewindRecord:
    """One rewind: the steps [region_start, region_end] of the spike (inclusive) and the data
    sample ranges (shard, start, end) put on the skip list for it."""

    region_start: int
    region_end: int
    skipped_ranges: list

    def overlaps(self, start: int, end: int) -> bool:
        return self.region_start <= end and start <= self.region_end


class RewindLedger:
    """Persisted rewind history: how many rewinds, the learning-rate multiplier they led to, and
    each rewind's step region and skipped data (the loop multiplies the schedule by lr_scale)."""

    def __init__(self) -> None:
        self.rewinds = 0
        self.lr_scale = 1.0
        self.history: list[RewindRecord] = []

    def record_rewind(self, region_start: int, region_end: int, skipped_ranges,
                      cfg: SpikeConfig) -> tuple[float, str | None]:
        """Record a rewind over the spike steps [region_start, region_end]; return the new
        lr_scale and, when the run must stop for a human, the reason (else None).

        If the region overlaps one rewound before, its data was already skipped and it spiked
        again: the cause is probably the optimizer state or the learning rate, not the data, so
        lr_scale *= lr_scale_decay.
        """
        if region_end < region_start:
            raise ValueError(f"rewind region: expected region_start <= region_end, found "
                             f"[{region_start}, {region_end}]")
        again = [r for r in self.history if r.overlaps(region_start, region_end)]
        if again:
            self.lr_scale *= cfg.lr_scale_decay
        self.rewinds += 1
        self.history.append(RewindRecord(int(region_start), int(region_end),
                                         [tuple(int(v) for v in rng) for rng in skipped_ranges]))
        reason = None
        if self.rewinds > cfg.max_rewinds:
            reason = (f"spike policy: rewind {self.rewinds} (steps {region_start}-{region_end}) "
                      f"exceeds --spike-max-rewinds {cfg.max_rewinds}; the run needs a human "
                      f"(lower the learning rate, check the data, or raise the limit)")
        elif self.lr_scale < cfg.min_lr_scale:
            reason = (f"spike policy: steps {region_start}-{region_end} spiked again after "
                      f"{len(again)} earlier rewind(s) of that region; lr_scale {self.lr_scale:.4g}"
                      f" is below --spike-min-lr-scale {cfg.min_lr_scale}; the run needs a human")
        return self.lr_scale, reason

    def skipped_ranges(self) -> list[tuple]:
        """Every data range skipped by any rewind, in rewind order."""
        return [rng for rec in self.history for rng in rec.skipped_ranges]

    def state_dict(self) -> dict:
        return {"rewinds": self.rewinds, "lr_scale": self.lr_scale,
                "history": [{"region_start": r.region_start, "region_end": r.region_end,
                             "skipped_ranges": [list(rng) for rng in r.skipped_ranges]}
                            for r in self.history]}

    def load_state_dict(self, state: dict) -> None:
        rewinds, scale, history = state.get("rewinds"), state.get("lr_scale"), state.get("history")
        _expect(isinstance(rewinds, int) and rewinds >= 0, "RewindLedger", "rewinds",
                "an integer >= 0", rewinds)
        _expect(isinstance(scale, (int, float)) and 0 < scale <= 1, "RewindLedger", "lr_scale",
                "a value in (0, 1]", scale)
        _expect(isinstance(history, list), "RewindLedger", "history", "a list of rewinds", history)
        records = []
        for i, r in enumerate(history):
            try:
                ranges = [tuple(int(v) for v in rng) for rng in r["skipped_ranges"]]
                records.append(RewindRecord(int(r["region_start"]), int(r["region_end"]), ranges))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"RewindLedger state: field 'history[{i}]': expected "
                                 f"region_start, region_end and skipped_ranges, found {r!r} ({e})"
                                 ) from None
        self.rewinds, self.lr_scale, self.history = rewinds, float(scale), records
