"""Ray's own lines in the driver go to Ray's log files, not the terminal: the terminal is raygpt's.

A run, a sweep and a prepare print one screen: raygpt's header, its step or progress lines,
validation, samples and the end. Ray's driver-side loggers would add their own: the token-auth
WARNING and "Started a local Ray instance" (logger "ray", at every start), Ray Data's execution
plan and timings (logger "ray.data", during prepare), and Ray's colour codes around each
worker's "(RayTrainWorker pid=...)" prefix in a redirected log. `quiet_ray_console()`, called
before `ray.init`, settles all of them through Ray's documented knobs and the loggers' levels:

- every handler of Ray's loggers that writes to the terminal shows ERROR and above only (an error
  of Ray's is still seen where it happens);
- the "ray" logger's records also go to `raygpt-driver-<pid>.log` in the session's logs directory
  (`/tmp/ray/session_*/logs`, beside Ray's own files; the records before Ray's session exists are
  held, at most `HELD_RECORDS`, and written once it does); Ray Data keeps writing its own
  `ray-data.log` there;
- RAY_COLOR_PREFIX=0 when stdout is not a terminal (Ray then prints the worker prefix bare).
- the raylet's account of a worker its memory monitor killed (Ray's "(raylet) ... killed due to
  the node running low on memory" and its dump of the node's workers and top processes) goes to
  the same file: raygpt says the kill in one line (raygpt.ray.memory_kill).

A setting the user made (RAY_COLOR_PREFIX in the environment) is kept.
"""

from __future__ import annotations

import logging
import os
import sys

from raygpt.ray import compat, memory_kill

# Ray's loggers whose records reach the driver's terminal (Ray Train's and Tune's propagate to
# "ray"; Ray Data's has a console handler of its own)
RAY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune")
DRIVER_LOG = "raygpt-driver-{pid}.log"
HELD_RECORDS = 1000  # before Ray's session exists (a start's few lines); the rest are dropped


class _ToSessionLog(logging.Handler):
    """Ray's records into the session's logs directory once there is one; held until then."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.held: list[logging.LogRecord] = []
        self.file: logging.FileHandler | None = None

    def open(self, logs_dir: str) -> str:
        path = os.path.join(logs_dir, DRIVER_LOG.format(pid=os.getpid()))
        self.file = logging.FileHandler(path, encoding="utf-8")
        self.file.setFormatter(logging.Formatter(
            "%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"))
        for record in self.held:
            self.file.handle(record)
        self.held.clear()
        return path

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is not None:
            self.file.handle(record)
        elif len(self.held) < HELD_RECORDS:
            self.held.append(record)


_session_log: _ToSessionLog | None = None


def quiet_ray_console() -> None:
    """Before `ray.init`: Ray's driver-side lines below ERROR to Ray's log files, none on the
    terminal; no colour codes in a redirected stdout. Idempotent."""
    global _session_log
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    for name in RAY_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            if _writes_to_terminal(handler):
                handler.setLevel(max(handler.level, logging.ERROR))
    if _session_log is None:
        _session_log = _ToSessionLog()
        logging.getLogger("ray").addHandler(_session_log)
    ray_logger = logging.getLogger("ray")
    compat.divert_raylet_messages(memory_kill.is_kill_account,
                                  lambda text: ray_logger.warning("(raylet) %s", text))


def open_session_log() -> str | None:
    """After `ray.init`: the held lines and every later one into the session's logs directory;
    its path, or None when this process started no session here (it joined a remote cluster)
    or it is open already."""
    if _session_log is None or _session_log.file is not None:
        return None
    logs_dir = compat.session_logs_dir()
    if logs_dir is None or not os.path.isdir(logs_dir):
        return None
    return _session_log.open(logs_dir)


def _writes_to_terminal(handler: logging.Handler) -> bool:
    """A handler that writes to stdout or stderr (Ray's PlainRayHandler is a StreamHandler
    whose stream is looked up at each record); a file's handler does not."""
    return isinstance(handler, logging.StreamHandler) and not isinstance(
        handler, logging.FileHandler)
