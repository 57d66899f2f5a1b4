"""The fault campaign, CI-sized (bench/fault_campaign.py runs longer ones): one run on 2 CPU
workers with retention and the spike monitor on meets every kind of fault once, in a seeded
random order at random steps (a killed worker, SIGTERM then -y 1, SIGUSR1, a NaN that rewinds,
a crash before DONE, a worker killed right after a rewind); the final loss of every step equals,
as floats, an uninterrupted run that meets the same spike. RAYGPT_CAMPAIGN_SEED replays a seed."""

import json
import os

import pytest
import ray

from bench.fault_campaign import KINDS, execute, plan
from raygpt import checkpoint as ck
from raygpt.ray_snapshot import SNAPSHOT
from raygpt.storage import open_run_dir

SEED = int(os.environ.get("RAYGPT_CAMPAIGN_SEED", "1717"))


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_plan_is_seeded_and_places_every_kind():
    a, b = plan(SEED, len(KINDS), 24), plan(SEED, len(KINDS), 24)
    assert a == b
    kinds = {f.split(":")[0] + (",visit" if "visit=2" in f else "") for f in a.faults}
    assert kinds == {"kill", "sigterm", "sigusr1", "crash_before_done", "kill,visit"}
    for f in a.faults:  # each worker killed after a rewind sits between a target and its NaN
        if "visit=2" in f:
            step = int(f.split("step=")[1].split(",")[0])
            assert any((n - 3) // 2 * 2 < step < n for n in a.nan_steps)


def test_every_fault_survived_with_every_step_equal(tmp_path, capsys):
    campaign = plan(SEED, len(KINDS), 24)
    with capsys.disabled():
        result = execute(campaign, tmp_path, log=lambda m: print(m, flush=True))
    assert len(result["survived"]) == len(campaign.faults) + len(campaign.nan_steps), \
        f"seed {SEED}: not every fault fired: {result['survived']}"
    assert not result["lost"] and not result["extra"], f"seed {SEED}: {result['line']}"
    assert not result["differing"], (
        f"seed {SEED}: {result['line']}: " + ", ".join(
            f"step {s}: {result['losses'][s]!r} vs {result['reference'][s]!r}"
            for s in result["differing"][:5]))
    # Ray's checkpoint list and the run directory agree at the end
    rd = open_run_dir(str(tmp_path / "campaign"))
    snap = json.loads((tmp_path / "campaign" / SNAPSHOT).read_text())
    names = [r["checkpoint_dir_name"] for r in snap["checkpoint_results"]]
    assert names == [ck.step_dir(s) for s in ck.list_checkpoint_steps(rd)]
