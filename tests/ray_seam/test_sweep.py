"""raygpt.ray.sweep: Ray Tune over raygpt runs on 2 CPU cores, 1 gloo worker per trial.

The pure parts (trial configs, search-space checks, the plan file, best config, table) first;
then the trainer-equivalence check, then four real sweeps of a 1-layer model: scheduler kinds
ranked by validation loss, trials killed mid-run (resumed inside Ray Train, and re-run by Tune),
a sweep whose driver is SIGKILLed and resumed, and WSD branches from one stable checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import ray
from ray import tune

from raygpt.checkpointing import protocol as ck
from raygpt.cli import main as cli_main
from raygpt.ray import sweep, sweep_tune, trials
from raygpt.config import ConfigError, TrainConfig, parse_args
from raygpt.train.schedule import learning_rate
from raygpt.storage import open_run_dir
from tests.helpers import records

REPO = Path(__file__).resolve().parents[2]
KINDS = ["cosine", "linear", "constant", "wsd"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny(**overrides) -> TrainConfig:
    """The base every sweep overrides: a 1-layer, 64-wide GPT-2 on 4 x 32 tokens, one worker."""
    base = dict(model="d1", batch_size=4, seq_len=32, max_steps=12, warmup_steps=2, val_every=4,
                val_batches=1, sample_every=0, checkpoint_every=4, num_workers=1, log_every=1000)
    base.update(overrides)
    return TrainConfig(**base)


def wait_for(predicate, timeout_s: float, what: str):
    """Poll `predicate` until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def all_cpus_free():
    return ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU")


def train_steps(recs, attempt=None):
    return [r["step"] for r in recs if r["kind"] == "train"
            and (attempt is None or r["attempt"] == attempt)]


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as env:
        # Ray Train's controller polls its workers every 2 s; every 0.5 s notices a report, a
        # finished run or a dead worker sooner (seconds per trial). Processes Ray starts for this
        # cluster (trials, controllers, workers) inherit it from the raylet.
        env.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
        # address="local": a Ray of our own even if `ray start` left one running on this machine
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


# ====================================================================== pure parts

def test_trial_config_applies_overrides_in_its_own_resumable_run_dir(tmp_path):
    base = trials.pin_for_trials(tiny(), gpus_available=0)
    assert base.total_batch_size == -1 and base.device == "cpu" and os.path.isabs(base.input_bin)
    cfg = trials.trial_config(base, {"batch_size": 8, "scheduler": "wsd",
                                    "spike.soft_z": np.float64(4.0), "warmup_steps": np.int64(3)},
                             str(tmp_path / "t"))
    assert (cfg.batch_size, cfg.scheduler, cfg.spike.soft_z, cfg.warmup_steps) == (8, "wsd", 4.0, 3)
    assert type(cfg.warmup_steps) is int  # a numpy int would break the manifest's JSON
    assert cfg.total_batch_size == 8 * 32 * 1  # B*T*world of the trial, not of the base
    # validation fitted to the trial's own T: a 512-token sequence fits 63 times in the
    # 32,768-token validation shard, so B=4 reads 15 batches of 4, not the base's 2 of T=32
    base2 = trials.pin_for_trials(tiny(val_every=4, val_batches=None), gpus_available=0)
    assert (base2.val_batch_size, base2.val_batches) == (None, None)
    long = trials.trial_config(base2, {"seq_len": 512}, str(tmp_path / "t2"))
    assert (long.val_batch_size, long.val_batches) == (4, 15)
    assert cfg.output_dir == str(tmp_path / "t") and cfg.resume == 1


def test_search_space_keys_must_be_config_fields():
    trials.check_space(tiny(), {"scheduler": tune.grid_search(KINDS), "spike.hard_z": 30.0,
                               "learning_rate": tune.loguniform(1e-4, 1e-2)})
    with pytest.raises(ConfigError, match="lr_peak"):
        trials.check_space(tiny(), {"lr_peak": 1e-3})
    with pytest.raises(ConfigError, match="spike field 'soft'"):
        trials.check_space(tiny(), {"spike.soft": 4.0})
    with pytest.raises(ConfigError, match="output_dir"):
        trials.check_space(tiny(), {"output_dir": "x"})


def test_wsd_branches_may_differ_only_in_resume_mutable_fields():
    sweep.check_branch_space({"val_every": 2, "checkpoint_every": 5})
    with pytest.raises(ConfigError, match=r"'final_lr_frac'.*config\.RESUME_MUTABLE_FIELDS"):
        sweep.check_branch_space({"final_lr_frac": 0.0})
    with pytest.raises(ConfigError, match="spike.soft_z"):
        sweep.check_branch_space({"spike.soft_z": 4.0})
    assert sweep.shared_stable_step([15, 10, 30]) == 8  # int(0.8f * 10), the shortest branch
    with pytest.raises(ConfigError, match="stable phase"):
        sweep.shared_stable_step([1])


def test_concurrency_is_what_the_workers_fit():
    assert sweep.max_concurrent_trials({"CPU": 2.0}, tiny()) == 2
    assert sweep.max_concurrent_trials({"CPU": 2.0}, tiny(num_workers=2)) == 1
    assert sweep.max_concurrent_trials({"CPU": 64.0, "GPU": 8.0},
                                       tiny(device="gpu", num_workers=4)) == 2
    assert sweep.max_concurrent_trials({"CPU": 1.0}, tiny(num_workers=2)) == 1  # never 0


def test_plan_file_round_trip_and_checks(tmp_path):
    d = open_run_dir(str(tmp_path))
    plan = sweep.SweepPlan(sweep_dir=str(tmp_path), mode="wsd_branch", user_base=tiny().to_dict(),
                           base=tiny().to_dict(), settings={"num_samples": 1}, shared_step=8,
                           stable_max_steps=10)
    sweep.write_plan(d, plan)
    assert sweep.read_plan(d) == plan
    raw = json.loads(d.read_bytes(sweep.PLAN_FILE))
    d.write_bytes_atomic(sweep.PLAN_FILE, json.dumps({**raw, "version": 99}).encode())
    with pytest.raises(ConfigError, match=r"sweep.json: version: expected 2, found 99"):
        sweep.read_plan(d)
    d.write_bytes_atomic(sweep.PLAN_FILE, json.dumps({**raw, "format": "other"}).encode())
    with pytest.raises(ConfigError, match=r"sweep.json: format: expected 'raygpt-sweep'"):
        sweep.read_plan(d)
    with pytest.raises(ConfigError, match="no such file"):
        sweep.read_plan(open_run_dir(str(tmp_path / "missing")))


def test_status_and_plot_of_a_sweep_directory_before_its_trials_and_with_a_bad_plan(tmp_path, capsys):
    """A sweep directory whose trials have not started shows them pending (the plan lists them
    before Tune starts); one whose sweep.json is damaged gets one line naming the file, exit 2,
    from both commands (no traceback)."""
    d = open_run_dir(str(tmp_path))
    sweep.write_plan(d, sweep.SweepPlan(
        sweep_dir=str(tmp_path), mode="grid", user_base=tiny().to_dict(), base=tiny().to_dict(),
        settings={"num_samples": 1},
        trials=trials.expand_trials({"scheduler": tune.grid_search(KINDS)}, 1, seed=0)))
    assert cli_main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"sweep {tmp_path} | mode grid | 4 trial(s): 4 pending (as of now: no results.txt yet)"
    assert [line.split()[1:4] for line in out[2:6]] == [
        [f"trial_00{i}", "pending", f"scheduler={kind}"] for i, kind in enumerate(KINDS)]
    d.write_bytes_atomic(sweep.PLAN_FILE, b"{not json")
    for command in ("status", "plot"):
        assert cli_main([command, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"raygpt {command}: error: {tmp_path / sweep.PLAN_FILE}: expected "
                              f"JSON") and err.count("\n") == 1, err


def test_best_config_reproduces_the_trial_through_the_cli(tmp_path):
    user = tiny(fault="kill:rank=0,step=3", overwrite=True, output_dir=str(tmp_path / "s"))
    overrides = {"scheduler": "wsd", "spike.soft_z": 4.5, "learning_rate": np.float64(3e-3)}
    best = sweep.best_config(user, overrides)
    assert not {"output_dir", "fault", "overwrite", "resume"} & set(best)
    assert best["spike.soft_z"] == 4.5 and best["scheduler"] == "wsd" and best["model"] == "d1"
    path = tmp_path / "best.json"
    path.write_text(json.dumps(best))
    from_cli = parse_args(["--config", str(path)])
    expected = user.with_overrides({**overrides, "learning_rate": 3e-3, "fault": "",
                                    "overwrite": False, "output_dir": TrainConfig().output_dir})
    assert from_cli == expected


def test_best_config_and_its_command_run_from_another_directory(tmp_path, monkeypatch):
    """Relative data paths given to the sweep (in the sweep's directory) are absolute in
    best_config.json, so the command the sweep suggests finds the same shards from anywhere."""
    import shlex
    from raygpt.config import absolute_paths, preflight
    from raygpt.llmc.shards import write_shard
    sweep_cwd, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (sweep_cwd / "data").mkdir(parents=True)
    elsewhere.mkdir()
    write_shard(sweep_cwd / "data" / "t_000001.bin", np.arange(4000) % 50257)
    write_shard(sweep_cwd / "data" / "v_000000.bin", np.arange(1000) % 50257)
    user = tiny(input_bin="data/t_*.bin", input_val_bin="data/v_*.bin",
                eval_set=["held=data/v_*.bin"], output_dir="runs/sweep")
    best = sweep.best_config(user, {"scheduler": "wsd"}, cwd=str(sweep_cwd))
    assert best["input_bin"] == str(sweep_cwd / "data" / "t_*.bin")
    assert best["input_val_bin"] == str(sweep_cwd / "data" / "v_*.bin")
    assert best["eval_set"] == [f"held={sweep_cwd / 'data' / 'v_*.bin'}"]
    path = sweep_cwd / "runs" / "sweep" / "best_config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(best))
    command = sweep.train_command(str(path), local=True)
    assert command == f"raygpt train --config {path}"
    assert sweep.train_command("s3://b/sweep/best_config.json", local=False) == (
        "raygpt train --config FILE, FILE a local copy of s3://b/sweep/best_config.json")
    # what `raygpt train` does with it before Ray starts (cli._train), from another directory
    monkeypatch.chdir(elsewhere)
    argv = shlex.split(command)
    assert argv[:2] == ["raygpt", "train"]
    cfg = absolute_paths(parse_args(argv[2:])).resolve(0)
    preflight.check(cfg)  # finds the shards, or raises ConfigError naming the flag
    assert (cfg.input_bin, cfg.scheduler) == (str(sweep_cwd / "data" / "t_*.bin"), "wsd")
    assert cfg.output_dir == str(elsewhere / "runs" / "shakespeare")  # -o: the user's own


def test_val_curve_keeps_the_latest_record_of_each_step_and_table_format():
    recs = [{"kind": "val", "step": 0, "val_loss": 10.0}, {"kind": "train", "step": 0, "loss": 9},
            {"kind": "val", "step": 4, "val_loss": 9.0}, {"kind": "val", "step": 4, "val_loss": 8.5}]
    assert sweep.val_curve(recs) == [(0, 10.0), (4, 8.5)]
    rows = [sweep.TrialRow(name="t1", trial_id="a", status="stopped",
                           overrides={"scheduler": "wsd"}, val_loss=8.5, step=12, skips=1,
                           rewinds=0, retries=0, run_dir="", val_curve=[], val_step=10)]
    lines = sweep.format_table(rows).splitlines()
    assert lines[0].split() == ["#", "trial", "status", "config", "val_loss", "val_step", "steps",
                                "skips", "rewinds", "retries"]
    # the val loss beside the step it was measured at, the steps trained after it
    assert lines[1].split() == ["1", "t1", "stopped", "scheduler=wsd", "8.5000", "10", "12", "1",
                                "0", "0"]


def test_command_line_space_takes_the_fields_types():
    ns, rest = trials.build_sweep_parser().parse_known_args(
        ["-e", "d1", "--grid", "scheduler=cosine,wsd", "--grid", "spike.soft_z=4,6",
         "--choice", "warmup_steps=2,5", "--loguniform", "learning_rate=1e-4,1e-2", "-x", "-1"])
    base = parse_args(rest)
    assert (base.model, base.max_steps) == ("d1", -1)
    space = sweep.space_from_args(ns)
    assert space["scheduler"] == {"grid_search": ["cosine", "wsd"]}
    assert space["spike.soft_z"] == {"grid_search": [4.0, 6.0]}
    assert all(type(v) is float for v in space["spike.soft_z"]["grid_search"])
    assert space["warmup_steps"].categories == [2, 5]
    assert (space["learning_rate"].lower, space["learning_rate"].upper) == (1e-4, 1e-2)
    bad = trials.build_sweep_parser().parse_known_args(["--grid", "warmup_steps=two"])[0]
    with pytest.raises(ConfigError, match="warmup_steps: expected int, found 'two'"):
        sweep.space_from_args(bad)


# ====================================================================== the trial's trainer

def test_a_trial_runs_the_single_run_trainer_with_its_callbacks(cluster, tmp_path, monkeypatch):
    """A trial's run is the single run's own driver.run, whose TorchTrainer (build_trainer's)
    gets the trial's controller callbacks appended after the DONE/MANIFEST finalizer."""
    from raygpt.ray import driver, worker

    built = []

    class Recorder:
        def __init__(self, train_loop_per_worker, **kwargs):
            built.append((train_loop_per_worker, kwargs))

        def fit(self):
            return type("Result", (), {"metrics": {}})()

    from ray.train import UserCallback
    marker = UserCallback()
    monkeypatch.setattr(driver, "RaygptTrainer", Recorder)  # TorchTrainer with raygpt's failure policy
    cfg = tiny(output_dir=str(tmp_path / "run")).resolve(0)
    driver.run(cfg, callbacks=(marker,))
    (fn, kwargs), = built
    assert fn is worker.train_func
    assert kwargs["train_loop_config"]["cfg"] == cfg.to_dict()
    callbacks = kwargs["run_config"].callbacks
    assert isinstance(callbacks[0], driver.CheckpointFinalizer) and callbacks[-1] is marker
    # between them raygpt's preemption watcher, in place of Ray Train's own
    assert [type(c) for c in callbacks[1:-1]] == [driver.PreemptionWatcherCallback]
    assert kwargs["run_config"].failure_config.max_failures == cfg.max_failures


def test_a_compiled_runs_workers_get_the_drivers_key_outside_its_config(cluster, tmp_path,
                                                                          monkeypatch):
    """The signing key of the compiled artifacts (raygpt.artifacts.signed_file) goes to the workers in
    train_loop_config beside the config, read from this machine's key file; the config (written
    to config.json in the run directory) and the workers' environment (on Ray's dashboard)
    do not hold it."""
    from raygpt.artifacts import signed_file
    from raygpt.ray import driver

    built = []

    class Recorder:
        def __init__(self, train_loop_per_worker, **kwargs):
            built.append(kwargs)

        def fit(self):
            return type("Result", (), {"metrics": {}})()

    monkeypatch.setattr(driver, "RaygptTrainer", Recorder)
    monkeypatch.setenv(signed_file.KEY_ENV, str(tmp_path / "artifact.key"))
    cfg = tiny(output_dir=str(tmp_path / "run"), compile=True).resolve(0)
    driver.run(cfg)
    [kwargs] = built
    secret = signed_file.load_or_create_key().secret
    assert kwargs["train_loop_config"]["artifact_key"].secret == secret
    stored = json.dumps([kwargs["train_loop_config"]["cfg"], kwargs["run_config"].worker_runtime_env],
                        default=str) + (tmp_path / "run" / "config.json").read_text()
    assert secret.hex() not in stored and "artifact_key" not in stored


def test_the_sweep_hands_every_trial_its_drivers_key_outside_the_plan(tmp_path, monkeypatch):
    """Tune may place a trial's driver on any node: each gets the sweep driver's key through
    with_parameters (Ray's object store), not its node's own, and the plan (sweep.json) does
    not hold it."""
    from raygpt.artifacts import signed_file

    class Stop(Exception):
        pass

    given = {}

    def with_parameters(trainable, **kwargs):
        given.update(kwargs)
        raise Stop

    monkeypatch.setattr(sweep_tune.tune, "with_parameters", with_parameters)
    monkeypatch.setenv(signed_file.KEY_ENV, str(tmp_path / "artifact.key"))
    base = tiny(output_dir=str(tmp_path / "base"), compile=True).resolve(0)
    plan = sweep.SweepPlan(sweep_dir=str(tmp_path / "sweep"), mode="grid",
                           user_base=base.to_dict(), base=base.to_dict(),
                           settings={"max_concurrent": 1},
                           trials=[{"name": "trial_000", "overrides": {"learning_rate": 1e-3}}])
    with pytest.raises(Stop):
        sweep._fit(plan, ["trial_000"], experiment=sweep.TUNE_DIR, command_line={})
    secret = signed_file.load_or_create_key().secret
    assert given["artifact_key"].secret == secret
    assert secret.hex() not in json.dumps(given["plan"]) and "artifact_key" not in given["plan"]


def test_an_existing_sweep_is_never_started_over_silently(cluster, tmp_path):
    from raygpt.storage.ownership import write_marker
    write_marker(open_run_dir(str(tmp_path)), "sweep")  # what a sweep's driver writes first
    sweep.write_plan(open_run_dir(str(tmp_path)), sweep.SweepPlan(
        sweep_dir=str(tmp_path), mode="grid", user_base={}, base={}))
    with pytest.raises(ConfigError, match="found an existing sweep; pass -y 1 to resume it"):
        sweep.run_sweep(tiny(), {"scheduler": tune.grid_search(KINDS)}, str(tmp_path))
    with pytest.raises(ConfigError, match="final_lr_frac"):
        sweep.run_wsd_branches(tiny(), [10, 20], str(tmp_path / "b"),
                               space={"final_lr_frac": tune.grid_search([0.0, 0.1])})
    assert not (tmp_path / "b").exists()  # refused before anything was written or trained


def test_graceful_asha_asks_the_run_to_stop_instead_of_stopping_the_trial(cluster):
    from raygpt.ray.worker import RunControl

    class Trial:  # what ASHA reads of a Tune trial
        def __init__(self, trial_id):
            self.trial_id = trial_id

    asha = sweep.GracefulASHA(time_attr="step", max_t=12, grace_period=4, reduction_factor=2,
                              metric="val_loss", mode="min")
    good, bad, no_run, last = (Trial(f"t{i}-{os.getpid()}") for i in range(4))
    for t in (good, bad, no_run, last):
        asha.on_trial_add(None, t)
    controls = {t: RunControl.options(name=sweep.trial_control_name(t.trial_id)).remote()
                for t in (good, bad, last)}
    try:
        assert asha.on_trial_result(None, good, {"step": 4, "val_loss": 1.0}) == asha.CONTINUE
        # ASHA stops `bad` at the first rung; the trial goes on, its run is asked to stop
        assert asha.on_trial_result(None, bad, {"step": 4, "val_loss": 5.0}) == asha.CONTINUE
        assert ray.get(controls[bad].poll.remote()) == (True, 0)
        assert ray.get(controls[good].poll.remote()) == (False, 0)
        assert asha.on_trial_result(None, bad, {"step": 8, "val_loss": 0.1}) == asha.CONTINUE
        assert asha.stopping == {bad.trial_id}
        # no run to ask (yet): nothing is recorded as stopping, so the next result asks again
        assert asha.on_trial_result(None, no_run, {"step": 4, "val_loss": 9.0}) == asha.CONTINUE
        assert no_run.trial_id not in asha.stopping
        # ASHA's STOP at max_t is the run ending on its own: no request
        assert asha.on_trial_result(None, last, {"step": 12, "val_loss": 1.0}) == asha.CONTINUE
        assert ray.get(controls[last].poll.remote()) == (False, 0)
    finally:
        for c in controls.values():
            ray.kill(c)


# ====================================================================== real sweeps

def test_scheduler_sweep_ranks_four_trials_on_two_cores(cluster, tmp_path, capsys):
    # checkpoints only at the end (or where ASHA stops a run): fewer bytes on 2 busy cores
    report = sweep.run_sweep(tiny(checkpoint_every=0), {"scheduler": tune.grid_search(KINDS)},
                             str(tmp_path / "s"), grace_period=4)
    assert report.max_concurrent == 2  # 2 CPUs, 1 CPU worker per trial
    rows = report.rows
    assert sorted(r.overrides["scheduler"] for r in rows) == sorted(KINDS)
    losses = [r.val_loss for r in rows]
    assert all(math.isfinite(v) for v in losses) and losses == sorted(losses)
    assert report.best.status == "done"
    spans = []
    for r in rows:
        assert r.run_dir == str(tmp_path / "s" / "trials" / r.name)
        run = open_run_dir(r.run_dir)
        assert run.exists("main.log") and run.exists("loss_history.jsonl")
        recs = records(r.run_dir)
        assert r.val_curve == sweep.val_curve(recs) and r.val_curve[0][0] == 0
        end = [x for x in recs if x["kind"] == "end"][-1]
        assert r.status in ("done", "stopped"), r
        if r.status == "done":
            assert end["step"] == r.step == 12 and r.val_curve[-1][0] == 12
        else:  # ASHA's stop is a checkpoint-and-stop request, not a kill
            assert end["stopped_early"] and r.step < 12
        assert ck.find_latest_verified(run) == end["step"]
        spans.append((recs[0]["time"], recs[-1]["time"]))
        # config.json as a single run writes it: this trial's config, the sweep's command line
        launch = json.loads((Path(r.run_dir) / "config.json").read_text())
        assert launch["launch"] == 1 and launch["config"]["scheduler"] == r.overrides["scheduler"]
        # a trial's first attempt starts fresh (no "-y 1: no verified checkpoint" line)
        assert launch["config"]["output_dir"] == r.run_dir and launch["config"]["resume"] == 0
        # results.txt's val loss is the one measured at val_step, whatever the run trained after
        assert (r.val_step, r.val_loss) == r.val_curve[-1] and r.val_step <= r.step
        assert launch["command"]["argv"] == list(getattr(sys, "orig_argv", sys.argv))
        assert launch["plan"][0].startswith("train: ")
    # never more trials training at once than the 2 cores' worth of workers
    for t, _ in spans:
        assert sum(1 for a, b in spans if a <= t <= b) <= 2
    # the table on disk, the best config through the CLI, the plot
    assert (tmp_path / "s" / "results.txt").read_text().strip() == report.table
    assert report.table.splitlines()[1].split()[1] == rows[0].name
    for line in report.table.splitlines()[1:]:
        row = next(r for r in rows if r.name == line.split()[1])
        assert line.split()[5:7] == [str(row.val_step), str(row.step)]
    # the sweep's console: each trial with its hyperparameters, no "-y 1" line for a fresh trial,
    # none of Tune's own table ("Logical resource usage: 0/2 CPUs") or banners
    printed = capsys.readouterr().out
    for r in rows:
        assert f"raygpt sweep | {r.name} (scheduler={r.overrides['scheduler']}) | started" in printed
        assert (f"raygpt sweep | {r.name} (scheduler={r.overrides['scheduler']}) | step "
                f"{r.val_curve[0][0]} | val loss {r.val_curve[0][1]:.4f}") in printed
    assert "no verified checkpoint" not in printed and "Logical resource usage" not in printed
    assert "started with configuration" not in printed and "Trial status:" not in printed
    # `raygpt status` on the sweep directory: the same table, read back from what is on disk
    assert cli_main(["status", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out.splitlines()
    counts = Counter(r.status for r in rows)
    assert out[0] == (f"sweep {tmp_path / 's'} | mode grid | 4 trial(s): "
                      + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    assert "\n".join(out[1:6]) == report.table
    # `raygpt plot` on it draws what the sweep's end drew (val_loss.png), byte for byte
    assert cli_main(["plot", str(tmp_path / "s"), "-o", str(tmp_path / "again.png")]) == 0
    assert capsys.readouterr().out.strip() == f"raygpt plot: wrote {tmp_path / 'again.png'} (4 trial(s))"
    assert (tmp_path / "again.png").read_bytes() == Path(report.plot_path).read_bytes()
    best = parse_args(["--config", report.best_config_path]).resolve(0)
    assert best.scheduler == report.best.overrides["scheduler"]
    manifest = ck.read_manifest(open_run_dir(report.best.run_dir), 12)
    assert json.loads(json.dumps(best.identity())) == manifest["config_identity"]
    assert Path(report.plot_path).read_bytes()[:8] == PNG_MAGIC
    # finished and early-stopped trials gave back every CPU (no leaked placement group)
    wait_for(all_cpus_free, 30, "the trials' CPUs to be free again")


def test_tune_does_not_rerun_a_trial_raygpt_stopped_but_reruns_a_killed_one(cluster, tmp_path):
    """One trial, two real faults, --max-failures 0 (so each worker fault ends its Ray Train
    run) and 2 Tune retries. Its worker is SIGKILLed at step 5 (or later, once checkpoint 2 is
    complete): a fault a restart cures, so Tune re-runs the trial, which resumes from its
    checkpoint. At step 8 the re-run meets a bad input (a ShardError, as a shard that changed
    under the loader raises): that error would recur, so Tune does not re-run it again, although
    retries are left (a third attempt would pass: the fault fires once per run directory).

    Both faults wait for checkpoint 2's DONE (after=2): a worker killed before Ray's controller
    took its checkpoint's report leaves that checkpoint without DONE, so without the gate the
    re-run could start from scratch on a slow machine; and since the kill is checked first at
    every step, the bad input can never come before it."""
    base = tiny(max_steps=12, checkpoint_every=2, val_every=4, max_failures=0,
                fault="kill:rank=0,step=5,after=2;bad_input:rank=0,step=8,after=2")
    report = sweep.run_sweep(base, {"scheduler": tune.grid_search(["cosine"])},
                             str(tmp_path / "s"), early_stop="none", trial_retries=2)
    (row,) = report.rows
    assert report.best is None
    run = Path(row.run_dir)
    kill, bad = (json.loads((run / "faults" / name).read_text())
                 for name in ("kill_r0_s5", "bad_input_r0_s8"))
    assert (row.status, row.stopped, row.retries) == ("error", 2, 1), report.table
    assert "InjectedBadInput" in row.error
    assert f"injected bad input at step {bad['at_step']}" in row.error
    recs = records(run)
    assert sorted({r["attempt"] for r in recs if r["kind"] == "train"}) == [1, 2]  # no third
    assert kill["at_step"] >= 5 and train_steps(recs, attempt=1) == list(range(kill["at_step"]))
    resume = [r for r in recs if r["kind"] == "resume"]
    assert len(resume) == 1 and 2 <= resume[0]["resumed_from"] <= kill["at_step"], resume
    assert bad["at_step"] == max(8, resume[0]["resumed_from"])
    assert train_steps(recs, attempt=2) == list(range(resume[0]["resumed_from"], bad["at_step"]))
    entry = sweep.read_ledger(open_run_dir(str(tmp_path / "s")))[row.name]
    assert (entry["status"], entry["failures"], entry["stopped"]) == ("error", 2, 2)
    # each Tune attempt recorded its launch, the sweep's command line in both
    launches = [json.loads((run / name).read_text()) for name in ("config.1.json", "config.json")]
    assert [x["launch"] for x in launches] == [1, 2]
    assert all(x["config"]["scheduler"] == "cosine" and x["config"]["fault"] == base.fault
               for x in launches)
    assert "resume: step " in " ".join(launches[1]["plan"])  # the re-run checked its checkpoint
    wait_for(all_cpus_free, 30, "the trial's CPUs to be free again")


@pytest.fixture(scope="module")
def interrupted_sweep(cluster, tmp_path_factory):
    """One sweep, two faults. The sweep runs from the command line (its own driver process, on
    the same Ray) with trials of 8 and 40 steps and --max-failures 0. The 40-step trial's worker
    is SIGKILLed at step 10 (or later, once checkpoint 4 is complete: a checkpoint Ray's
    controller had not yet taken from a killed worker has no DONE), so its Ray Train run fails
    and Tune re-runs the trial. Once the
    8-step trial has finished and the re-run is training, the driver itself is SIGKILLed; then
    Tune's state files are replaced by pickles whose loading would create a file (what anyone who
    can write the sweep directory could plant), and resume_sweep continues the sweep in this
    process without opening them. Returns what the tests below compare."""
    sweep_dir = tmp_path_factory.mktemp("interrupted") / "s"
    cmd = [sys.executable, str(REPO / "experiments" / "sweep_shakespeare.py"),
           "-e", "d1", "-b", "4", "-t", "32", "-u", "2", "-v", "4", "-m", "1", "-s", "0",
           "-n", "4", "--num-workers", "1", "--log-every", "1000", "-o", str(sweep_dir),
           "--grid", "max_steps=8,40", "--early-stop", "none", "--max-failures", "0",
           "--trial-retries", "1", "--fault", "kill:rank=0,step=10,after=4", "--address", cluster]
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    log_path = sweep_dir.parent / "driver.log"
    with open(log_path, "wb") as log:
        driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

        def short_done_long_rerun_training():
            assert driver.poll() is None, log_path.read_text()[-3000:]
            try:
                rows = sweep.collect_rows(str(sweep_dir))
            except ConfigError:  # sweep.json not written yet
                return None
            status = {r.overrides["max_steps"]: (r.name, r.status) for r in rows}
            if status[8][1] != "done" or status[40][1] in ("done", "stopped"):
                return None
            long_dir = sweep_dir / "trials" / status[40][0]
            if not (long_dir / "loss_history.jsonl").exists():
                return None
            rerun = [r for r in records(long_dir) if r["kind"] == "train" and r["attempt"] == 2]
            return (status[8][0], status[40][0]) if rerun else None

        short, long = wait_for(short_done_long_rerun_training, 300,
                               "the 8-step trial done and the 40-step trial re-run and training")
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    # Ray ends a dead driver's actors; their CPUs coming back means no old worker still writes
    wait_for(all_cpus_free, 60, "the dead driver's trials to be gone")
    short_history = (sweep_dir / "trials" / short / "loss_history.jsonl").read_bytes()
    long_before = records(sweep_dir / "trials" / long)
    status_before = sweep.sweep_status(str(sweep_dir))  # `raygpt status` of the dead sweep
    marker = sweep_dir.parent / "pwned"
    payload = pickle.dumps(CreatesFile(marker))
    tune_dir = sweep_dir / "tune"
    for state in [*tune_dir.glob("experiment_state-*.json")]:
        state.write_text(json.dumps({"trial_data": {"_type": "CLOUDPICKLE_FALLBACK",
                                                    "value": payload.hex()}}))
    for pkl in [tune_dir / "tuner.pkl", *tune_dir.glob("*/params.pkl")]:
        pkl.write_bytes(payload)
    report = sweep.resume_sweep(str(sweep_dir))
    return dict(sweep_dir=sweep_dir, short=short, long=long, short_history=short_history,
                long_before=long_before, status_before=status_before, report=report,
                pickle_loaded=marker.exists())


class CreatesFile:
    """Unpickling this creates `path`: a stand-in for any code a planted pickle would run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_killed_trial_is_rerun_by_tune_from_its_checkpoint(interrupted_sweep):
    s = interrupted_sweep
    long_dir = s["sweep_dir"] / "trials" / s["long"]
    kill = json.loads((long_dir / "faults" / "kill_r0_s10").read_text())  # the kill did happen
    row = next(r for r in s["report"].rows if r.name == s["long"])
    assert row.retries == 1  # Tune re-ran the failed trial once
    recs = records(long_dir)
    # killed before step at_step's update (10, or the first step after it with DONE_4)
    assert kill["at_step"] >= 10 and train_steps(recs, attempt=1) == list(range(kill["at_step"]))
    resume = [r for r in recs if r["kind"] == "resume" and r["attempt"] == 2]
    assert len(resume) == 1 and resume[0]["resumed_from"] in range(4, kill["at_step"] + 1, 4), \
        resume  # not from scratch
    steps = train_steps(recs, attempt=2)
    assert steps[0] == resume[0]["resumed_from"] and steps == list(range(steps[0], steps[-1] + 1))


def test_sweep_resumes_after_its_driver_is_killed(interrupted_sweep):
    s = interrupted_sweep
    assert not s["pickle_loaded"]  # the planted Tune state was never opened
    assert (s["sweep_dir"] / "tune.2").is_dir()  # a new Tune experiment over the unfinished trial
    # before the resume, `raygpt status` read the dead sweep's state: both trials, one done
    # (the ledger holds the re-run trial as running, or pending if it died before starting)
    head, _, *table, _ = s["status_before"].splitlines()
    status = {line.split()[1]: line.split()[2] for line in table}
    assert set(status) == {s["short"], s["long"]} and status[s["short"]] == "done", table
    assert head.endswith(f"2 trial(s): 1 done, 1 {status[s['long']]} (as of now: no results.txt "
                         f"yet)") and status[s["long"]] in ("pending", "running"), head
    short_dir, long_dir = (s["sweep_dir"] / "trials" / s[k] for k in ("short", "long"))
    # the finished trial was not run again: not one record added to its history
    assert (short_dir / "loss_history.jsonl").read_bytes() == s["short_history"]
    rows = {r.name: r for r in s["report"].rows}
    assert set(rows) == {s["short"], s["long"]}
    assert all(r.status == "done" for r in rows.values()), s["report"].table
    assert rows[s["short"]].step == 8 and rows[s["long"]].step == 40
    # the interrupted trial continued from a checkpoint after the restore, not from scratch
    rerun_from = next(r["resumed_from"] for r in s["long_before"] if r["kind"] == "resume")
    new = records(long_dir)[len(s["long_before"]):]
    resume = [r for r in new if r["kind"] == "resume"]
    assert len(resume) == 1 and resume[0]["resumed_from"] >= rerun_from > 0, resume
    assert train_steps(new) == list(range(resume[0]["resumed_from"], 40))
    assert ck.find_latest_verified(open_run_dir(str(long_dir))) == 40
    wait_for(all_cpus_free, 30, "the trials' CPUs to be free again")


def test_wsd_branches_start_at_the_shared_stable_checkpoint(cluster, tmp_path):
    base = tiny(scheduler="wsd")
    report = sweep.run_wsd_branches(base, [15, 10], str(tmp_path / "s"))
    plan = sweep.read_plan(open_run_dir(str(tmp_path / "s")))
    S = plan.shared_step
    assert S == 8 and plan.stable_max_steps == 10
    stable = open_run_dir(str(tmp_path / "s" / "stable"))
    stable_recs = records(stable.root)
    assert train_steps(stable_recs)[:S] == list(range(S))  # the stable phase, trained once
    assert {r.overrides["max_steps"] for r in report.rows} == {10, 15}
    lr = {}
    for r in report.rows:
        N = r.overrides["max_steps"]
        assert r.status == "done" and r.step == N
        recs = records(r.run_dir)
        assert recs[0]["kind"] == "resume" and recs[0]["resumed_from"] == S
        assert train_steps(recs) == list(range(S, N))  # nothing before S trained again
        run = open_run_dir(r.run_dir)
        name = f"{ck.step_dir(S)}/{ck.MANIFEST}"
        assert run.read_bytes(name) == stable.read_bytes(name)
        peak = 1e-3  # the CPU default learning rate
        for x in (x for x in recs if x["kind"] == "train"):
            assert x["lr"] == learning_rate("wsd", x["step"], peak_lr=peak, warmup_steps=2,
                                            total_steps=N, final_lr_frac=0.1), (N, x["step"])
        lr[N] = {x["step"]: x["lr"] for x in recs if x["kind"] == "train"}
    assert lr[15][9] == lr[15][8] == lr[10][8] > lr[10][9]  # 15 still stable at 9, 10 decaying
    assert Path(report.plot_path).read_bytes()[:8] == PNG_MAGIC
    wait_for(all_cpus_free, 30, "the trials' CPUs to be free again")
