"""The fault campaign, CI-sized (bench/fault_campaign.py runs longer ones): one run on 2 CPU
workers (a ray.cluster_utils.Cluster: a head and two 1-CPU worker nodes) with retention and the
spike monitor on meets one fault of each mechanism, in a seeded random order at random steps: a
Ctrl-C to the driver process's group (exit 3, relaunched with -y 1), a removed node (a
replacement joins, the run resumes by itself), SIGUSR1, a NaN that rewinds, a crash before DONE
and a worker killed right after a rewind. (A plain killed worker and SIGTERM to a worker run in
the bench; SIGTERM's stop-and-resume path is Ctrl-C's, and SIGKILL is the killed-after-rewind
fault's.) The final loss of every step equals, as floats, an uninterrupted run that meets the
same spike, and `raygpt status` lists every fault and every resume's audit.
RAYGPT_CAMPAIGN_SEED replays a seed."""

import json
import os

from bench.fault_campaign import (EXTERNAL, KINDS, execute, last_attempt, last_step, plan,
                                  status_problems)
from raygpt.checkpointing import protocol as ck
from raygpt.ray.checkpoint_list import SNAPSHOT
from raygpt.storage import open_run_dir

SEED = int(os.environ.get("RAYGPT_CAMPAIGN_SEED", "1717"))
CI_KINDS = ("ctrl_c", "remove_node", "sigusr1", "nan", "crash_before_done", "kill_after_rewind")
STEPS = 24


def test_plan_is_seeded_and_places_every_kind():
    assert set(CI_KINDS) <= set(KINDS) and set(EXTERNAL) <= set(KINDS)
    a, b = plan(SEED, len(KINDS), 40), plan(SEED, len(KINDS), 40)
    assert a == b
    kinds = {f.split(":")[0] + (",visit" if "visit=2" in f else "") for f in a.faults}
    assert kinds == {"kill", "sigterm", "sigusr1", "crash_before_done", "kill,visit"}
    assert sorted(k for k, _, _ in a.external) == ["ctrl_c", "remove_node"]
    assert a.n_faults == len(KINDS)
    for f in a.faults:  # each worker killed after a rewind sits between a target and its NaN
        if "visit=2" in f:
            step = int(f.split("step=")[1].split(",")[0])
            assert any((n - 3) // 2 * 2 < step < n for n in a.nan_steps)
    for seed in range(50):  # one kill right after each NaN's rewind at most: a second never fires
        c = plan(seed, 20, 72)
        kills = [int(f.split("step=")[1].split(",")[0]) for f in c.faults if "visit=2" in f]
        owners = [min(n for n in c.nan_steps if n > k) for k in kills]
        assert len(owners) == len(set(owners)), (seed, c.spec)
    ci = plan(SEED, len(CI_KINDS), STEPS, CI_KINDS)
    assert ci.n_faults == len(CI_KINDS)  # every kind of the CI menu found a step
    for _, step, _ in ci.external:  # a Ctrl-C must meet a running job
        assert step < STEPS - 4


def test_an_external_fault_waits_for_its_own_jobs_training(tmp_path):
    """A relaunched job is at the step its predecessor stopped at before it has trained at all:
    a Ctrl-C due there must wait for the new job's own train records (a SIGINT while Python
    starts up is no Ctrl-C that raygpt can answer)."""
    lines = [{"kind": "start", "step": 0, "attempt": 1},
             *({"kind": "train", "step": s, "loss": 1.0, "attempt": 1} for s in range(24)),
             {"kind": "end", "step": 24, "stopped_early": True, "attempt": 1}]
    (tmp_path / "loss_history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert last_attempt(tmp_path) == 1 and last_step(tmp_path) == 23
    assert last_step(tmp_path, after_attempt=1) == -1  # the next job has not trained yet
    with open(tmp_path / "loss_history.jsonl", "a") as f:
        f.write(json.dumps({"kind": "resume", "step": 24, "attempt": 2}) + "\n")
        f.write(json.dumps({"kind": "train", "step": 24, "loss": 1.0, "attempt": 2}) + "\n")
        f.write('{"kind": "train", "st')  # a line being appended
    assert last_step(tmp_path, after_attempt=1) == 24


def test_every_fault_survived_with_every_step_equal(tmp_path, capsys):
    campaign = plan(SEED, len(CI_KINDS), STEPS, CI_KINDS)
    with capsys.disabled():
        result = execute(campaign, tmp_path, log=lambda m: print(m, flush=True))
    fired = sorted(r["kind"] for r in result["survived"])
    assert len(fired) == campaign.n_faults, f"seed {SEED}: not every fault fired: {fired}"
    assert {"ctrl_c", "remove_node"} <= set(fired)
    assert not result["lost"] and not result["extra"], f"seed {SEED}: {result['line']}"
    assert not result["differing"], (
        f"seed {SEED}: {result['line']}: " + ", ".join(
            f"step {s}: {result['losses'][s]!r} vs {result['reference'][s]!r}"
            for s in result["differing"][:5]))
    # the Ctrl-C stopped its job with exit 3 and a relaunch with -y 1 finished the run
    assert result["codes"][-1] == 0 and 3 in result["codes"], result["codes"]
    assert any("driver got Ctrl-C" in p.read_text() for p in tmp_path.glob("campaign_job*.log"))
    # raygpt status (the CLI) lists every fault and every resume with its audit
    assert not result["status_problems"], f"seed {SEED}: {result['status_problems']}"
    assert "resume verified bit-exact" in result["status"]
    # Ray's checkpoint list and the run directory agree at the end
    rd = open_run_dir(str(tmp_path / "campaign"))
    snap = json.loads((tmp_path / "campaign" / SNAPSHOT).read_text())
    names = [r["checkpoint_dir_name"] for r in snap["checkpoint_results"]]
    assert names == [ck.step_dir(s) for s in ck.list_checkpoint_steps(rd)]
    # the status check itself sees what is missing (a fault left out, a resume line gone)
    campaign_dir = tmp_path / "campaign"
    lines = result["status"].splitlines()
    no_ctrl_c = "\n".join(l for l in lines if "ctrl_c after step" not in l)
    assert any("ctrl_c" in p for p in status_problems(no_ctrl_c, campaign, campaign_dir))
    no_resume = "\n".join(l for l in lines if " from step " not in l or "attempt" not in l)
    assert any("no line for the resume" in p for p in status_problems(no_resume, campaign, campaign_dir))
