"""The run's own memory: append-only records across attempts, the resume audit, goodput."""

from raygpt.runlog.history import (ResumeAudit, RunHistory, parse_jsonl, read_history, steps_logged,
                                   summarize_run)
from raygpt.storage import open_run_dir


def test_attempts_are_numbered_and_nothing_is_rewritten(tmp_path):
    rd = open_run_dir(str(tmp_path))
    h = RunHistory(rd, None, enabled=True)
    assert h.begin_attempt(None, None, max_steps=4) == 1
    h.train(0, loss=2.0, norm=1.0)
    h.train(1, loss=1.5, norm=1.0)
    first = (tmp_path / "loss_history.jsonl").read_bytes()
    h2 = RunHistory(rd, None, enabled=True)
    assert h2.begin_attempt(1, "restarted", max_steps=4) == 2
    h2.train(1, loss=1.5, norm=1.0)
    assert (tmp_path / "loss_history.jsonl").read_bytes().startswith(first)
    kinds = [r["kind"] for r in read_history(rd)]
    assert kinds == ["start", "train", "train", "resume", "train", "audit"]


def test_resume_audit_verifies_or_names_the_first_difference():
    ok = ResumeAudit({5: 1.0, 6: 0.9})
    assert ok.observe(5, 1.0) is None
    assert ok.observe(6, 0.9) == "resume verified bit-exact over 2 steps"
    bad = ResumeAudit({5: 1.0, 6: 0.9})
    line = bad.observe(5, 1.0000001)
    assert "WARNING step 5" in line and "after 0 equal steps" in line
    assert bad.observe(6, 0.9) is None  # answered once


def test_a_gpu_run_without_determinism_reports_a_difference_as_allowed_not_as_lost_state():
    from raygpt.config import TrainConfig
    from raygpt.runlog.history import exact_expected
    gpu = TrainConfig(device="gpu", deterministic=False)
    assert not exact_expected(gpu)
    assert exact_expected(gpu.with_overrides({"deterministic": True}))
    assert exact_expected(TrainConfig(device="cpu", deterministic=False))  # CPU kernels are
    assert exact_expected(None)
    noisy = ResumeAudit({5: 1.0, 6: 0.9}, exact=False)
    assert noisy.observe(5, 1.0) is None
    line = noisy.observe(6, 0.9000001)
    assert "WARNING" not in line and "did not restore" not in line
    assert "step 6" in line and "after 1 equal steps" in line and "--no-deterministic" in line
    assert ResumeAudit({5: 1.0}, exact=False).observe(5, 1.0) == "resume verified bit-exact over 1 steps"


def test_torn_last_line_is_skipped():
    data = b'{"kind":"train","step":0,"loss":1.0}\n{"kind":"tra'
    assert parse_jsonl(data, "x") == [{"kind": "train", "step": 0, "loss": 1.0}]


def test_summary_counts_failures_recovery_and_goodput():
    recs = [{"kind": "start", "time": 0.0},
            {"kind": "train", "step": 0, "dt": 1.0, "time": 1.0},
            {"kind": "train", "step": 1, "dt": 1.0, "time": 2.0},
            {"kind": "failure", "time": 2.5},
            {"kind": "resume", "time": 5.0},
            {"kind": "train", "step": 1, "dt": 1.0, "time": 6.0},
            {"kind": "train", "step": 2, "dt": 1.0, "time": 7.0},
            {"kind": "end", "time": 8.0}]
    s = summarize_run(recs)
    assert s["failures"] == 1 and s["resumes"] == 1
    assert s["recovery_s"] == [3.5]  # failure at 2.5 -> first new step at 6.0
    assert s["goodput"] == 3.0 / 8.0  # steps 0, 1, 2 once each, over 8 s of wall time


def test_each_recovery_is_split_into_parts_that_add_up_to_it():
    """From the last step before the failure to the last step re-trained after it: detection,
    worker group, process group, worker setup, checkpoint found, state loaded, the first step
    (its compilation), the other re-trained steps; a second failure before any step trained
    again is the same recovery, still going."""
    startup = {"group_up": 14.0, "process_group": 14.5, "restore_started": 16.0,
               "state_loaded": 16.75, "load_s": 0.5}
    recs = [{"kind": "start", "time": 0.0},
            *[{"kind": "train", "step": s, "dt": 1.0, "time": 1.0 + s} for s in range(6)],
            {"kind": "failure", "time": 8.0},          # last step (5) trained at 6.0
            {"kind": "failure", "time": 11.0},         # the new group failed while starting
            {"kind": "resume", "time": 17.0, "resumed_from": 4, "steps_lost": 2,
             "startup": startup},
            {"kind": "train", "step": 4, "dt": 3.0, "time": 20.0},
            {"kind": "train", "step": 5, "dt": 1.0, "time": 21.5},
            {"kind": "train", "step": 6, "dt": 1.0, "time": 22.5}]
    s = summarize_run(recs)
    first, second = [r["parts"] for r in s["recoveries"]]
    assert first == {"detected": 2.0, "group_up": 6.0, "process_group": 0.5, "setup": 1.5,
                     "checkpoint_found": 0.25, "state_loaded": 0.5, "first_step": 3.25,
                     "retrained": 1.5, "total": 15.5}
    assert sum(v for k, v in first.items() if k != "total") == first["total"]
    assert second["detected"] == 5.0 and second["total"] == 15.5 - 0.0  # from step 5's record too
    assert s["recoveries"][0]["steps_retrained"] == 2
    assert s["recovery_lines"][0] == (
        "recovery 1: 15.50 s = failure detected 2.00 s + worker group up 6.00 s + process group "
        "formed 0.50 s + worker setup 1.50 s + checkpoint found+verified 0.25 s + state loaded "
        "0.50 s + first step (compile) 3.25 s + steps re-trained 1.50 s (2 steps)")


def test_a_recovery_without_marks_or_lost_steps_shows_what_is_known():
    """A restart from scratch ("start", no checkpoint) by an older raygpt without start-up marks,
    and a recovery not trained again yet."""
    recs = [{"kind": "train", "step": 0, "dt": 1.0, "time": 1.0},
            {"kind": "failure", "time": 2.0},
            {"kind": "start", "time": 5.0},
            {"kind": "train", "step": 0, "dt": 1.0, "time": 7.0},
            {"kind": "failure", "time": 9.0}]
    s = summarize_run(recs)
    first, second = [r["parts"] for r in s["recoveries"]]
    assert first["detected"] == 1.0 and first["total"] == 6.0 and first["group_up"] is None
    assert s["recoveries"][0]["steps_retrained"] == 1  # step 0 again, from scratch
    assert s["recovery_lines"][0] == ("recovery 1: 6.00 s = failure detected 1.00 s + "
                                      "steps re-trained 0.00 s (1 steps)")
    assert second["total"] is None
    assert s["recovery_lines"][1] == "recovery 2: not trained again yet = failure detected 2.00 s"


def test_a_resume_after_a_rewind_is_audited_against_the_trajectory_it_is_on(tmp_path):
    """Steps a rewind abandoned and the run did not re-train before a crash are not what the
    resume's audit compares with: the resume skips the spike's data window, as the rewind did."""
    rd = open_run_dir(str(tmp_path))
    h = RunHistory(rd, None, enabled=True)
    h.begin_attempt(None, None, max_steps=12)
    for s in range(10):
        h.train(s, loss=2.0 - 0.1 * s + (5.0 if s >= 8 else 0.0), norm=1.0)  # spike from step 8
    h.event(10, "rewind", to_step=6, window=[[0, 64, 96]], lr_scale=1.0)
    for s in (6, 7):  # re-trained from checkpoint 6 on other data: other losses
        h.train(s, loss=1.0 - 0.01 * s, norm=1.0)
    # a worker dies here; the next attempt resumes from checkpoint 6 with the rewind applied
    h2 = RunHistory(rd, None, enabled=True)
    h2.begin_attempt(6, "restarted by Ray", max_steps=12)
    for s in (6, 7, 8, 9):
        h2.train(s, loss=1.0 - 0.01 * s, norm=1.0)
    resume, audit = [r for r in read_history(rd) if r["kind"] in ("resume", "audit")]
    assert resume["steps_lost"] == 2
    assert audit["message"] == "resume verified bit-exact over 2 steps"


def test_steps_logged_keeps_the_latest_attempt():
    records = [{"step": 0, "loss": 3.0}, {"step": 1, "loss": 9.0}, {"event": "rewind", "to": 0},
               {"step": 1, "loss": 2.9}, {"step": 2, "loss": 2.8},
               {"step": 2, "event": "skip", "loss": 9.9}]
    assert steps_logged(records) == {0: 3.0, 1: 2.9, 2: 2.8}
