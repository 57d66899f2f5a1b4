"""The checkpointing component's knobs: how often a checkpoint is written (-n,
--checkpoint-minutes), which are kept (-nk -nm; the policy is raygpt.checkpointing.retention),
resuming (-y) and how the state is copied out, with their defaults and checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from raygpt.config.knobs import knob, need


@dataclass
class CheckpointConfig:
    """When checkpoints are written, which are kept, and whether a run resumes from one."""

    checkpoint_every: int | None = knob(None, section="checkpoint", short="-n",
                                        may_change_on_resume=True,
                                        hints=("--save-every", "--save-steps"))
    """Write a checkpoint every N steps (-n); 0 writes only at the end and on signals. Default:
    100 on GPU, 50 on CPU (the 100-step CPU job checkpoints once before its end)."""
    checkpoint_minutes: float = knob(0.0, section="checkpoint", may_change_on_resume=True)
    """Also write a checkpoint once this many minutes have passed since the last one
    (--checkpoint-minutes), for long runs; rank 0's clock decides and every rank saves at the
    same step. 0 turns it off."""
    checkpoints_keep: int = knob(3, section="checkpoint", short="-nk", may_change_on_resume=True)
    """Keep the last K checkpoints (-nk) besides the -nm ones, the newest verified one and the
    last before a WSD decay; 0 keeps all. Default: 3."""
    major_checkpoint_every: int | None = knob(None, section="checkpoint", short="-nm",
                                              may_change_on_resume=True)
    """Keep every checkpoint whose step is a multiple of M forever (-nm); 0 turns it off.
    Default: the smallest multiple of -n at or above a quarter of -x, so about 4 are kept."""
    resume: int = knob(0, section="checkpoint", short="-y", choices=(0, 1),
                       may_change_on_resume=True, from_file=False)
    """1: resume from the newest verified checkpoint in the run directory (-y)."""
    overwrite: bool = knob(False, section="checkpoint", may_change_on_resume=True,
                           from_file=False)
    """Allow a fresh start over a run directory that already holds a run."""
    async_checkpoint: bool = knob(True, section="checkpoint", long="--sync-checkpoint",
                                  may_change_on_resume=True)
    """Write checkpoint files on a background thread after a host copy."""
    checkpoint_snapshot: str = knob("host", section="checkpoint", choices=("host", "device"),
                                    may_change_on_resume=True)
    """How a GPU checkpoint copies the state at its step: host (straight to pinned host memory
    on a side stream; no GPU memory, the update after a checkpoint waits for the copy's end)
    or device (a copy on the GPU first, the state's size in GPU memory for the whole run; the
    host copy then runs behind training)."""


    def resolve_checkpoint(self, *, on_gpu: bool) -> None:
        if self.checkpoint_every is None:
            # measured cost: docs/performance.md, "Checkpoint cost" (under 1% of step time on CPU)
            self.checkpoint_every = 100 if on_gpu else 50

    def validate_checkpoint(self) -> None:
        for flag, value in (("-n/--checkpoint-every", self.checkpoint_every),
                            ("-nk/--checkpoints-keep", self.checkpoints_keep),
                            ("-nm/--major-checkpoint-every",
                             0 if self.major_checkpoint_every is None else self.major_checkpoint_every)):
            need(value >= 0, flag, "an integer >= 0", value)
        need(isinstance(self.checkpoint_minutes, (int, float)) and math.isfinite(self.checkpoint_minutes)
             and self.checkpoint_minutes >= 0, "--checkpoint-minutes",
             "a number of minutes >= 0 (0 is off)", self.checkpoint_minutes)
        need(self.resume in (0, 1), "-y/--resume", "0 or 1", self.resume)
        need(self.checkpoint_snapshot in ("host", "device"), "--checkpoint-snapshot",
             "host or device", self.checkpoint_snapshot)
