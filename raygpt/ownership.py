"""Who may write a run directory, and what `--overwrite` may delete.

Two small files at the top of a run (or sweep) directory, reader and writer side by side:

- `raygpt_run.json`, the marker: written once when raygpt creates the directory (format,
  version, kind "run" | "sweep", a run id, who created it and when). `--overwrite` deletes only a
  directory that carries it, and never one of `refused_overwrite_target`'s places (`/`, the
  home directory, the current directory or one of their ancestors, a bucket root, an empty
  `-o`). A run directory from before the marker existed holds no marker: raygpt refuses to
  overwrite it and says to delete it by hand (`-y 1` still resumes it, and marks it).
- `raygpt_lease.json`, the lease: one writer per run directory. The driver (or a sweep trial)
  that runs a job holds it; it names the holder (user, host, pid, a token) and when it expires,
  and a heartbeat thread renews it every `ttl_s / 4`. A second job is refused with a line naming
  the holder and the expiry. The lease is released when the job ends (so `-y 1` right after a
  clean stop works at once); a job that died without releasing it is taken over by its
  successor once the lease expires, or at once when the holder was a process on this host that
  no longer exists. Holders of one *lineage* (a sweep trial and its retries, which share the
  sweep driver's token and the trial id) take over from each other at once.

Ray restarts of the worker group happen inside the driver's job: they never touch the lease.

Atomicity: on a local or NFS directory the read-check-write of an acquisition runs under an
`flock` on `.raygpt_lease.lock`, so two jobs cannot both win. Object stores (S3, GCS through
pyarrow.fs) offer no conditional put here, so an acquisition writes, waits `settle_s`, reads
back, and gives up if another holder's token is there: two jobs started within the same second
on the same bucket prefix can both see themselves lose (both are refused; start one again),
never both win unless the store reorders their puts beyond `settle_s`. Expiry is judged in
wall-clock time against the holder's own clock: hosts are assumed NTP-synchronised (a skew
of s seconds moves a takeover s seconds earlier or later; a live holder renews every
ttl_s / 4, so a skew below 3/4 of ttl_s never takes a live lease).
"""

from __future__ import annotations

import contextlib
import datetime
import getpass
import json
import logging
import os
import socket
import threading
import time
import uuid

from raygpt.config import ConfigError, TrainConfig
from raygpt.faults import announce as announce_faults
from raygpt.faults import armed_spec
from raygpt.runlog.history import LOSS_HISTORY, LOSS_HISTORY_LOG
from raygpt.runlog.mainlog import MAIN_LOG_LAYOUT
from raygpt.storage import RunDir, open_run_dir, read_json_bounded, redact

log = logging.getLogger(__name__)

# names only a raygpt run leaves in its directory: its logs, in either layout (runlog.segments)
RUN_LOGS = frozenset({LOSS_HISTORY, LOSS_HISTORY_LOG.folder, MAIN_LOG_LAYOUT.legacy,
                      MAIN_LOG_LAYOUT.folder})

MARKER = "raygpt_run.json"
MARKER_FORMAT = "raygpt-run-dir"
LEASE = "raygpt_lease.json"
LEASE_FORMAT = "raygpt-lease"
_LOCK = ".raygpt_lease.lock"
VERSION = 1
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

def read_marker(run_dir: RunDir) -> dict | None:
    """The marker's fields, None when there is none; RunDirRefused when it is not raygpt's."""
    if not run_dir.exists(MARKER):
        return None
    try:
        d = read_json_bounded(run_dir, MARKER)
    except ValueError as e:
        raise RunDirRefused(f"{run_dir.uri(MARKER)}: {e}") from e
    if not isinstance(d, dict) or d.get("format") != MARKER_FORMAT:
        found = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise RunDirRefused(f"{run_dir.uri(MARKER)}: format: expected {MARKER_FORMAT!r}, "
                            f"found {found!r}")
    return d


def write_marker(run_dir: RunDir, kind: str, **fields) -> dict:
    """Mark `run_dir` as raygpt's (kind "run" or "sweep"); returns the marker."""
    marker = {"format": MARKER_FORMAT, "version": VERSION, "kind": kind,
              "run_id": uuid.uuid4().hex, "created": time.time(),
              "created_by": f"{_user()}@{socket.gethostname()}", **fields}
    run_dir.write_bytes_atomic(MARKER, json.dumps(marker, indent=1, sort_keys=True).encode())
    return marker


def check_overwrite(run_dir: RunDir, kind: str, uri: str) -> None:
    """Raise RunDirRefused unless `--overwrite` may delete `run_dir` (named `uri` by the user):
    not a refused place, and marked as raygpt's of this kind."""
    why = refused_overwrite_target(uri)
    if why:
        raise RunDirRefused(redact(f"--overwrite {uri!r}: refused, {why}; name the run directory "
                                   f"itself (e.g. -o runs/NAME or s3://BUCKET/PREFIX/NAME)"))
    marker = read_marker(run_dir)
    if marker is None:
        raise RunDirRefused(
            f"--overwrite {run_dir.uri()}: refused, the directory holds no {MARKER} (raygpt marks "
            f"every run directory it creates; this one is from an older raygpt or is not "
            f"raygpt's); check what is in it and delete it by hand if it is yours to delete, or "
            f"resume it with -y 1")
    if marker.get("kind") != kind:
        raise RunDirRefused(f"--overwrite {run_dir.uri()}: refused, {MARKER} says it is a "
                            f"{marker.get('kind')!r} directory, expected a {kind!r} directory")


# ---------------------------------------------------------------------- the lease

def check_fresh_start(target: RunDir, kind: str, given: str, overwrite: bool) -> None:
    """The one rule for starting afresh where a run (or a sweep) already is: refused without
    --overwrite (-y 1 resumes it), and with it only over a directory `check_overwrite` allows."""
    if not overwrite:
        raise ConfigError(f"-o/--output-dir {redact(target.uri())}: expected an empty or new "
                          f"{kind} directory, found an existing {kind}; pass -y 1 to resume it or "
                          f"--overwrite to start fresh over it")
    check_overwrite(target, kind, given)


def delete_for_fresh_start(target: RunDir, kind: str, lease: "Lease | None") -> None:
    """Delete the existing run or sweep `check_fresh_start` allowed, under this job's lease
    (taken before, so a live job is never deleted; renewed after, as the delete took its file)."""
    log.info(f"raygpt | --overwrite: deleting the {kind} in {redact(target.uri())}")
    target.delete_dir("")
    if lease is not None:
        lease.renew()


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (a container without passwd): the uid says it
        return f"uid{os.getuid()}"


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
        return {"format": LEASE_FORMAT, "version": VERSION, "token": self.token,
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

def prepare_run_dir(cfg: TrainConfig, lease: Lease | None = None) -> RunDir:
    """Never overwrite a run silently, never delete what is not a run. A directory that holds a
    run needs -y 1 (resume) or --overwrite (start fresh: only over a directory raygpt marked as
    a run, never `/`, the home or current directory, a bucket root or an empty -o); a directory
    that holds anything else is refused. `lease` (not yet held) is taken after the checks and
    before anything is deleted, so a live run is never deleted. A new run directory is marked
    (`ownership.MARKER`); a pre-marker run resumed with -y 1 is marked then."""
    if not cfg.output_dir.strip():
        raise ConfigError(f"-o/--output-dir {cfg.output_dir!r}: refused, "
                          f"{refused_overwrite_target(cfg.output_dir)}")
    run_dir = open_run_dir(cfg.output_dir)
    names = [n for n in run_dir.listdir() if not is_own_file(n)] if run_dir.exists() else []
    holds_run = any(n in RUN_LOGS or n.startswith("step_") for n in names)
    marker = read_marker(run_dir)
    fresh_over_run = holds_run and cfg.resume != 1
    if fresh_over_run:
        check_fresh_start(run_dir, "run", cfg.output_dir, cfg.overwrite)
    elif names and not holds_run and marker is None:
        raise ConfigError(f"-o/--output-dir {redact(run_dir.uri())}: expected an empty or new run "
                          f"directory, found {len(names)} entries that are not a raygpt run "
                          f"(e.g. {', '.join(repr(n) for n in names[:3])}); name a new directory")
    if lease is not None:
        lease.acquire()  # RunDirBusy (a ConfigError) when another job holds it
    if fresh_over_run:
        delete_for_fresh_start(run_dir, "run", lease)
        marker = None
    run_dir.makedirs("")
    if marker is None:
        write_marker(run_dir, "run", adopted=holds_run and not fresh_over_run)
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
