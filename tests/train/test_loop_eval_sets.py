"""--eval-set in a real run (LocalSession, no Ray, a d2 model, CPU): two named sets evaluated
at -j's steps, each loss equal to `evaluate` computed independently on its shards with the
weights of that step; the run's own figures (train losses, norms, -j's validation, the weights,
main.log) bit-equal to the same run without sets; each set in the history, TensorBoard, the
trackers, `raygpt status` and `raygpt plot`, and not in main.log or Ray's reports."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raygpt.config import DEFAULT_TRAIN, DEFAULT_VAL
from raygpt.data.loader import DistributedDataLoader
from raygpt.runlog import tracking
from raygpt.runlog.mainlog import read_main_log
from raygpt.runlog.report import load_run, plot_run, run_status
from raygpt.runlog.tensorboard import read_scalars
from raygpt.train import loop
from raygpt.train.optim import FlatParameters
from tests.train.test_loop_wiring import (RecordingSession, checkpoint_params, console_lines,
                                          history, reference_model, wiring_config)

SETS = [f"shakes_train={DEFAULT_TRAIN}", f"val_again={DEFAULT_VAL}"]
STEPS_EVALUATED = [0, 2, 3]  # -v 2 and the last step (wiring_config: -x 3)


def _run(run_dir, **overrides):
    cfg = wiring_config(run_dir, **overrides)
    session = RecordingSession(run_dir)
    logged = []
    real_log = tracking.Trackers.log

    def recording_log(self, step, metrics):
        logged.append((step, dict(metrics)))
        return real_log(self, step, metrics)

    with pytest.MonkeyPatch.context() as mp, console_lines() as lines:
        mp.setattr(tracking.Trackers, "log", recording_log)
        summary = loop.train(cfg, session)
    return dict(cfg=cfg, run_dir=run_dir, summary=summary, metrics=session.metrics,
                tracked=logged, console="\n".join(lines))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return dict(plain=_run(tmp_path_factory.mktemp("plain")),
                sets=_run(tmp_path_factory.mktemp("sets"), eval_set=list(SETS)))


def weights_at(run, step):
    """A model with the run's weights at `step` (fresh GPT-2 init at 0, else its checkpoint)."""
    model = reference_model(run["cfg"])
    if step > 0:
        flat = FlatParameters(model, torch.device("cpu"), torch.float32)
        params, _ = checkpoint_params(run["run_dir"], step)
        flat.params[:flat.num_parameters].copy_(torch.from_numpy(params))
    return model


def independent_loss(run, step, pattern):
    cfg = run["cfg"]
    loader = DistributedDataLoader(pattern, cfg.val_batch_size, cfg.seq_len, 0, 1,
                                   shuffle=False, seed=cfg.seed)
    return loop.evaluate(weights_at(run, step), loader, cfg, torch.device("cpu"), 1)


def set_losses(run_dir) -> dict[str, dict[int, float]]:
    out = {}
    for r in history(run_dir, "eval_set"):
        out.setdefault(r["name"], {})[r["step"]] = r["val_loss"]
    return out


def test_each_set_is_evaluate_on_its_shards_at_the_validation_steps(runs):
    run = runs["sets"]
    got = set_losses(run["run_dir"])
    assert list(got) == ["shakes_train", "val_again"]
    for spec in SETS:
        name, pattern = spec.split("=", 1)
        assert sorted(got[name]) == STEPS_EVALUATED
        for step in STEPS_EVALUATED:
            assert got[name][step] == independent_loss(run, step, pattern), (name, step)
    # the -j shards again under a name: -j's policy exactly, so -j's own losses
    vals = {r["step"]: r["val_loss"] for r in history(run["run_dir"], "val")}
    assert got["val_again"] == vals
    assert got["shakes_train"] != vals
    # in the history right after -j's validation of the same step
    kinds = [(r["kind"], r.get("name")) for r in history(run["run_dir"], "val")
             + history(run["run_dir"], "eval_set")]
    assert kinds.count(("val", None)) == 3


def test_the_run_itself_is_bit_equal_to_the_run_without_sets(runs):
    plain, sets = runs["plain"]["run_dir"], runs["sets"]["run_dir"]
    keys = ("step", "loss", "norm", "lr", "tokens", "samples", "verdict")
    assert ([{k: r[k] for k in keys} for r in history(sets, "train")]
            == [{k: r[k] for k in keys} for r in history(plain, "train")])
    assert ([(r["step"], r["val_loss"]) for r in history(sets, "val")]
            == [(r["step"], r["val_loss"]) for r in history(plain, "val")])
    for step in (2, 3):
        assert np.array_equal(checkpoint_params(sets, step)[0], checkpoint_params(plain, step)[0])
    assert runs["sets"]["summary"]["val_loss"] == runs["plain"]["summary"]["val_loss"]
    # main.log keeps -j's tel: lines only: the same file as without sets
    assert read_main_log(str(sets)) == read_main_log(str(plain))
    assert b"tel:" in read_main_log(str(sets))
    # Ray's reports are unchanged: -j's validation only
    assert ([m for m in runs["sets"]["metrics"] if "val_loss" in m]
            == [m for m in runs["plain"]["metrics"] if "val_loss" in m])
    assert not any(k.startswith("val/") for m in runs["sets"]["metrics"] for k in m)


def test_each_set_goes_to_tensorboard_the_trackers_and_the_console(runs):
    run = runs["sets"]
    got = set_losses(run["run_dir"])
    scalars = read_scalars(run["run_dir"])
    for name, series in got.items():
        # (TensorBoard keeps float32)
        assert scalars[f"val/{name}"] == [(st, float(np.float32(v)))
                                          for st, v in sorted(series.items())]
    assert "val/loss" in scalars
    tracked = [(s, m) for s, m in run["tracked"] if any(k.startswith("val/") for k in m)]
    assert tracked == [item for step in STEPS_EVALUATED for item in (
        (step, {"val/loss": got["val_again"][step]}),
        (step, {"val/shakes_train": got["shakes_train"][step]}),
        (step, {"val/val_again": got["val_again"][step]}))]
    assert f"step     2 | val loss shakes_train {got['shakes_train'][2]:.6f}" in run["console"]
    assert "val/" not in "".join(k for s, m in runs["plain"]["tracked"] for k in m
                                 if k != "val/loss")


def test_status_and_plot_show_each_set(runs, tmp_path):
    run_dir = str(runs["sets"]["run_dir"])
    got = set_losses(run_dir)
    status = run_status(run_dir)
    line = next(ln for ln in status.splitlines() if ln.startswith("eval sets "))
    assert line == (f"eval sets shakes_train {got['shakes_train'][3]:.4f} (step 3) | "
                    f"val_again {got['val_again'][3]:.4f} (step 3)")
    assert "eval sets" not in run_status(str(runs["plain"]["run_dir"]))
    assert load_run(run_dir).eval_sets == got
    drawn = plot_run(run_dir, tmp_path / "run.png")
    for name, series in got.items():
        xs, ys = drawn[f"val_loss:{name}"]
        assert xs == [float(s) for s in sorted(series)]
        assert ys == pytest.approx([series[s] for s in sorted(series)])
    assert (tmp_path / "run.png").stat().st_size > 0


def test_a_malformed_eval_set_record_is_counted_not_shown():
    from raygpt.runlog.report import format_status, view_from_records
    records = [{"kind": "train", "step": 0, "loss": 3.0, "lr": 1e-3, "norm": 1.0, "tokens": 8,
                "dt": 0.1, "time": 1.0},
               {"kind": "eval_set", "step": 0, "name": "wiki", "val_loss": 2.5, "time": 1.0},
               {"kind": "eval_set", "step": 0, "name": "../x y", "val_loss": 2.5, "time": 1.0},
               {"kind": "eval_set", "step": 0, "name": "wiki", "val_loss": "2.5", "time": 1.0},
               {"kind": "eval_set", "step": 0, "val_loss": 2.5, "time": 1.0}]
    view = view_from_records("run", records)
    assert view.eval_sets == {"wiki": {0: 2.5}} and view.counts["malformed"] == 3
    assert "eval sets wiki 2.5000 (step 0)" in format_status(view, now=2.0)
