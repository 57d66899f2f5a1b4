"""raygpt under Ray Train with 2 gloo workers: learning, data parallel equivalence, and real
faults (a killed worker, SIGTERM, SIGUSR1, a crash before DONE, a fault on every attempt).
One local Ray (2 CPUs) is shared by the whole module."""

import json
import shutil

import pytest
import ray

from raygpt.checkpointing import protocol as ck
from raygpt.config import TrainConfig
from raygpt.ray.driver import RunFailed, run
from raygpt.runlog.history import RECOVERY_PARTS, STARTUP_MARKS, summarize_run
from raygpt.runlog.report import run_status
from raygpt.storage import open_run_dir
from raygpt.train.faults import read_fired
from tests.helpers import records, tiny_config, train_losses

TWO = dict(num_workers=2, max_steps=12, checkpoint_every=4, total_batch_size=4 * 32 * 2 * 2)


pytestmark = pytest.mark.usefixtures("local_ray")  # tests/ray_seam/conftest.py

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
    # no actor the run has no use for: Ray Train's DatasetManager (a process importing Ray Data
    # on every worker-group start) is left out when there are no datasets
    started = {a["ActorClassName"] for a in ray._private.state.actors().values()}
    assert "RayTrainWorker" in started and "DatasetManager" not in started, started


def test_checkpoints_are_stored_by_rename_and_their_timeline_is_in_the_summary(uninterrupted):
    """The run directory is Ray's, local, on the staging directory's filesystem (both under the
    system temp directory here): each rank's files reach it by rename on Ray's upload thread
    ("stored" in rank 0's timeline: raygpt's upload function ran, not Ray's copy), in order
    after they were captured, written and reported; the controller polled at raygpt's pace."""
    run_dir, cfg, summary = uninterrupted
    rows = summary["checkpoint_timeline"]
    assert [r["step"] for r in rows] == [4, 8, 12]
    for r in rows:
        if r["step"] == 12:  # the summary is made before the last upload (async) is through
            r.setdefault("stored", r["published"])
        assert r["saved"] <= r["written"] <= r["published"] <= r["stored"], r
        done = run_dir / ck.step_dir(r["step"]) / ck.done_file(r["step"])
        assert done.stat().st_mtime >= r["stored"] - 0.01  # DONE after rank 0's files were stored
    # a save that found the one before still being written says which and how long (whether
    # one waited is the machine's speed, not a property to test: bench/checkpoint.py times it)
    assert all(step in (8, 12) and waited >= 0 for step, waited in summary["checkpoint_waits"])


@pytest.fixture(scope="module")
def usr1_overlapped(uninterrupted, tmp_path_factory):
    """The uninterrupted run's config with --overlap-comm on and SIGUSR1 to rank 1 at step 5: one
    Ray run for two tests (neither the reduction's order nor the extra checkpoint may change a
    train loss, so each claim is checked against the uninterrupted run on its own terms)."""
    _, cfg, _ = uninterrupted
    run_dir = tmp_path_factory.mktemp("usr1_overlapped")
    go(cfg.with_overrides({"output_dir": str(run_dir), "overlap_comm": True,
                           "fault": "sigusr1:rank=1,step=5"}))
    return run_dir


def test_the_overlapped_reduction_changes_no_loss(uninterrupted, usr1_overlapped):
    """The uninterrupted run reduced its gradients in one collective after the backward pass
    (--overlap-comm is off on CPUs), over 2 micro-steps a step; reducing them during the last
    backward gives the same losses as floats (a sum of 2 terms is exact in any order)."""
    run_dir, cfg, _ = uninterrupted
    assert not cfg.resolve(0).overlap_comm and cfg.resolve(0).grad_accum_steps(2) == 2
    ran = json.loads((usr1_overlapped / "config.json").read_text())["config"]
    assert ran["overlap_comm"] is True and ran["total_batch_size"] == cfg.total_batch_size
    assert train_losses(usr1_overlapped) == train_losses(run_dir)


@pytest.fixture(scope="module")
def two_small(tmp_path_factory):
    """2 workers, 4 steps in order, no checkpoints, validated every step on a validation shard
    of 3 samples (rank 1 sits validation out): the run of two tests, data parallelism's and
    validation's (validation reads the weights, it changes no train loss)."""
    import numpy as np

    from raygpt.llmc.shards import read_shard, write_shard

    root = tmp_path_factory.mktemp("two_small")
    write_shard(root / "val.bin", np.asarray(read_shard(tiny_config(root).input_val_bin)[:100]))
    cfg = tiny_config(root / "two", num_workers=2, max_steps=4, checkpoint_every=0, shuffle=False,
                      val_every=1, val_batches=None, input_val_bin=str(root / "val.bin")).resolve(0)
    run(cfg)
    return root / "two", cfg


def test_two_workers_equal_one_worker_with_twice_the_batch(two_small, tmp_path):
    two_dir, _ = two_small
    one = tiny_config(tmp_path / "one", num_workers=1, batch_size=8, max_steps=4,
                      checkpoint_every=0, shuffle=False)
    go(one)
    a, b = train_losses(two_dir), train_losses(tmp_path / "one")
    assert a.keys() == b.keys() == set(range(4))
    for s in a:
        assert a[s] == pytest.approx(b[s], rel=1e-5, abs=1e-6)


def test_paths_relative_to_the_users_directory_train_and_resume(tmp_path, monkeypatch):
    """-i, -j and -o given relative to the driver's working directory name the user's files:
    Ray's workers run in another directory, so the driver makes them absolute before anything
    reads them. The run is then resumed from another directory, its paths relative to that one."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("input_bin", "input_val_bin"):
        shutil.copy(getattr(TrainConfig(), name), data / f"{name}.bin")
    monkeypatch.chdir(tmp_path)
    rel = dict(input_bin="data/input_bin.bin", input_val_bin="data/input_val_bin.bin",
               num_workers=2, checkpoint_every=4, val_every=4)
    first = go(tiny_config("runs/rel", max_steps=4, **rel))
    assert first["step"] == 4
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    again = go(tiny_config("../runs/rel", max_steps=8, resume=1,
                           **{**rel, "input_bin": "../data/input_bin.bin",
                              "input_val_bin": "../data/input_val_bin.bin"}))
    assert again["step"] == 8
    run_dir = tmp_path / "runs" / "rel"
    assert sorted(train_losses(run_dir)) == list(range(8))
    assert [r["step"] for r in records(run_dir) if r["kind"] == "resume"] == [4]
    assert ck.list_checkpoint_steps(open_run_dir(str(run_dir))) == [4, 8]


def test_killed_worker_resumes_with_identical_losses(uninterrupted, tmp_path):
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "killed"
    # after=4: at step 6, or at the first step after it once checkpoint 4 is complete
    summary = go(cfg.with_overrides({"output_dir": str(run_dir),
                                     "fault": "kill:rank=1,step=6,after=4"}))
    assert summary["failures"] == 1 and summary["resumes"] == 1
    resumes = [r for r in records(run_dir) if r["kind"] == "resume"]
    assert resumes[0]["resumed_from"] == 4
    (fired,) = read_fired(open_run_dir(str(run_dir)))[1]
    assert fired["fault"] == "kill:rank=1,step=6,after=4" and fired["at_step"] >= 6, fired
    assert train_losses(run_dir) == train_losses(full_dir)
    full, mine = open_run_dir(str(full_dir)), open_run_dir(str(run_dir))
    name = f"{ck.step_dir(12)}/{ck.model_file(12)}"
    assert full.read_bytes(name) == mine.read_bytes(name)  # final weights bit for bit
    # the recovery ledger: every part measured (the start-up marks from Ray's backend and the
    # loop), none negative, together the whole recovery; steps 4 and 5 re-trained
    assert set(STARTUP_MARKS) <= resumes[0]["startup"].keys()
    # the finer marks of the worker's own start-up (bench/recovery.py prints them)
    assert {"process_started", "train_func", "loop_imported", "model_built", "fingerprints",
            "checkpoint_chosen", "files_verified"} <= resumes[0]["startup"]["setup"].keys()
    # the group restarted on this node: rank 0 loaded the files it wrote from the node's copy
    assert resumes[0]["startup"]["load_from"] == ["local"]
    (recovery,) = summarize_run(records(run_dir))["recoveries"]
    parts = recovery["parts"]
    assert all(parts[p] is not None and parts[p] >= 0 for p in RECOVERY_PARTS), parts
    assert sum(parts[p] for p in RECOVERY_PARTS) == pytest.approx(parts["total"], abs=1e-6)
    assert recovery["steps_retrained"] == fired["at_step"] - 4
    assert "recovery 1: " in run_status(str(run_dir)) and "worker group up" in run_status(str(run_dir))


def test_sigusr1_adds_a_checkpoint_and_changes_nothing(uninterrupted, usr1_overlapped):
    full_dir, _, _ = uninterrupted
    assert ck.list_checkpoint_steps(open_run_dir(str(usr1_overlapped))) == [4, 6, 8, 12]
    assert train_losses(usr1_overlapped) == train_losses(full_dir)


def test_crash_before_done_falls_back_to_the_previous_checkpoint(uninterrupted, tmp_path):
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "nodone"
    summary = go(cfg.with_overrides({"output_dir": str(run_dir),
                                     "fault": "crash_before_done:rank=0,step=8,after=4"}))
    assert summary["step"] == 12 and summary["failures"] == 1
    # checkpoint 8 had its files but no DONE when rank 0 died at step 10 (or later: after=4
    # waits for checkpoint 4's DONE, which a slow controller may not have written by step 10),
    # so the restart passed over it to 4; the re-trained step 8 is saved and completed again,
    # so its state after the run says nothing of the first attempt's
    resumes = [r for r in records(run_dir) if r["kind"] == "resume"]
    assert resumes[-1]["resumed_from"] == 4
    assert train_losses(run_dir) == train_losses(full_dir)


def test_a_corrupt_state_file_of_one_rank_makes_both_ranks_fall_back_together(uninterrupted,
                                                                             tmp_path):
    """Each rank hashes only the files it loads, so only rank 1 sees that its state file of
    checkpoint 8 was corrupted after its MANIFEST (same size: no quick check can tell); the
    ranks' verdicts are agreed, and both resume from 4 with the uninterrupted run's losses."""
    import shutil

    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "corrupt"
    shutil.copytree(full_dir, run_dir)
    rd = open_run_dir(str(run_dir))
    rd.delete_dir(ck.step_dir(12))
    rel = f"{ck.step_dir(8)}/{ck.state_file(8, 1)}"
    data = bytearray(rd.read_bytes(rel))
    data[len(data) // 2] ^= 0x40
    rd.write_bytes_atomic(rel, bytes(data))
    assert ck.find_latest_verified(rd, hashes=False) == 8
    summary = go(cfg.with_overrides({"output_dir": str(run_dir), "resume": 1}))
    assert summary["step"] == 12
    resume = [r for r in records(run_dir) if r["kind"] == "resume"][-1]
    assert resume["resumed_from"] == 4
    assert sorted(train_losses(run_dir, attempt=resume["attempt"])) == list(range(4, 12))
    assert train_losses(run_dir) == train_losses(full_dir)


def test_a_resuming_rank_reads_only_the_files_it_loads(uninterrupted, monkeypatch):
    """Rank 1 of 2 resuming the finished 2-worker run (in this process, no Ray): of checkpoint
    12 it reads MANIFEST, its own state file and (fp32) the model file, nothing of rank 0's."""
    import torch

    from raygpt.checkpointing.runtime import Checkpointer
    from raygpt.data.loader import DistributedDataLoader
    from raygpt.storage import RunDir
    from raygpt.train.loop import build_model
    from raygpt.train.optim import AdamW, FlatParameters
    from raygpt.train.session import Session
    from raygpt.train.state import TrainState

    full_dir, cfg, _ = uninterrupted
    cfg = cfg.with_overrides({"resume": 1}).resolve(0)
    session = Session()
    session.rank, session.world, session.run_dir = 1, 2, open_run_dir(str(full_dir))
    model = build_model(cfg, torch.device("cpu"))
    flat = FlatParameters(model, torch.device("cpu"), torch.float32, pad_multiple=2)
    opt = AdamW(flat, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                weight_decay=cfg.weight_decay, rank=1, world=2, zero_stage=cfg.zero_stage)
    loader = DistributedDataLoader(cfg.input_bin, cfg.batch_size, cfg.seq_len, 1, 2,
                                   shuffle=cfg.shuffle, seed=cfg.seed)
    read = []
    for name in ("read_bytes", "sha256_of"):
        orig = getattr(RunDir, name)
        monkeypatch.setattr(RunDir, name, lambda self, rel, *a, _o=orig, **k: read.append(rel)
                            or _o(self, rel, *a, **k))
    ckpt = Checkpointer(cfg, session, flat, opt, model.config, cfg.max_steps)
    assert ckpt.restore_latest(TrainState.fresh(cfg), loader) == 12
    d = ck.step_dir(12)
    assert {r for r in read if r.startswith("step_")} == {
        f"{d}/{ck.MANIFEST}", f"{d}/{ck.state_file(12, 1)}", f"{d}/{ck.model_file(12)}"}
    assert read.count(f"{d}/{ck.state_file(12, 1)}") == 1  # read once: hashed from those bytes


def test_a_fault_on_every_attempt_exhausts_the_retry_budget(tmp_path):
    from raygpt.checkpointing.local_copy import LocalCopies

    cfg = tiny_config(tmp_path, num_workers=2, max_steps=6, max_failures=1, checkpoint_every=2,
                      fault="raise:rank=0,step=4,every=1")
    with pytest.raises(RunFailed) as e:
        go(cfg)
    # no clean end, but the driver removed the node's copies of checkpoint 2 (and 4) all the same
    assert not LocalCopies(open_run_dir(str(tmp_path)).uri()).dir.exists()
    failures = [r for r in records(tmp_path) if r["kind"] == "failure"]
    assert len(failures) == 2  # max_failures + 1 attempts, each failed
    starts = [r for r in records(tmp_path) if r["kind"] in ("start", "resume")]
    assert len(starts) == 2
    assert "2 attempt(s)" in str(e.value) and "InjectedFault" in str(e.value)


def snapshot_names(run_dir) -> list[str]:
    from raygpt.ray.checkpoint_list import SNAPSHOT
    snap = json.loads((run_dir / SNAPSHOT).read_text())
    return [r["checkpoint_dir_name"] for r in snap["checkpoint_results"]]


def test_sigterm_to_one_worker_stops_cleanly_then_retention_and_resume_with_y1(uninterrupted,
                                                                              tmp_path):
    """SIGTERM to rank 1 at step 8 stops the run cleanly (no failure) with a verified checkpoint
    of the step after it, and -y 1 resumes it to the uninterrupted run's losses; with -n 2 -nk 2
    -nm 0, retention deleted checkpoints Ray had registered; Ray's list follows (after each
    report, in the controller), the resumed controller accepts the run directory, and a
    checkpoint deleted after the last report (as a rewind does) is dropped from Ray's list
    before the next fit(). (One stop-and-resume for both: SIGTERM's stop was its own test.)"""
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "keep"
    stopped = cfg.with_overrides({"output_dir": str(run_dir), "checkpoint_every": 2,
                                  "checkpoints_keep": 2, "major_checkpoint_every": 0,  # no majors
                                  "fault": "sigterm:rank=1,step=8"})
    summary = go(stopped)
    assert summary["stopped_early"] and summary["step"] == 9 and summary["failures"] == 0
    rd = open_run_dir(str(run_dir))
    assert ck.list_checkpoint_steps(rd) == [8, 9] and not ck.verify_checkpoint(rd, 9)
    assert snapshot_names(run_dir) == [ck.step_dir(8), ck.step_dir(9)]
    rd.delete_dir(ck.step_dir(8))  # deleted behind Ray's back after its last report
    summary = go(stopped.with_overrides({"resume": 1}))
    assert summary["step"] == 12 and not summary["stopped_early"]
    assert train_losses(run_dir) == train_losses(full_dir)
    assert ck.list_checkpoint_steps(rd) == [10, 12]
    assert snapshot_names(run_dir) == [ck.step_dir(10), ck.step_dir(12)]


def test_nan_on_one_rank_rewinds_both_and_a_kill_after_the_rewind_keeps_its_decision(tmp_path):
    """2 workers, spike monitor on: NaN on rank 1 only at step 9 makes both ranks rewind to
    checkpoint 6 (safety 3) without a hang (the reference run), deleting checkpoint 8, the
    newest one Ray registered. Rank 1 is then SIGKILLed at step 7 of the re-run, before a
    checkpoint carries the rewind. Ray restarts the group inside the same fit()
    (its latest registered checkpoint is gone: a hint only), the workers resume from 6 and
    apply the recorded decision: the final losses equal, as floats, the same run without the
    kill. Ray's checkpoint list names only what exists, once each, and -y 1 accepts it."""
    from raygpt.config import SpikeConfig
    spike = SpikeConfig(enabled=True, min_history=4, window=8, safety_steps=3, max_rewinds=2)
    base = dict(num_workers=2, max_steps=12, checkpoint_every=2, spike=spike)
    ref = tiny_config(tmp_path / "ref", **base, fault="nan:rank=1,step=9")
    summary = go(ref)
    assert summary["rewinds"] == 1 and summary["failures"] == 0 and summary["step"] == 12
    (rw,) = [r for r in records(tmp_path / "ref") if r["kind"] == "rewind"]
    assert rw["step"] == 9 and rw["to_step"] == 6
    crash = tiny_config(tmp_path / "crash", **base,
                        fault="nan:rank=1,step=9;kill:rank=1,step=7,visit=2")
    summary = go(crash)
    assert summary["failures"] == 1 and summary["rewinds"] == 1 and summary["step"] == 12
    resumes = [r for r in records(tmp_path / "crash") if r["kind"] == "resume"]
    assert resumes[-1]["resumed_from"] == 6
    assert train_losses(tmp_path / "crash") == train_losses(tmp_path / "ref")
    rd = open_run_dir(str(tmp_path / "crash"))
    # the default retention (-nk 3, -nm 4) in the driver: 2 went at 8's commit, 6 at 12's
    assert ck.list_checkpoint_steps(rd) == [4, 8, 10, 12]
    names = snapshot_names(tmp_path / "crash")
    assert names == [ck.step_dir(s) for s in ck.list_checkpoint_steps(rd)]
    summary = go(crash.with_overrides({"resume": 1, "max_steps": 14}))  # a new controller
    assert summary["step"] == 14 and summary["failures"] == 0


def test_the_run_directory_records_what_ran(uninterrupted):
    """run() writes config.json before Ray starts: the resolved config, hardware, versions."""
    import json
    run_dir, cfg, _ = uninterrupted
    rec = json.loads((run_dir / "config.json").read_text())
    assert rec["launch"] == 1 and rec["config"] == cfg.resolve(0).to_dict()
    assert rec["hardware"]["workers"] == "2 x cpu" and "ray" in rec["versions"]
    assert rec["plan"][0].startswith("train: ")


def test_validation_on_fewer_ranks_than_workers(two_small):
    """A validation shard of 3 samples on 2 workers: rank 0 validates all 3, rank 1 sits
    validation out but joins the all-reduce; the loss is rank 0's samples' mean alone."""
    import torch

    from raygpt.train.loop import build_model, build_val_loader, evaluate

    run_dir, cfg = two_small
    assert (cfg.val_batch_size, cfg.val_batches) == (3, 1)
    assert build_val_loader(cfg, 1, 2) is None
    vals = {r["step"]: r["val_loss"] for r in records(run_dir) if r["kind"] == "val"}
    assert sorted(vals) == [0, 1, 2, 3, 4]
    model = build_model(cfg, torch.device("cpu"))  # the weights every rank starts from
    expected = evaluate(model, build_val_loader(cfg, 0, 1), cfg, torch.device("cpu"), world=1)
    assert vals[0] == pytest.approx(expected, rel=1e-6)


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

    from raygpt.ray.driver import build_trainer, create_control
    from raygpt.train.run_dir import prepare_run_dir
    from tests.runlog.test_tracking import latest, wandb_history

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
    claimed = prepare_run_dir(cfg)
    name = f"raygpt-test-control-{time.time_ns()}"
    control = create_control(name)
    try:
        build_trainer(cfg, claimed, control_name=name,
                      callbacks=(RecordReports(str(reports)),)).fit()
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
    # one W&B run id across both attempts; the killed attempt's own "run" record may die unwritten
    # with its process (W&B writes offline files asynchronously), so it is not counted
    assert ids and set(ids) == {kept["wandb"]["id"]}
    want = {s: r["loss"] for s, r in train.items()}
    # where the last attempt began: checkpoint 4, or step 0 when the kill beat checkpoint 4's DONE
    resumed = next((r["resumed_from"] for r in recs if r["kind"] == "resume"), 0)
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

