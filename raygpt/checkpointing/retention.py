"""Retention: which checkpoints a run keeps (llm.c's -nk / -nm, the last one before a WSD decay,
never the newest complete one) and their deletion. The policy is a pure function of the steps
(`checkpoints_to_delete`); `apply_retention` reads the run directory and deletes. It runs after
each checkpoint's finalization (raygpt.checkpointing.finalize)."""

from __future__ import annotations

from raygpt.checkpointing import protocol as ck
from raygpt.storage import RunDir


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



def apply_retention(run_dir: RunDir, policy: dict) -> list[int]:
    """Delete the checkpoints the retention policy lets go (-nk / -nm, the last before a WSD
    decay, never the newest verified one). Returns the deleted steps."""
    steps = ck.list_checkpoint_steps(run_dir)
    if not steps:
        return []
    newest = ck.find_latest_verified(run_dir, warn=lambda m: None, hashes=False)
    protect = set()
    if policy.get("wsd_decay_start") is not None:
        before = [s for s in steps if s <= policy["wsd_decay_start"]]
        if before:
            protect.add(max(before))
    doomed = checkpoints_to_delete(steps, keep_last=policy["keep_last"],
                                   keep_every=policy["keep_every"], protect=protect,
                                   newest_verified=newest)
    for s in doomed:
        run_dir.delete_dir(ck.step_dir(s))
    return doomed
