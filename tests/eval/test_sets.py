"""--eval-set NAME=GLOB: its specs, refused as one line naming --eval-set before Ray starts
(a bad name, a name twice, the main set's name, an empty glob, shards that are missing, damaged
or too small), its shards made absolute and given their endpoint as -j's are, and a --config
file's URI with options refused as -i's is."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raygpt.config import (ConfigError, TrainConfig, absolute_paths, as_command, parse_args,
                           read_config_file, stored_fields)
from raygpt.eval import sets
from raygpt.llmc.shards import write_shard
from tests.config.test_preflight import SMALL, args, no_ray, refused  # noqa: F401 (fixture)


@pytest.fixture()
def data(tmp_path):
    write_shard(tmp_path / "train.bin", np.arange(5000) % 500)
    write_shard(tmp_path / "val.bin", np.arange(2000) % 500)
    write_shard(tmp_path / "wiki_000.bin", np.arange(1500) % 300)
    write_shard(tmp_path / "wiki_001.bin", np.arange(1200) % 300)
    write_shard(tmp_path / "tiny.bin", np.arange(10) % 300)
    good = (tmp_path / "val.bin").read_bytes()
    (tmp_path / "truncated.bin").write_bytes(good[:-100])
    return tmp_path


def test_specs_parse_in_their_order():
    assert sets.parse(["wiki=/d/wiki_*.bin", "c4.en-v2_x=s3://b/c4_*.bin?x=1"]) == [
        ("wiki", "/d/wiki_*.bin"), ("c4.en-v2_x", "s3://b/c4_*.bin?x=1")]
    assert sets.parse([]) == [] and sets.parse(None) == []
    # a glob may itself hold '=' (only the first one splits)
    assert sets.parse(["a=/d/k=v/*.bin"]) == [("a", "/d/k=v/*.bin")]


@pytest.mark.parametrize("specs, says", [
    (["wiki"], "expected NAME=GLOB"),
    (["=/d/x.bin"], "expected NAME=GLOB"),
    (["wi ki=/d/x.bin"], "expected NAME=GLOB"),
    (["wiki/x=/d/x.bin"], "expected NAME=GLOB"),
    (["wiki="], "expected NAME=GLOB"),
    (["wiki=  "], "expected NAME=GLOB"),
    (["loss=/d/x.bin"], "expected a NAME other than 'loss'"),
    (["a=/d/x.bin", "b=/d/y.bin", "a=/d/z.bin"], "expected each NAME once, found 'a' twice"),
])
def test_bad_specs_are_one_line_naming_the_flag(specs, says):
    with pytest.raises(ConfigError) as e:
        sets.parse(specs)
    line = str(e.value)
    assert line.startswith("--eval-set: ") and says in line and "\n" not in line


@pytest.mark.parametrize("spec, says", [
    ("wiki", "--eval-set: expected NAME=GLOB"),
    ("w=", "--eval-set: expected NAME=GLOB"),
    ("loss={d}/val.bin", "--eval-set: expected a NAME other than 'loss'"),
    ("w={d}/missing_*.bin",
     "--eval-set w: expected a glob matching at least one llm.c token shard"),
    ("w={d}/truncated.bin", "truncated.bin: token count (header[2]) = 2000: expected a file of"),
    ("w={d}/tiny.bin", "tiny.bin: token count 10: expected at least val_batch_size*T+1"),
])
def test_the_command_refuses_a_bad_set_before_ray_starts(data, capsys, no_ray,  # noqa: F811
                                                         spec, says):
    err = refused(args(data, "--eval-set", spec.format(d=data), "-v", "1"), capsys)
    assert says in err, err
    assert err.startswith("raygpt: error: --eval-set"), err


def test_the_same_name_twice_is_refused_by_the_command(data, capsys, no_ray):  # noqa: F811
    err = refused(args(data, "--eval-set", f"w={data}/val.bin", "--eval-set",
                       f"w={data}/wiki_*.bin"), capsys)
    assert "--eval-set: expected each NAME once, found 'w' twice" in err


def test_preflight_lists_each_sets_shards(data):
    from raygpt.config import preflight
    cfg = parse_args(args(data, "--eval-set", f"wiki={data}/wiki_*.bin", "--eval-set",
                          f"v2={data}/val.bin", "-v", "1")).resolve(0)
    facts = preflight.check_data(cfg)
    assert any(f.startswith("eval set wiki: ") and "2,700 tokens in 2 shard(s)" in f for f in facts)
    assert any(f.startswith("eval set v2: ") and "in 1 shard(s)" in f for f in facts)
    # -v 0: the sets are off with validation, and nothing of theirs is checked
    cfg0 = parse_args(args(data, "--eval-set", f"t={data}/tiny.bin", "-v", "0")).resolve(0)
    assert not any(f.startswith("eval set") for f in preflight.check_data(cfg0))


def test_flags_repeat_and_paths_are_made_absolute(data, monkeypatch):
    monkeypatch.chdir(data)
    cfg = parse_args(["--eval-set", "wiki=wiki_*.bin", "--eval-set", "v=s3://b/v_*.bin"])
    assert cfg.eval_set == ["wiki=wiki_*.bin", "v=s3://b/v_*.bin"]
    assert absolute_paths(cfg).eval_set == [f"wiki={data}/wiki_*.bin", "v=s3://b/v_*.bin"]
    assert TrainConfig().eval_set == []
    assert "eval_set" not in TrainConfig().identity()  # may change on resume


def test_an_s3_set_takes_the_endpoint_as_j_does(data):
    pytest.importorskip("pyarrow")
    cfg = TrainConfig(**{**_small(data), "eval_set": ["w=s3://bucket/w_*.bin"],
                         "input_val_bin": "s3://bucket/v_*.bin",
                         "storage_endpoint": "http://127.0.0.1:9"})
    with pytest.MonkeyPatch.context() as mp:  # resolve reads no header of a bucket's shards
        mp.setattr("raygpt.data.fit._shard_tokens", lambda pattern, flag: None)
        r = cfg.resolve(0)
    name, pattern = sets.parse(r.eval_set)[0]
    assert name == "w" and pattern.startswith("s3://bucket/w_*.bin?")
    assert pattern.partition("?")[2] == r.input_val_bin.partition("?")[2]


def _small(data):
    return dict(model="d1", batch_size=2, seq_len=16, max_steps=2, device="cpu", num_workers=1,
                input_bin=str(data / "train.bin"), input_val_bin=str(data / "val.bin"),
                output_dir=str(data / "run"))


def test_a_config_file_set_with_uri_options_is_refused(data):
    path = data / "c.json"
    path.write_text(json.dumps({"eval_set": [
        f"v={data}/val.bin", "w=s3://b/w_*.bin?endpoint_override=evil:80&scheme=http"]}))
    with pytest.raises(ConfigError) as e:
        read_config_file(str(path))
    line = str(e.value)
    assert line.startswith(f"--config {path}: eval_set: expected a plain URI or path")
    assert "endpoint_override" in line and "\n" not in line
    path.write_text(json.dumps({"eval_set": [f"v={data}/val.bin", "w=s3://b/w_*.bin"]}))
    assert read_config_file(str(path))["eval_set"][1] == "w=s3://b/w_*.bin"
    cfg = parse_args(["--config", str(path)])
    assert cfg.eval_set == [f"v={data}/val.bin", "w=s3://b/w_*.bin"]
    path.write_text(json.dumps({"eval_set": "v=x.bin"}))  # a list, not one string
    with pytest.raises(ConfigError, match="eval_set: expected list"):
        parse_args(["--config", str(path)])


def test_a_set_with_options_goes_on_the_command_line_and_stored_plain():
    cfg = TrainConfig(eval_set=["v=/d/v.bin", "w=s3://b/w_*.bin?endpoint_override=h:1"])
    fields, flags = as_command(cfg)
    assert "eval_set" not in fields
    assert flags[-4:] == ["--eval-set", "v=/d/v.bin", "--eval-set",
                          "w=s3://b/w_*.bin?endpoint_override=h:1"]
    assert parse_args(flags).eval_set == cfg.eval_set
    assert stored_fields({"eval_set": cfg.eval_set}) == {"eval_set": ["v=/d/v.bin",
                                                                      "w=s3://b/w_*.bin"]}
    fields, flags = as_command(TrainConfig(eval_set=["v=/d/v.bin"]))
    assert fields["eval_set"] == ["v=/d/v.bin"] and "--eval-set" not in flags
