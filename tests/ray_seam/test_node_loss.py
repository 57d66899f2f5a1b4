"""Node loss: a Ray cluster (head + two 1-CPU worker nodes) loses a worker node ungracefully
mid-run; a replacement joins; Ray Train restarts the worker group and raygpt resumes from a
verified checkpoint with the losses an uninterrupted run has."""

import subprocess
import threading
import time

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from raygpt.checkpointing import protocol as ck
from raygpt.ray.driver import run
from raygpt.storage import open_run_dir
from raygpt.train.loop import train
from raygpt.train.session import LocalSession
from tests.helpers import records, samples_seen, tiny_config, train_losses

FAST_FAILURE_DETECTION = {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                          "health_check_initial_delay_ms": 0}


@pytest.fixture(scope="module")
def cluster():
    # the settings below hold for this module's cluster only: the test process's environment
    # is handed back as it was when the module ends (MonkeyPatch undoes them)
    with pytest.MonkeyPatch.context() as env:
        # the processes the cluster starts inherit this: notice drains fast (the workers poll
        # every step: the preemption test's --preemption-poll-steps 1)
        env.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
        # after a node loss an elastic run first retries its old size until Ray Train's
        # worker-group start times out (60 s by default), then resumes smaller: 15 s keeps that
        # path, faster
        env.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "15")
        c = Cluster(initialize_head=True, connect=True,
                    head_node_args={"num_cpus": 0, "_system_config": FAST_FAILURE_DETECTION})
        try:
            nodes = [c.add_node(num_cpus=1) for _ in range(2)]
            c.wait_for_nodes()
            yield c, nodes
        finally:
            ray.shutdown()
            c.shutdown()


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"gave up after {timeout} s waiting for {what}")


def test_every_node_of_the_cluster_sees_a_local_directory_on_this_machine(cluster, tmp_path):
    # (a prepare's local -o on a cluster is asked this first: raygpt.ray.shared_dir)
    from raygpt.ray import shared_dir
    blind, alive = shared_dir.nodes_not_seeing(str(tmp_path / "new" / "out"))
    assert (blind, alive) == ([], 3)  # the head and both worker nodes read the probe back
    assert list(tmp_path.iterdir()) == []  # the probe is gone; nothing else was made


def test_node_loss_resumes_with_uninterrupted_losses(cluster, tmp_path):
    c, nodes = cluster
    base = dict(num_workers=2, max_steps=16, checkpoint_every=4, max_failures=3)
    full = tiny_config(tmp_path / "full", **base).resolve(0)
    run(full)

    lossy = tiny_config(tmp_path / "lossy", **base).resolve(0)
    result, error = {}, []
    t = threading.Thread(target=lambda: _run_into(lossy, result, error), daemon=True)
    t.start()
    rd = open_run_dir(str(tmp_path / "lossy"))
    wait_for(lambda: rd.exists() and ck.find_latest_verified(rd, warn=lambda m: None) is not None,
             120, "the first verified checkpoint")
    c.remove_node(nodes[1], allow_graceful=False)  # the node dies with its worker
    c.add_node(num_cpus=1)  # a replacement joins (from the main thread, as Ray requires)
    t.join(timeout=300)
    assert not t.is_alive(), "the run did not finish after the node loss"
    assert not error, error
    assert result["failures"] >= 1 and result["step"] == 16
    resumed_from = [r["resumed_from"] for r in records(tmp_path / "lossy") if r["kind"] == "resume"]
    assert resumed_from and all(s % 4 == 0 for s in resumed_from)
    assert train_losses(tmp_path / "lossy") == train_losses(tmp_path / "full")


def _run_into(cfg, result, error):
    try:
        result.update(run(cfg))
    except Exception as e:  # surfaced by the test
        error.append(repr(e))


def test_elastic_run_finishes_on_fewer_workers_after_node_loss(cluster, tmp_path):
    """With --min-workers 1 the run does not wait for a replacement: it resumes on the one
    worker it has left, keeping the global batch through grad accumulation."""
    c, _ = cluster
    cfg = tiny_config(tmp_path, num_workers=2, min_workers=1, max_steps=16, checkpoint_every=4,
                      total_batch_size=4 * 32 * 2, max_failures=3, record_samples=True).resolve(0)
    result, error = {}, []
    t = threading.Thread(target=lambda: _run_into(cfg, result, error), daemon=True)
    t.start()
    rd = open_run_dir(str(tmp_path))
    wait_for(lambda: rd.exists() and ck.find_latest_verified(rd, warn=lambda m: None) is not None,
             120, "the first verified checkpoint")
    c.remove_node(next(iter(c.worker_nodes)), allow_graceful=False)  # no replacement this time
    t.join(timeout=300)
    assert not t.is_alive() and not error, error
    assert result["step"] == 16 and result["failures"] >= 1
    worlds = [r["world"] for r in records(tmp_path) if r["kind"] == "train"]
    assert worlds[0] == 2 and worlds[-1] == 1
    # the same global batch on either side of the loss: the curve is the one a single worker
    # (grad accumulation 2, no Ray: a few seconds) trains, on the same samples, each once
    twin = tiny_config(tmp_path / "twin", num_workers=1, max_steps=16, checkpoint_every=0,
                       total_batch_size=4 * 32 * 2, record_samples=True).resolve(0)
    train(twin, LocalSession(open_run_dir(twin.output_dir), torch.device("cpu")))
    elastic, single = train_losses(tmp_path), train_losses(tmp_path / "twin")
    assert sorted(elastic) == sorted(single) == list(range(16))
    for s in single:  # DDP's sum over ranks and accumulation's sum differ in rounding only
        assert elastic[s] == pytest.approx(single[s], rel=1e-4, abs=1e-5), s
    assert samples_seen(tmp_path) == samples_seen(tmp_path / "twin")


def test_preemption_notice_checkpoints_once_and_the_restart_resumes_there(cluster, tmp_path):
    """Ray's own drain API with reason PREEMPTION (what a spot reclaim sends): the run writes one
    checkpoint at the next step boundary and keeps training; when the node then goes, the
    restart resumes from that checkpoint. (Which budget Ray charges the restart to is Ray's
    call: with a local Cluster's removed node it is max_failures.) No periodic checkpoints
    (-n 0): every checkpoint before the end is the notice's (on a grid, a notice that lands just
    before a grid step is served by that step's checkpoint, and no extra one appears)."""
    c, _ = cluster
    while len(c.worker_nodes) < 2:  # earlier tests may have left one worker node
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    cfg = tiny_config(tmp_path, num_workers=2, max_steps=24, checkpoint_every=0, max_failures=2,
                      max_preemption_failures=2, preemption_poll_steps=1).resolve(0)
    result, error = {}, []
    t = threading.Thread(target=lambda: _run_into(cfg, result, error), daemon=True)
    t.start()
    rd = open_run_dir(str(tmp_path))
    trained = lambda: [r for r in records(tmp_path) if r["kind"] == "train"] if rd.exists(
        "loss_history.jsonl") else []
    wait_for(lambda: len(trained()) >= 3, 120, "training to start")
    victim = sorted(c.worker_nodes, key=lambda n: n.node_id)[-1]
    victim_id = victim.node_id
    subprocess.run(["ray", "drain-node", "--address", c.address, "--node-id", victim_id,
                    "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim",
                    "--deadline-remaining-seconds", "60"], check=True, capture_output=True)
    drained_at = len(trained())
    # the notice reaches the loop within a few steps: a checkpoint before the end appears
    wait_for(lambda: any(s < 24 for s in ck.list_checkpoint_steps(rd)), 120,
             "the preemption checkpoint")
    extra = [s for s in ck.list_checkpoint_steps(rd) if s < 24]
    assert len(extra) == 1 and extra[0] >= drained_at
    wait_for(lambda: not ck.verify_checkpoint(rd, extra[0]), 120, "the preemption checkpoint's DONE")
    c.remove_node(victim, allow_graceful=True)  # the reclaim: the drained node goes away
    c.add_node(num_cpus=1)
    t.join(timeout=300)
    assert not t.is_alive() and not error, error
    assert result["step"] == 24 and result["failures"] >= 1
    resumes = [r["resumed_from"] for r in records(tmp_path) if r["kind"] == "resume"]
    assert resumes and resumes[0] >= extra[0]
    assert len([s for s in ck.list_checkpoint_steps(rd) if s < 24]) == 1  # one per notice
