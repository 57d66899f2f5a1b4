"""Ray Train's controller's own log lines about a memory kill kept off the terminal (a
controller callback, so it is imported where the trainer is made: prepare and the console
setup never load Ray Train for it)."""

from __future__ import annotations

import logging

from raygpt.ray import compat
from raygpt.ray.memory_kill import MEMORY_MONITOR_WORDS


# Ray Train's controller logs a dead worker's error twice on its way out (its worker group's
# shutdown meets it again), and a callback that meets it once more, each time with the whole of
# Ray's text. Checked on Ray 2.60.0.
_CONTROLLER_LOGGERS = ("ray.train.v2._internal.execution.controller.controller",
                       "ray.train.v2._internal.execution.callback_manager")


class _DropMemoryKills(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not any(w in f"{record.getMessage()} {exc}" for w in MEMORY_MONITOR_WORDS)


class QuietMemoryKills(compat.ControllerCallback):
    """Keeps Ray's account of a memory kill off the terminal: the controller's log lines that
    repeat it are dropped (the run's failure record keeps the text whole, raygpt.ray.checkpoints;
    the driver says it in one line)."""

    def after_controller_start(self, train_run_context) -> None:
        for name in _CONTROLLER_LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(f, _DropMemoryKills) for f in logger.filters):
                logger.addFilter(_DropMemoryKills())
