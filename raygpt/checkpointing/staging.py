"""Staging: where a rank writes its checkpoint files before Ray (or the single process) stores
them: a directory private to this user and run, made atomically under the system temp
directory, one fresh directory per checkpoint in it, and the sweep of what dead processes left.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from raygpt.checkpointing.protocol import _TEMP_MARK, CheckpointError, step_dir
from raygpt.storage import atomic_file

log = logging.getLogger(__name__)

# A staging root is named raygpt-stage-<label>-<pid>-<random>. A single process removes its root
# when it exits, but Ray ends its worker processes without their exit handlers (at the end of every
# run too: 607 roots had piled up in one test machine's /tmp), and a worker killed by SIGKILL or
# the OOM killer keeps what it had staged (a rank's whole files, if the kill came mid-write). Ray
# uploads the last checkpoint on its own thread, so the train function cannot remove the root
# itself: every Checkpointer's first save on the node sweeps them, on a thread of its own.
_STAGE_ROOT = re.compile(r"raygpt-stage-[^/]*?-(\d+)-[^-/]+")
# a dead process's root is left alone this long after its last change (a pid namespace that is
# not ours, sharing this temp dir, could still be writing there)
STAGE_STALE_S = 600.0
# Roots made before they carried a pid (raygpt-stage-<label>-<random>) tell no process: one goes
# when nothing changed it for as long as the node's local checkpoint copies wait (a live run
# makes a directory in its root at every checkpoint).
_PIDLESS_STAGE_ROOT = re.compile(r"raygpt-stage-[^-/]+-[^-/]+")
PIDLESS_STAGE_STALE_S = 3 * 24 * 3600.0


def private_stage_root(label: str) -> Path:
    """A new local directory, private to this process's user, for one run's staged checkpoint
    files on this machine (every rank writes its files here before Ray uploads them). Created
    atomically by mkdtemp under the system temp directory: mode 0700 and a fresh unpredictable
    name, so no other user can have created it, or a symlink in its place, beforehand (a fixed
    path such as /tmp/raygpt-stage can be: the first user to create it locks every other user
    out, and a planted symlink receives their weights). Checked by `check_private_dir` too.
    The caller removes it when the run ends (and sweeps what dead processes left beside it:
    `sweep_dead_stage_roots`)."""
    root = Path(tempfile.mkdtemp(prefix=f"raygpt-stage-{label}-{os.getpid()}-"))
    check_private_dir(root)
    return root


def sweep_dead_stage_roots(tmp_dir: str | os.PathLike) -> list[Path]:
    """Remove the staging roots in `tmp_dir` that a dead process left: named by
    `private_stage_root` with a pid that no live process has and unchanged for STAGE_STALE_S (or
    named without a pid, by an older raygpt, and unchanged for PIDLESS_STAGE_STALE_S), this
    user's and private (a root `check_private_dir` would refuse is not touched), a real directory
    (a symlink is not followed). Returns what was removed; never raises (a root that cannot be
    removed now is tried again by the next run)."""
    now, removed = time.time(), []
    try:
        entries = list(os.scandir(tmp_dir))
    except OSError:
        return removed
    for entry in entries:
        m = _STAGE_ROOT.fullmatch(entry.name)
        if m is not None:
            if _process_alive(int(m.group(1))):
                continue
            min_age = STAGE_STALE_S
        elif _PIDLESS_STAGE_ROOT.fullmatch(entry.name):
            min_age = PIDLESS_STAGE_STALE_S
        else:
            continue
        try:
            check_private_dir(entry.path)
            if now - os.lstat(entry.path).st_mtime < min_age:
                continue
            shutil.rmtree(entry.path)
        except (OSError, CheckpointError):
            continue
        removed.append(Path(entry.path))
    if removed:
        log.info(f"raygpt | removed {len(removed)} staging director"
                 f"{'y' if len(removed) == 1 else 'ies'} left in {tmp_dir} by processes that no "
                 f"longer run")
    return removed


def _process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (another user's counts: it is alive)."""
    if pid <= 0:
        return True  # not a pid this code wrote: leave the directory alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True


def check_private_dir(path: str | os.PathLike) -> None:
    """CheckpointError unless `path` is a real directory (not a symlink), owned by this user,
    that no other user may read or write (atomic_file.check_private_dir's rule)."""
    try:
        atomic_file.check_private_dir(path, "staging directory")
    except atomic_file.NotPrivateError as e:
        raise CheckpointError(str(e)) from None


def stage_dir(tmp_root: str | os.PathLike, step: int) -> Path:
    """A fresh directory inside the private `tmp_root` (see `private_stage_root`, checked again
    here) where a rank writes its files for `step` before they are reported/uploaded; its name
    carries the temp mark so no scan mistakes it for a checkpoint."""
    check_private_dir(tmp_root)
    return Path(tempfile.mkdtemp(prefix=f"{step_dir(step)}{_TEMP_MARK}", dir=tmp_root))
