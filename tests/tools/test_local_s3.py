"""`python -m raygpt.tools.local_s3` as a user runs it: a subprocess that serves a bucket with the
Tiny Shakespeare shards in it and prints the environment and a `raygpt train` command line;
that environment and command reach the shards through raygpt's own checks before Ray (the same
reads `raygpt train` makes first), and Ctrl-C ends the server."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import pytest

from raygpt.config import ConfigError, parse_args, preflight

pytest.importorskip("moto.server")

REPO = Path(__file__).resolve().parents[2]
START_S = 60.0  # moto's server and two uploads; seconds on an idle machine


def _start(*args: str) -> tuple[subprocess.Popen, list[str]]:
    """The tool as a subprocess, and the lines it printed up to "serving until Ctrl-C"."""
    proc = subprocess.Popen([sys.executable, "-m", "raygpt.tools.local_s3", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    lines, deadline = [], time.monotonic() + START_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("serving until Ctrl-C"):
            return proc, lines
    proc.kill()
    raise AssertionError(f"no 'serving' line within {START_S} s: {lines} {proc.stderr.read()}")


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)  # the user's Ctrl-C
    return proc.wait(timeout=30)


def test_the_printed_environment_and_command_reach_the_shards(tmp_path, monkeypatch):
    proc, lines = _start("--bucket", "tryout")
    try:
        (export,) = [line for line in lines if line.startswith("export ")]
        env = dict(word.split("=", 1) for word in shlex.split(export)[1:])
        assert set(env) == {"AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
                            "AWS_SECRET_ACCESS_KEY", "AWS_EC2_METADATA_DISABLED"}
        assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        (command,) = [line for line in lines if line.startswith("raygpt train ")]
        argv = shlex.split(command)[2:]
        assert argv == ["-i", "s3://tryout/data/tiny_shakespeare_train.bin",
                        "-j", "s3://tryout/data/tiny_shakespeare_val.bin",
                        "-o", "s3://tryout/runs/shakespeare"]
        # what `raygpt train` checks before Ray starts: both shards read from the bucket
        cfg = parse_args(argv + ["--cpu", "--num-workers", "1"]).resolve(0, notes=[],
                                                                         cpus_available=1)
        plan = preflight.check(cfg)
        assert any("train: 305,260 tokens in 1 shard(s)" in p for p in plan), plan
        # the bytes in the bucket are the bundled shard's
        from raygpt.storage.uri import open_filesystem
        fs, path = open_filesystem("s3://tryout/data/tiny_shakespeare_val.bin")
        with fs.open_input_file(path) as f:
            stored = f.read()
        assert stored == resources.files("raygpt.data_files").joinpath(
            "tiny_shakespeare_val.bin").read_bytes()
        # a shard the tool did not upload is not there: the check is of the bucket, not a cache
        bad = parse_args(["-i", "s3://tryout/data/none_train.bin"] + argv[2:] + ["--cpu"])
        with pytest.raises(ConfigError):
            preflight.check(bad.resolve(0, notes=[], cpus_available=1))
    finally:
        rc = _stop(proc)
    assert rc == 0, proc.stderr.read()
    assert proc.stderr.read() == ""  # no request log, no warning


def test_no_data_makes_only_the_bucket(monkeypatch):
    proc, lines = _start("--no-data")
    try:
        assert not [line for line in lines if line.startswith(("uploaded", "raygpt train"))]
        (export,) = [line for line in lines if line.startswith("export ")]
        for word in shlex.split(export)[1:]:
            monkeypatch.setenv(*word.split("=", 1))
        from raygpt.storage.uri import open_filesystem
        import pyarrow.fs as pafs
        fs, path = open_filesystem("s3://raygpt")
        assert fs.get_file_info(path).type == pafs.FileType.Directory
        assert fs.get_file_info(pafs.FileSelector(path, recursive=True)) == []
    finally:
        assert _stop(proc) == 0


def test_a_bad_bucket_name_or_no_moto_is_one_line_and_exit_2():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    bad = subprocess.run([sys.executable, "-m", "raygpt.tools.local_s3", "--bucket", "Bad_Name"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == ("local_s3: error: --bucket 'Bad_Name': expected an S3 bucket name (3 "
                          "to 63 lower-case letters, digits, dots and hyphens)\n")
    # moto missing: its modules made unimportable in the child
    code = ("import sys; sys.modules['moto'] = sys.modules['moto.server'] = None; "
            "from raygpt.tools.local_s3 import main; sys.exit(main([]))")
    missing = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             cwd=REPO, env=env, timeout=60)
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr == ("local_s3: error: moto's S3 server is not installed; pip install "
                              "-e \".[test]\" installs it (the test extras)\n")
