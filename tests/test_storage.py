"""raygpt.storage on a local directory and on fsspec's in-memory filesystem through pyarrow.fs."""

import hashlib
import os
import uuid

import fsspec
import pyarrow.fs as pafs
import pytest

from raygpt.storage import RunDir, open_run_dir


def memory_fs() -> pafs.FileSystem:
    return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))


@pytest.fixture(params=["local", "memory"])
def run_dir(request, tmp_path):
    if request.param == "local":
        yield open_run_dir(tmp_path / "run")
        return
    fs = memory_fs()  # fsspec's memory store is process-global: give every test its own root
    root = f"/raygpt-test-{uuid.uuid4().hex}"
    yield open_run_dir((fs, root))
    if fs.get_file_info(root).type != pafs.FileType.NotFound:
        fs.delete_dir(root)


def test_open_run_dir_kinds(tmp_path):
    local = open_run_dir(tmp_path / "a")
    assert local.is_local and local.local_path("x/y") == tmp_path / "a" / "x" / "y"
    via_uri = open_run_dir(f"file://{tmp_path}/b")
    assert via_uri.is_local and via_uri.path("f") == f"{tmp_path}/b/f"
    mem = open_run_dir((memory_fs(), "/r"))
    assert not mem.is_local and mem.path("s/f") == "/r/s/f"
    assert open_run_dir(mem) is mem
    with pytest.raises(ValueError, match="not on a local filesystem"):
        mem.local_path("f")
    with pytest.raises(TypeError, match="FileSystem"):
        open_run_dir(("not a fs", "/r"))


def test_atomic_write_read_overwrite_and_listdir(run_dir: RunDir):
    assert not run_dir.exists("d/f.bin") and run_dir.listdir() == []
    run_dir.write_bytes_atomic("d/f.bin", b"first")
    run_dir.write_bytes_atomic("d/f.bin", b"second!")
    run_dir.write_bytes_atomic("d/sub/g", b"")
    assert run_dir.read_bytes("d/f.bin") == b"second!"
    assert run_dir.size_of("d/f.bin") == 7 and run_dir.size_of("d/sub/g") == 0
    # no temp file is left next to the target
    assert run_dir.listdir("d") == ["f.bin", "sub"]
    assert run_dir.listdir("d", files_only=True) == ["f.bin"]
    assert run_dir.is_dir("d/sub") and not run_dir.is_dir("d/f.bin")
    assert run_dir.listdir("nope") == []


def test_sha256_matches_hashlib(run_dir: RunDir):
    data = os.urandom(100_003)
    run_dir.write_bytes_atomic("blob", data)
    assert run_dir.sha256_of("blob") == hashlib.sha256(data).hexdigest()


def test_append_text_accumulates_and_leaves_no_temp(run_dir: RunDir):
    run_dir.append_text("logs/loss.jsonl", '{"step": 1}\n')
    run_dir.append_text("logs/loss.jsonl", '{"step": 2}\n')
    assert run_dir.read_bytes("logs/loss.jsonl") == b'{"step": 1}\n{"step": 2}\n'
    assert run_dir.listdir("logs") == ["loss.jsonl"]


def test_missing_file_errors_name_the_path(run_dir: RunDir):
    with pytest.raises(FileNotFoundError, match="nothere"):
        run_dir.read_bytes("nothere")
    with pytest.raises(FileNotFoundError, match="nothere"):
        run_dir.size_of("nothere")


def test_delete_file_and_dir_are_idempotent(run_dir: RunDir):
    run_dir.write_bytes_atomic("s/a", b"1")
    run_dir.write_bytes_atomic("s/b", b"2")
    run_dir.delete_file("s/a")
    run_dir.delete_file("s/a")  # already gone: fine
    assert run_dir.listdir("s") == ["b"]
    run_dir.delete_dir("s")
    run_dir.delete_dir("s")
    assert not run_dir.exists("s")


def test_upload_and_download_dir_round_trip(run_dir: RunDir, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "model.bin").write_bytes(b"\x00\x01model")
    (src / "sub" / "state.bin").write_bytes(b"state")
    run_dir.upload_dir(src, "step_00000010")
    assert run_dir.listdir("step_00000010") == ["model.bin", "sub"]
    assert run_dir.read_bytes("step_00000010/sub/state.bin") == b"state"
    dst = tmp_path / "dst"
    run_dir.download_dir("step_00000010", dst)
    assert (dst / "model.bin").read_bytes() == b"\x00\x01model"
    assert (dst / "sub" / "state.bin").read_bytes() == b"state"


def test_local_atomic_write_failure_keeps_old_content(tmp_path):
    rd = open_run_dir(tmp_path)
    rd.write_bytes_atomic("f", b"old")
    with pytest.raises(TypeError):
        rd.write_bytes_atomic("f", "not bytes")  # fails inside the write, after the temp exists
    assert rd.read_bytes("f") == b"old"
    assert rd.listdir() == ["f"]  # the temp file was cleaned up
