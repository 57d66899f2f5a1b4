"""raygpt.storage.atomic_file: the one atomic write every local writer uses (storage, llm.c model files,
token shards), and its fsync rule: the file before the rename, the directory after."""

import errno
import os
import stat

import pytest

from raygpt.storage import atomic_file
from raygpt.storage.atomic_file import atomic_local_file, write_local_atomic


def record_order(monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda a, b, **kw: (events.append("rename"),
                                                           real_replace(a, b, **kw)))
    return events


def test_file_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = record_order(monkeypatch)
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    write_local_atomic(target, [b"new ", b"bytes"])
    assert target.read_bytes() == b"new bytes"
    assert events == ["fsync file", "rename", "fsync dir"]
    assert os.listdir(tmp_path) == ["f.bin"]  # no temporary file left


@pytest.mark.parametrize("writer", ["model", "shard"])
def test_the_model_file_and_shard_writers_follow_the_rule(tmp_path, monkeypatch, writer):
    if writer == "model":
        from raygpt.llmc.model_file import write_model_file
        from raygpt.model.gpt import GPT, GPTConfig
        model = GPT(GPTConfig.from_depth(1), init_seed=1)
        events = record_order(monkeypatch)
        write_model_file(tmp_path / "model.bin", model)
    else:
        from raygpt.llmc.shards import write_shard
        events = record_order(monkeypatch)
        write_shard(tmp_path / "shard.bin", [1, 2, 3])
    assert events == ["fsync file", "rename", "fsync dir"]


def test_an_error_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_local_file(target) as f:
            f.write(b"half")
            raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]


def test_a_filesystem_without_directory_fsync_is_tolerated_an_io_error_is_not(tmp_path,
                                                                           monkeypatch):
    real_fsync = os.fsync

    def fsync_failing_on_dirs(code):
        def fsync(fd):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(code, os.strerror(code))
            real_fsync(fd)
        return fsync

    monkeypatch.setattr(os, "fsync", fsync_failing_on_dirs(errno.EINVAL))
    write_local_atomic(tmp_path / "a", [b"x"])  # e.g. a FUSE mount: the rename stands
    monkeypatch.setattr(os, "fsync", fsync_failing_on_dirs(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        atomic_file.fsync_directory(tmp_path)


@pytest.fixture()
def umask():
    """Set the process's umask for one test (it is process-wide: handed back at the end)."""
    saved = os.umask(0o022)
    yield os.umask
    os.umask(saved)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_the_written_file_follows_the_umask(tmp_path, umask, mask, mode):
    umask(mask)
    write_local_atomic(tmp_path / "f.bin", [b"x"])
    assert stat.S_IMODE(os.stat(tmp_path / "f.bin").st_mode) == mode


def test_a_temporary_name_is_never_an_existing_file_or_a_planted_link(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").write_bytes(b"keep")
    taken = iter(["aaaaaaaaaaaa", "aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(atomic_file.secrets, "token_hex", lambda n: next(taken))
    os.symlink(tmp_path / "elsewhere", tmp_path / "f.bin.tmp-aaaaaaaaaaaa")
    write_local_atomic(tmp_path / "f.bin", [b"new"])  # the link's name is passed over
    assert (tmp_path / "f.bin").read_bytes() == b"new"
    assert (tmp_path / "elsewhere").read_bytes() == b"keep"


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_every_file_of_a_real_run_directory_follows_the_umask(tmp_path, umask, mask):
    """A real run (the driver's claim and config.json, 4 steps with a checkpoint, its DONE and
    MANIFEST, main.log and the loss history) under a real umask: every file is 0666 and every
    directory 0777 less the umask (mkstemp's 0600 made DONE and MANIFEST private)."""
    import torch

    from raygpt.runlog.run_config import write_launch
    from raygpt.train.run_dir import claimed_run_dir
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    umask(mask)
    cfg = tiny_config(tmp_path / "run", max_steps=4, checkpoint_every=2).resolve(0)
    with claimed_run_dir(cfg) as (cfg, run_dir):
        write_launch(run_dir, cfg)
        train(cfg, LocalSession(run_dir, torch.device("cpu")))
    files = {p: stat.S_IMODE(p.lstat().st_mode) for p in (tmp_path / "run").rglob("*")}
    names = {p.name for p in files}
    assert {"DONE_00000002", "DONE_00000004", "config.json", "main.log",
            "loss_history.jsonl"} <= names
    assert len([p for p in files if p.name == "MANIFEST.json"]) == 2  # steps 2 and 4
    wrong = {str(p.relative_to(tmp_path)): oct(m) for p, m in files.items()
             if m != (0o777 if p.is_dir() else 0o666) & ~mask}
    assert not wrong, wrong


def test_move_local_file_renames_and_copies_whole_where_mounts_differ(tmp_path, monkeypatch):
    """A move is a rename (the same inode); where the kernel refuses one across mounts (EXDEV,
    which a bind mount of the same disk gives while its device number matches), the file is
    copied to a temporary name, renamed whole into place and the source removed; any other
    error is raised."""
    src, target = tmp_path / "staged.bin", tmp_path / "run" / "state.bin"
    target.parent.mkdir()
    src.write_bytes(b"state" * 1000)
    inode = src.stat().st_ino
    atomic_file.move_local_file(src, target)
    assert target.stat().st_ino == inode and not src.exists()

    src.write_bytes(b"other" * 1000)
    inode = src.stat().st_ino

    def refuse(a, b, **kw):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "rename", refuse)
    atomic_file.move_local_file(src, target)
    assert target.read_bytes() == b"other" * 1000 and target.stat().st_ino != inode
    assert not src.exists() and sorted(p.name for p in target.parent.iterdir()) == ["state.bin"]
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError):
        atomic_file.move_local_file(tmp_path / "missing", target)


# ---------------------------------------------------------------------- private paths

def test_a_private_dir_is_made_0700_whatever_the_umask_and_kept(tmp_path):
    path = tmp_path / "parent" / "cache"
    old = os.umask(0)
    try:
        assert atomic_file.private_dir(path, "compile cache") == path
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700
    (path / "entry").write_text("kept")
    atomic_file.private_dir(path, "compile cache")  # a later process: the same directory
    assert (path / "entry").read_text() == "kept"


def test_a_name_someone_else_made_first_in_a_shared_temp_dir_is_refused(tmp_path, monkeypatch):
    """Issue 43: a symlink planted at the name (to a directory that passes every check through
    the link, as its owner can make it pass while it is checked), a directory the group may
    use, another owner's directory, a file: NotPrivateError naming the path and what it is
    for, and nothing is created through a link."""
    target = tmp_path / "attackers"
    target.mkdir(mode=0o700)
    link = tmp_path / "raygpt_cache_1000"
    link.symlink_to(target)
    with pytest.raises(atomic_file.NotPrivateError) as e:
        atomic_file.private_dir(link, "compile cache")
    assert str(e.value) == (f"{link}: expected a private compile cache, found a symlink (to "
                            f"{str(target)!r}); refusing to use it")
    dangling = tmp_path / "raygpt_dangling"
    dangling.symlink_to(tmp_path / "not_yet")
    with pytest.raises(atomic_file.NotPrivateError, match="found a symlink"):
        atomic_file.private_dir(dangling, "compile cache")
    assert os.listdir(target) == [] and not (tmp_path / "not_yet").exists()

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(atomic_file.NotPrivateError) as e:
        atomic_file.private_dir(shared, "compile cache")
    assert str(e.value) == (f"{shared}: expected a compile cache only its owner can use (no "
                            f"group or other permissions), found mode 0770")
    shared.chmod(0o700)
    uid = os.lstat(shared).st_uid
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.raises(atomic_file.NotPrivateError) as e:
        atomic_file.private_dir(shared, "compile cache")
    assert str(e.value) == (f"{shared}: expected a compile cache owned by uid {uid + 1}, found "
                            f"one owned by uid {uid}; refusing to use it")
    monkeypatch.undo()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(atomic_file.NotPrivateError, match="found another kind of file"):
        atomic_file.private_dir(a_file, "compile cache")


def test_open_private_file_refuses_links_and_shared_files(tmp_path):
    key = tmp_path / "key"
    key.write_bytes(b"secret")
    key.chmod(0o600)
    fd = atomic_file.open_private_file(key, "key file")
    assert os.read(fd, 10) == b"secret"
    os.close(fd)
    link = tmp_path / "link"
    link.symlink_to(key)
    with pytest.raises(atomic_file.NotPrivateError, match=f"^{link}: .*found a symlink"):
        atomic_file.open_private_file(link, "key file")
    key.chmod(0o604)
    with pytest.raises(atomic_file.NotPrivateError, match="found mode 0604"):
        atomic_file.open_private_file(key, "key file")
    with pytest.raises(atomic_file.NotPrivateError, match="another kind of file"):
        atomic_file.open_private_file(tmp_path, "key file")
    with pytest.raises(FileNotFoundError):
        atomic_file.open_private_file(tmp_path / "none", "key file")
