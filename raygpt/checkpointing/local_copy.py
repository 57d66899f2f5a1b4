"""The node's local copies of the checkpoint files its ranks wrote, for a fast resume.

A rank writes its checkpoint files into a private staging directory and Ray uploads them to
storage, deleting the staged files after. Before that, `LocalCopies.keep` hard-links each file
into a node-local directory for the run (no bytes copied: the staged file's blocks, most likely
still in the page cache, stay on the node under a second name). When Ray restarts a worker on a
surviving node, the rank that loads a checkpoint reads its file from here instead of from
storage (an object store or NFS for a real run) whenever the local copy has the size that the
checkpoint's MANIFEST lists; the rank then hashes the bytes against MANIFEST's sha256 as it
would hash bytes read from storage (`reading.fetch_verified`), and on any difference it says so,
drops the local copy and reads storage. The local copy is a cache of bytes whose hash the
MANIFEST fixes: it can make a resume faster, never different.

Where: `<temp dir>/raygpt_local_ckpt_<uid>/<run key>/step_<N>/<name>`, the run key a hash of
the run directory's URI (two runs of one user on a node never share files); private to the user
(`atomic_file.private_dir`: a directory another user made first, or a symlink planted in its
place, is refused, and the copies are then not kept). Each rank keeps the copies of the files
it wrote for its last KEEP_STEPS checkpoints (the newest may not be complete when a worker is
lost: the resume then goes to the one before) and removes its copies when its run finishes; a
run that never finished here leaves its directory until a save of any run on the node finds it
STALE_S old.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from raygpt.checkpointing import protocol as ck
from raygpt.storage.atomic_file import check_private_dir, private_dir

log = logging.getLogger(__name__)

LOCAL_COPY_ROOT = os.path.join(tempfile.gettempdir(), f"raygpt_local_ckpt_{os.getuid()}")
KEEP_STEPS = 2  # the newest checkpoint and the one before (the newest may not be complete yet)
# A run's directory untouched this long (no checkpoint kept in it) belongs to a run that ended
# without a clean finish and was not resumed here: the first save of any run on the node removes
# it, so crashed runs do not fill the node's disk.
STALE_S = 3 * 24 * 3600


class LocalCopies:
    """One rank's view of its node's local copies of one run's checkpoint files."""

    def __init__(self, run_uri: str, root: str | os.PathLike | None = None):
        self.root = Path(root if root is not None else LOCAL_COPY_ROOT)
        self.dir = self.root / hashlib.sha256(run_uri.encode()).hexdigest()[:16]
        self.kept: list[tuple[int, list[str]]] = []  # (step, names) this process kept, oldest first
        self._disabled: str | None = None  # why copies are not kept here (said once)
        self._swept = False  # other runs' stale directories removed (once per process)

    # ------------------------------------------------------------------ save side
    def keep(self, step: int, stage: Path, names) -> None:
        """Hard-link the files `names` that this rank wrote into `stage` for checkpoint `step`
        into the node's local copy, then remove the run's local step directories other than
        the last KEEP_STEPS this process kept (an earlier attempt's, an abandoned trajectory's:
        every rank of the node saves at the same steps, and every rank of this attempt loaded
        before its first save). Never fails the save: a node where links cannot be made
        (another filesystem, a directory that is not private) keeps no copies, and resumes
        read storage."""
        if self._disabled is not None:
            return
        try:
            sdir = self._step_dir(step, create=True)
            for name in names:
                target = sdir / name
                target.unlink(missing_ok=True)  # an older attempt's file of the same name
                os.link(stage / name, target)
        except (OSError, ck.CheckpointError) as e:
            self._disabled = f"{type(e).__name__}: {e}"
            log.info(f"raygpt | checkpoint files are not kept on this node for a fast resume "
                     f"({self._disabled}); resumes read them from storage")
            return
        if not self._swept:
            self._swept = True
            self._remove_stale_runs()
        self.kept = [(s, n) for s, n in self.kept if s != step] + [(step, list(names))]
        del self.kept[:-KEEP_STEPS]
        keep_dirs = {ck.step_dir(s) for s, _ in self.kept}
        for entry in os.scandir(self.dir):
            if entry.name not in keep_dirs:
                shutil.rmtree(entry.path, ignore_errors=True)

    def _remove_stale_runs(self, now: float | None = None) -> None:
        """Remove other runs' directories under the root not modified for STALE_S seconds."""
        now = time.time() if now is None else now
        for entry in os.scandir(self.root):
            try:
                stale = now - entry.stat(follow_symlinks=False).st_mtime > STALE_S
            except OSError:
                continue
            if stale and entry.path != str(self.dir):
                shutil.rmtree(entry.path, ignore_errors=True)

    def remove_all(self) -> None:
        """Remove the copies this rank kept (its run is over); the directories go with the last
        rank of the node."""
        for step, names in self.kept:
            sdir = self.dir / ck.step_dir(step)
            for name in names:
                with contextlib.suppress(OSError):
                    (sdir / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                sdir.rmdir()
        self.kept = []
        with contextlib.suppress(OSError):
            self.dir.rmdir()

    def _step_dir(self, step: int, create: bool = False) -> Path:
        # what is read from here is loaded as training state: a root another user made first
        # (a directory, or a symlink to one they write) is refused
        if not create:
            check_private_dir(self.root, "checkpoint copy directory")
            return self.dir / ck.step_dir(step)
        private_dir(self.root, "checkpoint copy directory")
        self.dir.mkdir(mode=0o700, exist_ok=True)  # inside the private root: ours
        (self.dir / ck.step_dir(step)).mkdir(mode=0o700, exist_ok=True)
        return self.dir / ck.step_dir(step)

    # ------------------------------------------------------------------ load side
    def read(self, step: int, name: str, size: int) -> bytes | None:
        """The bytes of this node's local copy of file `name` of checkpoint `step` when it
        exists with `size` bytes (MANIFEST's), else None. The caller hashes them against
        MANIFEST before using them (`reading.fetch_verified`)."""
        try:
            path = self._step_dir(step) / name
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return None
            with open(path, "rb") as f:
                data = f.read(size + 1)
        except (OSError, ck.CheckpointError):
            return None
        return data if len(data) == size else None

    def discard(self, step: int, name: str) -> None:
        """Drop a local copy that did not match MANIFEST (storage's file is read instead)."""
        with contextlib.suppress(OSError):
            (self.dir / ck.step_dir(step) / name).unlink(missing_ok=True)

    def where(self, step: int, name: str) -> str:
        return str(self.dir / ck.step_dir(step) / name)


def remove_run(run_uri: str, root: str | os.PathLike | None = None) -> None:
    """Remove every local copy of one run on this node (tests, tools)."""
    shutil.rmtree(LocalCopies(run_uri, root).dir, ignore_errors=True)
