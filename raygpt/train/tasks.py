"""Periodic work in the loop as tasks: llm.c's "every N steps, and at the last step" blocks.

A task says whether it is due at a step (`due(step, last_step)`) and does its work with what
the loop hands it (`run(run, step)`: the loop's `Run`, whose parts a task reads: the forward
pass, the model, the state, the session's rank, world and device, the reporter). Its `phase`
says where in the step the loop runs it, in llm.c's order:

    "eval"        before the checkpoint: validation loss, the other validation sets,
                  HellaSwag, the sample (a task without a phase is one of these)
    "checkpoint"  the checkpoint, before `if last_step: break`
    "step"        the top of the training section (fault drills)
    "update"      right before the optimizer update; its `after(run, step)` runs once the
                  step is logged (watch metrics: the weights before, the ratio after)

The loop keeps its tasks in one list and runs the due ones of a phase in the list's order
(`run_due`). Every rank runs the same tasks at the same steps: a task whose work is a
collective (an all-reduce of a loss) keeps the ranks' collectives in the same order; one that
is rank 0's alone (the sample, watch metrics) says so in its `due`.

A task holds no slot of the step's agreement vector: what a task computes is reduced by its own
collective at its own steps, never inside a training step's one sync.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

PHASES = ("eval", "checkpoint", "step", "update")


class Task(Protocol):
    """One piece of periodic work (see the module's docstring)."""

    name: str
    phase: str  # one of PHASES

    def due(self, step: int, last_step: bool) -> bool:
        """Whether the task runs at `step` (`last_step`: the step the loop ends at)."""

    def run(self, run, step: int) -> None:
        """Do the work at `step` with the loop's `Run`, reporting through `run.runlog`."""


def every(n: int, step: int, last_step: bool) -> bool:
    """llm.c's schedule: every `n` steps (0 is never) and at the last step."""
    return n > 0 and (step % n == 0 or last_step)


def run_due(tasks: Sequence[Task], run, step: int, last_step: bool,
            phase: str = "eval", timed: Callable[[str, float], None] | None = None) -> list[Task]:
    """Run the tasks of `phase` due at `step`, in the list's order; returns them. `timed(name,
    seconds)` hears how long each took (the ETA counts the runs still to come)."""
    ran = []
    for task in tasks:
        if getattr(task, "phase", "eval") == phase and task.due(step, last_step):
            t0 = time.perf_counter()
            task.run(run, step)
            if timed is not None:
                timed(task.name, time.perf_counter() - t0)
            ran.append(task)
    return ran


def run_after(ran: Sequence[Task], run, step: int) -> None:
    """The second half of the "update" tasks that ran at `step`, once the step is logged."""
    for task in ran:
        task.after(run, step)
