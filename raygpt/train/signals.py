"""Operator signals and preemption notices, turned into flags the loop reads at step boundaries.

SIGTERM means "checkpoint and exit cleanly"; SIGUSR1 means "checkpoint and continue".
A preemption notice from Ray (`ray.train.get_preemption_info()`, polled by the Ray session)
means "checkpoint now, once, and keep training". The handlers only set flags: no I/O and no
collectives happen inside a signal handler. The loop puts the flags into its per-step agreement
collective, so a signal delivered to any one rank reaches every rank at the same step boundary.

`SaveClock` is the time-based request of the same kind (--checkpoint-minutes): rank 0's clock
puts it into the same agreement, so every rank saves at the same step.

Python runs signal handlers on the main thread only. Under Ray Train the training function runs
on a worker thread, so `install()` is executed on each worker's main thread by the trainer's
backend hook; in a plain process `watch()` installs them itself.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

_flags = {"stop": False, "save": False}
_lock = threading.Lock()


def _on_sigterm(signum, frame):
    _flags["stop"] = True


def _on_sigusr1(signum, frame):
    _flags["save"] = True


def install() -> bool:
    """Install the SIGTERM and SIGUSR1 handlers (main thread only). Returns True if installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGUSR1, _on_sigusr1)
    return True


class Flags:
    """The loop's view of the flags: a stop stays requested, a save request is taken once."""

    def stop_requested(self) -> float:
        return 1.0 if _flags["stop"] else 0.0

    def take_save_request(self) -> float:
        with _lock:
            save, _flags["save"] = _flags["save"], False
        return 1.0 if save else 0.0


def watch() -> Flags:
    """Reset the flags for a new training attempt and make sure handlers are in place. Checked
    against the handlers themselves, not a "done once" mark: whatever ran in this process since
    (ray.init's own SIGTERM handler, a driver handing its handlers back) may have replaced them,
    and a SIGTERM meant as "checkpoint and stop" would then kill the process."""
    _flags["stop"] = _flags["save"] = False
    if (signal.getsignal(signal.SIGTERM) is not _on_sigterm
            or signal.getsignal(signal.SIGUSR1) is not _on_sigusr1):
        install()  # a no-op off the main thread (Ray's backend hook installs them there)
    return Flags()


def unwatch() -> None:
    _flags["stop"] = _flags["save"] = False


# the signals whose handlers a training attempt may replace in its process
CALLER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@contextlib.contextmanager
def handlers_restored():
    """The caller's SIGTERM / SIGUSR1 / SIGINT handlers come back when the block ends, normally
    or by an exception: `watch()` installs raygpt's inside it, and a process that trains and then
    goes on (a test session, a notebook, a driver) must not keep a SIGTERM that only sets a flag
    nobody reads any more. Off the main thread (a Ray Train worker's training thread) nothing is
    saved or restored: handlers cannot be set there, and the worker's were installed on its
    main thread on purpose (`install` through the trainer's backend hook)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in CALLER_SIGNALS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:  # None: set outside Python; it cannot be put back from here
                signal.signal(s, handler)


class SaveClock:
    """--checkpoint-minutes: asks for a checkpoint once `minutes` of wall time have passed since
    the last checkpoint (or since the attempt started). Wall clocks differ between ranks, so only
    rank 0 keeps one (the others get minutes=0, never due); its request travels in the loop's
    per-step agreement like SIGUSR1's, and every rank saves at the same step boundary."""

    def __init__(self, minutes: float, clock=time.monotonic):
        self.interval_s = 60.0 * minutes
        self.clock = clock
        self.last = clock()

    def due(self) -> bool:
        return self.interval_s > 0 and self.clock() - self.last >= self.interval_s

    def saved(self) -> None:
        """A checkpoint was written: the interval starts again."""
        self.last = self.clock()
