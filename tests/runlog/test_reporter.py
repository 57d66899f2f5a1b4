"""The reporter without Ray: what a person reads on the console, and what reaches Ray's report,
from the real loop under a LocalSession that records its reports."""

import json
import re

import pytest
import torch

from raygpt.runlog.console import printable
from raygpt.storage import open_run_dir
from raygpt.train.loop import train
from raygpt.train.session import LocalSession
from tests.helpers import records, tiny_config


class RecordingSession(LocalSession):
    """A LocalSession that keeps what the loop reports (Ray's side of the seam)."""

    def __init__(self, run_dir, interval_s):
        super().__init__(open_run_dir(str(run_dir)), torch.device("cpu"))
        self.metrics_interval_s = interval_s
        self.reports = []

    def report_metrics(self, metrics):
        self.reports.append(dict(metrics))


def run_recorded(cfg, interval_s=0.0):
    session = RecordingSession(cfg.output_dir, interval_s)
    summary = train(cfg.resolve(0), session)
    return session, summary


def test_console_reads_like_a_person_would_want(tmp_path, capsys):
    cfg = tiny_config(tmp_path, max_steps=5, checkpoint_every=0, sample_every=4, gen_tokens=12,
                      input_val_bin="")
    run_recorded(cfg)
    out = capsys.readouterr().out
    lines = out.splitlines()
    steps = [x for x in lines if x.startswith("step ") and "/5 |" in x]
    assert len(steps) == 5
    assert "eta" not in steps[0]  # the first step (compile, warm-up) predicts nothing
    # the last step's ETA is the sample still due after it (runlog/eta.py): seconds at most
    assert all(" | eta " in x for x in steps[1:]) and re.search(r"\| eta \d+s$", steps[-1])
    # the sample: a header, then the text itself (not a repr) on "  | " lines
    at = lines.index("step     4 | sample:")
    sample_lines = []
    for line in lines[at + 1:]:
        if not line.startswith("  | "):
            break
        sample_lines.append(line[4:])
    stored = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in stored] == [4, 5]
    assert "\n".join(sample_lines) == printable(stored[0]["text"])
    assert "sample: '" not in out and 'sample: "' not in out
    # validation off: the end line says n/a, never "nan"
    end = [x for x in lines if x.startswith("raygpt | done")]
    assert len(end) == 1 and "| val loss n/a |" in end[0] and "nan" not in end[0]


def test_the_eta_counts_the_tasks_runs_still_to_come(tmp_path, capsys, monkeypatch):
    """The loop times its tasks and the reporter schedules them: after a slow sample (1.5 s) at
    step 2, the step lines' ETA holds the sample still due at the last step, which steps
    alone (a few ms each here) would not."""
    import time

    from raygpt.train import loop_tasks

    def slow_sample(model, cfg, device, step):
        time.sleep(1.5)
        return f"text of step {step}"

    monkeypatch.setattr(loop_tasks, "sample_text", slow_sample)
    run_recorded(tiny_config(tmp_path, max_steps=4, checkpoint_every=0, sample_every=2,
                             input_val_bin=""))
    steps = [x for x in capsys.readouterr().out.splitlines() if re.match(r"step +\d/4 \|", x)]
    etas = [int(m.group(1)) for x in steps[2:] if (m := re.search(r"\| eta (\d+)s$", x))]
    assert len(etas) == 2 and all(1 <= e <= 5 for e in etas), steps


def test_train_metrics_reach_the_session_at_log_steps(tmp_path):
    cfg = tiny_config(tmp_path, max_steps=7, checkpoint_every=0, log_every=3, val_every=4)
    session, _ = run_recorded(cfg, interval_s=0.0)
    trains = [r for r in session.reports if "grad_norm" in r]
    assert [r["step"] for r in trains] == [0, 3, 6]  # log_every and the last step
    history = {r["step"]: r for r in records(tmp_path) if r["kind"] == "train"}
    for r in trains:
        h = history[r["step"]]
        assert (r["train_loss"], r["lr"], r["grad_norm"]) == (h["loss"], h["lr"], h["norm"])
        assert r["tok_per_s"] == pytest.approx(cfg.resolve(0).total_batch_size / h["dt"])
        assert "val_loss" not in r  # a sweep forwards only validation reports to Tune
    vals = [r for r in session.reports if "val_loss" in r]
    assert [r["step"] for r in vals] == [0, 4, 7]


def test_train_reports_are_spaced_by_the_session_interval(tmp_path):
    cfg = tiny_config(tmp_path, max_steps=6, checkpoint_every=0)
    session, _ = run_recorded(cfg, interval_s=3600.0)
    # the first step, then none until the last: its metrics are the run's result
    assert [r["step"] for r in session.reports if "grad_norm" in r] == [0, 5]


def test_compile_notice_before_the_first_step_and_its_time_after(tmp_path, capsys, monkeypatch):
    # torch.compile itself is replaced (a CPU compile needs a C++ toolchain and minutes): the
    # notice's place in the output is what is tested
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)
    run_recorded(tiny_config(tmp_path, max_steps=3, checkpoint_every=0, compile=True,
                             val_every=2))
    lines = capsys.readouterr().out.splitlines()
    notice = next(i for i, l in enumerate(lines) if "torch.compile: compiling" in l)
    done = next(i for i, l in enumerate(lines) if "torch.compile: done, first step after" in l)
    first_val = next(i for i, l in enumerate(lines) if l.startswith("step     0 | val loss"))
    first_step = next(i for i, l in enumerate(lines) if l.startswith("step    1/3"))
    assert notice < first_val < done < first_step
    assert float(lines[done].rsplit("after ", 1)[1].split(" s")[0]) > 0
    assert sum("torch.compile" in l for l in lines) == 2


def test_a_checkpoint_report_holds_the_next_train_report_back_like_a_train_report():
    """Ray's worker queue holds one report: train metrics right behind a checkpoint's report
    would wait (on the training thread) for the controller's next poll."""
    import math
    import time
    from types import SimpleNamespace as NS

    from raygpt.runlog.reporter import Reporter

    rep = object.__new__(Reporter)  # only the gate's state
    rep.is_main, rep.max_steps, rep._last_ray_report = True, 100, -math.inf
    rep.cfg = NS(log_every=1)
    rep.session = NS(metrics_interval_s=60.0, last_checkpoint_report=-math.inf)
    assert rep.wants_ray_report(5)
    rep.session.last_checkpoint_report = time.monotonic()  # a checkpoint was just reported
    assert not rep.wants_ray_report(5)
    rep.session.last_checkpoint_report = time.monotonic() - 61.0
    assert rep.wants_ray_report(5)
    rep.session.last_checkpoint_report = time.monotonic()
    assert rep.wants_ray_report(99)  # the last step reports whatever came just before it
