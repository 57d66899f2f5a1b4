"""Fault injection specs: parsed strictly, fired once per run directory unless every=1; every
fault that fires leaves its record, and `raygpt status` lists them with each resume's audit."""

import json

import pytest

from raygpt.cli import main
from raygpt.train.faults import (FIRED, Fault, FaultPlan, InjectedFault, parse_spec, read_fired,
                           record_external)
from raygpt.runlog.history import RunHistory
from raygpt.storage import open_run_dir


def test_parse_spec():
    assert parse_spec("kill:rank=1,step=7; nan:step=3,every=1") == [
        Fault("kill", 7, 1, False), Fault("nan", 3, 0, True)]
    assert parse_spec("") == []


@pytest.mark.parametrize("spec, message", [
    ("explode:step=1", "expected a kind"), ("kill:rank=1", "expected step=N"),
    ("kill:step=x", "expected rank=N"), ("kill:steps=3", "expected rank=N")])
def test_bad_specs_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_fires_once_per_run_dir_unless_every(tmp_path):
    rd = open_run_dir(str(tmp_path))
    once = FaultPlan(parse_spec("nan:step=3"), rank=0, run_dir=rd)
    assert [once.nan_now(s) for s in (2, 3, 3)] == [False, True, False]
    assert not FaultPlan(parse_spec("nan:step=3"), rank=0, run_dir=rd).nan_now(3)  # next attempt
    every = FaultPlan(parse_spec("nan:step=3,every=1"), rank=0, run_dir=rd)
    assert every.nan_now(3) and every.nan_now(3)
    assert not FaultPlan(parse_spec("nan:rank=1,step=3"), rank=0, run_dir=rd).nan_now(3)


def test_visit_fires_at_the_nth_arrival_at_its_step_in_one_attempt(tmp_path):
    """A rewind brings the loop back to a step: visit=2 fires there the second time only."""
    rd = open_run_dir(str(tmp_path))
    assert parse_spec("raise:step=7,visit=2") == [Fault("raise", 7, 0, False, 2)]
    plan = FaultPlan(parse_spec("nan:step=7,visit=2"), rank=0, run_dir=rd)
    fired = []
    for step in (6, 7, 8, 9, 6, 7, 8):  # a rewind from 9 back to 6
        plan.before_update(step)
        fired.append(plan.nan_now(step))
    assert fired == [False, False, False, False, False, True, False]
    with pytest.raises(ValueError, match="visit: expected N >= 1"):
        parse_spec("kill:step=3,visit=0")


def test_after_fires_at_the_first_step_with_that_checkpoint_complete(tmp_path):
    """after=N: not before its step, and from there on at the first step at which checkpoint
    N's DONE exists (the driver's finalizer writes it while the loop trains on); once per run
    directory, like any fault."""
    from raygpt.checkpointing.protocol import write_done

    assert parse_spec("kill:rank=1,step=12,after=10") == [Fault("kill", 12, 1, False, 1, 10)]
    assert parse_spec("kill:rank=1,step=12,after=10")[0].spec == "kill:rank=1,step=12,after=10"
    with pytest.raises(ValueError, match="after: expected a checkpoint step"):
        parse_spec("kill:step=3,after=-1")
    with pytest.raises(ValueError, match="expected after=N or every=1"):
        parse_spec("kill:step=3,after=2,every=1")
    rd = open_run_dir(str(tmp_path))
    write_done(rd, 10)
    early = FaultPlan(parse_spec("nan:step=12,after=10"), rank=0, run_dir=open_run_dir(
        str(tmp_path / "other")))
    assert not any(early.nan_now(s) for s in (10, 11, 12, 13))  # no DONE in its run directory
    plan = FaultPlan(parse_spec("raise:step=12,after=20"), rank=0, run_dir=rd)
    for step in (11, 12, 13, 14):
        plan.before_update(step)  # no DONE for 20 yet: the run trains on
    write_done(rd, 20)
    with pytest.raises(InjectedFault, match="step 15"):
        plan.before_update(15)
    assert json.loads(rd.read_bytes(f"{FIRED}/raise_r0_s12"))["at_step"] == 15
    again = FaultPlan(parse_spec("raise:step=12,after=20"), rank=0, run_dir=rd)
    again.before_update(16)  # the next attempt runs clean
    assert FaultPlan(parse_spec("nan:step=12,after=10"), rank=0, run_dir=rd).nan_now(11) is False


# ---------------------------------------------------------------------- the record of what fired

def test_a_fault_leaves_its_record_before_it_strikes(tmp_path):
    rd = open_run_dir(str(tmp_path))
    plan = FaultPlan(parse_spec("raise:rank=1,step=4,visit=2;nan:rank=1,step=6,every=1"),
                     rank=1, run_dir=rd)
    plan.before_update(4)
    with pytest.raises(InjectedFault):
        plan.before_update(4)  # the second arrival: the record is there although it raised
    count, fired = read_fired(rd)
    assert count == 1
    rec = fired[0]
    assert (rec["kind"], rec["fault"], rec["rank"], rec["step"], rec["at_step"], rec["visit"],
            rec["by"]) == ("raise", "raise:rank=1,step=4,visit=2", 1, 4, 4, 2, "worker")
    assert not FaultPlan(parse_spec("raise:rank=1,step=4"), rank=1, run_dir=rd)._arm("raise", 4)
    plan.before_update(6)
    assert plan.nan_now(6) and plan.nan_now(6)  # every=1: each firing has its own record
    count, fired = read_fired(rd)
    assert count == 3 and [r["kind"] for r in fired] == ["raise", "nan", "nan"]
    assert fired[1]["fault"] == "nan:rank=1,step=6,every=1"
    # a crash before DONE strikes two steps after the checkpoint it leaves incomplete
    cbd = FaultPlan(parse_spec("crash_before_done:step=8"), rank=0, run_dir=rd)
    assert cbd._arm("crash_before_done", 8)
    assert read_fired(rd)[1][-1]["at_step"] == 10


def test_external_faults_are_recorded_and_old_markers_still_read(tmp_path):
    rd = open_run_dir(str(tmp_path))
    rd.write_bytes_atomic(f"{FIRED}/kill_r1_s7", b"")  # a marker from before records had content
    rd.write_bytes_atomic(f"{FIRED}/garbage", b"\xff{not json")
    record_external(rd, "ctrl_c", 12, injector="a test", detail="SIGINT to process group 1")
    record_external(rd, "remove_node", 15, injector="a test")
    with pytest.raises(ValueError, match="expected a kind in .*ctrl_c"):
        record_external(rd, "kill", 3)
    count, fired = read_fired(rd)
    assert count == 4
    by_kind = {r["kind"]: r for r in fired}
    assert (by_kind["kill"]["rank"], by_kind["kill"]["step"]) == (1, 7)
    assert "unreadable record" in by_kind["garbage"]["fault"]
    assert by_kind["ctrl_c"]["at_step"] == 12 and by_kind["ctrl_c"]["by"] == "external"
    assert [r["kind"] for r in fired][-2:] == ["ctrl_c", "remove_node"]  # in the order they fired
    assert read_fired(rd, keep=1) == (4, fired[-1:])


def _train(h, steps, tag=0.0):
    for s in steps:
        h.train(s, loss=10.0 - 0.1 * s + tag, norm=1.0, lr=1e-3, tokens=256 * (s + 1), dt=0.1)


def test_status_lists_every_fault_and_every_resumes_audit(tmp_path, capsys):
    """Four resumes, one of each verdict: nothing to re-do (a stop by signal), verified after
    re-doing steps, cut short by the next failure, still re-doing (the run is live)."""
    rd = open_run_dir(str(tmp_path / "run"))
    rd.makedirs()
    h = RunHistory(rd, cfg=None, enabled=True)
    h.begin_attempt(None, None, max_steps=20)
    _train(h, range(6))
    h.end({"step": 6, "max_steps": 20, "stopped_early": True})  # Ctrl-C: exit 3
    h.begin_attempt(6, "resumed with -y 1")                     # attempt 2: nothing re-done
    _train(h, range(6, 10))
    h.begin_attempt(8, "restarted by Ray")                      # attempt 3: re-does 8, 9
    _train(h, range(8, 12))
    h.begin_attempt(10, "restarted by Ray")                     # attempt 4: dies re-doing 10
    _train(h, [10])
    h.begin_attempt(10, "restarted by Ray")                     # attempt 5: live, at step 10
    _train(h, [10])
    record_external(rd, "ctrl_c", 5, injector="a test")
    FaultPlan(parse_spec("sigusr1:step=7"), rank=0, run_dir=rd)._arm("sigusr1", 7)
    kill = FaultPlan(parse_spec("kill:rank=1,step=10,visit=2"), rank=1, run_dir=rd)
    kill.visits[10] = 2  # back at step 10 after a rewind (before_update would SIGKILL us)
    assert kill._arm("kill", 10)
    record_external(rd, "remove_node", 11, injector="a test")

    assert main(["status", "--quick", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    fired = lines[[l.split()[0] if l.strip() else "" for l in lines].index("fired"):][:5]
    assert fired[0].startswith("fired     4 fault(s) injected")
    assert "ctrl_c after step 5 (injected by a test): SIGINT to the driver's process group" in fired[1]
    assert "sigusr1:rank=0,step=7: SIGUSR1 to the worker process" in fired[2]
    assert "kill:rank=1,step=10,visit=2: SIGKILL to the worker process" in fired[3]
    assert "remove_node after step 11 (injected by a test): a Ray node removed" in fired[4]
    resumes = [l for l in lines if "attempt " in l and " from step " in l]
    assert resumes[0].startswith("resumes   attempt 2 from step 6: no step to re-do")
    assert "attempt 3 from step 8: 2 step(s) re-done: resume verified bit-exact over 2 steps" \
        in resumes[1]
    assert "attempt 4 from step 10: 2 step(s) to re-do: no audit (the attempt ended" in resumes[2]
    assert "attempt 5 from step 10: 2 step(s) to re-do: audit pending" in resumes[3]
    assert len(resumes) == 4


@pytest.mark.parametrize("where", ["local", "object store"])
def test_armed_faults_are_recorded_once_per_announce_and_read_back_in_order(tmp_path, where):
    # locally the single fault_injection.jsonl; on an object store, which has no append, one
    # immutable segment per announce (one per attempt), after an older single-file record
    from raygpt.runlog import segments
    from raygpt.train.faults import RECORD, RECORD_LOG, announce, read_armed
    from tests.helpers import memory_fs
    import uuid
    rd = (open_run_dir(tmp_path / "run") if where == "local"
          else open_run_dir((memory_fs(), f"/raygpt-faults-{uuid.uuid4().hex}")))
    if where == "object store":  # a run directory an older raygpt wrote as one object
        rd.write_bytes_atomic(RECORD, b'{"spec":"kill:rank=0,step=1","sources":["--fault"],"time":1}\n')
    announce(rd, "", [])  # nothing armed: nothing recorded
    for step in (3, 5):
        announce(rd, f"nan:rank=0,step={step}", ["--fault"])
    count, last = read_armed(rd, keep=2)
    want = ["nan:rank=0,step=3", "nan:rank=0,step=5"]
    assert (count, [r["spec"] for r in last]) == (len(want) + (where != "local"), want)
    if where == "local":
        assert rd.listdir() == [RECORD] and len(rd.read_bytes(RECORD).splitlines()) == 2
    else:
        assert len(rd.listdir(RECORD_LOG.folder)) == 2  # a part per announce, the old object kept
        assert [json.loads(x)["spec"] for x in segments.read_lines(rd, RECORD_LOG)][0] == \
            "kill:rank=0,step=1"
