"""The step line's ETA (raygpt.runlog.eta): steps left at the step time, and each periodic
task's runs to come at its run time, so a validation does not make the ETA jump."""

import pytest

from raygpt.runlog.eta import Eta, Mean, due_steps, eta_seconds, runs_left
from raygpt.train.tasks import every


def test_due_steps_list_llmcs_schedule_from_the_first_step():
    due = lambda s, last: every(20, s, last)  # noqa: E731
    assert due_steps(due, 0, 100) == [0, 20, 40, 60, 80, 100]
    assert due_steps(due, 0, 90) == [0, 20, 40, 60, 80, 90]  # and the last step
    assert due_steps(due, 45, 90) == [60, 80, 90]  # a resumed run's own


@pytest.mark.parametrize("step, left", [(-1, 6), (0, 5), (19, 5), (20, 4), (89, 1), (90, 0)])
def test_runs_left_counts_the_due_steps_after_this_one(step, left):
    assert runs_left([0, 20, 40, 60, 80, 90], step) == left


def test_eta_is_the_steps_and_the_tasks_runs_to_come():
    assert eta_seconds(10, 2.0) == 20.0
    # 10 steps of 2 s, 3 validations of 5 s, 1 sample of 7 s, a task not yet timed adds nothing
    assert eta_seconds(10, 2.0, [(3, 5.0), (1, 7.0), (4, None)]) == 20.0 + 15.0 + 7.0


def test_a_tasks_first_run_is_left_out_of_its_mean_once_a_second_exists():
    m = Mean()
    assert m.value() is None
    m.add(30.0)  # compiling, a cold cache
    assert m.value() == 30.0
    m.add(4.0)
    m.add(6.0)
    assert m.value() == 5.0
    steps = Mean(skip_first=False)
    steps.add(3.0)
    steps.add(5.0)
    assert steps.value() == 4.0


def simulate(max_steps, step_s, val_every, val_s, schedule=True):
    """The loop's clock: validation before the step at every due step, each step `step_s`;
    the ETA the reporter would print after each step, with the true time left beside it."""
    eta, clock, out = Eta(max_steps), 0.0, []
    val = lambda s, last: every(val_every, s, last)  # noqa: E731
    if schedule:
        eta.schedule("val", due_steps(val, 0, max_steps))
    ends = []
    for step in range(max_steps + 1):
        if val(step, step == max_steps):
            clock += val_s
            eta.task_ran("val", val_s)
        if step == max_steps:
            break
        clock += step_s
        ends.append(clock)
        out.append((step, eta.step_done(step, clock)))
    end = clock
    return [(step, e, end - ends[step]) for step, e in out]


def test_the_eta_does_not_jump_after_a_validation_and_is_the_time_left():
    rows = simulate(max_steps=100, step_s=2.0, val_every=20, val_s=30.0)
    assert rows[0][1] is None  # the first step is no guide
    for step, eta, truth in rows[1:]:
        assert eta == pytest.approx(truth, abs=1e-6), step
    etas = [e for _, e, _ in rows[1:]]
    # it only falls, by the time that passed: never up after a validation (steps 20, 40, ...)
    assert all(a > b for a, b in zip(etas, etas[1:]))
    assert etas[18] - etas[19] == pytest.approx(2.0 + 30.0)  # the validation before step 20
    assert etas[-1] == pytest.approx(30.0)  # the last step leaves the final validation


def test_without_the_tasks_schedule_the_eta_misses_the_validations():
    """The mutation the ETA guards against: steps alone under-count by the validations left."""
    rows = simulate(max_steps=100, step_s=2.0, val_every=20, val_s=30.0, schedule=False)
    step, eta, truth = rows[10]
    assert truth - eta == pytest.approx(5 * 30.0)  # validations at 20, 40, 60, 80 and 100


def test_a_rewind_restarts_the_clock_without_counting_its_gap():
    eta = Eta(10)
    eta.step_done(0, 1.0)
    assert eta.step_done(1, 3.0) == pytest.approx(8 * 2.0)
    eta.restart()  # rewound: 60 s of restore before the next step ends
    assert eta.step_done(1, 63.0) == pytest.approx(8 * 2.0)
    assert eta.step_done(2, 65.0) == pytest.approx(7 * 2.0)
