"""W&B and MLflow, offline: a tiny run with the flags, then what each tracker stored is read back
and compared with loss_history.jsonl; a resume continues the same tracker runs. The package
checks run before Ray (exit 2, one line)."""

import json
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from raygpt.config import ConfigError
from raygpt.runlog import tracking
from raygpt.storage import open_run_dir
from raygpt.train.loop import train
from raygpt.train.session import LocalSession
from tests.helpers import records, tiny_config

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- W&B's offline file

def wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (run-ID.wandb): W&B's LevelDB-style log,
    a 7-byte file header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks
    [crc32 of type+data, u16 length, u8 type (1 full, 2 first, 3 middle, 4 last)]."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert struct.unpack_from("<4sHB", data, 0) == (b":W&B", 0xBEE1, 0), path
    off, pending = 7, b""
    while off + 7 <= len(data):
        room = 32768 - off % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            off += room
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, off)
        if (crc, length, kind) == (0, 0, 0):
            off += room
            continue
        chunk = data[off + 7:off + 7 + length]
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF, (path, off)
        off += 7 + length
        pending += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec


def wandb_history(run_dir: Path) -> tuple[list[str], list[dict]]:
    """(run ids, history rows) of every offline attempt under run_dir/wandb, in time order."""
    ids, rows = [], []
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.append(rec.run.run_id)
            elif kind == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                             for i in rec.history.item})
    return ids, rows


def latest(pairs):
    """{step: value}, a later value of a step winning (as loss_history's readers do)."""
    out = {}
    for step, value in pairs:
        out[step] = value
    return out


def run_local(cfg):
    return train(cfg.resolve(0), LocalSession(open_run_dir(cfg.output_dir), torch.device("cpu")))


# ---------------------------------------------------------------------- offline runs

@pytest.fixture
def offline(monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the test reads the file store too


def test_trackers_store_what_loss_history_has_and_a_resume_continues_them(tmp_path, offline):
    from mlflow.tracking import MlflowClient

    run_dir, store = tmp_path / "run", tmp_path / "mlruns"
    common = dict(checkpoint_every=3, log_every=2, val_every=3, wandb="raygpt-test",
                  mlflow=str(store))
    run_local(tiny_config(run_dir, max_steps=6, **common))
    kept = json.loads((run_dir / "tracking.json").read_text())
    run_local(tiny_config(run_dir, max_steps=9, resume=1, **common))  # -y 1, a longer -x
    assert json.loads((run_dir / "tracking.json").read_text()) == kept  # the same tracker runs

    recs = records(run_dir)
    train_recs = [r for r in recs if r["kind"] == "train"]
    log_steps = {r["step"] for r in train_recs if r["step"] % 2 == 0 or r["step"] == 5
                 or r["step"] == 8}  # log_every, and each attempt's last step
    want_loss = latest((r["step"], r["loss"]) for r in train_recs if r["step"] in log_steps)
    want_lr = latest((r["step"], r["lr"]) for r in train_recs if r["step"] in log_steps)
    want_val = latest((r["step"], r["val_loss"]) for r in recs if r["kind"] == "val")
    assert sorted(want_loss) == [0, 2, 4, 5, 6, 8] and sorted(want_val) == [0, 3, 6, 9]

    # W&B: two offline attempts of one run id, "step" as the x-axis, the same floats
    ids, rows = wandb_history(run_dir)
    assert ids == [kept["wandb"]["id"]] * 2
    assert latest((r["step"], r["train/loss"]) for r in rows if "train/loss" in r) == want_loss
    assert latest((r["step"], r["train/lr"]) for r in rows if "train/lr" in r) == want_lr
    assert latest((r["step"], r["val/loss"]) for r in rows if "val/loss" in r) == want_val

    # MLflow: one run (the kept id) in the local file store, finished
    client = MlflowClient(tracking_uri=kept["mlflow"]["uri"])
    assert kept["mlflow"]["uri"] == store.resolve().as_uri()
    run_id = kept["mlflow"]["run_id"]
    loss = client.get_metric_history(run_id, "train/loss")
    assert latest((m.step, m.value) for m in sorted(loss, key=lambda m: m.timestamp)) == want_loss
    val = client.get_metric_history(run_id, "val/loss")
    assert latest((m.step, m.value) for m in sorted(val, key=lambda m: m.timestamp)) == want_val
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["model"] == "d2"
    assert run.data.tags["raygpt.attempt"] == "2"
    runs = client.search_runs([run.info.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]


def test_a_resume_tops_up_what_mlflow_lost_with_the_killed_process(tmp_path, offline, capsys):
    from mlflow.tracking import MlflowClient

    run_dir, store = tmp_path / "run", tmp_path / "mlruns"
    common = dict(checkpoint_every=4, mlflow=str(store))
    run_local(tiny_config(run_dir, max_steps=6, **common))
    kept = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    # as if the process had died with its async queue: the file store lost steps 2..5
    (metric_file,) = store.glob(f"*/{kept['run_id']}/metrics/train/loss")
    lines = metric_file.read_text().splitlines()
    metric_file.write_text("\n".join(lines[:2]) + "\n")
    run_local(tiny_config(run_dir, max_steps=8, resume=1, **common))  # from the end, step 6
    assert "trackers: 4 earlier log steps they had lost re-sent" in capsys.readouterr().out
    want = {r["step"]: r["loss"] for r in records(run_dir) if r["kind"] == "train"}
    client = MlflowClient(tracking_uri=kept["uri"])
    history = client.get_metric_history(kept["run_id"], "train/loss")
    assert latest((m.step, m.value) for m in sorted(history, key=lambda m: m.timestamp)) == want


def test_mlflow_sqlite_store_and_a_failed_attempt_is_marked(tmp_path, offline, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config(tmp_path / "run", max_steps=4, checkpoint_every=0, mlflow=uri,
                      fault="raise:rank=0,step=2")
    with pytest.raises(Exception, match="injected"):
        run_local(cfg)
    kept = json.loads((tmp_path / "run" / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(kept["run_id"]).info.status == "FAILED"
    losses = {m.step: m.value for m in client.get_metric_history(kept["run_id"], "train/loss")}
    recs = records(tmp_path / "run")
    assert losses == {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}


def test_a_tracker_that_fails_mid_run_is_dropped_and_recorded(tmp_path, offline, monkeypatch):
    calls = []

    def broken(self, step, metrics):
        calls.append(step)
        raise ConnectionError("server went away")

    monkeypatch.setattr(tracking.MlflowTracker, "log", broken)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    summary = run_local(tiny_config(tmp_path, max_steps=4, checkpoint_every=0,
                                    mlflow=str(tmp_path / "mlruns")))
    assert summary["step"] == 4 and calls == [0]  # training went on; the tracker was dropped
    assert not list(cwd.iterdir())  # no MLflow default store (./mlflow.db) on the side
    errors = [r for r in records(tmp_path) if r["kind"] == "tracker_error"]
    assert len(errors) == 1 and errors[0]["tracker"] == "mlflow"
    assert "server went away" in errors[0]["message"]
    assert "s:0 tracker_error:1 tracker:mlflow" in (tmp_path / "main.log").read_text()


def test_a_damaged_tracking_file_is_named(tmp_path):
    rd = open_run_dir(str(tmp_path))
    rd.write_bytes_atomic(tracking.TRACKING_FILE, b"[1, 2")
    with pytest.raises(tracking.TrackingError, match="tracking.json: expected a JSON object"):
        tracking.read_ids(rd)


# ---------------------------------------------------------------------- checks on the driver

def test_uris_and_worker_environment():
    assert tracking.normalize_mlflow_uri("") == ""
    assert tracking.normalize_mlflow_uri("mlruns") == (Path.cwd() / "mlruns").as_uri()
    for uri in ("http://mlflow:5000", "file:///x/y", "sqlite:///a.db", "databricks"):
        assert tracking.normalize_mlflow_uri(uri) == uri
    env = {"WANDB_MODE": "offline", "WANDB_API_KEY": "k", "MLFLOW_TRACKING_TOKEN": "t",
           "MLFLOW_EXPERIMENT_NAME": "e", "MLFLOW_TRACKING_PASSWORD": "p", "HOME": "/root"}
    assert tracking.worker_env(env) == {"WANDB_MODE": "offline", "MLFLOW_EXPERIMENT_NAME": "e"}


BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Block())
from raygpt.cli import main
sys.exit(main(["train"] + sys.argv[1:]))
"""


@pytest.mark.parametrize("flag, value, blocked, named", [
    ("--wandb", "proj", ["wandb"], "the wandb package"),
    ("--mlflow", "mlruns", ["mlflow"], "the mlflow package"),
    ("--mlflow", "sqlite:///x.db", ["sqlalchemy"], "the sqlalchemy package"),
])
def test_a_missing_tracker_package_is_one_line_and_exit_2_before_ray(tmp_path, flag, value,
                                                                      blocked, named):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", BLOCK.format(blocked=blocked), flag, value,
                        "-o", str(tmp_path / "run"), "--cpu"],
                       capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and flag in lines[0], p.stderr
    extra = "wandb" if flag == "--wandb" else "mlflow"
    assert f"pip install 'raygpt[{extra}]'" in lines[0]
    assert "Started a local Ray" not in p.stdout + p.stderr
    assert not (tmp_path / "run").exists()  # nothing touched
    assert time.monotonic() - t0 < 60


def test_the_check_passes_when_the_packages_are_there(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    cfg = tiny_config(tmp_path, wandb="p", mlflow=str(tmp_path / "m")).resolve(0)
    assert cfg.mlflow == (tmp_path / "m").resolve().as_uri()
    assert tracking.check_installed(cfg) is None
    monkeypatch.setattr(tracking, "installed", lambda module: module != "wandb")
    with pytest.raises(ConfigError, match="--wandb p: expected the wandb package"):
        cfg.validate()


def test_eval_sets_go_to_mlflow_and_a_resume_tops_up_what_it_lost(tmp_path, offline):
    from mlflow.tracking import MlflowClient

    from raygpt.config import DEFAULT_TRAIN

    run_dir, store = tmp_path / "run", tmp_path / "mlruns"
    common = dict(checkpoint_every=4, val_every=2, mlflow=str(store),
                  eval_set=[f"shakes_train={DEFAULT_TRAIN}"])
    run_local(tiny_config(run_dir, max_steps=6, **common))
    kept = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=kept["uri"])

    def stored():
        history = client.get_metric_history(kept["run_id"], "val/shakes_train")
        return latest((m.step, m.value) for m in sorted(history, key=lambda m: m.timestamp))

    def want():
        return {r["step"]: r["val_loss"] for r in records(run_dir) if r["kind"] == "eval_set"}

    assert sorted(want()) == [0, 2, 4, 6] and stored() == want()
    # as if the process had died with its async queue: the file store lost steps 2..6
    (metric_file,) = store.glob(f"*/{kept['run_id']}/metrics/val/shakes_train")
    metric_file.write_text(metric_file.read_text().splitlines()[0] + "\n")
    run_local(tiny_config(run_dir, max_steps=8, resume=1, **common))  # from the end, step 6
    assert stored() == want() and sorted(want()) == [0, 2, 4, 6, 8]
