"""raygpt.atomic_file: the one atomic write every local writer uses (storage, llm.c model files,
token shards), and its fsync rule: the file before the rename, the directory after."""

import errno
import os
import stat

import pytest

from raygpt import atomic_file
from raygpt.atomic_file import atomic_local_file, write_local_atomic


def record_order(monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("rename"), real_replace(a, b)))
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
        from raygpt.model import GPT, GPTConfig
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
