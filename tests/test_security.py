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
from raygpt.config import ConfigError, TrainConfig, parse_args
from raygpt.data.loader import DistributedDataLoader
from raygpt.llmc.shards import write_shard
from raygpt.runlog.history import LOSS_HISTORY
from raygpt.runlog.report import check_checkpoints, run_status
from raygpt.storage import RunDir, open_run_dir
from raygpt.storage import ownership
from raygpt.storage.ownership import LEASE, MARKER, Lease, RunDirBusy, refused_overwrite_target
from raygpt.train.run_dir import claimed_run_dir, prepare_run_dir
from raygpt.train.faults import RECORD, armed_spec, plan_for
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


def _raygpt_config(d) -> None:
    """The config.json a raygpt run writes at its launch (run_config's format)."""
    from raygpt.runlog.run_config import CONFIG_FILE, FORMAT
    record = {"format": FORMAT, "version": 1, "launch": 1, "config": tiny_config(d).to_dict()}
    open_run_dir(d).write_bytes_atomic(CONFIG_FILE, json.dumps(record).encode())


def _tree(d) -> dict:
    """{relative path: bytes (None for a directory)} of everything under `d`: what "unchanged,
    byte for byte" compares."""
    return {str(p.relative_to(d)): None if p.is_dir() else p.read_bytes()
            for p in sorted(d.rglob("*"))}


def test_overwrite_needs_the_marker_and_a_resume_adopts_only_an_older_raygpt_run(tmp_path, capsys):
    """A run from before markers (raygpt's config.json) is adopted by -y 1: marked, with every
    file it holds left byte for byte; only then may --overwrite delete it."""
    old = tmp_path / "old"
    _fake_run(old, marked=False)
    _raygpt_config(old)
    before = _tree(old)
    with pytest.raises(ConfigError, match=f"holds no {MARKER}.*delete it by hand"):
        prepare_run_dir(tiny_config(old, overwrite=True))
    with pytest.raises(ConfigError, match="without run-directory markers.*pass -y 1"):
        prepare_run_dir(tiny_config(old))
    assert _tree(old) == before
    prepare_run_dir(tiny_config(old, resume=1))  # -y 1: raygpt's own run, marked now
    marker = ownership.read_marker(open_run_dir(old))
    assert marker["kind"] == "run" and marker["adopted"] is True
    assert marker["uid"] == os.geteuid() and marker["user"] and marker["host"]
    assert {k: v for k, v in _tree(old).items() if k != MARKER} == before  # nothing rewritten
    prepare_run_dir(tiny_config(old, overwrite=True))  # marked now: a fresh start over it
    assert sorted(os.listdir(old)) == [MARKER]
    assert "--overwrite: deleting the run" in capsys.readouterr().out
    # a sweep's marker does not let a run's --overwrite delete it (and the other way round)
    swept = tmp_path / "sweep"
    _fake_run(swept, marked=False)
    ownership.write_marker(open_run_dir(swept), "sweep")
    with pytest.raises(ConfigError, match="'sweep' directory, expected a 'run'"):
        prepare_run_dir(tiny_config(swept, overwrite=True))
    with pytest.raises(ConfigError, match="'sweep' directory, expected a 'run'"):
        prepare_run_dir(tiny_config(swept, resume=1))  # nor a run write into a sweep


def test_a_new_run_in_a_directory_holding_something_else_is_refused(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="1 entries raygpt did not create for a run.*thesis.tex"
                                          ".*name a new or empty directory"):
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
    _fake = f"bucket/runs/a"  # a run from before markers: its loss history and config.json
    _put(fs, f"{_fake}/{LOSS_HISTORY}", b"{}\n")
    _put(fs, f"{_fake}/config.json", json.dumps({"format": "raygpt-config", "config": {}}).encode())
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


# ====================================================================== 3. nothing that is not ours

def test_a_foreign_main_log_is_never_truncated_adopted_or_deleted(tmp_path):
    """A shared directory holding a colleague's main.log (a name raygpt's runs use) and a file
    beside it: -y 1 used to mark it adopted (then the run's Logger truncated main.log) and a
    later --overwrite deleted both. Every claim is refused in one line, before anything is
    written (not even the lease's files)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "main.log").write_bytes(b"s:1 trl:9.9999\na colleague's line, no newline")
    (shared / "notes.txt").write_bytes(b"keep me")
    before = _tree(shared)
    for flags in (dict(resume=1), dict(overwrite=True), dict(resume=1, overwrite=True), {}):
        with pytest.raises(ConfigError) as e:
            with claimed_run_dir(tiny_config(shared, **flags)):
                pass
        message = str(e.value)
        assert "\n" not in message and str(shared) in message, flags
        assert "'main.log', 'notes.txt'" in message and "name a new or empty directory" in message
        if flags.get("resume"):
            assert ("-y 1 resumes only a raygpt run of yours, and it holds neither a config.json "
                    "in raygpt's format nor a complete raygpt checkpoint") in message
        assert _tree(shared) == before, flags  # byte for byte, and no file added


def test_sweep_o_on_a_directory_holding_anything_else_is_refused_before_anything_is_written(tmp_path):
    """`raygpt sweep -o DIR` used to mark any directory a sweep (and --overwrite then deleted
    it): refused before Ray starts (`_checked_before_ray`) and again where the plan is written
    (`_new_plan`), with or without --overwrite; no marker, no file added."""
    from raygpt.ray import sweep

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.csv").write_bytes(b"lr,loss\n")
    before = _tree(mine)
    base = tiny_config(mine)
    for b in (base, base.with_overrides({"overwrite": True})):
        with pytest.raises(ConfigError, match=r"found 1 entries raygpt did not create for a sweep "
                                              r"\(no raygpt_run.json; e.g. 'results.csv'\)"):
            sweep._checked_before_ray(b, {"learning_rate": 1e-3}, str(mine),
                                      open_run_dir(str(mine)), {"early_stop": "none"}, None)
        with pytest.raises(ConfigError, match="entries raygpt did not create for a sweep"):
            sweep._new_plan("grid", b, b, str(mine), open_run_dir(str(mine)), {}, lease=None)
        assert _tree(mine) == before
    # a new directory becomes this user's sweep; a second plan needs --overwrite
    new = tmp_path / "new"
    sweep._new_plan("grid", base, base, str(new), open_run_dir(str(new)), {})
    marker = ownership.read_marker(open_run_dir(new))
    assert marker["kind"] == "sweep" and marker["uid"] == os.geteuid()
    with pytest.raises(ConfigError, match="found an existing sweep"):
        sweep._new_plan("grid", base, base, str(new), open_run_dir(str(new)), {})
    sweep._new_plan("grid", base.with_overrides({"overwrite": True}), base, str(new),
                    open_run_dir(str(new)), {})
    assert ownership.read_marker(open_run_dir(new))["run_id"] != marker["run_id"]  # started over


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_another_uids_marker_directory_or_run_is_refused(tmp_path):
    """On shared storage (NFS, umask 002) another user's run can be writable: its marker, an
    empty directory of theirs, or their run from before markers is never claimed."""
    run = tmp_path / "run"
    _fake_run(run, marked=True)
    os.chown(run / MARKER, 4242, 4242)
    before = _tree(run)
    for flags in (dict(overwrite=True), dict(resume=1), {}):
        with pytest.raises(ConfigError, match=f"{MARKER} is not yours: the file is owned by uid "
                                              f"4242, not by you \\(uid 0\\)"):
            prepare_run_dir(tiny_config(run, **flags), Lease(open_run_dir(run)))
        assert _tree(run) == before, flags
    with pytest.raises(ConfigError, match="--overwrite .*owned by uid 4242"):
        ownership.check_overwrite(open_run_dir(run), "run", str(run))
    empty = tmp_path / "theirs"
    empty.mkdir()
    os.chown(empty, 4242, 4242)
    with pytest.raises(ConfigError, match="the directory is owned by uid 4242"):
        prepare_run_dir(tiny_config(empty))
    assert os.listdir(empty) == []
    old = tmp_path / "old"
    _fake_run(old, marked=False)
    _raygpt_config(old)
    os.chown(old / "config.json", 4242, 4242)
    with pytest.raises(ConfigError, match="config.json is owned by uid 4242"):
        prepare_run_dir(tiny_config(old, resume=1))
    assert not (old / MARKER).exists()


def test_a_marker_that_names_another_owner_or_is_a_link_is_refused(tmp_path):
    """A marker copied from another user's run (or edited), a version-1 marker of another user,
    a symlink to someone's marker, and on an object store a marker of another user name."""
    run = tmp_path / "run"
    _fake_run(run, marked=True)
    record = json.loads((run / MARKER).read_text())
    other = os.geteuid() + 1
    (run / MARKER).write_text(json.dumps({**record, "uid": other}))
    before = _tree(run)
    with pytest.raises(ConfigError, match=rf"names \S+ \(uid {other}\) as its owner, not you"):
        prepare_run_dir(tiny_config(run, overwrite=True))
    (run / MARKER).write_text(json.dumps({"format": "raygpt-run-dir", "version": 1, "kind": "run",
                                          "created_by": "mallory@elsewhere"}))
    with pytest.raises(ConfigError, match="names 'mallory' as its owner"):
        prepare_run_dir(tiny_config(run, resume=1))
    elsewhere = tmp_path / "elsewhere"
    ownership.write_marker(open_run_dir(elsewhere), "run")
    (run / MARKER).unlink()
    (run / MARKER).symlink_to(elsewhere / MARKER)
    with pytest.raises(ConfigError, match="expected a regular file written by raygpt, found a symlink"):
        prepare_run_dir(tiny_config(run, overwrite=True))
    assert {k: v for k, v in _tree(run).items() if k != MARKER} == \
        {k: v for k, v in before.items() if k != MARKER}
    from tests.helpers import memory_fs
    store = open_run_dir((memory_fs(), f"/owned-{os.getpid()}-{time.time_ns()}"))
    ownership.write_marker(store, "run")
    record = json.loads(store.read_bytes(MARKER))
    store.write_bytes_atomic(MARKER, json.dumps({**record, "user": "mallory"}).encode())
    with pytest.raises(ConfigError, match="names mallory \\(uid .*\\) as its owner, not you"):
        ownership.check_overwrite(store, "run", "s3://bucket/runs/x")


def test_owner_problem_compares_the_file_owner_and_the_recorded_uid_or_user():
    v2 = {"version": 2, "user": "ann", "uid": 1000}
    assert ownership.owner_problem(v2, 1000, "ann", 1000) is None
    assert ownership.owner_problem(v2, 1000, "ann-in-a-container", 1000) is None  # the uid decides
    assert "owned by uid 1001" in ownership.owner_problem(v2, 1001, "ann", 1000)
    assert "names ann (uid 1000)" in ownership.owner_problem(v2, 1001, "bob", 1001)
    assert ownership.owner_problem(v2, None, "ann", 1234) is None  # object store: the user name
    assert "not you (bob)" in ownership.owner_problem(v2, None, "bob", 1000)
    v1 = {"version": 1, "created_by": "ann@host-a"}
    assert ownership.owner_problem(v1, 1000, "ann", 1000) is None
    assert "names 'ann'" in ownership.owner_problem(v1, 1000, "bob", 1000)
    assert "names no one" in ownership.owner_problem({"version": 1}, None, "ann", 1000)


def test_compact_takes_the_runs_lease_and_touches_only_a_run_of_yours(s3, capsys):
    """`raygpt compact` beside a live run could hide the parts it stores and deletes what it
    merged: refused, naming the holder, while the lease is held; done once it is released.
    A prefix that is not a raygpt run of this user's is never compacted."""
    from raygpt.cli import main
    fs, uri = s3
    prefix = "bucket/compacted"
    rd = open_run_dir(uri(prefix))
    ownership.write_marker(rd, "run")
    for seq in range(3):
        _put(fs, f"{prefix}/main_log/part-{seq:08d}-aaaaaaaa.log", f"s:{seq} trl:1.0\n".encode())

    def listing(p):
        return sorted(i.path for i in fs.get_file_info(pafs.FileSelector(p, recursive=True)))
    holder = Lease(rd, what="raygpt train", settle_s=0.05)
    holder.acquire()
    before = listing(prefix)
    assert main(["compact", uri(prefix)]) == 1
    err = capsys.readouterr().err
    assert "pid" in err and "(raygpt train) holds its lease" in err and SECRET not in err
    assert listing(prefix) == before
    holder.release()
    assert main(["compact", uri(prefix)]) == 0
    assert "main.log: 3 segments merged" in capsys.readouterr().out
    assert fs.get_file_info(pafs.FileSelector(f"{prefix}/main_log"))[0].base_name == "base-00000002.log"
    other = "bucket/someone-else"
    _put(fs, f"{other}/main.log", b"theirs\n")
    _put(fs, f"{other}/main_log/part-00000000-bbbbbbbb.log", b"s:0 trl:1.0\n")
    before = listing(other)
    assert main(["compact", uri(other)]) == 2  # not a run of yours: bad input, as for train
    assert "expected a raygpt run directory of yours" in capsys.readouterr().err
    assert listing(other) == before


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
    assert "is a symbolic link; raygpt never reads through links" in problems[-1]
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
    report = driver._failure_report(cfg, open_run_dir(cfg.output_dir), 0.0,
                                    RuntimeError(f"at s3://AKIATEST:{SECRET}@bucket/x"))
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


# ====================================================================== 7. a shared run directory
# (issue 43: NFS with umask 002, where another user can plant files and links)

_CONTROL = ("\x1b", "\x07", "\r", "\x08", "\x9b", "\u202e", "\u2066")  # ESC, BEL, CR, BS, CSI, bidi
_HOSTILE = "\x1b]0;pwned\x07\x1b[2J\rfine\x08\x9b1A\u202egnp.exe\u2066"


def _history(run, records) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / LOSS_HISTORY).write_text("".join(json.dumps(r) + "\n" for r in records))


_TRAINED = [{"kind": "start", "step": 0, "time": 1, "attempt": 1, "max_steps": 4},
            {"kind": "train", "step": 0, "loss": 3.0, "norm": 1.0, "lr": 1e-3, "tokens": 64,
             "dt": 0.1, "time": 2, "attempt": 1},
            {"kind": "train", "step": 1, "loss": 2.9, "norm": 1.0, "lr": 1e-3, "tokens": 128,
             "dt": 0.1, "time": 3, "attempt": 1}]


def _status(argv, capsys) -> tuple[int, str, str]:
    from raygpt.cli import main
    code = main(["status", *argv])  # the command line: it hands status the sweep reader
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plot_replaces_a_planted_plot_png_link_and_never_writes_through_it(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from raygpt.runlog.report import plot_main
    run, victim = tmp_path / "run", tmp_path / "victim" / "thesis.tex"
    _history(run, _TRAINED)
    victim.parent.mkdir()
    victim.write_text("years of work")
    (run / "plot.png").symlink_to(victim)
    assert plot_main([str(run)]) == 0
    assert victim.read_text() == "years of work"
    assert not (run / "plot.png").is_symlink()
    assert (run / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # -o naming a link elsewhere: the link is replaced as well, its target never written
    (tmp_path / "out.png").symlink_to(victim)
    assert plot_main([str(run), "-o", str(tmp_path / "out.png")]) == 0
    assert victim.read_text() == "years of work" and not (tmp_path / "out.png").is_symlink()


def test_a_planted_main_log_link_stops_the_run_with_one_line_and_its_target_is_unchanged(tmp_path):
    """A resume (-y 1) appends to main.log and the loss history: a link planted at either is
    refused (O_NOFOLLOW), the run stops as a bad input (no retry would get past it), and the
    file the link points at is untouched."""
    import torch

    from raygpt.runlog.history import RunHistory, append_record
    from raygpt.storage.atomic_file import RefusedPath
    from raygpt.train.errors import EXIT_BAD_INPUT, stop_code
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession

    victim = tmp_path / "victim_bashrc"
    victim.write_text("alias ls=ls\n")
    cfg = tiny_config(tmp_path / "run", max_steps=2, checkpoint_every=2).resolve(0)
    with claimed_run_dir(cfg) as (cfg, run_dir):
        train(cfg, LocalSession(run_dir, torch.device("cpu")))
    planted = tmp_path / "run" / "main.log"
    planted.unlink()
    planted.symlink_to(victim)
    with pytest.raises(Exception) as e:
        with claimed_run_dir(cfg.with_overrides({"resume": 1, "max_steps": 4})) as (c, rd):
            train(c, LocalSession(rd, torch.device("cpu")))
    message = str(e.value)
    assert f"{planted}: is a symbolic link; raygpt never writes through links in a run " \
           f"directory" in message and "\n" not in message, message
    assert stop_code(e.value) == EXIT_BAD_INPUT
    assert victim.read_text() == "alias ls=ls\n"
    # the loss history: its resume read refuses the link already, and so would its append
    history = tmp_path / "run" / LOSS_HISTORY
    history.unlink()
    history.symlink_to(victim)
    rd = open_run_dir(tmp_path / "run")
    with pytest.raises(RefusedPath, match="never reads through links"):
        RunHistory(rd, cfg, enabled=True).begin_attempt(resumed_from=2, note=None)
    with pytest.raises(RefusedPath, match=f"{history}: is a symbolic link; raygpt never writes"):
        append_record(rd, {"kind": "failure", "time": 1})
    assert victim.read_text() == "alias ls=ls\n"


def test_no_write_read_or_append_goes_through_a_link_below_the_root_and_the_root_may_be_one(
        tmp_path):
    from raygpt.runlog.run_config import write_launch
    from raygpt.storage.atomic_file import RefusedPath

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "MANIFEST.json").write_text('{"secret": 1}')
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "chosen").symlink_to(real)  # -o /data/run where /data -> /mnt: the user's link
    rd = open_run_dir(tmp_path / "chosen" / "run")
    rd.write_bytes_atomic("config.json", b"{}")
    rd.append_text("main.log", "s:0 trl:1.0\n")
    rd.makedirs("step_00000002")
    assert rd.read_bytes("config.json") == b"{}" and (real / "run" / "main.log").exists()

    run = real / "run"
    (run / "step_00000004").symlink_to(elsewhere)  # a symlinked subdirectory
    (run / "tensorboard").symlink_to(elsewhere)
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "model_00000004.bin").write_bytes(b"weights")
    refused = "is a symbolic link; raygpt never writes through links in a run directory"
    for write in (lambda: rd.write_bytes_atomic("step_00000004/DONE_00000004", b""),
                  lambda: rd.append_text("step_00000004/log.jsonl", "{}\n"),
                  lambda: rd.makedirs("tensorboard/run1"),
                  lambda: rd.move_dir_in(staged, "step_00000004"),
                  lambda: rd.upload_dir(staged, "step_00000004")):
        named = tmp_path / "chosen" / "run"  # as the user spelled it
        with pytest.raises(RefusedPath, match=f"{named / 'step_00000004'}: {refused}|"
                                              f"{named / 'tensorboard'}: {refused}"):
            write()
    from types import SimpleNamespace

    from raygpt.ray.checkpoints import store_by_rename  # Ray's upload of a rank's files, by rename
    with pytest.raises(RefusedPath, match=f"{run / 'step_00000004'}: {refused}"):
        store_by_rename(SimpleNamespace(path=str(staged), filesystem=None), "step_00000004",
                        dest=run / "step_00000004")
    assert sorted(os.listdir(elsewhere)) == ["MANIFEST.json"]
    assert (staged / "model_00000004.bin").exists()
    # reads: neither through the linked directory nor through a link at the file's own name
    with pytest.raises(RefusedPath, match="raygpt never reads through links"):
        rd.read_bytes("step_00000004/MANIFEST.json")
    (run / "config.json").unlink()
    (run / "config.json").symlink_to(elsewhere / "MANIFEST.json")
    with pytest.raises(RefusedPath, match="config.json: is a symbolic link"):
        rd.read_bytes("config.json")
    # a launch never copies a planted config.json's target into the run (config.1.json)
    with pytest.raises(ConfigError, match="config.json: is a symbolic link"):
        write_launch(rd, tiny_config(rd.root).resolve(0), argv=["raygpt"])
    assert not (run / "config.1.json").exists()
    # an atomic write over a link replaces the link, never its target
    rd.write_bytes_atomic("config.json", b"{}")
    assert not (run / "config.json").is_symlink()
    assert (elsewhere / "MANIFEST.json").read_text() == '{"secret": 1}'
    # a planted FIFO is refused, not waited on
    os.mkfifo(run / "fifo.json")
    with pytest.raises(RefusedPath, match="expected a regular file, found a FIFO"):
        rd.read_bytes("fifo.json")
    with pytest.raises(RefusedPath, match="expected a regular file, found a FIFO"):
        rd.append_text("fifo.json", "{}\n")


def test_status_prints_no_control_character_from_any_file(tmp_path, capsys, caplog):
    """ESC sequences, CR, backspace, C1 CSI and bidi overrides planted in config.json's command
    line, the loss history's string fields, a failure record, a fired fault, a segment's name
    and a sweep's mode and settings: `raygpt status` prints each as a visible escape."""
    from raygpt.ray import sweep
    from raygpt.runlog.run_config import write_launch

    run = tmp_path / "run"
    _history(run, _TRAINED + [
        {"kind": "skip", "step": 1, "reason": _HOSTILE, "time": 4},
        {"kind": "failure", "causes": {_HOSTILE: f"OSError: {_HOSTILE}\nckpts     forged"},
         "time": 5},
        {"kind": "resume", "step": 0, "resumed_from": _HOSTILE, "attempt": 2, "time": 6},
        {"kind": "audit", "step": 1, "message": _HOSTILE, "attempt": 2, "time": 7},
        {"kind": "rewind", "step": _HOSTILE, "to_step": _HOSTILE, "time": 8},
        {"kind": "end", "step": _HOSTILE, "time": 9}])
    rd = open_run_dir(run)
    write_launch(rd, tiny_config(run).resolve(0), argv=["raygpt", "train", _HOSTILE],
                 adapted=[_HOSTILE])
    record = json.loads(rd.read_bytes("config.json"))
    record["config"]["model"] = _HOSTILE
    rd.write_bytes_atomic("config.1.json", json.dumps(record).encode())
    rd.write_bytes_atomic("faults/fired/kill_r0_s1", json.dumps(
        {"kind": _HOSTILE, "fault": _HOSTILE, "detail": _HOSTILE, "time": 1}).encode())
    rd.append_text("fault_injection.jsonl", json.dumps({"spec": _HOSTILE, "sources": [_HOSTILE]}) + "\n")
    rd.write_bytes_atomic(f"loss_history/{_HOSTILE}", b"")
    code, out, err = _status([str(run)], capsys)
    assert code == 0, err
    shown = out + err + caplog.text
    for bad in _CONTROL:
        assert bad not in shown, (repr(bad), shown)
    assert "\\x1b]0;pwned\\x07" in out and "\\u202egnp.exe" in out
    assert not any(line.startswith("ckpts     forged") for line in out.splitlines())

    sweep_dir = tmp_path / "sweep"
    plan = sweep.SweepPlan(sweep_dir=str(sweep_dir), mode=_HOSTILE, user_base={}, base={},
                           settings={_HOSTILE: _HOSTILE})
    sweep.write_plan(open_run_dir(sweep_dir), plan)
    code, out, err = _status([str(sweep_dir)], capsys)  # the mode is refused, quoted escaped
    assert code == 2 and err.count("\n") == 1, err
    for bad in _CONTROL:
        assert bad not in out + err, (repr(bad), out + err)
    assert "mode: expected 'grid' or 'wsd_branch'" in err and "\\x1b]0;pwned\\x07" in err
    # an error that quotes a file: one line, escaped
    (sweep_dir / sweep.PLAN_FILE).write_text(json.dumps({"format": _HOSTILE}))
    code, out, err = _status([str(sweep_dir)], capsys)
    assert code == 2 and err.count("\n") == 1 and not any(bad in err for bad in _CONTROL), err


@pytest.mark.timeout(120)
def test_status_reads_a_sparse_6_gb_segment_and_a_config_linked_to_dev_zero_in_bounded_memory(
        tmp_path, capsys, caplog):
    run = tmp_path / "run"
    _history(run, _TRAINED)
    (run / "loss_history").mkdir()
    huge = run / "loss_history" / "part-00000001-0badf00d.jsonl"
    huge.touch()
    os.truncate(huge, 6 << 30)  # sparse: 6 GB of zeros that take no disk
    (run / "config.json").symlink_to("/dev/zero")
    big_config = run / "config.1.json"
    big_config.touch()
    os.truncate(big_config, 6 << 30)
    t0 = time.monotonic()
    tracemalloc.start()
    try:
        code, out, err = _status([str(run)], capsys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 0, err
    assert "2/4 steps" in out  # the history before the planted segment is all there
    assert peak < 64 << 20, peak
    assert time.monotonic() - t0 < 30
    assert f"{huge}: skipped, unread: expected a segment of at most" in err + caplog.text
    assert f"skipped {run / 'config.json'}: is a symbolic link" in out
    assert f"skipped {big_config}: expected at most 1,048,576 bytes, found more" in out


_DEEP = b"[" * 200_000


def test_json_nested_too_deep_is_one_line_in_every_reader(tmp_path, capsys, caplog):
    """A line of 200,000 '[' makes json.loads raise RecursionError: the loss history (status and
    a resume's read), config.json, a MANIFEST, the fault record, tracking.json, sweep.json and
    the run-dir marker each report it as one line naming the file, or skip that line."""
    from raygpt.checkpointing.protocol import verify_checkpoint
    from raygpt.ray import sweep
    from raygpt.runlog.history import RunHistory, iter_history
    from raygpt.runlog.tracking import TRACKING_FILE, TrackingError, read_ids
    from raygpt.train.faults import read_armed

    run = tmp_path / "run"
    _history(run, _TRAINED)
    with open(run / LOSS_HISTORY, "ab") as f:
        f.write(_DEEP + b"\n")
        f.write(b'{"kind":"train","step":2,"loss":2.8,"norm":1.0,"lr":0.001,"tokens":192,'
                b'"dt":0.1,"time":4,"attempt":1}\n')
    (run / "config.json").write_bytes(_DEEP)
    (run / RECORD).write_bytes(_DEEP + b"\n")
    rd = open_run_dir(run)
    _checkpoint(rd, 2)
    (run / ck.step_dir(2) / ck.MANIFEST).write_bytes(_DEEP)

    code, out, err = _status([str(run)], capsys)
    assert code == 0, err
    assert "3/4 steps" in out
    assert f"{run / LOSS_HISTORY}: line 4: skipped (expected JSON, found arrays or objects nested " \
           f"too deep to parse)" in err + caplog.text
    assert f"skipped {run / 'config.json'}: expected JSON, found arrays or objects nested too " \
           f"deep" in out
    assert "NOT usable: step 2: step_00000002/MANIFEST.json: unreadable: expected JSON, found " \
           "arrays or objects nested too deep to parse" in out
    # the resume's read of the history: the attempt numbering and the audit still work
    assert [r["step"] for r in iter_history(rd) if r["kind"] == "train"] == [0, 1, 2]
    history = RunHistory(rd, tiny_config(run), enabled=True)
    assert history.begin_attempt(resumed_from=2, note=None) == 2
    history.close()
    assert read_armed(rd) == (0, [])
    rd.write_bytes_atomic(TRACKING_FILE, _DEEP)
    with pytest.raises(TrackingError, match="nested too deep"):
        read_ids(rd)
    ownership_marker = run / MARKER
    ownership_marker.write_bytes(_DEEP)
    with pytest.raises(ConfigError, match="nested too deep|expected"):
        prepare_run_dir(tiny_config(run, resume=1))
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    (sweep_dir / sweep.PLAN_FILE).write_bytes(_DEEP)
    capsys.readouterr()  # the warnings of the reads above
    code, out, err = _status([str(sweep_dir)], capsys)
    assert code == 2 and "sweep.json" in err and "nested too deep" in err and err.count("\n") == 1
    assert verify_checkpoint(rd, 2)
