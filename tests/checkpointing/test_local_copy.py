"""raygpt.checkpointing.local_copy: a restarted rank loads the checkpoint files its node kept
(hard links of what its ranks wrote) when they match MANIFEST, and storage's otherwise; the
resumed losses stay those of the uninterrupted run either way. Real runs (LocalSession, a
raised fault for the lost attempt) and real files."""

import os
import time

import pytest
import torch

from raygpt.checkpointing import local_copy
from raygpt.checkpointing.local_copy import KEEP_STEPS, LocalCopies
from raygpt.checkpointing.protocol import model_file, state_file, step_dir
from raygpt.storage import open_run_dir


@pytest.fixture
def local_root(tmp_path, monkeypatch):
    """This test's own node-local root (the module's default is shared by the machine's runs)."""
    root = tmp_path / "node_local"
    monkeypatch.setattr(local_copy, "LOCAL_COPY_ROOT", str(root))
    return root


@pytest.fixture
def storage_elsewhere(monkeypatch):
    """Storage on another filesystem than the node's staging directory (a bucket, NFS): the
    session copies the staged files into it, so the stored files and the node's copies are two
    files, and damage to one leaves the other. (On the node's own filesystem the files are
    moved in by rename, and the stored file and the node's copy are one file.)"""
    from raygpt.storage import RunDir

    monkeypatch.setattr(RunDir, "_same_device", lambda self, local_dir: False)


def _train(run_dir, **overrides):
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    # blocking saves: checkpoint 4 is published before step 4 trains, whatever the machine's
    # load (an async one could still be on its way when the fault strikes)
    cfg = tiny_config(run_dir, max_steps=6, checkpoint_every=4, async_checkpoint=False,
                      **overrides).resolve(0)
    return train(cfg, LocalSession(open_run_dir(str(run_dir)), torch.device("cpu")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's losses, step by step."""
    from tests.helpers import train_losses

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    _train(run_dir)
    return train_losses(run_dir)


def _lost_after_checkpoint_4(run_dir):
    """A first attempt that saves checkpoint 4 and dies at step 5 (no clean end: its node's
    copies stay, as after a SIGKILL)."""
    from raygpt.train.faults import InjectedFault

    with pytest.raises(InjectedFault):
        _train(run_dir, fault="raise:rank=0,step=5")


def _resume(run_dir):
    from tests.helpers import records

    _train(run_dir, resume=1)
    resumes = [r for r in records(run_dir) if r["kind"] == "resume"]
    assert [r["resumed_from"] for r in resumes] == [4]
    return resumes[0]["startup"]


def _local_file(root, run_dir, step, name):
    return LocalCopies(open_run_dir(str(run_dir)).uri(), root).dir / step_dir(step) / name


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_restarted_rank_loads_its_nodes_copy_when_storage_is_damaged(tmp_path, local_root,
                                                                       reference,
                                                                       storage_elsewhere):
    """The local copy is what is loaded: storage's state and model files are damaged (same
    size, other bytes: only a hash sees it) and the resume still goes from checkpoint 4, with
    the uninterrupted run's losses as floats; reading storage would have refused it."""
    from tests.helpers import train_losses

    run_dir = tmp_path / "run"
    _lost_after_checkpoint_4(run_dir)
    for name in (state_file(4, 0), model_file(4)):
        assert _local_file(local_root, run_dir, 4, name).stat().st_size > 0
        stored = run_dir / step_dir(4) / name
        assert os.stat(stored).st_ino != _local_file(local_root, run_dir, 4, name).stat().st_ino
        _flip_a_byte(stored)
    startup = _resume(run_dir)
    assert startup["load_from"] == ["local"]
    assert train_losses(run_dir, attempt=2) == {s: l for s, l in reference.items() if s >= 4}
    # the run ended cleanly: the node's copies of it are gone
    assert not LocalCopies(open_run_dir(str(run_dir)).uri(), local_root).dir.exists()


def test_a_local_copy_that_differs_from_manifest_falls_back_to_storage(tmp_path, local_root,
                                                                       reference, capfd,
                                                                       storage_elsewhere):
    """A local copy with other bytes of the same size (only its sha256 shows it) is not used:
    the rank says so and loads storage's file; the resumed losses are the uninterrupted run's."""
    from tests.helpers import train_losses

    run_dir = tmp_path / "run"
    _lost_after_checkpoint_4(run_dir)
    bad = _local_file(local_root, run_dir, 4, state_file(4, 0))
    _flip_a_byte(bad)
    capfd.readouterr()
    startup = _resume(run_dir)
    said = capfd.readouterr().err
    assert startup["load_from"] == ["local", "storage"]  # the model file's copy was intact
    stored = run_dir / step_dir(4) / state_file(4, 0)
    # the flipped byte is named by the piece of the file it is in (MANIFEST's piece_sha256)
    assert (f"WARNING: {bad}: this node's copy of {stored} differs from MANIFEST (sha256 of "
            f"bytes [0, ") in said
    assert "reading storage's" in said
    assert train_losses(run_dir, attempt=2) == {s: l for s, l in reference.items() if s >= 4}


def test_fetch_verified_takes_a_matching_local_copy_and_storage_otherwise(tmp_path):
    """fetch_verified, file by file: a local copy of MANIFEST's size and sha256 is read instead
    of storage's; one of another size is passed over; one of other bytes is passed over and
    dropped; when storage's is bad too, the error names storage's file."""
    from raygpt.checkpointing import protocol as ck
    from raygpt.checkpointing.reading import fetch_verified

    run_dir = open_run_dir(str(tmp_path / "run"))
    good = bytes(range(256)) * 4
    for name in ("a.bin", "b.bin", "c.bin"):
        run_dir.write_bytes_atomic(f"{step_dir(4)}/{name}", good)
    ck.write_done(run_dir, 4)
    manifest = ck.write_manifest(run_dir, 4, world_size=1, num_parameters=1, config_hash="c",
                                 tokenizer_hash="t", data_hash="d")
    stage = tmp_path / "stage"
    stage.mkdir()
    for name in ("a.bin", "b.bin", "c.bin"):
        (stage / name).write_bytes(good)
    local = LocalCopies(run_dir.uri(), tmp_path / "root")
    local.keep(4, stage, ["a.bin", "b.bin", "c.bin"])
    os.truncate(local.dir / step_dir(4) / "b.bin", len(good) - 1)  # another size
    _flip_a_byte(local.dir / step_dir(4) / "c.bin")  # other bytes, same size
    _flip_a_byte(tmp_path / "run" / step_dir(4) / "a.bin")  # storage's a is damaged
    sources = {}
    files = fetch_verified(run_dir, 4, manifest, ["a.bin", "b.bin", "c.bin"], local, sources)
    assert files == {"a.bin": good, "b.bin": good, "c.bin": good}
    assert sources == {"a.bin": "local", "b.bin": "storage", "c.bin": "storage"}
    assert not (local.dir / step_dir(4) / "c.bin").exists()  # dropped
    assert (local.dir / step_dir(4) / "b.bin").exists()  # never read: left for the next save
    _flip_a_byte(tmp_path / "run" / step_dir(4) / "c.bin")
    with pytest.raises(ck.CheckpointError, match=f"{step_dir(4)}/c.bin: sha256: expected"):
        fetch_verified(run_dir, 4, manifest, ["c.bin"], local)
    with pytest.raises(ck.CheckpointError, match=f"{step_dir(4)}/a.bin: sha256: expected"):
        fetch_verified(run_dir, 4, manifest, ["a.bin"])  # no local copies: storage's only


def test_copies_kept_for_the_last_checkpoints_only_and_never_outside_a_private_dir(tmp_path):
    """Hard links (no bytes copied) of the files named, KEEP_STEPS checkpoints' worth, an older
    attempt's directories removed at the first save; a root another user could write to keeps
    nothing and reads nothing, without failing the save."""
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "a.bin").write_bytes(b"abc")
    root = tmp_path / "root"
    earlier = LocalCopies("s3://bucket/run", root)  # an earlier attempt's copies of step 1
    earlier.keep(1, stage, ["a.bin"])
    copies = LocalCopies("s3://bucket/run", root)
    for step in (4, 8, 12):
        copies.keep(step, stage, ["a.bin"])
    assert sorted(os.listdir(copies.dir)) == [step_dir(s) for s in (8, 12)][-KEEP_STEPS:]
    assert os.stat(copies.dir / step_dir(12) / "a.bin").st_ino == os.stat(stage / "a.bin").st_ino
    assert copies.read(12, "a.bin", 3) == b"abc"
    assert copies.read(12, "a.bin", 4) is None  # MANIFEST's size differs: not read
    assert copies.read(4, "a.bin", 3) is None  # gone
    assert LocalCopies("s3://bucket/other", root).read(12, "a.bin", 3) is None  # another run
    copies.remove_all()
    assert not copies.dir.exists()

    # a run that ended without a clean finish, days ago, is swept by the next run's first save;
    # one saved in recently is not
    old, recent = root / "0123456789abcdef", root / "fedcba9876543210"
    old.mkdir()
    recent.mkdir()
    os.utime(old, (0, time.time() - local_copy.STALE_S - 60))
    LocalCopies("s3://bucket/third", root).keep(4, stage, ["a.bin"])
    assert not old.exists() and recent.exists()

    os.chmod(root, 0o755)  # not private: refused
    shared = LocalCopies("s3://bucket/run", root)
    shared.keep(16, stage, ["a.bin"])
    assert shared.kept == [] and not (shared.dir / step_dir(16)).exists()
    os.chmod(root, 0o700)
    copies.keep(20, stage, ["a.bin"])
    os.chmod(root, 0o755)
    assert copies.read(20, "a.bin", 3) is None


def test_a_symlink_planted_at_the_local_copy_root_keeps_and_reads_nothing(tmp_path):
    """Issue 43: another user of the node plants the root's name as a symlink to a directory
    (one that looks private through the link): no copy is kept through it, none is read from
    it, and the save goes on."""
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "a.bin").write_bytes(b"abc")
    target = tmp_path / "attackers"
    target.mkdir(mode=0o700)
    planted = tmp_path / "raygpt_local_ckpt_1000"
    planted.symlink_to(target)
    copies = LocalCopies("s3://bucket/run", planted)
    copies.keep(4, stage, ["a.bin"])  # never raises: the rank's save goes on
    assert os.listdir(target) == [] and copies.kept == []
    (target / copies.dir.name / step_dir(4)).mkdir(parents=True)
    (target / copies.dir.name / step_dir(4) / "a.bin").write_bytes(b"abc")
    assert copies.read(4, "a.bin", 3) is None  # what the link's owner put there is not read
