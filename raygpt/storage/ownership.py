"""Who may write a run directory, and what `--overwrite` may delete.

Two small files at the top of a run (or sweep) directory, reader and writer side by side:

- `raygpt_run.json`, the marker (format, version, kind "run" | "sweep", run id, when, and the
  owner: user name, uid, host), written once into a directory raygpt created or found empty
  (`claim_dir`); a directory holding anything else is refused and left untouched. A marker is
  honoured only when it is this user's (`owner_problem`): locally or on NFS a regular file
  (lstat: no symlink) owned by this uid and recording it; on an object store, which has no owners
  raygpt can read, recording this user's name (a guard against colleagues' mistakes, not against
  whoever holds the bucket's credentials). `--overwrite` deletes only a directory with this
  user's marker of the right kind, never one of `refused_overwrite_target`'s places (`/`, home,
  the current directory or an ancestor, a bucket root, an empty `-o`).
- An unmarked run is adopted by `-y 1` (marked, nothing else written, then resumed) only when it
  shows raygpt wrote it for this user: a raygpt `config.json` or a complete checkpoint (DONE, a
  raygpt MANIFEST and its files), owned by this uid locally or on NFS. `--overwrite` refuses it.
- `raygpt_lease.json`, the lease: one writer per run directory. The job's driver (or sweep trial)
  holds it, naming the holder (user, host, pid, token) and its expiry, renewed every `ttl_s / 4`
  by a heartbeat thread; a second job is refused with a line naming both. A clean end releases
  it; a dead holder's lease is taken over once it expires, or at once when the holder was a
  process on this host that is gone. One *lineage* (a sweep trial and its retries: same sweep
  token and trial id) takes over at once. Ray's restarts inside a job never touch the lease.

Atomicity: locally or on NFS an acquisition's read-check-write runs under an `flock` on
`.raygpt_lease.lock`. Object stores (S3, GCS through pyarrow.fs) offer no conditional put here,
so an acquisition writes, waits `settle_s`, reads back, and gives up if another token is there:
two jobs started within a second on one prefix may both lose (both refused), never both win
unless the store reorders their puts beyond `settle_s`. Expiry is judged against the holder's
wall clock (hosts NTP-synchronised: a skew below 3/4 of ttl_s never takes a live lease).
"""

from __future__ import annotations

import contextlib
import datetime
import getpass
import json
import logging
import os
import pwd
import socket
import stat
import threading
import time
import uuid
from typing import Callable

from raygpt.checkpointing import protocol as ck
from raygpt.config import ConfigError, TrainConfig
from raygpt.runlog import run_config
from raygpt.runlog.history import LOSS_HISTORY, LOSS_HISTORY_LOG
from raygpt.runlog.mainlog import MAIN_LOG_LAYOUT
from raygpt.storage import RunDir, open_run_dir, read_json_bounded, redact
from raygpt.train.faults import announce as announce_faults
from raygpt.train.faults import armed_spec

log = logging.getLogger(__name__)

# names only a raygpt run leaves in its directory: its logs, in either layout (runlog.segments)
RUN_LOGS = frozenset({LOSS_HISTORY, LOSS_HISTORY_LOG.folder, MAIN_LOG_LAYOUT.legacy,
                      MAIN_LOG_LAYOUT.folder})

MARKER = "raygpt_run.json"
MARKER_FORMAT = "raygpt-run-dir"
MARKER_VERSION = 2  # 2 records the owner's uid; 1 only "created_by": "user@host"
LEASE = "raygpt_lease.json"
LEASE_FORMAT = "raygpt-lease"
_LOCK = ".raygpt_lease.lock"
LEASE_VERSION = 1
DEFAULT_TTL_S = float(os.environ.get("RAYGPT_LEASE_TTL_S", "60"))


class RunDirRefused(ConfigError):
    """A run directory may not be used or deleted as asked; the message says why and what to do."""


class RunDirBusy(RunDirRefused):
    """Another job holds the run directory's lease."""


# ---------------------------------------------------------------------- what --overwrite may delete

def refused_overwrite_target(uri: str, *, home: str | None = None, cwd: str | None = None) -> str | None:
    """Why the directory named `uri` (a `-o` value) may never be deleted, or None (pure but for
    the defaults of `home` and `cwd`). Local paths are compared after resolving symlinks."""
    if not uri or not uri.strip():
        return "an empty -o/--output-dir (an unset variable?) names the current directory"
    if "://" in uri:
        scheme, _, rest = uri.partition("://")
        rest = rest.split("?", 1)[0]
        if "@" in rest:  # credentials (s3://KEY:SECRET@bucket/...), a "/" in the secret too
            rest = rest.rsplit("@", 1)[1]
        rest = rest.strip("/")
        if scheme in ("file", "local"):
            return refused_overwrite_target("/" + rest, home=home, cwd=cwd)
        if "/" not in rest:
            return f"{scheme}://{rest} is a bucket root, not a run directory"
        return None
    home = os.path.realpath(home or os.path.expanduser("~"))
    cwd = os.path.realpath(cwd or os.getcwd())
    target = os.path.realpath(uri)
    if target == os.path.realpath("/"):
        return "/ is the root directory"
    for place, what in ((home, "the home directory"), (cwd, "the current directory")):
        if place == target:
            return f"{target} is {what}"
        if place.startswith(target.rstrip("/") + "/"):
            return f"{target} contains {what} ({place})"
    return None


# ---------------------------------------------------------------------- the marker

def _user() -> str:
    """This process's user name: the password database's for its uid ($USER can be set to
    anything), else getpass's, else "uid<N>" (a container without passwd)."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except (KeyError, OSError):
        pass
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name at all: the uid says it
        return f"uid{os.geteuid()}"


def _lstat(run_dir: RunDir, rel: str) -> os.stat_result:
    """The entry itself on a local or NFS directory, not what a symlink there points to."""
    return os.lstat(run_dir.local_path(rel))


def read_marker(run_dir: RunDir) -> dict | None:
    """The marker's fields, None when there is none; RunDirRefused when it is not raygpt's (or,
    on a local or NFS directory, not a regular file: a symlink could lend a stranger's marker)."""
    if not run_dir.exists(MARKER):
        return None
    if run_dir.is_local and not stat.S_ISREG(_lstat(run_dir, MARKER).st_mode):
        raise RunDirRefused(f"{run_dir.uri(MARKER)}: expected a regular file written by raygpt, "
                            f"found a symlink or another kind of entry; remove it by hand")
    try:
        d = read_json_bounded(run_dir, MARKER)
    except ValueError as e:  # JSONError / FileTooLarge name the file already
        named = str(e) if str(e).startswith(run_dir.uri(MARKER)) else f"{run_dir.uri(MARKER)}: {e}"
        raise RunDirRefused(named) from e
    if not isinstance(d, dict) or d.get("format") != MARKER_FORMAT:
        found = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise RunDirRefused(f"{run_dir.uri(MARKER)}: format: expected {MARKER_FORMAT!r}, "
                            f"found {found!r}")
    if d.get("version", 1) not in (1, MARKER_VERSION):
        raise RunDirRefused(f"{run_dir.uri(MARKER)}: version: expected 1 or {MARKER_VERSION}, "
                            f"found {d.get('version')!r} (a newer raygpt's?)")
    return d


def write_marker(run_dir: RunDir, kind: str, **fields) -> dict:
    """Mark `run_dir` as raygpt's (kind "run" or "sweep") and this user's; returns the marker."""
    user, host = _user(), socket.gethostname()
    marker = {"format": MARKER_FORMAT, "version": MARKER_VERSION, "kind": kind,
              "run_id": uuid.uuid4().hex, "created": time.time(), "user": user,
              "uid": os.geteuid(), "host": host, "created_by": f"{user}@{host}", **fields}
    run_dir.write_bytes_atomic(MARKER, json.dumps(marker, indent=1, sort_keys=True).encode())
    return marker


def marker_owner(marker: dict) -> tuple[object, object]:
    """(user name, uid or None) a marker records; version 1 recorded only "user@host"."""
    if marker.get("version", 1) >= 2:
        return marker.get("user"), marker.get("uid")
    created_by = marker.get("created_by")
    return (created_by.rsplit("@", 1)[0] if isinstance(created_by, str) else None), None


def owner_problem(marker: dict, file_uid: int | None, user: str, uid: int) -> str | None:
    """Why `marker` does not make its directory this user's (`user`, `uid`), or None.
    `file_uid`: the marker file's owner on a local or NFS filesystem; None on an object store,
    whose objects have no owner raygpt can read, so there the recorded user name is compared."""
    rec_user, rec_uid = marker_owner(marker)
    named = (f"{rec_user} (uid {rec_uid})" if rec_uid is not None
             else repr(rec_user) if rec_user is not None else "no one")
    if file_uid is not None:
        if file_uid != uid:
            return f"the file is owned by uid {file_uid}, not by you (uid {uid})"
        if rec_uid is None:  # a version-1 marker: its user name is all it records
            return None if rec_user == user else f"it names {named} as its owner, not you ({user})"
        if isinstance(rec_uid, bool) or rec_uid != uid:  # a file copied or edited to look ours
            return f"it names {named} as its owner, not you (uid {uid})"
        return None
    return None if rec_user == user else f"it names {named} as its owner, not you ({user})"


def check_marker_ours(run_dir: RunDir, marker: dict, doing: str) -> None:
    """RunDirRefused, one line naming `doing` (the flag or command), unless `marker` is this
    user's (`owner_problem`)."""
    file_uid = _lstat(run_dir, MARKER).st_uid if run_dir.is_local else None
    why = owner_problem(marker, file_uid, _user(), os.geteuid())
    if why:
        raise RunDirRefused(f"{doing} {redact(run_dir.uri())}: refused, its {MARKER} is not yours: "
                            f"{why}; raygpt writes and deletes only directories it marked for "
                            f"you: name a directory of your own, or ask its owner")


def check_overwrite_target(uri: str) -> None:
    """RunDirRefused when `--overwrite` names one of `refused_overwrite_target`'s places."""
    why = refused_overwrite_target(uri)
    if why:
        raise RunDirRefused(redact(f"--overwrite {uri!r}: refused, {why}; name the run directory "
                                   f"itself (e.g. -o runs/NAME or s3://BUCKET/PREFIX/NAME)"))


def check_overwrite(run_dir: RunDir, kind: str, uri: str) -> None:
    """Raise RunDirRefused unless `--overwrite` may delete `run_dir` (named `uri` by the user):
    not a refused place, and marked as raygpt's of this kind by this user."""
    check_overwrite_target(uri)
    marker = read_marker(run_dir)
    if marker is None:
        raise RunDirRefused(
            f"--overwrite {redact(run_dir.uri())}: refused, the directory holds no {MARKER} "
            f"(raygpt marks every directory it creates; this one is from an older raygpt or is "
            f"not raygpt's); check what is in it and delete it by hand if it is yours to delete, "
            f"or resume it with -y 1 if it is a raygpt run of yours")
    check_marker_ours(run_dir, marker, "--overwrite")
    if marker.get("kind") != kind:
        raise RunDirRefused(f"--overwrite {redact(run_dir.uri())}: refused, {MARKER} says it is a "
                            f"{marker.get('kind')!r} directory, expected a {kind!r} directory")


def check_fresh_start(target: RunDir, kind: str, given: str, overwrite: bool) -> None:
    """The one rule for starting afresh where a run (or a sweep) already is: refused without
    --overwrite (-y 1 resumes it), and with it only over a directory `check_overwrite` allows."""
    if not overwrite:
        raise RunDirRefused(f"-o/--output-dir {redact(target.uri())}: expected an empty or new "
                            f"{kind} directory, found an existing {kind}; pass -y 1 to resume it "
                            f"or --overwrite to start fresh over it")
    check_overwrite(target, kind, given)


def delete_for_fresh_start(target: RunDir, kind: str, lease: "Lease | None") -> None:
    """Delete the existing run or sweep `check_fresh_start` allowed, under this job's lease
    (taken before, so a live job is never deleted; renewed after, as the delete took its file)."""
    log.info(f"raygpt | --overwrite: deleting the {kind} in {redact(target.uri())}")
    target.delete_dir("")
    if lease is not None:
        lease.renew()


# ---------------------------------------------------------------------- the lease

def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _pid_gone(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, TypeError, OverflowError):
        return False
    return False


def describe_holder(lease: dict) -> str:
    return (f"{lease.get('user')}@{lease.get('host')} pid {lease.get('pid')}"
            + (f" ({lease.get('what')})" if lease.get("what") else ""))


def read_lease(run_dir: RunDir) -> dict | None:
    """The lease's fields, or None when there is none or it is unreadable (a lease nobody can
    read protects nothing: it is overwritten, with a warning)."""
    if not run_dir.exists(LEASE):
        return None
    try:
        d = read_json_bounded(run_dir, LEASE)
        if not (isinstance(d, dict) and d.get("format") == LEASE_FORMAT
                and isinstance(d.get("token"), str) and isinstance(d.get("expires"), (int, float))):
            raise ValueError("expected a raygpt lease (format, token, expires)")
    except ValueError as e:
        log.warning(f"raygpt | WARNING: {run_dir.uri(LEASE)}: ignored ({e})")
        return None
    return d


class Lease:
    """The single-writer lease of one run directory (see the module docstring)."""

    def __init__(self, run_dir: RunDir, *, ttl_s: float = DEFAULT_TTL_S, lineage: str | None = None,
                 what: str = "", settle_s: float | None = None, clock=time.time):
        if not ttl_s > 0:
            raise ValueError(f"lease ttl_s: expected seconds > 0, found {ttl_s!r}")
        self.run_dir, self.ttl_s, self.lineage, self.what = run_dir, float(ttl_s), lineage, what
        self.settle_s = (0.0 if run_dir.is_local else 0.5) if settle_s is None else settle_s
        self.clock = clock
        self.token = uuid.uuid4().hex
        self.held = False
        self.lost: str | None = None  # why the lease was lost while held (heartbeat)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, acquired: float) -> dict:
        now = self.clock()
        return {"format": LEASE_FORMAT, "version": LEASE_VERSION, "token": self.token,
                "lineage": self.lineage, "user": _user(), "host": socket.gethostname(),
                "pid": os.getpid(), "what": self.what, "acquired": acquired, "renewed": now,
                "expires": now + self.ttl_s}

    @contextlib.contextmanager
    def _exclusive(self):
        """The read-check-write section: under flock on a local or NFS directory."""
        if not self.run_dir.is_local:
            yield
            return
        import fcntl
        self.run_dir.makedirs("")
        # 0666 less the umask, as every file raygpt writes (a shared run directory stays usable)
        fd = os.open(self.run_dir.local_path(_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def may_take(self, current: dict | None) -> tuple[bool, str]:
        """(may this holder take the lease over from `current`, why)."""
        if current is None:
            return True, "free"
        if current.get("token") == self.token:
            return True, "ours"
        if self.lineage is not None and current.get("lineage") == self.lineage:
            return True, f"held by an earlier holder of the same lineage ({describe_holder(current)})"
        now = self.clock()
        if current["expires"] <= now:
            return True, (f"taken over from {describe_holder(current)}, whose lease expired at "
                          f"{_when(current['expires'])}")
        if current.get("host") == socket.gethostname() and _pid_gone(current.get("pid")):
            return True, (f"taken over from {describe_holder(current)}, a process on this host "
                          f"that no longer exists")
        return False, (f"{self.run_dir.uri()}: refused, another job writes this run directory: "
                       f"{describe_holder(current)} holds its lease (renewed {_when(current.get('renewed') or 0)}, "
                       f"expires {_when(current['expires'])}, in {current['expires'] - now:.0f} s, "
                       f"unless renewed); stop that job first, or wait for its lease to expire "
                       f"if it died")

    def acquire(self) -> str:
        """Take the lease or raise RunDirBusy naming the holder; returns how it was taken."""
        with self._exclusive():
            ok, why = self.may_take(read_lease(self.run_dir))
            if not ok:
                raise RunDirBusy(why)
            self.run_dir.write_bytes_atomic(LEASE, json.dumps(self._record(self.clock())).encode())
        if self.settle_s:
            time.sleep(self.settle_s)
        back = read_lease(self.run_dir)
        if back is None or back.get("token") != self.token:
            raise RunDirBusy(f"{self.run_dir.uri()}: refused, another job took this run "
                             f"directory's lease at the same moment"
                             + (f" ({describe_holder(back)})" if back else "") + "; try again")
        self.held, self._acquired = True, back["acquired"]
        if why not in ("free", "ours"):
            log.info(f"raygpt | lease of {self.run_dir.uri()}: {why}")
        return why

    def renew(self) -> bool:
        """Extend the lease; False (and `lost` set) when another holder has it now."""
        with self._exclusive():
            current = read_lease(self.run_dir)
            if current is not None and current.get("token") != self.token:
                self.lost = f"{describe_holder(current)} took the lease over"
                self.held = False
                return False
            self.run_dir.write_bytes_atomic(LEASE, json.dumps(self._record(self._acquired)).encode())
        return True

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not self.held:
            return
        self.held = False
        with self._exclusive():
            current = read_lease(self.run_dir)
            if current is not None and current.get("token") == self.token:
                self.run_dir.delete_file(LEASE)

    def start_heartbeat(self, on_lost=None) -> None:
        """Renew every ttl_s / 4 on a daemon thread; call `on_lost(reason)` once if another
        holder took the lease (this job should then stop writing). A failed renewal (storage
        unreachable) is retried at the next beat, with a warning."""
        def beat():
            while not self._stop.wait(self.ttl_s / 4):
                try:
                    if not self.renew():
                        log.warning(f"raygpt | WARNING: lost the lease of {self.run_dir.uri()}: "
                                    f"{self.lost}")
                        if on_lost is not None:
                            on_lost(self.lost)
                        return
                except Exception as e:  # noqa: BLE001 - the next beat retries
                    log.warning(f"raygpt | WARNING: could not renew the lease of {self.run_dir.uri()}: "
                                f"{type(e).__name__}: {e}")
        self._stop.clear()
        self._thread = threading.Thread(target=beat, daemon=True, name="raygpt-lease-heartbeat")
        self._thread.start()

    def __enter__(self) -> "Lease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def is_own_file(name: str) -> bool:
    """The files of this module (kept when a run directory is judged empty or scanned)."""
    return name in (MARKER, LEASE, _LOCK)


# ---------------------------------------------------------------------- claiming a run directory

def foreign_entries(run_dir: RunDir) -> list[str]:
    """The names in `run_dir` other than this module's own files ([] when it does not exist)."""
    return [n for n in run_dir.listdir() if not is_own_file(n)] if run_dir.exists() else []


def holds_run(run_dir: RunDir) -> bool:
    """Whether `run_dir` holds a run's logs (either layout) or a checkpoint directory."""
    return any(n in RUN_LOGS or n.startswith("step_") for n in run_dir.listdir())


def _run_evidence(run_dir: RunDir) -> str | None:
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


def why_not_a_run_of_yours(run_dir: RunDir) -> str | None:
    """None when an unmarked directory (a run from before markers) shows it is a raygpt run of
    this user's (`_run_evidence`, and on a local or NFS directory that file is a regular file
    owned by this uid; an object store has no owner to compare); else what it lacks."""
    rel = _run_evidence(run_dir)
    if rel is None:
        return (f"it holds neither a {run_config.CONFIG_FILE} in raygpt's format nor a "
                f"complete raygpt checkpoint")
    if run_dir.is_local:
        st, uid = _lstat(run_dir, rel), os.geteuid()
        if not stat.S_ISREG(st.st_mode):
            return f"its {rel} is not a regular file"
        if st.st_uid != uid:
            return f"its {rel} is owned by uid {st.st_uid}, not by you (uid {uid})"
    return None


def _check_dir_owner(run_dir: RunDir) -> None:
    """An existing empty local directory is marked only when it is this uid's (the directory a
    shared, group-writable parent lets one create is not another user's to take)."""
    if not (run_dir.is_local and run_dir.exists()):
        return
    owner, uid = os.stat(run_dir.local_path()).st_uid, os.geteuid()
    if owner != uid:
        raise RunDirRefused(f"-o/--output-dir {run_dir.uri()}: refused, the directory is owned by "
                            f"uid {owner}, not by you (uid {uid}); name a new directory (raygpt "
                            f"creates it)")


def check_claim(run_dir: RunDir, kind: str, given: str, *, holds: Callable[[RunDir], bool],
                resume: bool = False, overwrite: bool = False) -> str:
    """What claiming `run_dir` for a `kind` job does, or RunDirRefused (one line) saying why
    not; reads only. `holds(run_dir)`: whether a run (or sweep) is there already.
    "use": this user's marker of this kind (a resume, or nothing there yet);
    "replace": the same with a run there and --overwrite: delete it, then mark afresh;
    "mark": new or empty (only this module's own files): mark it;
    "adopt": -y 1 on a run from before markers that `why_not_a_run_of_yours` accepts: mark it.
    Anything else (foreign files, another user's marker, another kind's) is refused."""
    where = redact(run_dir.uri())
    if overwrite:  # a place --overwrite must never name is refused whatever it holds
        check_overwrite_target(given)
    marker = read_marker(run_dir)
    if marker is not None:
        check_marker_ours(run_dir, marker, "-o/--output-dir")
        if marker.get("kind") != kind:
            raise RunDirRefused(f"-o/--output-dir {where}: refused, {MARKER} says it is a "
                                f"{marker.get('kind')!r} directory, expected a {kind!r} "
                                f"directory; name another directory")
        if holds(run_dir) and not resume:
            check_fresh_start(run_dir, kind, given, overwrite)
            return "replace"
        return "use"
    names = foreign_entries(run_dir)
    if not names:
        _check_dir_owner(run_dir)
        return "mark"
    premarker = kind == "run" and holds(run_dir)
    why_not = why_not_a_run_of_yours(run_dir) if premarker else None
    if premarker and why_not is None:
        if resume:
            return "adopt"
        if overwrite:
            check_overwrite(run_dir, kind, given)  # raises: no marker
        raise RunDirRefused(f"-o/--output-dir {where}: expected an empty or new run directory, "
                            f"found a run from a raygpt without run-directory markers (no "
                            f"{MARKER}); pass -y 1 to resume it (raygpt marks it then), or "
                            f"delete it by hand to start afresh there")
    examples = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    adopt = (f"; -y 1 resumes only a raygpt run of yours, and {why_not}" if premarker and resume
             else "")
    raise RunDirRefused(f"-o/--output-dir {where}: refused, expected an empty or new {kind} "
                        f"directory, found {len(names)} entries raygpt did not create for a "
                        f"{kind} (no {MARKER}; e.g. {examples}){adopt}; nothing in it was "
                        f"changed: name a new or empty directory")


def claim_dir(run_dir: RunDir, kind: str, given: str, *, holds: Callable[[RunDir], bool],
              resume: bool = False, overwrite: bool = False, lease: "Lease | None" = None) -> dict:
    """The one way a directory becomes a raygpt run or sweep (`check_claim`'s actions); returns
    its marker. Checked before `lease` is taken (a refusal writes nothing) and again under it,
    so what is deleted or marked is what was checked. A lease this call took is released again
    if the second check refuses."""
    args = dict(holds=holds, resume=resume, overwrite=overwrite)
    check_claim(run_dir, kind, given, **args)
    took = lease is not None and not lease.held
    if took:
        lease.acquire()  # RunDirBusy (a ConfigError) when another job holds it
    try:
        action = check_claim(run_dir, kind, given, **args)
    except RunDirRefused:
        if took:
            lease.release()
        raise
    if action == "replace":
        delete_for_fresh_start(run_dir, kind, lease)
    run_dir.makedirs("")
    if action == "use":
        return read_marker(run_dir)
    return write_marker(run_dir, kind, **({"adopted": True} if action == "adopt" else {}))


def check_own_run(run_dir: RunDir, doing: str) -> None:
    """For a command that changes an existing run in place (`raygpt compact`): RunDirRefused
    unless `run_dir` carries this user's run marker, or is an unmarked run from before markers
    that `why_not_a_run_of_yours` accepts. Marks nothing."""
    marker = read_marker(run_dir)
    if marker is not None:
        check_marker_ours(run_dir, marker, doing)
        if marker.get("kind") != "run":
            raise RunDirRefused(f"{doing} {redact(run_dir.uri())}: refused, {MARKER} says it is a "
                                f"{marker.get('kind')!r} directory, expected a run directory")
        return
    why_not = why_not_a_run_of_yours(run_dir)
    if why_not:
        raise RunDirRefused(f"{doing} {redact(run_dir.uri())}: refused, expected a raygpt run "
                            f"directory of yours, found no {MARKER} and {why_not}")


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
    run_dir = open_run_dir(cfg.output_dir)
    claim_dir(run_dir, "run", cfg.output_dir, holds=holds_run, resume=cfg.resume == 1,
              overwrite=cfg.overwrite, lease=lease)
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
