"""The loop's periodic tasks (raygpt.train.tasks): llm.c's schedule, the due ones of a phase run
in the list's order, and the loop's list in llm.c's order (val loss, the eval sets, HellaSwag,
sample, then the checkpoint, fault drills and watch metrics)."""

from __future__ import annotations

import contextlib

from raygpt.train import loop, loop_tasks, signals
from raygpt.train.tasks import every, run_after, run_due
from tests.train.test_loop_wiring import session_for, wiring_config


def test_every_is_llmcs_schedule():
    assert [s for s in range(8) if every(3, s, s == 7)] == [0, 3, 6, 7]
    assert not any(every(0, s, s == 7) for s in range(8))  # 0 is never, the last step too


class Recorder:
    def __init__(self, name, due_at, seen):
        self.name, self.due_at, self.seen = name, due_at, seen

    def due(self, step, last_step):
        return step in self.due_at or (last_step and "last" in self.due_at)

    def run(self, run, step):
        self.seen.append((self.name, step, run))


def test_run_due_runs_the_due_tasks_in_order_with_the_run():
    seen = []
    tasks = [Recorder("a", {0, 2}, seen), Recorder("b", {2, "last"}, seen),
             Recorder("c", set(), seen)]
    for step in range(4):
        run_due(tasks, "RUN", step, step == 3)
    assert seen == [("a", 0, "RUN"), ("a", 2, "RUN"), ("b", 2, "RUN"), ("b", 3, "RUN")]


def test_run_due_times_each_task_it_runs():
    seen, times = [], []
    tasks = [Recorder("a", {1}, seen), Recorder("b", {0, 1}, seen)]
    for step in range(2):
        run_due(tasks, "RUN", step, False, timed=lambda name, s: times.append((name, s)))
    assert [n for n, _ in times] == ["b", "a", "b"]
    assert all(0 <= s < 1 for _, s in times)


class Phased(Recorder):
    def __init__(self, name, phase, due_at, seen):
        super().__init__(name, due_at, seen)
        self.phase = phase

    def after(self, run, step):
        self.seen.append((self.name + ".after", step, run))


def test_run_due_runs_one_phase_and_run_after_the_second_half_of_those_it_ran():
    seen = []
    tasks = [Phased("ckpt", "checkpoint", {1}, seen), Phased("w", "update", {1}, seen),
             Phased("x", "update", {2}, seen), Recorder("val", {1}, seen)]  # no phase: "eval"
    assert run_due(tasks, "R", 1, False, "eval") == [tasks[3]]
    ran = run_due(tasks, "R", 1, False, "update")
    assert ran == [tasks[1]] and seen == [("val", 1, "R"), ("w", 1, "R")]
    run_after(ran, "R", 1)
    assert seen[-1] == ("w.after", 1, "R") and len(seen) == 3
    assert run_due(tasks, "R", 1, False, "step") == []


def test_the_loops_tasks_are_in_llmcs_order(tmp_path):
    cfg = wiring_config(tmp_path, hellaswag="", eval_set=[
        f"b={cfg_val(tmp_path)}", f"a={cfg_val(tmp_path)}"])
    with contextlib.ExitStack() as on_exit:
        tasks = loop_tasks.loop_tasks(cfg, session_for(tmp_path), on_exit, None, 50257)
        assert [t.name for t in tasks] == ["val", "b", "a", "hellaswag", "sample"]
        due = {t.name: [s for s in range(4) if t.due(s, s == 3)] for t in tasks}
    assert due == {"val": [0, 2, 3], "b": [0, 2, 3], "a": [0, 2, 3], "hellaswag": [],
                   "sample": [2, 3]}
    # -v 0: no validation, and no eval set either
    cfg0 = wiring_config(tmp_path, val_every=0, eval_set=[f"a={cfg_val(tmp_path)}"])
    with contextlib.ExitStack() as on_exit:
        assert [t.name for t in loop_tasks.loop_tasks(cfg0, session_for(tmp_path), on_exit, None,
                                                      50257)] == ["val", "hellaswag", "sample"]


def test_the_run_lists_every_periodic_task_with_its_phase_and_schedule(tmp_path):
    """build_run's list: the eval tasks, then the checkpoint (-n 2 and the last step, not the
    step just loaded), fault drills (only on a rank a drill names) and watch metrics (rank 0,
    every --watch-every steps, counted from 1)."""
    cfg = wiring_config(tmp_path, hellaswag="", watch_every=2, fault="raise:rank=0,step=9")
    with contextlib.ExitStack() as on_exit, signals.handlers_restored():
        r = loop.build_run(cfg, session_for(tmp_path), on_exit)
        assert [(t.name, getattr(t, "phase", "eval")) for t in r.tasks] == [
            ("val", "eval"), ("hellaswag", "eval"), ("sample", "eval"),
            ("checkpoint", "checkpoint"), ("drill", "step"), ("watch", "update")]
        due = {t.name: [s for s in range(6) if t.due(s, s == 5)] for t in r.tasks}
        assert due["checkpoint"] == [2, 4, 5] and due["watch"] == [1, 3, 5]
        assert due["drill"] == list(range(6))  # the plan counts every step's visits
        r.ckpt.loaded_step = 4  # resumed from 4: it is not written again
        assert [s for s in range(6) if r.task("checkpoint").due(s, s == 5)] == [2, 5]
        r.state.save_requested = True  # SIGUSR1, a preemption notice, a stop
        assert r.task("checkpoint").due(3, False)
    cfg = wiring_config(tmp_path / "other", fault="raise:rank=1,step=9")
    with contextlib.ExitStack() as on_exit, signals.handlers_restored():
        r = loop.build_run(cfg, session_for(tmp_path / "other"), on_exit)
        assert not any(r.task("drill").due(s, False) for s in range(6))  # rank 1's drill


def cfg_val(run_dir):
    return wiring_config(run_dir).input_val_bin


def test_an_eval_set_feeds_only_the_ranks_its_data_holds(tmp_path):
    import numpy as np

    from raygpt.eval import sets
    from raygpt.llmc.shards import write_shard

    cfg = wiring_config(tmp_path)
    small = tmp_path / "small.bin"  # one rank's micro-batch: the other ranks sit it out
    write_shard(small, np.arange(cfg.val_batch_size * cfg.seq_len + 1) % 300)
    cfg = wiring_config(tmp_path, eval_set=[f"small={small}", f"full={cfg_val(tmp_path)}"])
    with contextlib.ExitStack() as on_exit:
        by_rank = [{t.name: t.loader for t in sets.tasks(cfg, rank, 3, None, 50257, on_exit)}
                   for rank in range(3)]
    assert [r["small"] is not None for r in by_rank] == [True, False, False]
    assert all(r["full"] is not None for r in by_rank)
