"""The training state that is not tensors: step, RNG, policy windows, counters.

Everything here goes into every checkpoint (the header fields llm.c has, the rest in the state
file's extras), so a resume from any checkpoint continues the same run *and the same policy*:
llm.c's z-score detectors, the spike monitor's windows, the rewind ledger with lr_scale, and the
skip counters. `judge()` turns one step's (loss, norm) into a verdict; it is the only place the
skip / rewind policy is decided, and it holds no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from raygpt.config import TrainConfig
from raygpt.train.knobs import OptimizerConfig
from raygpt.train.outlier import OutlierDetector, RewindLedger, SpikeMonitor, Verdict

# llm.c seeds its xorshift state with this constant; every rank uses the same state so that
# replicated working weights are rounded identically.
RNG_SEED_BASE = 13371337


@dataclass
class TrainState:
    step: int = 0
    rng_state: int = RNG_SEED_BASE
    rng_state_last_update: int = RNG_SEED_BASE
    tokens_seen: int = 0
    skips: int = 0
    clipped: int = 0
    loss_detector: OutlierDetector = field(default_factory=OutlierDetector)
    grad_detector: OutlierDetector = field(default_factory=OutlierDetector)
    monitor: SpikeMonitor | None = None
    ledger: RewindLedger = field(default_factory=RewindLedger)
    # not persisted: per-attempt bookkeeping
    save_requested: bool = False
    spike_samples: list = field(default_factory=list)

    @classmethod
    def fresh(cls, cfg: TrainConfig) -> "TrainState":
        return cls(rng_state=RNG_SEED_BASE + cfg.seed, rng_state_last_update=RNG_SEED_BASE + cfg.seed,
                   monitor=SpikeMonitor(cfg.spike) if cfg.spike.enabled else None)

    @property
    def lr_scale(self) -> float:
        return self.ledger.lr_scale

    def judge(self, cfg: OptimizerConfig, step: int, loss: float, norm: float) -> Verdict:
        """llm.c's z-score skip (-sl / -sg), then the spike policy (raygpt.train.outlier) when it is on.
        A non-finite loss or norm never reaches AdamW: it rewinds under the spike policy and is
        skipped (with the reason said) without it."""
        # a non-finite value is judged but never enters a detector's window (see OutlierDetector)
        zloss = self.loss_detector.update(loss)
        zgrad = self.grad_detector.update(norm)
        if self.monitor is not None:
            verdict = self.monitor.check(step, loss, norm)
            if verdict.kind != "ok":
                return verdict
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return Verdict("skip", loss_z=zloss, gnorm_ratio=float("nan"),
                           reason=f"non-finite loss {loss} or norm {norm}")
        if cfg.skip_update_lossz > 0 and math.isfinite(zloss) and zloss > cfg.skip_update_lossz:
            return Verdict("skip", loss_z=zloss, gnorm_ratio=float("nan"),
                           reason=f"loss z-score {zloss:.2f} > {cfg.skip_update_lossz}")
        if cfg.skip_update_gradz > 0 and math.isfinite(zgrad) and zgrad > cfg.skip_update_gradz:
            return Verdict("skip", loss_z=zloss, gnorm_ratio=float("nan"),
                           reason=f"grad-norm z-score {zgrad:.2f} > {cfg.skip_update_gradz}")
        return Verdict("ok", loss_z=zloss, gnorm_ratio=float("nan"), reason="")

    # ------------------------------------------------------------------ persistence
    def extras(self) -> dict:
        """Everything beyond llm.c's header fields, for the state file's JSON trailer."""
        return {
            "tokens_seen": self.tokens_seen, "skips": self.skips, "clipped": self.clipped,
            "loss_detector": self.loss_detector.state_dict(),
            "grad_detector": self.grad_detector.state_dict(),
            "monitor": self.monitor.state_dict() if self.monitor is not None else None,
            "ledger": self.ledger.state_dict(),
        }

    def load_extras(self, extras: dict) -> list[str]:
        """Restore from a state file's extras; returns a note for each policy window that had to
        be repaired (a detector poisoned by a non-finite value in an older checkpoint)."""
        self.tokens_seen = extras["tokens_seen"]
        self.skips = extras["skips"]
        self.clipped = extras["clipped"]
        self.loss_detector.load_state_dict(extras["loss_detector"])
        self.grad_detector.load_state_dict(extras["grad_detector"])
        if self.monitor is not None and extras.get("monitor") is not None:
            self.monitor.load_state_dict(extras["monitor"])
        self.ledger.load_state_dict(extras["ledger"])
        owners = {"loss outlier detector (-sl)": self.loss_detector,
                  "grad-norm outlier detector (-sg)": self.grad_detector, "spike monitor": self.monitor}
        return [f"{name}: {owner.repair_note}" for name, owner in owners.items()
                if owner is not None and owner.repair_note]

    def advance(self, tokens: int, *, clipped: bool) -> None:
        """A step done (its update applied or skipped): the step, tokens seen, clipped steps."""
        self.step += 1
        self.tokens_seen += tokens
        self.clipped += int(clipped)
