"""Ray Train's list of a run's checkpoints, kept in agreement with the run directory.

Ray Train's controller records every reported checkpoint in `<run dir>/checkpoint_manager_snapshot.json`
(its CheckpointManager state) and rewrites the file at each registration. A new controller on the
same directory (a job resumed with -y 1, a retried Tune trial) reads it back and refuses to
start when any checkpoint it names is gone (`CheckpointManagerInitializationError ... does not
exist anymore`). raygpt deletes checkpoints behind Ray's back: retention (-nk / -nm, in the
driver-side finalizer) and spike rewinds (rank 0 deletes the abandoned trajectory), so the file
must be brought back to what exists:

- in the controller, after each report and at its end (`after_report`, called by
  raygpt.ray.checkpoints' `CheckpointFinalizer` and `FinalizerDrain`): Ray has just written the
  file, synchronously, on the same thread, and retention has just deleted; rewriting it there
  cannot race with Ray's own write;
- before every fit() on an existing directory (`before_fit`, called by `driver.build_trainer`,
  which the driver and the sweep's trials use): no controller is running on the directory then,
  and whatever was deleted since the last report (a rewind, a crash in between) is dropped.

This module is the one place the list is compared with the run directory and patched; which
checkpoints are complete is the checkpoint store's to say (raygpt.checkpointing.store).

Only raygpt's own checkpoints are read by raygpt; the ones Ray lists are a hint (the worker
scans the run directory for the newest verified checkpoint), so a checkpoint deleted during a
fit that Ray's in-memory list still names is harmless to that fit, and the file is what must
agree for the next one.

The file's format is Ray's (its pydantic model, `compat.CheckpointManagerState`, reads and writes
it; pydantic 2, as Ray 2.60 uses), so a Ray upgrade that changes it fails here loudly rather than
being half-understood.
"""

from __future__ import annotations

import logging

from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing.store import CheckpointStore
from raygpt.ray.compat import CheckpointManagerState, TrainingResultState
from raygpt.storage import MAX_JSON_BYTES, RunDir, parse_json

SNAPSHOT = "checkpoint_manager_snapshot.json"

log = logging.getLogger(__name__)


def before_fit(run_dir: RunDir) -> list[str]:
    """Bring the list in line before a fit() on `run_dir` (no controller runs on it then); a
    failure propagates: Ray's controller would refuse the directory. Returns the names dropped."""
    dropped = reconcile_snapshot(run_dir)
    if dropped:
        log.info(f"raygpt | Ray's checkpoint list ({SNAPSHOT}) named {len(dropped)} checkpoint(s) "
                 f"no longer in the run directory; dropped: {', '.join(dropped)}")
    return dropped


def after_report(run_dir: RunDir) -> None:
    """Bring the list in line on Ray's controller thread, right after Ray wrote it (a report, the
    controller's end): take out what retention just deleted and what a rewind deleted since the
    last report. A failure is a warning: the next fit() brings it in line before starting."""
    try:
        reconcile_snapshot(run_dir)
    except Exception as e:  # noqa: BLE001 - see above: before_fit tries again
        log.warning(f"raygpt | WARNING: could not update Ray's checkpoint list ({SNAPSHOT}): "
                    f"{type(e).__name__}: {e}")


def reconcile_snapshot(run_dir: RunDir) -> list[str]:
    """Rewrite Ray's snapshot (atomically, only when something changes) so that it names only
    checkpoint directories that exist, each once (a rewind's re-trained checkpoint reuses its
    abandoned predecessor's name; the later report is the one whose files are there). Returns
    the names it dropped. A snapshot torn by a crash during Ray's own (non-atomic) write is
    rebuilt from the complete checkpoints (DONE and MANIFEST present)."""
    if not run_dir.exists(SNAPSHOT):
        return []
    try:  # bounded: a snapshot larger than that is not Ray's, and is rebuilt like a torn one
        text = run_dir.read_bytes(SNAPSHOT, max_bytes=MAX_JSON_BYTES).decode("utf-8", errors="replace")
        raw = parse_json(text, run_dir.uri(SNAPSHOT))
    except ValueError:
        _write(run_dir, _rebuilt(run_dir))
        return ["<torn snapshot rebuilt>"]
    state = CheckpointManagerState.model_validate(raw)
    present = {name for name in run_dir.listdir() if run_dir.is_dir(name)}
    fixed, dropped = reconciled(state, present)
    if dropped:
        _write(run_dir, fixed)
    return dropped


def reconciled(state: CheckpointManagerState,
               present: set[str]) -> tuple[CheckpointManagerState, list[str]]:
    """The pure part: `state` with every checkpoint not in `present` (directory names) dropped,
    duplicates of a name reduced to the latest report, and everything that refers to a
    checkpoint by name (latest, pending validations, validation outcomes) made to match."""
    by_name: dict[str, tuple[int, TrainingResultState]] = {}
    dropped = []
    for result, index in zip(state.checkpoint_results, state.checkpoint_report_indices):
        name = result.checkpoint_dir_name
        if name not in present:
            dropped.append(name)
            continue
        if name in by_name:
            dropped.append(f"{name} (an earlier report of the same name)")
            if by_name[name][0] > index:
                continue
        by_name[name] = (index, result)
    kept = sorted(by_name.values(), key=lambda pair: pair[0])  # report order, as Ray keeps it
    kept_names = set(by_name)
    latest = state.latest_checkpoint_result
    if latest is not None:
        if latest.checkpoint_dir_name in kept_names:
            latest = by_name[latest.checkpoint_dir_name][1]
        else:
            latest = kept[-1][1] if kept else None
    pending = [(r, spec) for r, spec in zip(state.pending_training_results,
                                            state.pending_validation_specs)
               if r.checkpoint_dir_name in kept_names]
    fixed = state.model_copy(update={
        "checkpoint_results": [r for _, r in kept],
        "checkpoint_report_indices": [i for i, _ in kept],
        "latest_checkpoint_result": latest,
        "pending_training_results": [r for r, _ in pending],
        "pending_validation_specs": [spec for _, spec in pending],
        "validated_checkpoint_dir_names": [n for n in state.validated_checkpoint_dir_names
                                           if n in kept_names],
        "timed_out_validation_checkpoint_dir_names": [
            n for n in state.timed_out_validation_checkpoint_dir_names if n in kept_names],
        "failed_validation_checkpoint_dir_names": [
            n for n in state.failed_validation_checkpoint_dir_names if n in kept_names],
    })
    return fixed, dropped


def _rebuilt(run_dir: RunDir) -> CheckpointManagerState:
    """A snapshot naming the run's complete checkpoints, oldest first, as if reported in order."""
    steps = CheckpointStore(run_dir).sealed_steps()
    results = [TrainingResultState(checkpoint_dir_name=ck.step_dir(s),
                                    metrics={"checkpoint_step": s}) for s in steps]
    return CheckpointManagerState(
        checkpoint_results=results, checkpoint_report_indices=list(range(len(results))),
        latest_checkpoint_result=results[-1] if results else None,
        pending_training_results=[], pending_validation_specs=[],
        current_report_index=len(results), validated_checkpoint_dir_names=[],
        timed_out_validation_checkpoint_dir_names=[], failed_validation_checkpoint_dir_names=[])


def _write(run_dir: RunDir, state: CheckpointManagerState) -> None:
    run_dir.write_bytes_atomic(SNAPSHOT, state.model_dump_json().encode("utf-8"))
