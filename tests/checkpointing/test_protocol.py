"""raygpt.checkpointing.protocol: MANIFEST/DONE verification on a local directory and on an
in-memory pyarrow filesystem, resume selection, compatibility, retention, staging, abandoned
trajectories, finalize, names and copies (the state file format itself:
tests/llmc/test_state_file.py)."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raygpt.checkpointing.protocol import (
    ABANDONED, MANIFEST, abandoned_by, read_abandoned_trajectories,
    record_abandoned_trajectory, CheckpointError, WorldSizeMismatch, check_compatible,
    done_file, find_latest_verified, list_checkpoint_steps, model_file, read_manifest,
    state_file, step_dir,
    verify_bytes, verify_checkpoint,
    write_done, write_manifest,
)
from raygpt.checkpointing.retention import checkpoints_to_delete
from raygpt.checkpointing.staging import (PIDLESS_STAGE_STALE_S, STAGE_STALE_S, private_stage_root,
                                          stage_dir, sweep_dead_stage_roots)
from raygpt.config import TrainConfig
from raygpt.llmc.state_file import read_state_file
from tests.helpers import memory_fs
from raygpt.storage import RunDir, open_run_dir
from tests.llmc.test_state_file import P, state_bytes


# ---------------------------------------------------------------------- manifest and verify
@pytest.fixture(params=["local", "memory"])
def run_dir(request, tmp_path):
    if request.param == "local":
        yield open_run_dir(tmp_path / "run")
        return
    fs = memory_fs()
    root = f"/raygpt-ckpt-test-{uuid.uuid4().hex}"
    yield open_run_dir((fs, root))
    if fs.get_file_info(root).type != pafs.FileType.NotFound:
        fs.delete_dir(root)


IDENTITY = TrainConfig().identity()


def make_checkpoint(rd: RunDir, step: int, world: int = 2) -> None:
    d = step_dir(step)
    rd.write_bytes_atomic(f"{d}/{model_file(step)}", os.urandom(256))
    for rank in range(world):
        rd.write_bytes_atomic(f"{d}/{state_file(step, rank)}",
                              state_bytes(rank=rank, num_processes=world, step=step))
    write_done(rd, step)
    write_manifest(rd, step, world_size=world, num_parameters=P, config_hash=TrainConfig().hash(),
                   tokenizer_hash="tok", data_hash="data", config_identity=IDENTITY,
                   extra={"note": "test"})


def test_clean_checkpoint_verifies_and_manifest_lists_every_file(run_dir):
    make_checkpoint(run_dir, 20)
    assert verify_checkpoint(run_dir, 20) == []
    assert verify_checkpoint(run_dir, 20, world_size=2) == []
    man = read_manifest(run_dir, 20)
    assert sorted(man["files"]) == [done_file(20), model_file(20), state_file(20, 0), state_file(20, 1)]
    name = f"{step_dir(20)}/{state_file(20, 1)}"
    assert man["files"][state_file(20, 1)] == {"size": run_dir.size_of(name),
                                               "sha256": run_dir.sha256_of(name)}
    assert (man["step"], man["world_size"], man["num_parameters"]) == (20, 2, P)
    assert man["config_identity"] == json.loads(json.dumps(IDENTITY))
    # the state file read back through storage is the one written
    sf = read_state_file(run_dir.read_bytes(name), num_parameters=P, expect_processes=2, expect_rank=1)
    assert sf.step == 20


def test_flipped_byte_is_a_sha256_problem_naming_the_file(run_dir):
    make_checkpoint(run_dir, 20)
    rel = f"{step_dir(20)}/{state_file(20, 1)}"
    raw = bytearray(run_dir.read_bytes(rel))
    raw[2000] ^= 0x01
    run_dir.write_bytes_atomic(rel, bytes(raw))
    problems = verify_checkpoint(run_dir, 20)
    assert len(problems) == 1 and state_file(20, 1) in problems[0] and "sha256" in problems[0]


def test_truncated_file_is_a_size_problem(run_dir):
    make_checkpoint(run_dir, 20)
    rel = f"{step_dir(20)}/{model_file(20)}"
    run_dir.write_bytes_atomic(rel, run_dir.read_bytes(rel)[:100])
    problems = verify_checkpoint(run_dir, 20)
    assert len(problems) == 1 and model_file(20) in problems[0] and "size" in problems[0]


def test_missing_done_is_a_problem(run_dir):
    make_checkpoint(run_dir, 20)
    run_dir.delete_file(f"{step_dir(20)}/{done_file(20)}")
    problems = verify_checkpoint(run_dir, 20)
    assert any(done_file(20) in p and "missing" in p for p in problems)


def test_missing_or_unreadable_manifest_is_a_problem(run_dir):
    make_checkpoint(run_dir, 20)
    rel = f"{step_dir(20)}/{MANIFEST}"
    run_dir.write_bytes_atomic(rel, b"{not json")
    problems = verify_checkpoint(run_dir, 20)
    assert len(problems) == 1 and MANIFEST in problems[0] and "unreadable" in problems[0]
    run_dir.delete_file(rel)
    problems = verify_checkpoint(run_dir, 20)
    assert len(problems) == 1 and MANIFEST in problems[0] and "missing" in problems[0]
    with pytest.raises(CheckpointError, match="MANIFEST.json: missing"):
        read_manifest(run_dir, 20)


def test_missing_rank_file_is_a_problem(run_dir):
    make_checkpoint(run_dir, 20)
    run_dir.delete_file(f"{step_dir(20)}/{state_file(20, 1)}")
    problems = verify_checkpoint(run_dir, 20)
    assert len(problems) == 1 and state_file(20, 1) in problems[0] and "missing" in problems[0]


def test_rank_file_never_written_is_a_problem(run_dir):
    # a 2-rank checkpoint checked for 3 ranks: rank 2's file was never listed
    make_checkpoint(run_dir, 20)
    problems = verify_checkpoint(run_dir, 20, world_size=3)
    assert len(problems) == 1 and state_file(20, 2) in problems[0] and "not listed" in problems[0]


def test_unlisted_extra_files_are_fine_and_temp_files_are_not_hashed(run_dir):
    d = step_dir(20)
    run_dir.write_bytes_atomic(f"{d}/.{model_file(20)}.tmp-abc", b"half a write")
    make_checkpoint(run_dir, 20)
    assert not any(".tmp-" in name for name in read_manifest(run_dir, 20)["files"])
    run_dir.write_bytes_atomic(f"{d}/ray_metadata.json", b"{}")
    assert verify_checkpoint(run_dir, 20) == []


def test_list_steps_ignores_temp_dirs_and_non_dirs(run_dir):
    for step in (30, 10):
        make_checkpoint(run_dir, step, world=1)
    run_dir.write_bytes_atomic("step_00000040.tmp-xyz/model_00000040.bin", b"partial")
    run_dir.write_bytes_atomic("step_00000050", b"a file, not a checkpoint")
    run_dir.write_bytes_atomic("step_7/x", b"wrong width")
    run_dir.write_bytes_atomic("main.log", b"s:1 trl:1.0\n")
    assert list_checkpoint_steps(run_dir) == [10, 30]


def test_find_latest_verified_falls_back_past_corrupt_newest(run_dir):
    for step in (10, 20, 30):
        make_checkpoint(run_dir, step)
    rel = f"{step_dir(30)}/{state_file(30, 0)}"
    raw = bytearray(run_dir.read_bytes(rel))
    raw[-1] ^= 0xFF
    run_dir.write_bytes_atomic(rel, bytes(raw))
    run_dir.delete_file(f"{step_dir(20)}/{done_file(20)}")  # 20 never completed
    warnings = []
    assert find_latest_verified(run_dir, warn=warnings.append) == 10
    assert len(warnings) == 2
    assert "30" in warnings[0] and state_file(30, 0) in warnings[0]
    assert "20" in warnings[1] and done_file(20) in warnings[1]
    # before_step is strict: the newest verified below 10 does not exist
    assert find_latest_verified(run_dir, before_step=30, warn=warnings.append) == 10
    assert find_latest_verified(run_dir, before_step=10, warn=warnings.append) is None


def test_find_latest_verified_on_empty_run_dir(run_dir):
    assert find_latest_verified(run_dir, warn=pytest.fail) is None


# ---------------------------------------------------------------------- compatibility
def manifest_for(identity=IDENTITY, world=2, **over):
    m = {"step": 20, "world_size": world, "config_identity": json.loads(json.dumps(identity)),
         "config_hash": TrainConfig().hash(), "tokenizer_hash": "tok", "data_hash": "data"}
    m.update(over)
    return m


def test_check_compatible_accepts_identical_run():
    check_compatible(manifest_for(), config_identity=IDENTITY, tokenizer_hash="tok",
                     data_hash="data", world_size=2)


def test_check_compatible_names_every_differing_field():
    cfg = TrainConfig(learning_rate=3e-4, scheduler="wsd")
    cfg.spike.soft_z = 4.0
    with pytest.raises(CheckpointError) as e:
        check_compatible(manifest_for(), config_identity=cfg.identity(), tokenizer_hash="tok2",
                         data_hash="data", world_size=2)
    msg = str(e.value)
    assert not isinstance(e.value, WorldSizeMismatch)
    for field in ("learning_rate", "scheduler", "spike.soft_z", "tokenizer_hash"):
        assert field in msg
    assert "data_hash" not in msg and "world_size" not in msg and "step_00000020/MANIFEST.json" in msg


def test_check_compatible_allows_resume_mutable_fields():
    cfg = TrainConfig(max_steps=500, checkpoint_every=7)  # in RESUME_MUTABLE_FIELDS
    check_compatible(manifest_for(), config_identity=cfg.identity(), tokenizer_hash="tok",
                     data_hash="data", world_size=2)


def test_world_size_alone_is_its_own_error():
    with pytest.raises(WorldSizeMismatch, match="world_size: checkpoint 2 ranks, this run 4"):
        check_compatible(manifest_for(), config_identity=IDENTITY, tokenizer_hash="tok",
                         data_hash="data", world_size=4)
    with pytest.raises(CheckpointError, match="(?s)data_hash.*world_size") as e:
        check_compatible(manifest_for(), config_identity=IDENTITY, tokenizer_hash="tok",
                         data_hash="other", world_size=4)
    assert not isinstance(e.value, WorldSizeMismatch)


def test_check_compatible_without_identity_compares_the_hash():
    m = manifest_for(config_identity=None)
    check_compatible(m, config_identity=IDENTITY, tokenizer_hash="tok", data_hash="data", world_size=2)
    with pytest.raises(CheckpointError, match="config_hash"):
        check_compatible(m, config_identity=TrainConfig(seed=1).identity(), tokenizer_hash="tok",
                         data_hash="data", world_size=2)


# ---------------------------------------------------------------------- retention and staging
STEPS = list(range(10, 101, 10))


@pytest.mark.parametrize("keep_last, keep_every, protect, newest_verified, expected", [
    (2, 40, {70}, None, [10, 20, 30, 50, 60]),
    (0, 40, set(), None, []),                               # 0 keeps everything
    (3, 0, set(), None, [10, 20, 30, 40, 50, 60, 70]),
    (1, 0, set(), 50, [10, 20, 30, 40, 60, 70, 80, 90]),    # newest verified survives
    (1, 25, {10}, 100, [20, 30, 40, 60, 70, 80, 90]),       # multiples of 25: only 50, 100
    (20, 0, set(), None, []),                               # fewer steps than keep_last
])
def test_retention(keep_last, keep_every, protect, newest_verified, expected):
    got = checkpoints_to_delete(STEPS, keep_last=keep_last, keep_every=keep_every, protect=protect,
                                newest_verified=newest_verified)
    assert got == expected


def test_retention_handles_unsorted_input_and_rejects_negative():
    assert checkpoints_to_delete([30, 10, 20], keep_last=1, keep_every=0, protect=set(),
                                 newest_verified=None) == [10, 20]
    with pytest.raises(ValueError, match="keep_last"):
        checkpoints_to_delete(STEPS, keep_last=-1, keep_every=0, protect=set(), newest_verified=None)


def test_stage_dir_is_private_fresh_and_not_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = private_stage_root("r0")
    assert root.parent == tmp_path and (root.stat().st_mode & 0o777) == 0o700
    assert private_stage_root("r0") != root  # per run: a fresh name every time
    a, b = stage_dir(root, 40), stage_dir(root, 40)
    assert a != b and a.is_dir() and b.is_dir() and a.name.startswith("step_00000040")
    assert (a.stat().st_mode & 0o777) == 0o700
    assert list_checkpoint_steps(open_run_dir(root)) == []


def _stage_root_of_a_killed_process(tmp_path) -> Path:
    """A real process makes its staging root, stages a file in it, and is SIGKILLed (as the OOM
    killer or Ray's kill would): its exit handlers never run."""
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, tempfile, time\n"
         "tempfile.tempdir = sys.argv[1]\n"
         "from raygpt.checkpointing.staging import private_stage_root, stage_dir\n"
         "d = stage_dir(private_stage_root('r0'), 40)\n"
         "(d / 'state_00000040_00000.bin').write_bytes(b'x' * 4096)\n"
         "print(d.parent, flush=True)\n"
         "time.sleep(600)\n", str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    root = Path(child.stdout.readline().strip())
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    child.stdout.close()
    assert root.is_dir() and any(root.rglob("*.bin"))
    return root


def _dead_pid() -> int:
    """A pid no process has now (a child that has exited and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def test_a_killed_process_staging_root_is_swept_and_nothing_in_use(tmp_path, monkeypatch):
    """A worker killed mid-checkpoint leaves its staging root with the files it staged; the sweep
    removes it once it is STAGE_STALE_S old, and removes nothing a live process, another pid
    namespace or another user could still be using; a root named by an older raygpt (no pid)
    goes after PIDLESS_STAGE_STALE_S. (A run's Checkpointer sweeps at its first save:
    tests/checkpointing/test_runtime.py.)"""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead_old = _stage_root_of_a_killed_process(tmp_path)
    dead_recent = _stage_root_of_a_killed_process(tmp_path)
    _age(dead_old, STAGE_STALE_S + 5)
    live = private_stage_root("r1")  # this process: alive
    assert sweep_dead_stage_roots(tmp_path) == [dead_old]
    assert dead_recent.exists()  # changed within STAGE_STALE_S: left alone
    _age(live, STAGE_STALE_S + 5)
    _age(dead_recent, STAGE_STALE_S - 60)
    not_private = _stage_root_of_a_killed_process(tmp_path)
    not_private.chmod(0o755)
    _age(not_private, STAGE_STALE_S + 5)
    loot = tmp_path / "elsewhere"
    loot.mkdir()
    (loot / "keep.bin").write_bytes(b"y")
    planted = tmp_path / f"raygpt-stage-r0-{_dead_pid()}-planted"
    planted.symlink_to(loot)
    _age(planted, STAGE_STALE_S + 5)
    pidless = tmp_path / "raygpt-stage-r0-06fmilw9"  # an older raygpt's name: no pid to ask
    pidless.mkdir(mode=0o700)
    (pidless / "state_00000038_00000.bin").write_bytes(b"z")
    _age(pidless, PIDLESS_STAGE_STALE_S - 60)
    assert sweep_dead_stage_roots(tmp_path) == []
    assert live.exists() and dead_recent.exists() and not_private.exists()
    assert planted.is_symlink() and (loot / "keep.bin").exists() and pidless.exists()
    _age(dead_recent, STAGE_STALE_S + 5)
    _age(pidless, PIDLESS_STAGE_STALE_S + 5)
    assert sorted(sweep_dead_stage_roots(tmp_path)) == sorted([dead_recent, pidless])
    assert live.exists() and not_private.exists() and (loot / "keep.bin").exists()


def test_staging_refuses_a_planted_symlink_a_shared_or_a_foreign_directory(tmp_path, monkeypatch):
    """Another user's /tmp/raygpt-stage (or a symlink planted there) must never receive this
    user's checkpoint files: the staging root is a fresh mkdtemp, and a root that is a symlink,
    readable by others or not ours is refused before a file is written."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    loot = tmp_path / "attacker"
    loot.mkdir()
    (tmp_path / "raygpt-stage").symlink_to(loot)  # the old fixed path, planted
    root = private_stage_root("r0")
    assert not root.is_symlink() and root != tmp_path / "raygpt-stage"
    stage_dir(root, 1)
    assert list(loot.iterdir()) == []
    with pytest.raises(CheckpointError, match="found a symlink"):
        stage_dir(tmp_path / "raygpt-stage", 2)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(CheckpointError, match="no group or other permissions.*found mode 0777"):
        stage_dir(shared, 3)
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)  # as seen by another user
    with pytest.raises(CheckpointError, match="owned by uid"):
        stage_dir(root, 4)
    assert list(loot.iterdir()) == [] and list(shared.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Abandoned trajectories: a checkpoint reported before a spike rewind, finalized after it


def _upload_without_done(rd: RunDir, step: int, world: int = 2) -> dict:
    """What Ray has stored once every rank reported: the files, no DONE, no MANIFEST; returns
    the hashes the ranks computed while writing."""
    import hashlib
    d, hashes = step_dir(step), {}
    files = {model_file(step): os.urandom(256)}
    files.update({state_file(step, r): state_bytes(rank=r, num_processes=world, step=step)
                  for r in range(world)})
    for name, data in files.items():
        rd.write_bytes_atomic(f"{d}/{name}", data)
        hashes[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    return hashes


def _meta(step: int, trajectory: str) -> dict:
    return {"step": step, "world_size": 2, "num_parameters": P,
            "config_hash": TrainConfig().hash(), "tokenizer_hash": "tok", "data_hash": "data",
            "config_identity": IDENTITY, "extra": {"trajectory": trajectory},
            "retention": {"keep_last": 0, "keep_every": 0, "wsd_decay_start": None}}


def test_a_checkpoint_of_an_abandoned_trajectory_is_refused_done(run_dir):
    from raygpt.checkpointing.finalize import finalize_checkpoint

    make_checkpoint(run_dir, 20)
    hashes = _upload_without_done(run_dir, 30)  # reported on trajectory "old" before the rewind
    record_abandoned_trajectory(run_dir, "old", 20)  # the rewind: back to 20
    with pytest.raises(CheckpointError, match=r"step_00000030.*trajectory old.*back to step 20"):
        finalize_checkpoint(run_dir, 30, hashes, _meta(30, "old"))
    assert not run_dir.exists(f"{step_dir(30)}/{done_file(30)}")
    assert find_latest_verified(run_dir) == 20
    # the re-trained step 30, on the new trajectory, becomes complete as usual
    hashes = _upload_without_done(run_dir, 30)
    finalize_checkpoint(run_dir, 30, hashes, _meta(30, "new"))
    assert find_latest_verified(run_dir) == 30
    assert read_manifest(run_dir, 30)["extra"]["trajectory"] == "new"


def test_abandoned_trajectories_file_round_trip_and_rules(run_dir):
    assert read_abandoned_trajectories(run_dir) == []
    record_abandoned_trajectory(run_dir, "a", 10)
    record_abandoned_trajectory(run_dir, "b", 40)
    entries = read_abandoned_trajectories(run_dir)
    assert entries == [{"trajectory": "a", "to_step": 10}, {"trajectory": "b", "to_step": 40}]
    assert abandoned_by(20, "a", entries) == entries[0]
    assert abandoned_by(10, "a", entries) is None   # the rewind's target itself stays valid
    assert abandoned_by(30, "b", entries) is None   # saved before b's target
    assert abandoned_by(50, "c", entries) is None   # another trajectory
    assert abandoned_by(50, None, entries) is None  # a manifest from before trajectories


def test_a_corrupt_abandoned_trajectories_file_is_an_error_naming_it(run_dir):
    run_dir.write_bytes_atomic(ABANDONED, b'[{"trajectory": 3}]')
    with pytest.raises(CheckpointError, match=r"abandoned_trajectories.json: expected a list"):
        read_abandoned_trajectories(run_dir)
    run_dir.write_bytes_atomic(ABANDONED, b"[{")
    with pytest.raises(CheckpointError, match=r"abandoned_trajectories.json"):
        read_abandoned_trajectories(run_dir)


def test_a_rewinds_decision_is_recorded_with_its_abandonment(run_dir):
    from raygpt.checkpointing.protocol import latest_rewind_decision
    record_abandoned_trajectory(run_dir, "old", 4)  # written before decisions existed
    assert latest_rewind_decision(read_abandoned_trajectories(run_dir)) is None
    ledger = {"rewinds": 1, "lr_scale": 1.0, "history": []}
    record_abandoned_trajectory(run_dir, "a", 10, ledger=ledger, skip_ranges=[(0, 8, 12)])
    record_abandoned_trajectory(run_dir, "b", 20, ledger={**ledger, "rewinds": 2},
                                skip_ranges=[(0, 8, 12), (0, 40, 44)])
    entries = read_abandoned_trajectories(run_dir)
    assert latest_rewind_decision(entries) == {
        "trajectory": "b", "to_step": 20, "ledger": {**ledger, "rewinds": 2},
        "skip_ranges": [[0, 8, 12], [0, 40, 44]]}
    run_dir.write_bytes_atomic(ABANDONED, json.dumps(
        [{"trajectory": "a", "to_step": 1, "ledger": {"rewinds": 1}, "skip_ranges": [[0, 1]]}]
    ).encode())
    with pytest.raises(CheckpointError, match=r"abandoned_trajectories.json: entry 0: expected "
                                              r"a rewind decision"):
        read_abandoned_trajectories(run_dir)


# ---------------------------------------------------------------------------------------------
# Issue 23: the finalizer never reads the ranks' data back; it takes their hashes


def _reads(monkeypatch) -> list[str]:
    """The run-dir paths read (read_bytes, sha256_of) from here on."""
    seen = []
    for name in ("read_bytes", "sha256_of"):
        orig = getattr(RunDir, name)

        def spy(self, rel, *a, _orig=orig, **kw):
            seen.append(rel)
            return _orig(self, rel, *a, **kw)
        monkeypatch.setattr(RunDir, name, spy)
    return seen


def test_finalize_reads_no_rank_file_and_manifests_the_ranks_hashes(run_dir, monkeypatch):
    from raygpt.checkpointing.finalize import finalize_checkpoint

    make_checkpoint(run_dir, 20)  # an older complete one, which retention looks at too
    hashes = _upload_without_done(run_dir, 30)
    seen = _reads(monkeypatch)
    finalize_checkpoint(run_dir, 30, hashes, _meta(30, "t"))
    rank_files = [p for p in seen if "/state_" in p or "/model_" in p]
    assert rank_files == []  # presence and sizes only: the data are not read back
    listed = read_manifest(run_dir, 30)["files"]
    assert {n: listed[n] for n in hashes} == hashes
    assert set(listed) == set(hashes) | {done_file(30)}
    assert verify_checkpoint(run_dir, 30) == []  # the ranks' hashes are the stored bytes'


def test_finalize_refuses_a_short_upload_or_a_rank_that_reported_no_files(run_dir):
    from raygpt.checkpointing.finalize import finalize_checkpoint

    hashes = _upload_without_done(run_dir, 30)
    rel = f"{step_dir(30)}/{state_file(30, 1)}"
    run_dir.write_bytes_atomic(rel, run_dir.read_bytes(rel)[:-1])  # truncated in storage
    with pytest.raises(CheckpointError, match=r"state_00000030_00001.bin: expected \d+ bytes as "
                                              r"written by its rank, found \d+"):
        finalize_checkpoint(run_dir, 30, hashes, _meta(30, "t"))
    hashes = _upload_without_done(run_dir, 30)
    del hashes[state_file(30, 1)]  # rank 1's report lost: its file is in storage, unvouched for
    with pytest.raises(CheckpointError, match=r"state_00000030_00001.bin: no rank reported"):
        finalize_checkpoint(run_dir, 30, hashes, _meta(30, "t"))
    for name in (done_file(30), MANIFEST):
        assert not run_dir.exists(f"{step_dir(30)}/{name}")


def test_a_flipped_byte_after_upload_is_caught_by_a_hashing_verify_not_a_quick_one(run_dir):
    from raygpt.checkpointing.finalize import finalize_checkpoint

    hashes = _upload_without_done(run_dir, 30)
    rel = f"{step_dir(30)}/{state_file(30, 0)}"
    data = bytearray(run_dir.read_bytes(rel))
    data[100] ^= 1  # same size: storage corrupted it after the rank hashed it
    run_dir.write_bytes_atomic(rel, bytes(data))
    finalize_checkpoint(run_dir, 30, hashes, _meta(30, "t"))
    assert verify_checkpoint(run_dir, 30, hashes=False) == []
    assert find_latest_verified(run_dir, hashes=False) == 30
    problems = verify_checkpoint(run_dir, 30)
    assert len(problems) == 1 and problems[0].startswith(f"{rel}: sha256: expected")
    manifest = read_manifest(run_dir, 30)
    with pytest.raises(CheckpointError, match=r"state_00000030_00000.bin: sha256: expected"):
        verify_bytes(run_dir, 30, state_file(30, 0), bytes(data), manifest)
    verify_bytes(run_dir, 30, state_file(30, 1), run_dir.read_bytes(
        f"{step_dir(30)}/{state_file(30, 1)}"), manifest)
    with pytest.raises(CheckpointError, match=r"size: expected"):
        verify_bytes(run_dir, 30, state_file(30, 0), bytes(data[:-1]), manifest)


def test_quick_verify_still_needs_done_manifest_every_rank_and_sizes(run_dir):
    make_checkpoint(run_dir, 40)
    d = step_dir(40)
    run_dir.write_bytes_atomic(f"{d}/{state_file(40, 1)}", b"short")
    assert any("size: expected" in p for p in verify_checkpoint(run_dir, 40, hashes=False))
    run_dir.delete_file(f"{d}/{done_file(40)}")
    assert any("DONE_00000040: missing" in p for p in verify_checkpoint(run_dir, 40, hashes=False))
    assert any("state_00000040_00002.bin: expected rank file not listed" in p
               for p in verify_checkpoint(run_dir, 40, world_size=3, hashes=False))


# ---------------------------------------------------------------------------------------------
# names read back, and the copy (a WSD sweep's branches start from one stable checkpoint)

def test_a_step_is_read_back_from_a_directory_name_by_the_format_s_regex():
    from raygpt.checkpointing import protocol as ck
    assert ck.step_of_dir(ck.step_dir(12)) == 12 and ck.step_of_dir("step_123456789") == 123456789
    for other in ("step_12", "step_0000001x", "step_00000012.tmp-ab", "checkpoint_00000012", ""):
        assert ck.step_of_dir(other) is None, other


def test_copy_checkpoint_refuses_an_unverified_source(tmp_path):
    from raygpt.checkpointing import protocol as ck
    src, dst = open_run_dir(str(tmp_path / "src")), open_run_dir(str(tmp_path / "dst"))
    src.write_bytes_atomic(f"{ck.step_dir(8)}/{ck.model_file(8)}", b"x" * 10)  # no DONE, no MANIFEST
    with pytest.raises(ck.CheckpointError, match="unverified"):
        ck.copy_checkpoint(src, dst, 8)
    assert not dst.exists(ck.step_dir(8))
