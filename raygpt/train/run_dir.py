"""A training run's directory, claimed before anything is written (storage.ownership's marker,
lease and claim, given what only a run knows): which names show a run is there, what shows an
unmarked directory is a raygpt run of this user's (its config.json, a complete checkpoint), and
the armed faults recorded in it. Here, above storage, because a run's names come from the run
log, the checkpoints and the config.
"""

from __future__ import annotations

import contextlib
import os

from raygpt.checkpointing import protocol as ck
from raygpt.config import ConfigError, TrainConfig
from raygpt.runlog import run_config
from raygpt.runlog.history import LOSS_HISTORY, LOSS_HISTORY_LOG
from raygpt.runlog.mainlog import MAIN_LOG_LAYOUT
from raygpt.storage import RunDir, open_run_dir, read_json_bounded
from raygpt.storage.ownership import Lease, claim_dir, refused_overwrite_target
from raygpt.train.faults import announce as announce_faults
from raygpt.train.faults import armed_spec

# names only a raygpt run leaves in its directory: its logs, in either layout (runlog.segments)
RUN_LOGS = frozenset({LOSS_HISTORY, LOSS_HISTORY_LOG.folder, MAIN_LOG_LAYOUT.legacy,
                      MAIN_LOG_LAYOUT.folder})


def holds_run(run_dir: RunDir) -> bool:
    """Whether `run_dir` holds a run's logs (either layout) or a checkpoint directory."""
    return any(n in RUN_LOGS or n.startswith("step_") for n in run_dir.listdir())


def run_evidence(run_dir: RunDir) -> str | None:
    """The file that shows an unmarked directory is a run raygpt wrote: config.json in
    raygpt's format, else the MANIFEST of its newest complete checkpoint; None when neither."""
    if run_dir.exists(run_config.CONFIG_FILE):
        try:
            rec = read_json_bounded(run_dir, run_config.CONFIG_FILE)
        except ValueError:
            rec = None
        if (isinstance(rec, dict) and rec.get("format") == run_config.FORMAT
                and isinstance(rec.get("config"), dict)):
            return run_config.CONFIG_FILE
    step = ck.find_latest_verified(run_dir, warn=lambda _: None, hashes=False)
    return None if step is None else f"{ck.step_dir(step)}/{ck.MANIFEST}"


def prepare_run_dir(cfg: TrainConfig, lease: Lease | None = None) -> RunDir:
    """Claim the run directory `cfg.output_dir` (`claim_dir`): never overwrite a run silently,
    never write into or delete what raygpt did not mark for this user. A run there needs -y 1
    (resume) or --overwrite (start fresh: only over a directory raygpt marked as this user's
    run, never `/`, the home or current directory, a bucket root or an empty -o). `lease`
    (not yet held) is taken after the checks and before anything is deleted, so a live run
    is never deleted."""
    if not cfg.output_dir.strip():
        raise ConfigError(f"-o/--output-dir {cfg.output_dir!r}: refused, "
                          f"{refused_overwrite_target(cfg.output_dir)}")
    # the lease's run directory is the one claimed (opened once); without one, -o opened here
    run_dir = lease.run_dir if lease is not None else open_run_dir(cfg.output_dir)
    claim_dir(run_dir, "run", cfg.output_dir, holds=holds_run, resume=cfg.resume == 1,
              overwrite=cfg.overwrite, lease=lease, evidence=run_evidence)
    return run_dir


@contextlib.contextmanager
def claimed_run_dir(cfg: TrainConfig, *, lineage: str | None = None, what: str = "raygpt train",
                    on_lost=None):
    """`prepare_run_dir` under this job's lease, renewed by a heartbeat while inside, released
    on the way out (so `-y 1` right after works at once). Armed faults (--fault, and
    RAYGPT_FAULT only with --allow-fault-injection) are folded into the config it yields,
    printed and recorded in the run directory."""
    spec, sources = armed_spec(cfg.fault, os.environ, cfg.allow_fault_injection)
    cfg = cfg.with_overrides({"fault": spec})
    lease = Lease(open_run_dir(cfg.output_dir), lineage=lineage, what=what)
    try:
        run_dir = prepare_run_dir(cfg, lease)
        announce_faults(run_dir, spec, sources)
        lease.start_heartbeat(on_lost)
        yield cfg, run_dir
    finally:
        lease.release()
