"""The driver's signals while a run trains, forwarded to the workers through the run's control
actor (raygpt.ray.worker.RunControl, which rank 0 polls): SIGTERM (e.g. `ray job stop`) and a
first Ctrl-C ask every rank to checkpoint and stop, SIGUSR1 to checkpoint and go on; a second
Ctrl-C aborts at once. On the workers, raygpt.train.signals' handlers are installed by the backend
hook (raygpt.ray.worker)."""

from __future__ import annotations

import logging
import signal
import threading

import ray

log = logging.getLogger(__name__)


class DriverSignals:
    """The driver's signals while a run trains: SIGTERM and the first Ctrl-C become a stop
    request (every rank checkpoints at the next step boundary and exits; -y 1 resumes), SIGUSR1
    a save request, forwarded to the workers through the control actor. A second Ctrl-C aborts
    at once: Ray Train's controller is told to abort (it kills the workers) and the driver raises
    RunAborted. `ray.init()` installs its own SIGTERM handler in the driver; this takes it over
    for the run's duration and `restore()` gives every handler back. The handlers only record
    the request; a thread makes the remote call (no Ray calls inside a handler), except for the
    abort, which must happen before the handler returns."""

    ABORT_WAIT_S = 10.0  # how long a second Ctrl-C waits for the controller to abort

    def __init__(self, control):
        self.control = control
        self.sigints = 0
        self.aborted = False
        self._pending: list[str] = []
        self._wake = threading.Event()
        self._done = threading.Event()
        self._old = {}
        if threading.current_thread() is not threading.main_thread():
            return  # a sweep trial's thread: signals belong to the sweep's driver
        self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGTERM, signal.SIGUSR1)}
        self._old[signal.SIGINT] = signal.getsignal(signal.SIGINT)
        threading.Thread(target=self._forward, daemon=True, name="raygpt-signal-forwarder").start()

    def _handler(self, signum, frame):
        self._pending.append("stop" if signum == signal.SIGTERM else "save")
        self._wake.set()

    def on_sigint(self, controller) -> None:
        """Ctrl-C while fit() runs (installed by RaygptTrainer in place of Ray Train's)."""
        self.sigints += 1
        if self.sigints == 1:
            self._pending.append("ctrl-c")
            self._wake.set()
            return
        log.info("raygpt | second Ctrl-C: aborting now, without a checkpoint; -y 1 resumes from "
                 "the last verified checkpoint")
        self.aborted = True
        try:
            ray.get(controller.abort.remote(), timeout=self.ABORT_WAIT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass  # the controller exits inside abort(): its actor error is the expected answer
        raise KeyboardInterrupt  # out of fit(); run() turns it into RunAborted

    def _forward(self):
        while not self._done.is_set():
            self._wake.wait()
            self._wake.clear()
            while self._pending:
                kind = self._pending.pop(0)
                what = {"stop": "SIGTERM", "save": "SIGUSR1",
                        "ctrl-c": "Ctrl-C (press it again to abort at once)"}[kind]
                log.info(f"raygpt | driver got {what}: asking the workers to checkpoint"
                         f"{'' if kind == 'save' else ' and stop'}")
                self.control.request.remote("save" if kind == "save" else "stop")

    def restore(self) -> None:
        self._done.set()
        self._wake.set()
        for s, h in self._old.items():
            signal.signal(s, h)
