"""Periodic work in the loop as tasks: llm.c's "every N steps, and at the last step" blocks.

A task says whether it is due at a step (`due(step, last_step)`) and does its work with what
the loop hands it (`run(run, step)`: the loop's `Run`, whose parts a task reads: the forward
pass, the model, the session's rank, world and device, the reporter). The loop keeps its tasks
in one list, in llm.c's order (validation loss, then the other validation sets, HellaSwag, the
sample), and runs the due ones where llm.c's loop body does, before the checkpoint
(`run_due`). Every rank runs the same tasks at the same steps: a task whose work is a
collective (an all-reduce of a loss) keeps the ranks' collectives in the same order; one that
is rank 0's alone (the sample) says so in its `due`.

A task holds no slot of the step's agreement vector: what a task computes is reduced by its own
collective at its own steps, never inside a training step's one sync.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence


class Task(Protocol):
    """One piece of periodic work (see the module's docstring)."""

    name: str

    def due(self, step: int, last_step: bool) -> bool:
        """Whether the task runs at `step` (`last_step`: the step the loop ends at)."""

    def run(self, run, step: int) -> None:
        """Do the work at `step` with the loop's `Run`, reporting through `run.runlog`."""


def every(n: int, step: int, last_step: bool) -> bool:
    """llm.c's schedule: every `n` steps (0 is never) and at the last step."""
    return n > 0 and (step % n == 0 or last_step)


def run_due(tasks: Sequence[Task], run, step: int, last_step: bool,
            timed: Callable[[str, float], None] | None = None) -> None:
    """Run the tasks due at `step`, in the list's order; `timed(name, seconds)` hears how long
    each took (the ETA counts the runs still to come)."""
    for task in tasks:
        if task.due(step, last_step):
            t0 = time.perf_counter()
            task.run(run, step)
            if timed is not None:
                timed(task.name, time.perf_counter() - t0)
