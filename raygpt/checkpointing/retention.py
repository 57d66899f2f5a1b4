"""Retention: which checkpoints a run keeps, as pure functions of the steps and the knobs (llm.c's
-nk / -nm, the last one before a WSD decay, never the newest complete one). Deleting is the
store's (raygpt.checkpointing.store: `CheckpointStore.retain`), which runs it after each
checkpoint's commit, where the run's config is (the driver, or the single process).

The default keeps a disk: the last DEFAULT_KEEP_LAST checkpoints, plus the "major" ones, every
-nm steps; -nm unset is `default_keep_every`: the multiple of -n at or above a quarter of the
run, so a run of any length keeps at most about four majors besides its last few."""

from __future__ import annotations

import dataclasses
import math

DEFAULT_KEEP_LAST = 3  # -nk's default
MAJORS_PER_RUN = 4  # -nm unset: about this many major checkpoints over the run


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """What a run keeps: the newest `keep_last` (0 keeps everything), every multiple of
    `keep_every` (0: none), and the last checkpoint at or before `wsd_decay_start` (None: no
    WSD decay)."""

    keep_last: int
    keep_every: int = 0
    wsd_decay_start: int | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RetentionPolicy":
        return cls(keep_last=d["keep_last"], keep_every=d.get("keep_every", 0),
                   wsd_decay_start=d.get("wsd_decay_start"))


def default_keep_every(checkpoint_every: int, max_steps: int) -> int:
    """-nm unset: the smallest multiple of -n at or above max_steps / MAJORS_PER_RUN (0 when -n
    is 0: only the last checkpoint is written then)."""
    if checkpoint_every <= 0 or max_steps <= 0:
        return 0
    return checkpoint_every * max(1, math.ceil(max_steps / (MAJORS_PER_RUN * checkpoint_every)))


def policy_for(*, keep_last: int, keep_every: int | None, checkpoint_every: int,
               max_steps: int, wsd_decay_start: int | None) -> RetentionPolicy:
    """The run's policy from its knobs (-nk, -nm, where None is `default_keep_every`, -n) and
    its length in steps (known once the loader has counted an epoch for -x -1)."""
    every = default_keep_every(checkpoint_every, max_steps) if keep_every is None else keep_every
    return RetentionPolicy(keep_last=keep_last, keep_every=every, wsd_decay_start=wsd_decay_start)


def checkpoints_to_delete(steps, *, keep_last: int, keep_every: int, protect: set[int],
                          newest_verified: int | None) -> list[int]:
    """Steps to delete, ascending (llm.c's -nk / -nm, plus protected steps).

    Kept: the newest keep_last steps (keep_last == 0 keeps everything), every multiple of
    keep_every (> 0; llm.c's "major" checkpoints), every step in protect (e.g. the last one
    before the WSD decay starts), and newest_verified, whatever else says.
    """
    if keep_last < 0 or keep_every < 0:
        raise ValueError(f"retention: expected keep_last >= 0 and keep_every >= 0, "
                         f"found {keep_last}, {keep_every}")
    steps = sorted(set(steps))
    if keep_last == 0:
        return []
    keep = set(steps[-keep_last:]) | set(protect)
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    if newest_verified is not None:
        keep.add(newest_verified)
    return [s for s in steps if s not in keep]


def to_delete(policy: RetentionPolicy, steps, newest_verified: int | None) -> list[int]:
    """`checkpoints_to_delete` under `policy`: the last step at or before the WSD decay is
    protected."""
    before = [s for s in steps if policy.wsd_decay_start is not None and s <= policy.wsd_decay_start]
    return checkpoints_to_delete(steps, keep_last=policy.keep_last, keep_every=policy.keep_every,
                                 protect={max(before)} if before else set(),
                                 newest_verified=newest_verified)
