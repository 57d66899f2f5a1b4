"""-i's weighted sources (raygpt.config.mixture): the syntax, a plain glob left as it was, and
every bad mix refused in one line naming -i, exit 2, before Ray starts (the real command line)."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from raygpt.config import ConfigError, absolute_paths, parse_args, preflight
from raygpt.config.mixture import parse, patterns, with_patterns
from raygpt.data.sources import data_fingerprint
from raygpt.llmc.shards import write_shard
from tests.config.test_preflight import REPO, SMALL, no_ray, refused  # noqa: F401 (fixture)


@pytest.fixture()
def data(tmp_path):
    write_shard(tmp_path / "web_000.bin", np.arange(5000) % 500)
    write_shard(tmp_path / "code_000.bin", 300 + np.arange(3000) % 200)
    write_shard(tmp_path / "tiny_000.bin", np.arange(20))
    return tmp_path


def mix(data, *sources):
    return [a for s in sources for a in ("-i", s.format(d=data))]


def test_a_plain_glob_is_not_a_mix():
    for plain in ("data/*.bin", "s3://bucket/fw/fw_train_*.bin", "/data/v=2:x/*.bin",
                  "data/v=2:x/*.bin", "gs://b/a=1:b/*.bin"):
        assert parse(plain) is None and patterns(plain) == [plain]
        assert with_patterns(plain, lambda flag, p: f"{flag}|{p}") == f"-i/--input-bin|{plain}"


def test_weighted_sources_keep_their_order_names_and_weights_as_written():
    spec = "web=0.70:s3://b/fw/fw_train_*.bin\ncode=3e-1:/data/code_train_*.bin\nold=0:x/*.bin"
    sources = parse(spec)
    assert [(s.name, s.weight_text, s.weight, s.pattern) for s in sources] == [
        ("web", "0.70", 0.7, "s3://b/fw/fw_train_*.bin"), ("code", "3e-1", 0.3, "/data/code_train_*.bin"),
        ("old", "0", 0.0, "x/*.bin")]
    assert with_patterns(spec, lambda flag, p: p.upper()) == (
        "web=0.70:S3://B/FW/FW_TRAIN_*.BIN\ncode=3e-1:/DATA/CODE_TRAIN_*.BIN\nold=0:X/*.BIN")
    seen = []
    with_patterns(spec, lambda flag, p: seen.append(flag) or p)
    assert seen == ["-i/--input-bin web", "-i/--input-bin code", "-i/--input-bin old"]


def test_each_i_adds_a_source_and_the_first_replaces_a_config_files(tmp_path):
    cfg = parse_args(["-i", "web=0.7:a/*.bin", "-i", "code=0.3:b/*.bin"])
    assert cfg.input_bin == "web=0.7:a/*.bin\ncode=0.3:b/*.bin"
    (tmp_path / "c.json").write_text(json.dumps({"input_bin": "x=1:old/*.bin\ny=1:older/*.bin"}))
    cfg = parse_args(["--config", str(tmp_path / "c.json"), "-i", "web=1:a/*.bin", "-i",
                      "code=1:b/*.bin"])
    assert cfg.input_bin == "web=1:a/*.bin\ncode=1:b/*.bin"
    assert parse_args(["-i", "plain/*.bin"]).input_bin == "plain/*.bin"  # as before
    assert parse_args(["-i", "a/*.bin", "-i", "b/*.bin"]).input_bin == "b/*.bin"  # the last wins


def test_relative_globs_of_a_mix_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(parse_args(["-i", "web=0.7:a/*.bin", "-i", "code=0.3:s3://b/c*.bin"]))
    assert cfg.input_bin == f"web=0.7:{tmp_path}/a/*.bin\ncode=0.3:s3://b/c*.bin"


def test_the_data_fingerprint_of_a_mix_holds_its_names_weights_and_shards(data):
    web, code = str(data / "web_*.bin"), str(data / "code_*.bin")
    base = data_fingerprint(f"web=0.7:{web}\ncode=0.3:{code}")
    assert data_fingerprint(f"web=0.70:{web}\ncode=0.3:{code}") == base  # the same numbers
    for other in (f"web=0.6:{web}\ncode=0.3:{code}", f"www=0.7:{web}\ncode=0.3:{code}",
                  f"code=0.3:{code}\nweb=0.7:{web}", f"web=0.7:{web}\ncode=0.3:{web}"):
        assert data_fingerprint(other) != base, other
    assert data_fingerprint(f"web=1:{web}") == data_fingerprint(web)  # one source: its glob


@pytest.mark.parametrize("sources, says", [
    (["web=x:{d}/web_*.bin", "code=1:{d}/code_*.bin"],
     "-i/--input-bin web: weight: expected a finite number >= 0, found 'x'"),
    (["web=-0.5:{d}/web_*.bin", "code=1:{d}/code_*.bin"],
     "-i/--input-bin web: weight: expected a finite number >= 0, found '-0.5'"),
    (["web=nan:{d}/web_*.bin", "code=1:{d}/code_*.bin"],
     "-i/--input-bin web: weight: expected a finite number >= 0, found 'nan'"),
    (["web=1:{d}/web_*.bin", "code=inf:{d}/code_*.bin"],
     "-i/--input-bin code: weight: expected a finite number >= 0, found 'inf'"),
    (["web=:{d}/web_*.bin", "code=1:{d}/code_*.bin"],
     "-i/--input-bin web: weight: expected a finite number >= 0, found ''"),
    (["web=0:{d}/web_*.bin", "code=0.0:{d}/code_*.bin"],
     "-i/--input-bin: weights: expected at least one > 0 (their sum is what each is a share of), "
     "found web=0, code=0.0"),
    (["web=1:{d}/web_*.bin", "web=2:{d}/code_*.bin"],
     "-i/--input-bin: expected each NAME once, found 'web' twice"),
    (["web=1:{d}/web_*.bin", "code=1:{d}/missing_*.bin"],
     "-i/--input-bin code: expected a glob matching at least one llm.c token shard (local, "
     "s3:// or gs://), found '{d}/missing_*.bin'"),
    (["{d}/web_*.bin", "code=1:{d}/code_*.bin"],
     "-i/--input-bin: expected GLOB, or NAME=WEIGHT:GLOB once per -i"),
    (["web=1:", "code=1:{d}/code_*.bin"], "-i/--input-bin web: expected a glob of llm.c token "
                                          "shards after web=1:, found ''"),
    (["web=1:{d}/web_*.bin", "code=1:{d}/tiny_*.bin"],
     "-i/--input-bin code: {d}/tiny_000.bin: token count 20: expected at least B*T*world+1"),
])
def test_a_bad_mix_is_refused_in_one_line_before_ray_starts(data, no_ray, capsys, sources, says):
    err = refused([*SMALL, *mix(data, *sources), "-j", "", "-o", str(data / "run")], capsys)
    assert says.format(d=data) in err, err
    assert not (data / "run").exists()  # nothing touched


def test_preflight_says_what_each_source_holds_and_weight_0_is_allowed(data, no_ray):
    cfg = parse_args([*SMALL, *mix(data, "web=0.7:{d}/web_*.bin", "code=0:{d}/code_*.bin"),
                      "-j", "", "-o", str(data / "run")]).resolve(0)
    facts = preflight.check_data(cfg)
    assert facts[:3] == ["train web: 5,000 tokens in 1 shard(s)",
                         "train code: 3,000 tokens in 1 shard(s)",
                         "mixed by weight: web 0.7, code 0 (weight 0: never drawn)"]


def test_one_epoch_of_a_mix_is_until_its_first_source_runs_out(data, no_ray):
    # at T=16: web 312 samples at 0.5 -> 624 draws, code 187 at 0.5 -> 374: 5,984 tokens
    base = [*SMALL[:-2], "-j", "", "-o", str(data / "run"), "-x", "-1"]
    cfg = parse_args([*base, *mix(data, "web=1:{d}/web_*.bin", "code=1:{d}/code_*.bin"),
                      "-d", str(2 * 16 * 187)]).resolve(0)
    preflight.check_data(cfg)  # one step of 5,984 tokens fits
    cfg = cfg.with_overrides({"total_batch_size": 2 * 16 * 188})
    with pytest.raises(ConfigError, match=r"-x/--max-steps -1: one epoch of the mix is 5,984 "
                                          r"tokens at T=16"):
        preflight.check_data(cfg)


@pytest.mark.parametrize("sources, says", [
    (["web=0.7:{d}/web_*.bin", "code=x:{d}/code_*.bin"], "-i/--input-bin code: weight: expected"),
    (["web=0.7:{d}/web_*.bin", "code=0.3:{d}/nothing_*.bin"], "-i/--input-bin code: expected a "
                                                               "glob matching at least one"),
])
def test_the_real_command_line_refuses_a_bad_mix_in_one_line_with_exit_2(data, sources, says):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raygpt", "train", *SMALL, *mix(data, *sources),
                           "-j", "", "-o", str(data / "run")], capture_output=True, text=True,
                          timeout=60, env=env, cwd=data)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"raygpt: error: {says}"), lines
    assert proc.stdout == "" and not (data / "run").exists()
    assert time.monotonic() - t0 < 15
