"""How a run ends: which errors a restart can cure, and the exit codes that tell them apart.

Ray Train restarts the whole worker group when a worker raises (`FailureConfig.max_failures`).
That cures what a restart can cure: a lost process, node or collective. It cannot cure a bad
input met inside a worker (a corrupt shard, a checkpoint or config the run cannot use) or a
decision raygpt made itself (the spike policy escalating to a human): the next attempt meets the
same error after minutes of start-up, and the run fails anyway with its budget spent.
`stop_code(exc)` tells the two apart; it runs inside the worker, where the exception still has
its cause. `RunStopped` carries the verdict to the driver, whose failure policy
(`raygpt.ray.driver.StopOnRunStopped`) ends the run at once instead of retrying.

Exit codes of `raygpt train` and `experiments/shakespeare.py`:
    0  finished               1  failed (retry budget spent, or raygpt decided to stop)
    2  bad input              3  stopped early by a signal or Ctrl-C, resumable with -y 1
    130  aborted by a second Ctrl-C (resumable from the last verified checkpoint)
"""

from __future__ import annotations

from raygpt.checkpointing.protocol import CheckpointError
from raygpt.config import ConfigError
from raygpt.llmc.shards import ShardError
from raygpt.llmc.state_file import StateFileError
from raygpt.runlog.tracking import TrackingError
from raygpt.storage.atomic_file import RefusedPath

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_STOPPED = 3
EXIT_ABORTED = 130  # 128 + SIGINT, the shell's code for a process ended by Ctrl-C


class TrainingStopped(Exception):
    """raygpt decided to stop the run: the spike policy escalates to a human."""


class OutOfMemory(Exception):
    """A worker ran out of memory (a CUDA allocation, the host's, or Ray's memory monitor):
    a restart at the same micro-batch would again. The message names -b (raygpt.model.memory)."""


class RunStopped(Exception):
    """Raised by a worker whose error a restart would meet again: the run ends now with
    `message`, and the driver exits with `exit_code` (EXIT_BAD_INPUT or EXIT_FAILED)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.message, self.exit_code = message, exit_code

    def __reduce__(self):  # crosses processes (worker -> Ray controller -> driver)
        return (RunStopped, (self.message, self.exit_code))


def stop_code(exc: BaseException) -> int | None:
    """EXIT_BAD_INPUT for an input the run cannot use, EXIT_FAILED for a stop raygpt decided,
    None for a fault a restart may cure (the retry budget is for those).

    Bad input: OutOfMemory (the micro-batch does not fit the machine), ConfigError,
    CheckpointError (a verified checkpoint that this run cannot use, a corrupt run-dir file),
    StateFileError (a rank's llm.c state file that does not parse), ShardError (a token shard that is wrong or changed under the loader)
    and TrackingError (a --wandb / --mlflow tracker that cannot start: a URI MLflow refuses, a
    W&B login that is missing, a corrupt tracking.json), unless the error was caused by an
    OSError: a read that failed on a flaky mount or object store, or a tracking server that
    did not answer, may succeed on the next attempt. A RefusedPath (a symbolic link planted in
    the run directory), raised or behind a background append's error, is bad input too."""
    if isinstance(exc, RunStopped):
        return exc.exit_code
    if any(isinstance(e, RefusedPath) for e in _chain(exc)):
        return EXIT_BAD_INPUT
    if isinstance(exc, TrainingStopped):
        return EXIT_FAILED
    if isinstance(exc, OutOfMemory):
        return EXIT_BAD_INPUT
    if isinstance(exc, (ConfigError, CheckpointError, StateFileError, ShardError, TrackingError)):
        return None if _caused_by_os_error(exc) else EXIT_BAD_INPUT
    return None


def _caused_by_os_error(exc: BaseException) -> bool:
    return any(isinstance(cause, OSError) for cause in _chain(exc)[1:])


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and its causes (explicit, else implicit), each once."""
    out: list[BaseException] = []
    while exc is not None and all(exc is not e for e in out):
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out
