"""WSD branches (`sweep_tune.run_wsd_branches`): llm.c's WSD holds the peak LR until step
`int(0.8f * max_steps)` and then decays, so the steps before the shortest branch's decay start S
are the same in every branch. The stable phase is trained once (scheduler wsd, max_steps = the
shortest branch total) and asked to stop once its checkpoint at S exists (the request lands a
few steps later, or the run ends at that total, which is the shortest branch's own schedule).
Every trial then copies checkpoint S (rank files, DONE, MANIFEST) into its own run directory and
resumes from it with its own `max_steps`: stable until int(0.8 * max_steps), then its decay.
Only fields a checkpoint lets change on resume (`config.RESUME_MUTABLE_FIELDS`) may differ
between branches; anything else would fail the checkpoint's compatibility check, so it is
refused before anything runs.
"""

from __future__ import annotations

import logging

from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing.store import CheckpointStore
from raygpt.config import RESUME_MUTABLE_FIELDS, ConfigError, TrainConfig
from raygpt.ray.driver import run
from raygpt.ray.sweep_plan import STABLE_DIR, SweepPlan
from raygpt.ray.trials import trial_config
from raygpt.storage import RunDir, join_uri, open_run_dir
from raygpt.train.schedule import wsd_decay_start

log = logging.getLogger(__name__)

def shared_stable_step(branch_totals: list[int]) -> int:
    """S: the decay start of the shortest branch, where every branch is still in its stable
    phase (wsd_decay_start grows with max_steps), so checkpoint S is valid for all of them."""
    step = wsd_decay_start(min(branch_totals))
    if step < 1:
        raise ConfigError(f"--wsd-branches {branch_totals}: the shortest branch's decay starts at "
                          f"step {step}; expected max_steps >= 2 so there is a stable phase")
    return step


def check_branch_space(space: dict) -> None:
    """Branches resume one checkpoint, so they may differ only where a resume may differ."""
    for key in space:
        top = key.split(".", 1)[0]
        if top not in RESUME_MUTABLE_FIELDS:
            raise ConfigError(
                f"WSD branch space key {key!r}: branches resume the shared stable-phase "
                f"checkpoint, whose compatibility check requires every field outside "
                f"config.RESUME_MUTABLE_FIELDS to match; expected one of "
                f"{sorted(RESUME_MUTABLE_FIELDS)}, found {key!r}")


def seed_branch(plan: SweepPlan, run_dir: RunDir) -> bool:
    """Give a branch trial the shared stable-phase checkpoint, unless its run directory already
    has a verified checkpoint of its own (a retried or resumed trial continues from that).
    Returns True when it copied."""
    if CheckpointStore(run_dir).latest_verified(hashes=True) is not None:
        return False
    stable = open_run_dir(join_uri(plan.sweep_dir, STABLE_DIR))  # the plan's URI (a trial's)
    ck.copy_checkpoint(stable, run_dir, plan.shared_step)
    return True


def run_stable_phase(plan: SweepPlan, command_line: dict, lineage: str | None = None) -> int:
    """Train the WSD stable phase once (skipped when its checkpoint at S already verifies) and
    return S. The run is the branches' own config with max_steps = the shortest branch total, so
    its LR up to S is every branch's LR up to S; it checkpoints at S and is stopped there."""
    stable = open_run_dir(join_uri(plan.sweep_dir, STABLE_DIR))  # its run gets the URI string
    S = plan.shared_step
    if stable.exists(ck.step_dir(S)) and not ck.verify_checkpoint(stable, S):
        return S
    base = TrainConfig.from_dict(plan.base).with_overrides(command_line)
    every = base.checkpoint_every if base.checkpoint_every and S % base.checkpoint_every == 0 else S
    adapted: list[str] = []
    cfg = trial_config(base, {"max_steps": plan.stable_max_steps, "checkpoint_every": every},
                       stable.uri(), notes=adapted)
    log.info(f"raygpt sweep | WSD stable phase: {cfg.max_steps}-step schedule, stopping after the "
             f"checkpoint at step {S} | {stable.uri()}")
    run(cfg, stop_at_step=S, lineage=f"{lineage}/stable" if lineage else None,
        what="raygpt sweep trial", argv=list(plan.command) or None, cwd=plan.cwd or None,
        adapted=adapted)
    problems = ck.verify_checkpoint(stable, S) if stable.exists(ck.step_dir(S)) else ["missing"]
    if problems:
        raise ck.CheckpointError(f"{stable.uri(ck.step_dir(S))}: the stable phase ended without a "
                                 f"verified checkpoint at the shared step {S}: {problems[0]}")
    return S
