"""A sweep directory is shared storage: whoever can write a file in it must not run code, arm
faults or choose servers as the user who runs or reads the sweep (raygpt.ray.sweep, raygpt.config).

Every sweep directory here is built by hand (sweep.json, ledger.json, the trials' loss
histories) and no Ray starts: Tune's own files are planted as the attack (pickles whose loading
would create a file), and `raygpt status`, `raygpt plot` and the resume path must never open them.
"""

from __future__ import annotations

import json
import pickle

import pytest

from raygpt.cli import main as cli_main
from raygpt.config import ConfigError, TrainConfig, parse_args
from raygpt.ray import sweep, sweep_tune, trials
from raygpt.storage import ownership
from raygpt.storage import open_run_dir


class CreatesFile:
    """Unpickling this creates `path` (the harmless stand-in for running `id`)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def tiny(**overrides) -> TrainConfig:
    base = dict(model="d1", batch_size=4, seq_len=32, max_steps=12, warmup_steps=2, val_every=4,
                val_batches=1, sample_every=0, checkpoint_every=4, num_workers=1, device="cpu")
    base.update(overrides)
    return TrainConfig(**base)


def write_history(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "loss_history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def hand_built_sweep(tmp_path, *, finished=True):
    """A two-trial sweep as raygpt leaves it: trial_000 done at step 12, trial_001 stopped early
    by ASHA at step 8 (or, unless `finished`, interrupted at step 8 with no end record)."""
    d = tmp_path / "s"
    ownership.write_marker(open_run_dir(str(d)), "sweep")  # raygpt made it, for this user
    items = [{"name": "trial_000", "overrides": {"scheduler": "cosine"}},
             {"name": "trial_001", "overrides": {"scheduler": "wsd"}}]
    sweep.write_plan(open_run_dir(str(d)), sweep.SweepPlan(
        sweep_dir=str(d), mode="grid", user_base=tiny().to_dict(), base=tiny().to_dict(),
        settings={"num_samples": 1, "early_stop": "asha", "max_t": 12, "trial_retries": 2,
                  "reduction_factor": 2.0, "max_concurrent": 1, "grace_period": 4},
        trials=items))
    val = lambda step, loss: {"kind": "val", "step": step, "val_loss": loss}  # noqa: E731
    write_history(d / "trials" / "trial_000", [
        {"kind": "start", "step": 0}, val(0, 4.0), val(4, 3.0), val(8, 2.5), val(12, 2.0),
        {"kind": "end", "step": 12, "stopped_early": False, "skips": 1, "rewinds": 0}])
    second = [{"kind": "start", "step": 0}, val(0, 4.0), val(4, 3.5), val(8, 3.2)]
    if finished:
        second.append({"kind": "end", "step": 8, "stopped_early": True, "skips": 0, "rewinds": 0})
    write_history(d / "trials" / "trial_001", second)
    entries = {"trial_000": {**sweep.ledger_entry("terminated"), "trial_id": "a1"},
               "trial_001": {**sweep.ledger_entry("terminated" if finished else "running"),
                             "failures": 1, "trial_id": "b2"}}
    sweep.write_ledger(open_run_dir(str(d)), entries)
    return d


def plant_tune_pickles(sweep_dir, marker):
    """Tune's state files, each crafted to create `marker` when loaded: tuner.pkl (cloudpickle),
    experiment_state-*.json (JSON that embeds a cloudpickle, which ExperimentAnalysis and
    Tuner.restore expand), basic-variant-state-*.json (a cloudpickle despite its name), and a
    trial's params.pkl / error.pkl."""
    payload = pickle.dumps(CreatesFile(marker))
    tune_dir = sweep_dir / "tune"
    (tune_dir / "trial_000").mkdir(parents=True, exist_ok=True)
    (tune_dir / "tuner.pkl").write_bytes(payload)
    (tune_dir / "experiment_state-2026-12-03_00-00-00.json").write_text(json.dumps(
        {"trial_data": {"_type": "CLOUDPICKLE_FALLBACK", "value": payload.hex()},
         "runner_data": {}}))
    (tune_dir / "basic-variant-state-2026-12-03_00-00-00.json").write_bytes(payload)
    for name in ("params.pkl", "error.pkl"):
        (tune_dir / "trial_000" / name).write_bytes(payload)
    (tune_dir / "trial_000" / "params.json").write_text(json.dumps({"trial": "trial_000"}))


def test_status_and_plot_read_json_only_never_tunes_pickles(tmp_path, capsys):
    d = hand_built_sweep(tmp_path)
    marker = tmp_path / "pwned"
    plant_tune_pickles(d, marker)
    assert cli_main(["status", str(d)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"sweep {d} | mode grid | 2 trial(s): 1 done, 1 stopped "
                      f"(as of now: no results.txt yet)")
    assert out[2].split() == ["1", "trial_000", "done", "scheduler=cosine", "2.0000", "12", "12",
                              "1", "0", "0"]
    assert out[3].split() == ["2", "trial_001", "stopped", "scheduler=wsd", "3.2000", "8", "8",
                              "0", "0", "1"]
    pytest.importorskip("matplotlib")
    assert cli_main(["plot", str(d), "-o", str(tmp_path / "p.png")]) == 0
    assert capsys.readouterr().out.strip() == f"raygpt plot: wrote {tmp_path / 'p.png'} (2 trial(s))"
    assert not marker.exists()


def test_plot_replaces_a_link_planted_at_the_sweeps_png_never_its_target(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    d = hand_built_sweep(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (d / sweep.PLOT).symlink_to(victim)
    assert cli_main(["plot", str(d)]) == 0
    assert victim.read_text() == "precious"
    assert not (d / sweep.PLOT).is_symlink()
    assert (d / sweep.PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_restores_nothing_of_tunes_and_runs_only_unfinished_trials(tmp_path, monkeypatch):
    """-y 1 over a sweep whose trials all finished: no Tune experiment, no pickle opened, the
    results written from JSON. Over one with an interrupted trial: a new Tune experiment
    (tune.2/) over that trial alone, ASHA's rungs rebuilt from both trials' curves."""
    d = hand_built_sweep(tmp_path)
    marker = tmp_path / "pwned"
    plant_tune_pickles(d, marker)
    monkeypatch.setattr(sweep_tune, "_ensure_ray", lambda address: None)
    report = sweep.resume_sweep(str(d))
    assert [r.name for r in report.rows] == ["trial_000", "trial_001"]
    assert report.best.name == "trial_000" and (d / "results.txt").exists()
    assert not marker.exists()

    d2 = hand_built_sweep(tmp_path / "b", finished=False)
    plant_tune_pickles(d2, marker)
    fits = []
    monkeypatch.setattr(sweep_tune, "_fit", lambda plan, names, **kw: fits.append((names, kw)))
    sweep.resume_sweep(str(d2), command_line={"fault": "kill:rank=0,step=9"})
    ((names, kw),) = fits
    assert names == ["trial_001"] and kw["experiment"] == "tune.2"
    assert kw["command_line"] == {"fault": "kill:rank=0,step=9"}
    assert kw["replay"] == {"trial_000": [(0, 4.0), (4, 3.0), (8, 2.5), (12, 2.0)],
                            "trial_001": [(0, 4.0), (4, 3.5), (8, 3.2)]}
    assert not marker.exists()

    # a trial Tune gave up on stays an error, unless --retry-errored: then it runs with a clean
    # verdict and its failures still counted
    ledger = sweep.read_ledger(open_run_dir(str(d2)))
    ledger["trial_001"].update(status="error", failures=3, stopped=2, error="bad input")
    sweep.write_ledger(open_run_dir(str(d2)), ledger)
    assert sweep.collect_rows(str(d2))[1].status == "error"
    fits.clear()
    sweep.resume_sweep(str(d2))
    assert fits == []  # nothing to run: the results are written from what there is
    sweep.resume_sweep(str(d2), retry_errored=True)
    ((names, kw),) = fits
    assert names == ["trial_001"] and kw["ledger"]["trial_001"] == {
        "status": "pending", "failures": 3, "stopped": None, "error": "", "trial_id": "b2"}


def test_resume_of_a_sweep_that_is_not_this_users_is_refused_unread(tmp_path, monkeypatch):
    """-y 1 over a sweep directory raygpt did not mark (or whose marker is another user's) is
    one line; nothing in it is read as a plan, written, or leased."""
    d = hand_built_sweep(tmp_path)
    (d / ownership.MARKER).unlink()
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    monkeypatch.setattr(sweep_tune, "_ensure_ray", lambda address: pytest.fail("Ray started"))
    with pytest.raises(ownership.RunDirRefused, match="expected an empty or new sweep directory"):
        sweep.resume_sweep(str(d))
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before
    marker = ownership.write_marker(open_run_dir(str(d)), "sweep")
    (d / ownership.MARKER).write_text(json.dumps({**marker, "uid": marker["uid"] + 1}))
    with pytest.raises(ownership.RunDirRefused, match="not"):
        sweep.resume_sweep(str(d))
    assert not (d / ownership.LEASE).exists()


def test_asha_replay_rebuilds_the_rungs_by_trial_name():
    asha = sweep.GracefulASHA(time_attr="step", max_t=12, grace_period=4, reduction_factor=2,
                              metric="val_loss", mode="min")
    asha.replay({"trial_000": [(0, 4.0), (4, 3.0), (8, 2.5)], "trial_001": [(4, 3.5)]})
    rungs = {milestone: recorded for milestone, recorded in asha._brackets[0]._rungs}
    assert rungs[4] == {"trial_000": -3.0, "trial_001": -3.5}  # ASHA records -loss for "min"
    assert rungs[8] == {"trial_000": -2.5}


@pytest.mark.parametrize("field, value, flag", [
    ("fault", "kill:rank=0,step=1", "--fault"),
    ("allow_fault_injection", True, "--allow-fault-injection"),
    ("storage_endpoint", "http://attacker:9000", "--storage-endpoint"),
    ("mlflow", "http://attacker:5000", "--mlflow")])
@pytest.mark.parametrize("which", ["base", "user_base"])
def test_a_sweep_json_that_arms_faults_or_picks_servers_is_refused(tmp_path, capsys, field,
                                                                    value, flag, which):
    d = hand_built_sweep(tmp_path)
    plan = json.loads((d / "sweep.json").read_text())
    plan[which][field] = value
    (d / "sweep.json").write_text(json.dumps(plan))
    expected = (f"{d / 'sweep.json'}: {which}: {field}: expected "
                f"{getattr(TrainConfig(), field)!r} (only the command line sets it: {flag}), "
                f"found {value!r}")
    with pytest.raises(ConfigError) as e:
        sweep.resume_sweep(str(d))
    assert str(e.value) == expected
    assert cli_main(["status", str(d)]) == 2
    err = capsys.readouterr().err
    assert err == f"raygpt status: error: {expected}\n"


@pytest.mark.parametrize("trial, match", [
    ({"name": "../../escape", "overrides": {"scheduler": "wsd"}}, r"trials\[1\]: name: expected"),
    ({"name": "trial_001", "overrides": {"fault": "kill:step=1"}}, r"trials\[1\] \(trial_001\): "
                                                                    r"search space key 'fault'"),
    ({"name": "trial_001", "overrides": {"storage_endpoint": "http://x"}}, "'storage_endpoint'"),
    ({"name": "trial_001", "overrides": {"max_steps": "12"}}, "max_steps: expected int"),
    ({"name": "trial_000", "overrides": {"scheduler": "wsd"}}, "expected a new name")])
def test_a_sweep_json_trial_that_escapes_or_arms_its_run_is_refused(tmp_path, trial, match):
    d = hand_built_sweep(tmp_path)
    plan = json.loads((d / "sweep.json").read_text())
    plan["trials"][1] = trial
    (d / "sweep.json").write_text(json.dumps(plan))
    with pytest.raises(ConfigError, match=match):
        sweep.collect_rows(str(d))


def test_damaged_ledger_and_history_are_one_line_or_one_row(tmp_path, capsys):
    d = hand_built_sweep(tmp_path)
    # a history line that is JSON but not a val record raygpt wrote: left out, not a traceback
    with open(d / "trials" / "trial_001" / "loss_history.jsonl", "a") as f:
        f.write('{"kind": "val", "step": "x", "val_loss": [1]}\n{torn\n')
    assert [r.val_curve[-1] for r in sweep.collect_rows(str(d))] == [(12, 2.0), (8, 3.2)]
    (d / "ledger.json").write_text(json.dumps({"format": "raygpt-sweep-ledger", "version": 1,
                                               "trials": {"trial_000": {"status": "exec"}}}))
    capsys.readouterr()  # the torn line's warning
    assert cli_main(["status", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"raygpt status: error: {d / 'ledger.json'}: trials.trial_000: "
                          f"expected an entry like") and err.count("\n") == 1


def test_a_config_file_may_not_choose_the_storage_endpoint_or_mlflow_server(tmp_path):
    for field, value in (("storage_endpoint", "http://attacker:9000"),
                         ("mlflow", "http://attacker:5000")):
        path = tmp_path / "cfg.json"
        path.write_text(json.dumps({"scheduler": "wsd", field: value}))
        with pytest.raises(ConfigError, match=rf"--config {path}: may not set \['{field}'\]"):
            parse_args(["--config", str(path), "-o", "s3://bucket/run"])


def test_best_config_leaves_out_what_a_config_file_may_not_set(tmp_path):
    user = tiny(storage_endpoint="http://minio:9000", mlflow=str(tmp_path / "m"),
                fault="kill:rank=0,step=3")
    best = sweep.best_config(user, {"scheduler": "wsd"})
    assert not set(best) & set(trials.PLACEMENT_FIELDS) and best["scheduler"] == "wsd"
    path = tmp_path / "best.json"
    path.write_text(json.dumps(best))
    assert parse_args(["--config", str(path)]).scheduler == "wsd"


def test_expanded_trials_are_concrete_stable_and_seeded():
    from ray import tune
    space = {"scheduler": tune.grid_search(["cosine", "wsd"]),
             "learning_rate": tune.loguniform(1e-4, 1e-2), "warmup_steps": tune.choice([2, 5]),
             "spike.hard_z": 30.0}
    got = trials.expand_trials(space, 2, seed=7)
    assert [t["name"] for t in got] == ["trial_000", "trial_001", "trial_002", "trial_003"]
    assert [t["overrides"]["scheduler"] for t in got] == ["cosine", "wsd", "cosine", "wsd"]
    assert all(1e-4 <= t["overrides"]["learning_rate"] <= 1e-2
               and type(t["overrides"]["learning_rate"]) is float
               and t["overrides"]["warmup_steps"] in (2, 5) for t in got)
    assert got == trials.expand_trials(space, 2, seed=7) != trials.expand_trials(space, 2, seed=8)
    json.dumps(got)  # stored in sweep.json as it is
    trials.check_trials(tiny(), got, "sweep.json: trials")
    with pytest.raises(ConfigError, match="'learning_rate': expected a grid, a choice"):
        trials.expand_trials({"learning_rate": tune.sample_from(lambda _: 1e-3)}, 1, seed=0)
