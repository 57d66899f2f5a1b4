"""Fault injection specs: parsed strictly, fired once per run directory unless every=1."""

import pytest

from raygpt.faults import Fault, FaultPlan, parse_spec
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
