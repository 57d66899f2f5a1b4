"""raygpt under Ray Train with 2 gloo workers: learning, data parallel equivalence, and real
faults (a killed worker, SIGTERM, SIGUSR1, a crash before DONE, a fault on every attempt).
One local Ray (2 CPUs) is shared by the whole module."""

import pytest
import ray

from raygpt import checkpoint as ck
from raygpt.storage import open_run_dir
from raygpt.trainer import RunFailed, run
from tests.helpers import records, tiny_config, train_losses

TWO = dict(num_workers=2, max_steps=12, checkpoint_every=4, total_batch_size=4 * 32 * 2 * 2)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def go(cfg):
    return run(cfg.resolve(0))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full2")
    cfg = tiny_config(run_dir, **TWO, val_every=6)
    summary = go(cfg)
    return run_dir, cfg, summary


def test_two_workers_learn(uninterrupted):
    run_dir, cfg, summary = uninterrupted
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(12))
    assert losses[11] < losses[0] - 0.5
    vals = [r["val_loss"] for r in records(run_dir) if r["kind"] == "val"]
    assert len(vals) == 3 and vals[-1] < vals[0]
    rd = open_run_dir(str(run_dir))
    assert ck.list_checkpoint_steps(rd) == [4, 8, 12]
    assert all(not ck.verify_checkpoint(rd, s) for s in (4, 8, 12))
    assert summary["failures"] == 0


def test_two_workers_equal_one_worker_with_twice_the_batch(tmp_path):
    two = tiny_config(tmp_path / "two", num_workers=2, max_steps=4, checkpoint_every=0, shuffle=False)
    one = tiny_config(tmp_path / "one", num_workers=1, batch_size=8, max_steps=4,
                      checkpoint_every=0, shuffle=False)
    go(two), go(one)
    a, b = train_losses(tmp_path / "two"), train_losses(tmp_path / "one")
    assert a.keys() == b.keys()
    for s in a:
        assert a[s] == pytest.approx(b[s], rel=1e-5, abs=1e-6)


def test_killed_worker_resumes_with_identical_losses(uninterrupted, tmp_path):
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "killed"
    summary = go(cfg.with_overrides({"output_dir": str(run_dir), "fault": "kill:rank=1,step=6"}))
    assert summary["failures"] == 1 and summary["resumes"] == 1
    resumes = [r for r in records(run_dir) if r["kind"] == "resume"]
    assert resumes[0]["resumed_from"] == 4
    assert train_losses(run_dir) == train_losses(full_dir)
    full, mine = open_run_dir(str(full_dir)), open_run_dir(str(run_dir))
    name = f"{ck.step_dir(12)}/{ck.model_file(12)}"
    assert full.read_bytes(name) == mine.read_bytes(name)  # final weights bit for bit


def test_sigterm_to_one_worker_stops_cleanly_and_resumes(uninterrupted, tmp_path):
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "term"
    stopped = cfg.with_overrides({"output_dir": str(run_dir), "fault": "sigterm:rank=1,step=6"})
    summary = go(stopped)
    assert summary["stopped_early"] and summary["step"] == 7 and summary["failures"] == 0
    rd = open_run_dir(str(run_dir))
    assert 7 in ck.list_checkpoint_steps(rd) and not ck.verify_checkpoint(rd, 7)
    summary = go(stopped.with_overrides({"resume": 1}))
    assert summary["step"] == 12 and not summary["stopped_early"]
    assert train_losses(run_dir) == train_losses(full_dir)


def test_sigusr1_adds_a_checkpoint_and_changes_nothing(uninterrupted, tmp_path):
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "usr1"
    go(cfg.with_overrides({"output_dir": str(run_dir), "fault": "sigusr1:rank=1,step=5"}))
    assert ck.list_checkpoint_steps(open_run_dir(str(run_dir))) == [4, 6, 8, 12]
    assert train_losses(run_dir) == train_losses(full_dir)


def test_crash_before_done_falls_back_to_the_previous_checkpoint(uninterrupted, tmp_path):
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "nodone"
    summary = go(cfg.with_overrides({"output_dir": str(run_dir),
                                     "fault": "crash_before_done:rank=0,step=8"}))
    assert summary["step"] == 12 and summary["failures"] == 1
    rd = open_run_dir(str(run_dir))
    problems = ck.verify_checkpoint(rd, 8)  # the files of the first attempt, without DONE
    assert problems and "DONE" in problems[0]
    resumes = [r for r in records(run_dir) if r["kind"] == "resume"]
    assert resumes[-1]["resumed_from"] == 4
    assert train_losses(run_dir) == train_losses(full_dir)


def test_nan_on_one_rank_rewinds_both_without_a_hang(tmp_path):
    from raygpt.config import SpikeConfig
    spike = SpikeConfig(enabled=True, min_history=4, window=8, max_rewinds=2)
    cfg = tiny_config(tmp_path, num_workers=2, max_steps=10, checkpoint_every=2, spike=spike,
                      fault="nan:rank=1,step=7")
    summary = go(cfg)
    assert summary["rewinds"] == 1 and summary["step"] == 10 and summary["failures"] == 0
    rw = [r for r in records(tmp_path) if r["kind"] == "rewind"]
    assert len(rw) == 1 and rw[0]["step"] == 7 and rw[0]["to_step"] <= 6


def test_a_fault_on_every_attempt_exhausts_the_retry_budget(tmp_path):
    cfg = tiny_config(tmp_path, num_workers=2, max_steps=6, max_failures=1,
                      fault="raise:rank=0,step=2,every=1")
    with pytest.raises(RunFailed) as e:
        go(cfg)
    failures = [r for r in records(tmp_path) if r["kind"] == "failure"]
    assert len(failures) == 2  # max_failures + 1 attempts, each failed
    starts = [r for r in records(tmp_path) if r["kind"] in ("start", "resume")]
    assert len(starts) == 2
    assert "2 attempt(s)" in str(e.value) and "InjectedFault" in str(e.value)


def test_train_metrics_reach_ray_and_trackers_continue_across_a_restart(tmp_path, monkeypatch):
    """2 workers with --wandb (offline) and --mlflow (a local directory), rank 1 killed at step
    6: Ray's reports carry train metrics at the agreed steps from both ranks, only rank 0 logs
    to the trackers, and the restarted attempt continues the same W&B and MLflow runs (MLflow
    topped up with whatever the killed attempt had not stored yet)."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    import json
    import time

    from mlflow.tracking import MlflowClient
    from ray.train import UserCallback

    from raygpt.trainer import build_trainer, create_control, prepare_run_dir
    from tests.test_tracking import latest, wandb_history

    class RecordReports(UserCallback):  # defined here: pickled by value to the controller
        def __init__(self, path):
            self.path = path

        def after_report(self, run_context, metrics, checkpoint):
            with open(self.path, "a") as f:
                f.write(json.dumps({"ranks": len(metrics), **metrics[0]}) + "\n")

    # Ray Train's controller polls (and so takes reports) every 0.1 s; the gate is two polls
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the file store
    run_dir, reports = tmp_path / "run", tmp_path / "reports.jsonl"
    cfg = tiny_config(run_dir, num_workers=2, max_steps=8, checkpoint_every=4, val_every=4,
                      total_batch_size=4 * 32 * 2, fault="kill:rank=1,step=6",
                      wandb="raygpt-test", mlflow=str(tmp_path / "mlruns")).resolve(0)
    prepare_run_dir(cfg)
    name = f"raygpt-test-control-{time.time_ns()}"
    control = create_control(name)
    try:
        build_trainer(cfg, control_name=name, callbacks=(RecordReports(str(reports)),)).fit()
    finally:
        ray.kill(control)

    recs = records(run_dir)
    assert [r["attempt"] for r in recs if r["kind"] in ("start", "resume")] == [1, 2]
    train = {r["step"]: r for r in recs if r["kind"] == "train"}  # the latest attempt wins
    got = [json.loads(line) for line in reports.read_text().splitlines()]
    trains = [r for r in got if "grad_norm" in r]  # (checkpoint reports carry train_loss too)
    assert len(trains) >= 3 and all(r["ranks"] == 2 for r in trains)
    for r in trains:  # a report's step may have been re-done later; compare with its attempt
        assert any(h["step"] == r["step"] and h["loss"] == r["train_loss"] and h["lr"] == r["lr"]
                   and h["norm"] == r["grad_norm"] for h in recs if h["kind"] == "train")
    assert trains[-1]["step"] == 7 and trains[-1]["train_loss"] == train[7]["loss"]

    kept = json.loads((run_dir / "tracking.json").read_text())
    ids, rows = wandb_history(run_dir)
    assert ids == [kept["wandb"]["id"]] * 2  # one offline dir per attempt, one run id
    want = {s: r["loss"] for s, r in train.items()}
    resumed = [r["resumed_from"] for r in recs if r["kind"] == "resume"][0]
    got_wandb = latest((r["step"], r["train/loss"]) for r in rows if "train/loss" in r)
    # the killed attempt's unwritten tail is W&B's to lose (its buffer dies with the process);
    # what W&B has is right, and the last attempt is all there
    assert all(got_wandb[s] == want[s] for s in got_wandb)
    assert {s for s in got_wandb if s >= resumed} == {s for s in want if s >= resumed}
    client = MlflowClient(tracking_uri=kept["mlflow"]["uri"])
    history = sorted(client.get_metric_history(kept["mlflow"]["run_id"], "train/loss"),
                     key=lambda m: m.timestamp)
    assert latest((m.step, m.value) for m in history) == want
    assert client.get_run(kept["mlflow"]["run_id"]).info.status == "FINISHED"

