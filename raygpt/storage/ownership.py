"""Who may write a run directory, and what `--overwrite` may delete.

Two small files at the top of a run (or sweep) directory, reader and writer side by side:

- `raygpt_run.json`, the marker (format, version, kind "run" | "sweep", run id, when, and the
  owner: user name, uid, host), written once into a directory raygpt created or found empty
  (`claim_dir`); a directory holding anything else is refused and left untouched. A marker is
  honoured only when it is this user's (`owner_problem`): where the store reads owners
  (`caps.owners`: a local or NFS directory) a regular file (lstat: no symlink) owned by this uid
  and recording it; on a store without (an object store), recording this user's name (a guard against colleagues' mistakes, not against
  whoever holds the bucket's credentials). `--overwrite` deletes only a directory with this
  user's marker of the right kind, never one of `refused_overwrite_target`'s places (`/`, home,
  the current directory or an ancestor, a bucket root, an empty `-o`).
- An unmarked run is adopted by `-y 1` (marked, nothing else written, then resumed) only when it
  shows raygpt wrote it for this user: a raygpt `config.json` or a complete checkpoint (DONE, a
  raygpt MANIFEST and its files; the caller's `evidence`, raygpt.train.run_dir's for a run),
  owned by this uid where the store reads owners. `--overwrite` refuses it.
- `raygpt_lease.json`, the lease: one writer per run directory. The job's driver (or sweep trial)
  holds it, naming the holder (user, host, pid, token) and its expiry, renewed every `ttl_s / 4`
  by a heartbeat thread; a second job is refused with a line naming both. A clean end releases
  it; a dead holder's lease is taken over once it expires, or at once when the holder was a
  process on this host that is gone. One *lineage* (a sweep trial and its retries: same sweep
  token and trial id) takes over at once. Ray's restarts inside a job never touch the lease.

Atomicity: where the store has a lock (`caps.locks`: a local or NFS directory's `flock` on
`.raygpt_lease.lock`) an acquisition's read-check-write runs under it. A store without one
(S3, GCS through pyarrow.fs: no conditional put here) makes an acquisition writes, waits `settle_s`, reads back, and gives up if another token is there:
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
import threading
import time
import uuid
from typing import Callable

# ConfigError: a leaf module with no imports of its own; a refusal is a bad input (exit 2)
# wherever the command lines catch one
from raygpt.config.errors import ConfigError
from raygpt.storage.rundir import RunDir, read_json_bounded
from raygpt.storage.uri import redact

log = logging.getLogger(__name__)

# what shows an unmarked directory is a run raygpt wrote for this user: the name of the file
# that proves it, or None (raygpt.train.run_dir.run_evidence: config.json, a checkpoint)
Evidence = Callable[[RunDir], "str | None"]

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


def read_marker(run_dir: RunDir) -> dict | None:
    """The marker's fields, None when there is none; RunDirRefused when it is not raygpt's (or,
    on a local or NFS directory, not a regular file: a symlink could lend a stranger's marker)."""
    if not run_dir.exists(MARKER):
        return None
    owner = run_dir.store.owner(MARKER)  # None where the store has no owners to read
    if owner is not None and not owner.regular:
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
    owner = run_dir.store.owner(MARKER)
    file_uid = owner.uid if owner is not None else None
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
        # without a lock, a write is read back after a pause (see the module docstring)
        self.settle_s = (0.0 if run_dir.caps.locks else 0.5) if settle_s is None else settle_s
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
        """The read-check-write section: under the store's lock where it has one (flock on a
        local or NFS directory)."""
        if not self.run_dir.caps.locks:
            yield
            return
        with self.run_dir.store.lock(_LOCK):
            yield

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


def why_not_a_run_of_yours(run_dir: RunDir, evidence: Evidence) -> str | None:
    """None when an unmarked directory (a run from before markers) shows it is a raygpt run of
    this user's (`evidence` names the file that shows it, and where the store has owners that
    file is a regular file owned by this uid); else what it lacks."""
    rel = evidence(run_dir)
    if rel is None:
        return ("it holds neither a config.json in raygpt's format nor a complete raygpt "
                "checkpoint")
    owner, uid = run_dir.store.owner(rel), os.geteuid()
    if owner is not None:
        if not owner.regular:
            return f"its {rel} is not a regular file"
        if owner.uid != uid:
            return f"its {rel} is owned by uid {owner.uid}, not by you (uid {uid})"
    return None


def _check_dir_owner(run_dir: RunDir) -> None:
    """An existing empty local directory is marked only when it is this uid's (the directory a
    shared, group-writable parent lets one create is not another user's to take)."""
    found = run_dir.store.owner("") if run_dir.exists() else None  # None: no owners to read
    if found is None:
        return
    owner, uid = found.uid, os.geteuid()
    if owner != uid:
        raise RunDirRefused(f"-o/--output-dir {run_dir.uri()}: refused, the directory is owned by "
                            f"uid {owner}, not by you (uid {uid}); name a new directory (raygpt "
                            f"creates it)")


def check_claim(run_dir: RunDir, kind: str, given: str, *, holds: Callable[[RunDir], bool],
                resume: bool = False, overwrite: bool = False,
                evidence: Evidence | None = None) -> str:
    """What claiming `run_dir` for a `kind` job does, or RunDirRefused (one line) saying why
    not; reads only. `holds(run_dir)`: whether a run (or sweep) is there already.
    "use": this user's marker of this kind (a resume, or nothing there yet);
    "replace": the same with a run there and --overwrite: delete it, then mark afresh;
    "mark": new or empty (only this module's own files): mark it;
    "adopt": -y 1 on a run from before markers that `why_not_a_run_of_yours` accepts with
    `evidence` (given for a run only): mark it.
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
    premarker = evidence is not None and holds(run_dir)
    why_not = why_not_a_run_of_yours(run_dir, evidence) if premarker else None
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
              resume: bool = False, overwrite: bool = False, lease: "Lease | None" = None,
              evidence: Evidence | None = None) -> dict:
    """The one way a directory becomes a raygpt run or sweep (`check_claim`'s actions); returns
    its marker. Checked before `lease` is taken (a refusal writes nothing) and again under it,
    so what is deleted or marked is what was checked. A lease this call took is released again
    if the second check refuses."""
    args = dict(holds=holds, resume=resume, overwrite=overwrite, evidence=evidence)
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


def check_own_run(run_dir: RunDir, doing: str, evidence: Evidence) -> None:
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
    why_not = why_not_a_run_of_yours(run_dir, evidence)
    if why_not:
        raise RunDirRefused(f"{doing} {redact(run_dir.uri())}: refused, expected a raygpt run "
                            f"directory of yours, found no {MARKER} and {why_not}")
