"""Issue 25, tried as a careless or hostile user would: every attack or accident is reproduced
and shown refused. No Ray: the driver-side pieces (run-directory claims, leases, fault gating,
status, readers) are exercised directly; S3 cases run against a local S3 server (moto's
ThreadedMotoServer on 127.0.0.1, through pyarrow.fs.S3FileSystem)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from urllib.parse import quote

import numpy as np
import pyarrow.fs as pafs
import pytest

from raygpt.checkpointing import protocol as ck
from raygpt import ownership
from raygpt.config import ConfigError, TrainConfig, parse_args
from raygpt.data.loader import DistributedDataLoader
from raygpt.llmc.shards import write_shard
from raygpt.faults import RECORD, armed_spec, plan_for
from raygpt.runlog.history import LOSS_HISTORY
from raygpt.ownership import LEASE, MARKER, Lease, RunDirBusy, refused_overwrite_target
from raygpt.report import check_checkpoints, run_status
from raygpt.storage import RunDir, open_run_dir
from raygpt.ownership import claimed_run_dir, prepare_run_dir
from tests.helpers import S3Server, tiny_config

SECRET = "TOPSECRETkey/with+slash"
QUOTED = quote(SECRET, safe="")


# ---------------------------------------------------------------------- a local S3 server

@pytest.fixture(scope="module")
def s3():
    """(filesystem, uri(path) -> an s3:// URI carrying the endpoint and the credentials)."""
    env = pytest.MonkeyPatch()  # the variable is handed back as it was when the module ends
    if "AWS_EC2_METADATA_DISABLED" not in os.environ:
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with S3Server() as server:
        fs = server.fs(secret_key=SECRET)
        fs.create_dir("bucket")

        def uri(path: str) -> str:  # credentials in the URI: what must never be printed or stored
            return (f"s3://AKIATEST:{QUOTED}@{path}?endpoint_override={server.address}"
                    f"&scheme=http&region=us-east-1")
        yield fs, uri
    env.undo()


def _put(fs, path: str, data: bytes = b"x") -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


# ====================================================================== 1. --overwrite and --config

def test_overwrite_targets_that_are_never_a_run(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work" / "here"
    home.mkdir()
    cwd.mkdir(parents=True)
    where = dict(home=str(home), cwd=str(cwd))
    for target, why in (("", "empty"), ("   ", "empty"), ("/", "root directory"),
                        (str(home), "home directory"), (str(cwd), "current directory"),
                        (str(cwd) + "/.", "current directory"),
                        (str(tmp_path / "work"), "contains the current directory"),
                        (str(tmp_path), "contains the home directory"),
                        ("s3://bucket", "bucket root"), ("s3://bucket/", "bucket root"),
                        ("s3://bucket?endpoint_override=x", "bucket root"),
                        ("gs://b//", "bucket root"), ("file:///", "root directory")):
        assert why in refused_overwrite_target(target, **where), target
    for fine in (str(cwd / "runs" / "a"), str(home / "runs" / "a"), "s3://bucket/runs/a"):
        assert refused_overwrite_target(fine, **where) is None, fine


def _fake_run(d, *, marked: bool) -> None:
    """A directory that looks like a run: loss history, main.log, a step directory."""
    d.mkdir(parents=True, exist_ok=True)
    (d / LOSS_HISTORY).write_text('{"kind":"start","step":0,"time":1}\n')
    (d / "main.log").write_text("s:0 trl:1.0\n")
    (d / "step_00000004").mkdir()
    (d / "step_00000004" / "DONE_00000004").write_text("")
    if marked:
        ownership.write_marker(open_run_dir(d), "run")


def test_overwrite_never_deletes_the_current_or_home_directory_or_an_empty_o(tmp_path, monkeypatch):
    """The reproduced accidents: `-o "$RUN_DIR"` with the variable unset, `-o .`, a home
    directory holding run-like files (even one carrying a marker)."""
    cwd, home = tmp_path / "work" / "cwd", tmp_path / "home"
    _fake_run(cwd, marked=True)
    _fake_run(home, marked=True)
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_ed25519").write_text("private key")
    (tmp_path / "work" / LOSS_HISTORY).write_text("{}\n")  # the parent looks like a run too
    ownership.write_marker(open_run_dir(tmp_path / "work"), "run")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    for out, why in (("", "empty -o/--output-dir"), (".", "current directory"),
                     (str(cwd), "current directory"), (str(home), "home directory"),
                     (str(tmp_path / "work"), "contains the current directory")):
        with pytest.raises(ConfigError, match=why):
            prepare_run_dir(tiny_config(out, overwrite=True))
    assert sorted(os.listdir(cwd)) == sorted([LOSS_HISTORY, "main.log", "step_00000004", MARKER])
    assert (home / ".ssh" / "id_ed25519").read_text() == "private key"
    with pytest.raises(ConfigError, match="-o/--output-dir"):  # refused at validation too
        tiny_config("").resolve(0)


def test_overwrite_needs_the_marker_and_a_resume_marks_an_older_run(tmp_path, capsys):
    old = tmp_path / "old"
    _fake_run(old, marked=False)
    with pytest.raises(ConfigError, match=f"holds no {MARKER}.*delete it by hand"):
        prepare_run_dir(tiny_config(old, overwrite=True))
    assert (old / LOSS_HISTORY).exists() and (old / "step_00000004").is_dir()
    prepare_run_dir(tiny_config(old, resume=1))  # -y 1: the user says it is a run
    marker = ownership.read_marker(open_run_dir(old))
    assert marker["kind"] == "run" and marker["adopted"] is True
    assert (old / LOSS_HISTORY).exists()
    prepare_run_dir(tiny_config(old, overwrite=True))  # marked now: a fresh start over it
    assert sorted(os.listdir(old)) == [MARKER]
    assert "--overwrite: deleting the run" in capsys.readouterr().out
    # a sweep's marker does not let a run's --overwrite delete it (and the other way round)
    swept = tmp_path / "sweep"
    _fake_run(swept, marked=False)
    ownership.write_marker(open_run_dir(swept), "sweep")
    with pytest.raises(ConfigError, match="'sweep' directory, expected a 'run'"):
        prepare_run_dir(tiny_config(swept, overwrite=True))


def test_a_new_run_in_a_directory_holding_something_else_is_refused(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="1 entries that are not a raygpt run.*thesis.tex"):
        prepare_run_dir(tiny_config(docs))
    assert os.listdir(docs) == ["thesis.tex"]
    fresh = tmp_path / "new"
    prepare_run_dir(tiny_config(fresh))  # new: created and marked
    assert os.listdir(fresh) == [MARKER]
    prepare_run_dir(tiny_config(fresh))  # marked and empty of runs: fine again


def _config_file(tmp_path, content) -> str:
    p = tmp_path / "cfg.json"
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(p)


def test_config_files_are_type_checked_and_cannot_place_or_arm_a_run(tmp_path):
    for fields, match in (
            ({"overwrite": "false"}, r"may not set \['overwrite'\]"),
            ({"output_dir": "/"}, r"may not set \['output_dir'\]"),
            ({"resume": 1, "fault": "kill:step=1"}, r"may not set \['fault', 'resume'\]"),
            ({"allow_fault_injection": True}, "may not set"),
            ({"shuffle": "false"}, "shuffle: expected bool, found 'false'"),
            ({"compile": "true"}, "compile: expected bool or null, found 'true'"),
            ({"max_steps": 1.5}, "max_steps: expected int or null, found 1.5"),
            ({"seed": True}, "seed: expected int, found True"),
            ({"learning_rate": "3e-4"}, "learning_rate: expected float or null"),
            ({"spike": {"enabled": "yes"}}, "spike.enabled: expected bool, found 'yes'"),
            ({"spike": {"soft_z": None}}, "spike.soft_z: expected float, found None"),
            ({"nope": 1}, "unknown config field 'nope'"),
            ([1, 2], "expected a JSON object"),
            ("{not json", "expected a JSON object")):
        with pytest.raises(ConfigError, match=match):
            parse_args(["--config", _config_file(tmp_path, fields)])
    big = tmp_path / "big.json"
    big.write_text('{"seed": 1' + " " * (2 << 20) + "}")
    with pytest.raises(ConfigError, match="at most"):
        parse_args(["--config", str(big)])
    ok = parse_args(["--config", _config_file(tmp_path, {"learning_rate": 1, "shuffle": False,
                                                           "spike": {"enabled": True}})])
    assert ok.learning_rate == 1.0 and isinstance(ok.learning_rate, float)
    assert ok.shuffle is False and ok.spike.enabled and not ok.overwrite
    # the same checks hold wherever a config is built from a dict (sweep plans, Ray's payload)
    with pytest.raises(ConfigError, match="overwrite: expected bool, found 'false'"):
        TrainConfig.from_dict({"overwrite": "false"})


def test_overwrite_of_an_s3_bucket_root_is_refused_and_nothing_is_deleted(s3):
    fs, uri = s3
    for name in (LOSS_HISTORY, "main.log", "customers.csv", MARKER):
        _put(fs, f"bucket/{name}", b'{"format": "raygpt-run-dir", "kind": "run"}')
    with pytest.raises(ConfigError, match="bucket root") as e:
        prepare_run_dir(tiny_config(uri("bucket"), overwrite=True))
    assert SECRET not in str(e.value) and QUOTED not in str(e.value)
    names = {i.base_name for i in fs.get_file_info(pafs.FileSelector("bucket"))}
    assert {LOSS_HISTORY, "main.log", "customers.csv", MARKER} <= names
    # a run under a prefix is a run directory like any other
    _fake = f"bucket/runs/a"
    _put(fs, f"{_fake}/{LOSS_HISTORY}", b"{}\n")
    with pytest.raises(ConfigError, match=f"holds no {MARKER}"):
        prepare_run_dir(tiny_config(uri(_fake), overwrite=True))
    prepare_run_dir(tiny_config(uri(_fake), resume=1))
    prepare_run_dir(tiny_config(uri(_fake), overwrite=True))
    assert {i.base_name for i in fs.get_file_info(pafs.FileSelector(_fake))} == {MARKER}


# ====================================================================== 2. one writer: the lease

def test_a_second_job_is_refused_naming_the_holder_until_the_first_releases(tmp_path):
    rd = open_run_dir(tmp_path / "run")
    first = Lease(rd, what="raygpt train")
    first.acquire()
    with pytest.raises(RunDirBusy, match=rf"@.* pid {os.getpid()} \(raygpt train\) holds its "
                                         rf"lease .*expires .* UTC"):
        Lease(rd).acquire()
    first.release()
    assert not rd.exists(LEASE)
    second = Lease(rd)
    assert second.acquire() == "free"
    second.release()


def test_a_dead_jobs_lease_is_taken_over_once_expired_or_at_once_when_its_process_is_gone(tmp_path):
    rd = open_run_dir(tmp_path / "run")
    dead = Lease(rd, ttl_s=0.6)
    dead.acquire()  # never renewed, never released: a job killed outright
    with pytest.raises(RunDirBusy):
        Lease(rd).acquire()  # its process (this one) lives and the lease has not expired
    deadline = time.monotonic() + 10
    while True:
        try:
            how = Lease(rd).acquire()
            break
        except RunDirBusy:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert "expired" in how
    assert dead.renew() is False and "took the lease over" in dead.lost
    # a holder on this host whose process no longer exists: taken over at once
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    record = json.loads(rd.read_bytes(LEASE))
    rd.write_bytes_atomic(LEASE, json.dumps({**record, "token": "x", "pid": gone.pid,
                                             "expires": time.time() + 3600}).encode())
    assert "no longer exists" in Lease(rd).acquire()


def test_the_heartbeat_keeps_a_live_lease_and_a_lineage_takes_over_its_own(tmp_path):
    rd = open_run_dir(tmp_path / "run")
    live = Lease(rd, ttl_s=0.6, lineage="sweep-1/trial-a")
    live.acquire()
    live.start_heartbeat()
    time.sleep(1.5)  # more than twice the ttl: only the heartbeat keeps it
    with pytest.raises(RunDirBusy):
        Lease(rd).acquire()
    with pytest.raises(RunDirBusy):
        Lease(rd, lineage="sweep-1/trial-b").acquire()
    retry = Lease(rd, lineage="sweep-1/trial-a")  # Tune's retry of the same trial
    assert "same lineage" in retry.acquire()
    lost = []
    deadline = time.monotonic() + 5
    while live._thread is not None and live._thread.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert live.lost and not live.held
    live.start_heartbeat(on_lost=lost.append)  # harmless: it stops at once on a lost lease
    retry.release()
    live.release()
    assert not rd.exists(LEASE)


def test_the_lease_works_on_s3(s3):
    fs, uri = s3
    rd = open_run_dir(uri("bucket/leased"))
    first = Lease(rd, ttl_s=1.0, settle_s=0.05)
    first.acquire()
    with pytest.raises(RunDirBusy, match="holds its lease"):
        Lease(rd, settle_s=0.05).acquire()
    assert fs.get_file_info(f"bucket/leased/{LEASE}").type == pafs.FileType.File
    deadline = time.monotonic() + 10  # the first job dies without a word: expiry
    while True:
        try:
            second = Lease(rd, settle_s=0.05)
            second.acquire()
            break
        except RunDirBusy:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert first.renew() is False
    second.release()
    assert fs.get_file_info(f"bucket/leased/{LEASE}").type == pafs.FileType.NotFound


def test_overwrite_refuses_a_live_run(tmp_path):
    run = tmp_path / "run"
    _fake_run(run, marked=True)
    holder = Lease(open_run_dir(run))
    holder.acquire()
    with pytest.raises(RunDirBusy, match="another job writes this run directory"):
        prepare_run_dir(tiny_config(run, overwrite=True), Lease(open_run_dir(run)))
    assert (run / LOSS_HISTORY).exists() and (run / "step_00000004").is_dir()
    holder.release()
    prepare_run_dir(tiny_config(run, overwrite=True), Lease(open_run_dir(run)))
    assert not (run / LOSS_HISTORY).exists()


def test_a_claim_refuses_a_second_job_and_releases_on_the_way_out(tmp_path):
    cfg = tiny_config(tmp_path / "run")
    with claimed_run_dir(cfg):
        with pytest.raises(RunDirBusy):
            with claimed_run_dir(cfg.with_overrides({"resume": 1})):
                pass
        assert open_run_dir(cfg.output_dir).exists(LEASE)
    with pytest.raises(RuntimeError, match="boom"):
        with claimed_run_dir(cfg.with_overrides({"resume": 1})):
            raise RuntimeError("boom")
    with claimed_run_dir(cfg.with_overrides({"resume": 1})):  # -y 1 right after: no waiting
        pass
    assert not open_run_dir(cfg.output_dir).exists(LEASE)


# ====================================================================== 4. a Ray of one's own

def test_a_run_starts_its_own_ray_unless_an_address_is_given(monkeypatch):
    import ray

    from raygpt.ray import driver
    from raygpt.ray import sweep
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda address=None, **kw: seen.append(address))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    driver.init_ray()
    sweep._ensure_ray(None)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    driver.init_ray()
    driver.init_ray("ray://head:10001")
    assert seen == ["local", "local", "10.0.0.1:6379", "ray://head:10001"]


# ====================================================================== 5. fault injection

def test_a_fault_from_the_environment_needs_the_flag_and_is_announced(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAYGPT_FAULT", "kill:rank=0,step=3")
    cfg = tiny_config(tmp_path / "run")
    with pytest.raises(ConfigError, match="RAYGPT_FAULT.*--allow-fault-injection"):
        with claimed_run_dir(cfg):
            pass
    assert not (tmp_path / "run").exists()  # refused before anything was touched
    assert plan_for("", 0).faults == []  # a worker never reads its environment
    with claimed_run_dir(cfg.with_overrides({"allow_fault_injection": True,
                                             "fault": "nan:rank=0,step=5"})) as (armed, rd):
        assert armed.fault == "nan:rank=0,step=5;kill:rank=0,step=3"
        assert [f.kind for f in plan_for(armed.fault, 0).faults] == ["nan", "kill"]
    out = capsys.readouterr().out
    assert "FAULT INJECTION ARMED: nan:rank=0,step=5;kill:rank=0,step=3 (from --fault and " \
           "RAYGPT_FAULT)" in out
    record = [json.loads(x) for x in (tmp_path / "run" / RECORD).read_text().splitlines()]
    assert record[-1]["sources"] == ["--fault", "RAYGPT_FAULT"]
    (tmp_path / "run" / LOSS_HISTORY).write_text('{"kind":"start","step":0,"time":1}\n')
    assert "FAULT INJECTION ARMED 1 time(s)" in run_status(str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="expected a kind"):
        armed_spec("", {"RAYGPT_FAULT": "explode:step=1"}, True)
    assert armed_spec("", {}, False) == ("", [])


def test_the_train_command_refuses_an_inherited_fault(tmp_path, monkeypatch, capsys):
    from raygpt.cli import main
    monkeypatch.setenv("RAYGPT_FAULT", "kill:rank=0,step=1")
    code = main(["train", "--cpu", "-e", "d2", "-o", str(tmp_path / "r"), "-x", "2"])
    assert code == 2 and "--allow-fault-injection" in capsys.readouterr().err
    assert parse_args(["--allow-fault-injection"]).allow_fault_injection is True


# ====================================================================== 6. untrusted files

def _checkpoint(rd: RunDir, step: int) -> None:
    d = ck.step_dir(step)
    rd.write_bytes_atomic(f"{d}/{ck.model_file(step)}", os.urandom(64))
    rd.write_bytes_atomic(f"{d}/{ck.state_file(step, 0)}", os.urandom(64))
    ck.write_done(rd, step)
    ck.write_manifest(rd, step, world_size=1, num_parameters=16, config_hash="c",
                      tokenizer_hash="t", data_hash="d")


def _tamper(rd: RunDir, step: int, edit) -> None:
    rel = f"{ck.step_dir(step)}/{ck.MANIFEST}"
    m = json.loads(rd.read_bytes(rel))
    edit(m)
    rd.write_bytes_atomic(rel, json.dumps(m).encode())


def test_manifest_names_stay_inside_their_step_directory(tmp_path, monkeypatch):
    rd = open_run_dir(tmp_path / "run")
    _checkpoint(rd, 1)
    _checkpoint(rd, 2)
    secret = tmp_path / "secret"
    secret.write_bytes(b"outside the run")
    import hashlib
    entry = {"size": secret.stat().st_size, "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}
    _tamper(rd, 2, lambda m: m["files"].update({"../../secret": entry}))
    hashed = []
    real = RunDir.sha256_of
    monkeypatch.setattr(RunDir, "sha256_of", lambda self, rel, **kw: hashed.append(rel) or real(self, rel, **kw))
    warnings = []
    assert ck.find_latest_verified(rd, warn=warnings.append) == 1
    assert "step 2" in warnings[0] and "files['../../secret']" in warnings[0]
    assert not any(".." in r for r in hashed)
    for bad in ("/etc/passwd", "sub/x", "..", "", " model", "a\\b"):
        _tamper(rd, 2, lambda m: (m["files"].clear(), m["files"].update({bad: entry})))
        assert "expected a file name inside the step directory" in ck.verify_checkpoint(rd, 2)[-1]


@pytest.mark.timeout(60)  # an unbounded read of /dev/zero fails here, not at the suite's 15 min
def test_a_manifest_linked_to_dev_zero_is_refused_without_reading_it_all(tmp_path):
    rd = open_run_dir(tmp_path / "run")
    _checkpoint(rd, 1)
    _checkpoint(rd, 2)
    manifest = tmp_path / "run" / ck.step_dir(2) / ck.MANIFEST
    manifest.unlink()
    manifest.symlink_to("/dev/zero")
    t0 = time.monotonic()
    problems = ck.verify_checkpoint(rd, 2)
    assert "expected at most" in problems[-1]
    assert ck.find_latest_verified(rd, warn=lambda m: None) == 1
    assert [c.ok for c in check_checkpoints(rd, verify="quick")] == [True, False]
    # a listed file that is a link to /dev/zero (listed as empty) is not hashed forever either
    model = tmp_path / "run" / ck.step_dir(1) / ck.model_file(1)
    model.unlink()
    model.symlink_to("/dev/zero")
    _tamper(rd, 1, lambda m: m["files"][ck.model_file(1)].update(size=0))
    assert any("not a readable file" in p or "unreadable" in p for p in ck.verify_checkpoint(rd, 1))
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("edit, says", [
    (lambda m: m["files"].update({"model_00000002.bin": "x"}), "expected {size, sha256}"),
    (lambda m: m["files"]["model_00000002.bin"].update(size="64"), "size: expected an integer"),
    (lambda m: m["files"]["model_00000002.bin"].update(sha256=None), "sha256: expected 64 hex"),
    (lambda m: m.update(world_size="1"), "world_size: expected an integer"),
    (lambda m: m.update(extra=[]), "extra: expected an object"),
    (lambda m: m.update(files=[]), "files: expected an object"),
    (lambda m: m["files"].update({"sub": {"size": 0, "sha256": "0" * 64}}), "not a readable file"),
])
def test_a_malformed_manifest_condemns_its_checkpoint_not_the_reader(tmp_path, edit, says):
    rd = open_run_dir(tmp_path / "run")
    _checkpoint(rd, 1)
    _checkpoint(rd, 2)
    rd.makedirs(f"{ck.step_dir(2)}/sub")
    _tamper(rd, 2, edit)
    assert says in " ".join(ck.verify_checkpoint(rd, 2))
    warnings = []
    assert ck.find_latest_verified(rd, warn=warnings.append) == 1  # resume falls back
    assert "step 2" in warnings[0]
    assert ck.verify_checkpoint(rd, 2, hashes=False)  # the quick check
    rd.write_bytes_atomic(LOSS_HISTORY, b'{"kind":"start","step":0,"time":1}\n')
    text = run_status(rd)
    assert "NOT usable: step 2" in text and "1 complete: step 1" in text  # quick: sizes only
    text = run_status(rd, verify="full")
    assert "NOT usable: step 2" in text and "1 verified: step 1" in text


def test_status_streams_a_long_history_in_bounded_memory(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    n = 60_000
    line = ('{"kind":"train","step":%d,"loss":3.25,"norm":1.5,"lr":0.0006,"tokens":%d,"dt":0.1,'
            '"verdict":"ok","world":8,"pad":"' + "x" * 200 + '","time":%d,"attempt":1}\n')
    with open(run / LOSS_HISTORY, "w") as f:
        f.write('{"kind":"start","step":0,"time":0,"attempt":1,"max_steps":%d}\n' % n)
        for s in range(n):
            f.write(line % (s, (s + 1) * 4096, s))
    size = (run / LOSS_HISTORY).stat().st_size
    tracemalloc.start()
    try:
        text = run_status(str(run))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"{n}/{n} steps (100.0%)" in text
    assert "goodput" in text
    # the whole file is ~17 MB and its records as Python dicts many times that; streaming
    # keeps one 8 MiB chunk, the last lines and a number per step
    assert peak < 0.9 * size, (peak, size)


def test_status_prints_no_terminal_escapes_and_no_credentials(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    hostile = [
        {"kind": "start", "step": 0, "time": 1, "max_steps": 4},
        {"kind": "train", "step": 0, "loss": 3.0, "norm": 1.0, "lr": 1e-3, "tokens": 10, "dt": 0.1, "time": 2},
        {"kind": "skip", "step": 0, "reason": "\x1b]0;pwned\x07\x1b[2J\rlooks fine", "time": 3},
        {"kind": "failure", "causes": {"0": f"OSError: s3://AKIATEST:{SECRET}@bucket/run \x1b[1A"},
         "time": 4},
        {"kind": "audit", "step": 0, "message": "resume verified \u202egnp.exe", "time": 5},
        {"kind": "train", "step": 1, "loss": "NaN\x1b[31m", "norm": 1, "lr": 1, "tokens": 1, "time": 6},
    ]
    (run / LOSS_HISTORY).write_text("".join(json.dumps(r) + "\n" for r in hostile))
    text = run_status(str(run))
    for bad in ("\x1b", "\x07", "\r", "\u202e", SECRET):
        assert bad not in text, repr(bad)
    assert "\\x1b]0;pwned\\x07" in text and "s3://***@bucket/run" in text
    assert "1 malformed record(s) left out" in text


def test_failure_reports_and_sweep_plans_never_hold_credentials(tmp_path, s3):
    from raygpt.ray import driver
    from raygpt.ray import sweep
    fs, uri = s3
    cfg = tiny_config(uri("bucket/failed"))
    report = driver._failure_report(cfg, 0.0, RuntimeError(f"at s3://AKIATEST:{SECRET}@bucket/x"))
    assert SECRET not in report and QUOTED not in report and "AKIATEST" not in report
    assert "s3://***@bucket/failed?endpoint_override" in report and "s3://***@bucket/x" in report
    sweep_dir = uri("bucket/sweep")
    plan = sweep.SweepPlan(sweep_dir=sweep_dir, mode="grid", user_base=cfg.to_dict(),
                           base=cfg.to_dict())
    rd = open_run_dir(sweep_dir)
    sweep.write_plan(rd, plan)
    stored = rd.read_bytes(sweep.PLAN_FILE).decode()
    assert SECRET not in stored and QUOTED not in stored and "AKIATEST" not in stored
    assert "s3://***@bucket/sweep" in stored
    assert sweep.read_plan(rd, sweep_dir).sweep_dir == sweep_dir  # the caller's own spelling


def test_the_loader_keeps_a_bounded_number_of_shards_open(tmp_path):
    """A glob of many shards must not hold a descriptor per shard: with the soft limit on open
    files set just above what the process has open, reading every shard still works."""
    rng = np.random.default_rng(0)
    for i in range(120):
        write_shard(tmp_path / f"s_{i:04d}.bin", rng.integers(0, 50257, 4 * 8 + 1))
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    loader = DistributedDataLoader(str(tmp_path / "s_*.bin"), 1, 8, 0, 1, shuffle=True, seed=1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = fds()
    resource.setrlimit(resource.RLIMIT_NOFILE, (before + 40, hard))
    try:
        for _ in range(120 * 4 + 4):  # every sample of every shard, into the next epoch
            loader.next_batch()
            assert loader.open_shards <= DistributedDataLoader.MAX_OPEN_SHARDS
        assert fds() <= before + DistributedDataLoader.MAX_OPEN_SHARDS + 1
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    small = DistributedDataLoader(str(tmp_path / "s_*.bin"), 1, 8, 0, 1, max_open_shards=2)
    for _ in range(40):
        small.next_batch()
    assert small.open_shards == 2
