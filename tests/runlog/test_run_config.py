"""config.json: every launch of a run recorded in its run directory (resolved config, what was
adapted, hardware, versions, command line), earlier launches kept, and `raygpt status` showing
what ran and what a later launch changed."""

from __future__ import annotations

import dataclasses
import json

from raygpt.config import TrainConfig
from raygpt.runlog import report
from raygpt.runlog.run_config import (CONFIG_FILE, config_changes, format_launches, read_launches,
                               write_launch)
from raygpt.storage import open_run_dir


def test_each_launch_is_recorded_and_earlier_ones_are_kept(tmp_path):
    rd = open_run_dir(str(tmp_path))
    first = TrainConfig(output_dir=str(tmp_path)).resolve(gpus_available=0)
    write_launch(rd, first, argv=["raygpt", "train", "-o", str(tmp_path)],
                 adapted=["B=4 (not 8): because"], plan=["train: 1 token"])
    rec = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert rec["format"] == "raygpt-config" and rec["launch"] == 1
    assert rec["config"] == first.to_dict()
    assert set(rec["config"]) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert rec["command"]["line"] == f"raygpt train -o {tmp_path}"
    assert rec["adapted"] == ["B=4 (not 8): because"] and rec["plan"] == ["train: 1 token"]
    assert {"python", "raygpt", "ray", "torch", "numpy", "pyarrow"} <= set(rec["versions"])
    assert rec["hardware"]["workers"] == "2 x cpu" and rec["hardware"]["cpus"] >= 1

    second = first.with_overrides({"max_steps": 300, "resume": 1})
    write_launch(rd, second, argv=["raygpt", "train", "-y", "1", "-x", "300"])
    third = second.with_overrides({"num_workers": 1})
    write_launch(rd, third, argv=["raygpt", "train", "-y", "1", "--num-workers", "1"])
    assert json.loads((tmp_path / "config.1.json").read_text()) == rec  # the first, unchanged
    launches = read_launches(rd)
    assert [r["launch"] for r in launches] == [1, 2, 3]
    assert [r["config"]["max_steps"] for r in launches] == [100, 300, 300]
    assert config_changes(launches[0]["config"], launches[1]["config"]) == [
        "max_steps: 100 -> 300", "resume: 0 -> 1"]


def test_status_shows_what_ran(tmp_path):
    rd = open_run_dir(str(tmp_path))
    cfg = TrainConfig(output_dir=str(tmp_path)).resolve(gpus_available=0)
    write_launch(rd, cfg, argv=["python", "experiments/shakespeare.py"], adapted=["a note"])
    write_launch(rd, cfg.with_overrides({"max_steps": 150, "resume": 1}),
                 argv=["python", "experiments/shakespeare.py", "-y", "1", "-x", "150"])
    rd.append_text("loss_history.jsonl", json.dumps(
        {"kind": "train", "step": 0, "loss": 10.9, "norm": 1.0, "lr": 1e-4, "tokens": 1024,
         "dt": 0.5, "attempt": 1, "time": 1.0}) + "\n")
    text = report.run_status(str(tmp_path), verify="quick")
    assert "launch    2 launch(es), newest " in text
    assert "python experiments/shakespeare.py -y 1 -x 150" in text
    assert "2 x cpu on " in text and "| d4 | fp32 | B=8 T=64 | 1,024 tokens/step | -x 150 |" in text
    assert "launch 2 changed: max_steps: 100 -> 150; resume: 0 -> 1" in text
    assert format_launches([]) == []


def test_a_file_that_is_not_a_launch_record_is_skipped(tmp_path):
    rd = open_run_dir(str(tmp_path))
    (tmp_path / "config.1.json").write_text("{not json")
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"format": "something else"}))
    assert read_launches(rd) == []
    write_launch(rd, TrainConfig(output_dir=str(tmp_path)).resolve(0), argv=["x"])
    # the unreadable first file stays; the foreign config.json is kept as config.2.json
    assert (tmp_path / "config.1.json").read_text() == "{not json"
    assert json.loads((tmp_path / "config.2.json").read_text()) == {"format": "something else"}
    assert [r["launch"] for r in read_launches(rd)] == [3]


def test_a_hand_edited_record_does_not_break_status():
    lines = format_launches([{"format": "raygpt-config", "config": {"total_batch_size": None}}])
    assert len(lines) == 1 and "config.json not as raygpt writes it" in lines[0]


def test_credentials_in_a_uri_are_not_stored(tmp_path):
    """-o s3://KEY:SECRET@bucket/...: config.json keeps the run's identity, never the secret."""
    rd = open_run_dir(str(tmp_path))
    uri = "s3://AKIAEXAMPLE:s3cr3tValue@bucket/runs/x"
    cfg = TrainConfig(output_dir=uri).resolve(gpus_available=0)
    write_launch(rd, cfg, argv=["raygpt", "train", "-o", uri])
    text = (tmp_path / CONFIG_FILE).read_text()
    assert "s3cr3tValue" not in text and "AKIAEXAMPLE" not in text
    rec = json.loads(text)
    assert rec["config"]["output_dir"] == "s3://***@bucket/runs/x"
    assert rec["command"]["line"].endswith("-o s3://***@bucket/runs/x")


def test_records_that_cannot_be_read_are_skipped_and_said_each_in_one_printable_line(tmp_path):
    rd = open_run_dir(tmp_path)
    write_launch(rd, TrainConfig(output_dir=str(tmp_path)).resolve(0), argv=["raygpt", "\x1b[2J"])
    rd.write_bytes_atomic("config.1.json", b"[" * 200_000)
    rd.write_bytes_atomic("config.2.json", b'{"format": "other"}')
    (tmp_path / "config.3.json").write_bytes(b" " * ((1 << 20) + 1))
    skipped = []
    assert len(read_launches(rd, skipped=skipped)) == 1
    assert skipped == [
        f"{tmp_path}/config.1.json: expected JSON, found arrays or objects nested too deep to parse",
        f"{tmp_path}/config.2.json: expected a 'raygpt-config' record, found another",
        f"{tmp_path}/config.3.json: expected at most 1,048,576 bytes, found more"]
    lines = format_launches(read_launches(rd), skipped)
    assert "raygpt '\\x1b[2J'" in lines[0] and not any("\x1b" in line for line in lines)
    assert lines[-3:] == [f"          skipped {why}" for why in skipped]
    assert format_launches([], skipped[:1]) == [f"launch    skipped {skipped[0]}"]
