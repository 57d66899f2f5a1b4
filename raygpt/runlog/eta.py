"""The step line's ETA: the time to the run's end, its periodic tasks included.

    remaining = steps left x the mean step time
              + for each periodic task (validation, each --eval-set, HellaSwag, the sample):
                its runs left x its mean run time

The step time is the wall clock from one step's line to the next with the tasks' time taken
out (so it holds checkpoints and logging, which recur with the steps), and a task's runs left
are its due steps after the current one, from its schedule listed once at the start. A
validation's time is thus counted before it runs, and the ETA does not jump when one does. The
first step is never timed (the clock starts at its end: compilation, warm-up) and a task's first
run is left out of its mean once a later one exists. A task not yet run has no time to count:
its first run adds it.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Iterable, Sequence


def due_steps(due: Callable[[int, bool], bool], first: int, max_steps: int) -> list[int]:
    """The steps in [first, max_steps] at which a task with this `due(step, last_step)` runs."""
    return [s for s in range(first, max_steps + 1) if due(s, s == max_steps)]


def runs_left(steps: Sequence[int], step: int) -> int:
    """How many of a task's (sorted) due steps come after `step`."""
    return len(steps) - bisect.bisect_right(steps, step)


def eta_seconds(steps_left: int, step_s: float,
                tasks: Iterable[tuple[int, float | None]] = ()) -> float:
    """The remaining time: `steps_left` steps of `step_s` each, and for each task (runs left,
    seconds per run) its runs; a task with no measured time (None) adds nothing yet."""
    return steps_left * step_s + sum(n * s for n, s in tasks if s is not None)


class Mean:
    """A mean of durations; with `skip_first`, the first is left out once there is a second
    (a task's first run warms up)."""

    def __init__(self, skip_first: bool = True):
        self.first: float | None = None
        self.total, self.count = 0.0, 0
        self.skip_first = skip_first

    def add(self, seconds: float) -> None:
        if self.skip_first and self.first is None:
            self.first = seconds
        else:
            self.total += seconds
            self.count += 1

    def value(self) -> float | None:
        return self.total / self.count if self.count else self.first


class Eta:
    """The ETA's state in the reporter: each step's end (`step_done`), each task's run
    (`task_ran`), the tasks' schedules (`schedule`)."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.step_time = Mean(skip_first=False)  # the first step is never timed: no gap before it
        self.schedules: dict[str, list[int]] = {}
        self.task_times: dict[str, Mean] = {}
        self._last: float | None = None  # the clock at the previous step's end
        self._tasks_since = 0.0  # the tasks' time since then

    def schedule(self, name: str, steps: list[int]) -> None:
        self.schedules[name] = steps

    def task_ran(self, name: str, seconds: float) -> None:
        self.task_times.setdefault(name, Mean()).add(seconds)
        self._tasks_since += seconds

    def restart(self) -> None:
        """After a rewind: the gap to the next step holds a checkpoint's restore, not a step."""
        self._last, self._tasks_since = None, 0.0

    def step_done(self, step: int, now: float) -> float | None:
        """The step `step` (0-based) ended at `now`: the seconds to the run's end, or None
        before two steps have ended (the first one is no guide)."""
        if self._last is not None:
            self.step_time.add(max(0.0, now - self._last - self._tasks_since))
        self._last, self._tasks_since = now, 0.0
        step_s = self.step_time.value()
        if step_s is None or not math.isfinite(step_s):
            return None
        return eta_seconds(self.max_steps - step - 1, step_s,
                           ((runs_left(steps, step), self._task_s(name))
                            for name, steps in self.schedules.items()))

    def _task_s(self, name: str) -> float | None:
        mean = self.task_times.get(name)
        return mean.value() if mean is not None else None
