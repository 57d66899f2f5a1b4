"""raygpt.storage on a local directory and on fsspec's in-memory filesystem through pyarrow.fs."""

import hashlib
import os
import pickle
import uuid

import pyarrow.fs as pafs
import pytest

from tests.helpers import memory_fs
from raygpt.storage import RunDir, open_run_dir


@pytest.fixture(params=["local", "memory"])
def run_dir(request, tmp_path):
    if request.param == "local":
        yield open_run_dir(tmp_path / "run")
        return
    fs = memory_fs()  # fsspec's memory store is process-global: give every test its own root
    root = f"/raygpt-test-{uuid.uuid4().hex}"
    rd = open_run_dir((fs, root))
    yield rd
    rd.close()  # store what the test appended before the root goes
    if fs.get_file_info(root).type != pafs.FileType.NotFound:
        fs.delete_dir(root)


@pytest.fixture
def local_run_dir(tmp_path):
    """Appends are for local / NFS run directories (an object store refuses them)."""
    return open_run_dir(tmp_path / "run")


def test_open_run_dir_kinds(tmp_path):
    local = open_run_dir(tmp_path / "a")
    assert local.caps.local_paths and local.local_path("x/y") == tmp_path / "a" / "x" / "y"
    via_uri = open_run_dir(f"file://{tmp_path}/b")
    assert via_uri.caps.local_paths and via_uri.path("f") == f"{tmp_path}/b/f"
    mem = open_run_dir((memory_fs(), "/r"))
    assert not mem.caps.local_paths and mem.path("s/f") == "/r/s/f"
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


def test_append_text_accumulates_and_leaves_no_temp(local_run_dir: RunDir):
    local_run_dir.append_text("logs/loss.jsonl", '{"step": 1}\n')
    local_run_dir.append_text("logs/loss.jsonl", '{"step": 2}\n')
    assert local_run_dir.read_bytes("logs/loss.jsonl") == b'{"step": 1}\n{"step": 2}\n'
    assert local_run_dir.listdir("logs") == ["loss.jsonl"]


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


def test_upload_dir_round_trip(run_dir: RunDir, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "model.bin").write_bytes(b"\x00\x01model")
    (src / "sub" / "state.bin").write_bytes(b"state")
    run_dir.upload_dir(src, "step_00000010")
    assert run_dir.listdir("step_00000010") == ["model.bin", "sub"]
    assert run_dir.read_bytes("step_00000010/sub/state.bin") == b"state"
    assert run_dir.read_bytes("step_00000010/model.bin") == b"\x00\x01model"


def test_move_dir_in_renames_on_the_same_filesystem_and_copies_elsewhere(run_dir: RunDir,
                                                                          tmp_path):
    """A checkpoint's staged files reach a local run directory on the staging directory's
    filesystem by rename (the same inode: no byte copied, each file whole under its final
    name) and any other run directory by copy (the staged files stay for the caller)."""
    src = tmp_path / "stage"
    (src / "sub").mkdir(parents=True)
    (src / "model.bin").write_bytes(b"model")
    (src / "sub" / "state.bin").write_bytes(b"state")
    inode = (src / "model.bin").stat().st_ino
    run_dir.move_dir_in(src, "step_00000010")
    assert run_dir.listdir("step_00000010") == ["model.bin", "sub"]
    assert run_dir.read_bytes("step_00000010/sub/state.bin") == b"state"
    if run_dir.caps.local_paths:
        assert run_dir.local_path("step_00000010/model.bin").stat().st_ino == inode
        assert not (src / "model.bin").exists()
    else:
        assert (src / "model.bin").read_bytes() == b"model"


def test_move_dir_in_copies_across_filesystems(tmp_path, monkeypatch):
    rd = open_run_dir(tmp_path / "run")
    monkeypatch.setattr(RunDir, "_same_device", lambda self, local_dir: False)
    src = tmp_path / "stage"
    src.mkdir()
    (src / "model.bin").write_bytes(b"model")
    rd.move_dir_in(src, "step_00000010")
    assert rd.local_path("step_00000010/model.bin").stat().st_ino != (src / "model.bin").stat().st_ino
    assert rd.read_bytes("step_00000010/model.bin") == b"model"


def test_local_atomic_write_failure_keeps_old_content(tmp_path):
    rd = open_run_dir(tmp_path)
    rd.write_bytes_atomic("f", b"old")
    with pytest.raises(TypeError):
        rd.write_bytes_atomic("f", "not bytes")  # fails inside the write, after the temp exists
    assert rd.read_bytes("f") == b"old"
    assert rd.listdir() == ["f"]  # the temp file was cleaned up


# ---------------------------------------------------------------------- appends

@pytest.fixture
def remote():
    """(pyarrow fs over fsspec's memory store, a fresh root); cleaned up afterwards."""
    fs = memory_fs()
    root = f"/raygpt-appends-{uuid.uuid4().hex}"
    yield fs, root
    if fs.get_file_info(root).type != pafs.FileType.NotFound:
        fs.delete_dir(root)


def lines(first: int, last: int) -> bytes:
    return b"".join(b'{"step":%d}\n' % i for i in range(first, last))


def test_an_object_store_refuses_appends_naming_the_file_and_writes_nothing(remote):
    # an object store has no append: its logs are immutable segments (raygpt.runlog.segments),
    # the one mechanism; an append here would have to rewrite the whole object
    fs, root = remote
    rd = RunDir(fs, root)
    with pytest.raises(ValueError, match=r"h\.jsonl: an object store has no append"):
        rd.append_text("h.jsonl", "x\n")
    with rd.background_appends():  # refused on the caller's thread, not later on the writer's
        with pytest.raises(ValueError, match="no append"):
            rd.append_text("h.jsonl", "x\n")
    assert rd.listdir() == [] and not rd.exists("h.jsonl")


def test_a_pickled_run_dir_keeps_its_place(remote, tmp_path):
    fs, root = remote
    rd = RunDir(fs, root)
    rd.write_bytes_atomic("f", b"1")
    copy = pickle.loads(pickle.dumps(rd))
    assert (copy.root, copy.caps.local_paths, copy.read_bytes("f")) == (root, False, b"1")
    local = pickle.loads(pickle.dumps(open_run_dir(tmp_path)))
    assert local.caps.local_paths and local.local_path() == tmp_path


def test_local_appends_are_durable_at_once(tmp_path, monkeypatch):
    fsyncs = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
    rd = open_run_dir(tmp_path)
    for i in range(3):
        rd.append_text("h.jsonl", '{"step":%d}\n' % i)
        # on disk before append_text returns, and fsynced once per append
        assert (tmp_path / "h.jsonl").read_bytes() == lines(0, i + 1)
        assert len(fsyncs) == i + 1
    rd.flush()
    rd.close()  # no-ops: nothing is buffered
    assert len(fsyncs) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.jsonl"]


# ---------------------------------------------------------------------- background appends


def test_background_appends_keep_order_and_reads_see_every_line(local_run_dir: RunDir):
    lines = [f'{{"step":{i}}}\n' for i in range(500)]
    with local_run_dir.background_appends():
        for line in lines:
            local_run_dir.append_text("loss_history.jsonl", line)
        # a read through the same RunDir waits for what is queued
        assert local_run_dir.read_bytes("loss_history.jsonl") == "".join(lines).encode()
        local_run_dir.append_text("main.log", "s:1 trl:1.0\n")
        assert local_run_dir.size_of("main.log") == len("s:1 trl:1.0\n")
    assert local_run_dir._writer is None  # back to appends on the caller's thread


def test_background_appends_are_on_disk_after_flush(tmp_path):
    rd = open_run_dir(tmp_path / "run")
    with rd.background_appends():
        for i in range(50):
            rd.append_text("h.jsonl", f"{i}\n")
        rd.flush()
        # another reader (a resumed attempt, `raygpt status`) sees the file itself
        assert (tmp_path / "run" / "h.jsonl").read_text() == "".join(f"{i}\n" for i in range(50))


def test_background_append_failure_is_raised_with_the_file_and_later_lines_dropped(tmp_path):
    rd = open_run_dir(tmp_path / "run")
    rd.makedirs("")
    (tmp_path / "run" / "blocked").mkdir()  # appending to a directory fails
    with pytest.raises(RuntimeError, match="background append failed.*blocked") as err:
        with rd.background_appends():
            rd.append_text("blocked", "x\n")
            rd.append_text("h.jsonl", "after the failure\n")
            rd.flush()
    assert isinstance(err.value.__cause__, OSError)
    assert not (tmp_path / "run" / "h.jsonl").exists()  # never a line past a lost one


def test_background_appends_drain_before_delete_and_overwrite(local_run_dir: RunDir):
    with local_run_dir.background_appends():
        for i in range(100):
            local_run_dir.append_text("main.log", f"old {i}\n")
        local_run_dir.write_bytes_atomic("main.log", b"")  # a fresh start truncates the old log
        local_run_dir.append_text("main.log", "new\n")
        assert local_run_dir.read_bytes("main.log") == b"new\n"
        local_run_dir.append_text("d/x", "1\n")
        local_run_dir.delete_dir("d")
        assert not local_run_dir.exists("d/x")


def test_background_appends_disabled_is_a_no_op(local_run_dir: RunDir):
    with local_run_dir.background_appends(enabled=False):
        assert local_run_dir._writer is None
        local_run_dir.append_text("h", "1\n")
    assert local_run_dir.read_bytes("h") == b"1\n"


def test_a_torn_last_line_is_ended_before_the_first_append(local_run_dir: RunDir):
    """A crash tore the file's last line: the next process's first append starts with a newline,
    so the fragment is a line of its own (readers skip it) and nothing is rewritten."""
    local_run_dir.write_bytes_atomic("loss_history.jsonl", b'{"step":0}\n{"step":1,"lo')
    fresh = RunDir(local_run_dir.fs, local_run_dir.root)  # the restarted process
    with fresh.background_appends():
        fresh.append_text("loss_history.jsonl", '{"step":1}\n')
        fresh.append_text("loss_history.jsonl", '{"step":2}\n')
    fresh.close()
    data = RunDir(local_run_dir.fs, local_run_dir.root).read_bytes("loss_history.jsonl")
    assert data == b'{"step":0}\n{"step":1,"lo\n{"step":1}\n{"step":2}\n'
    from raygpt.runlog.history import parse_jsonl
    assert [r["step"] for r in parse_jsonl(data, "loss_history.jsonl")] == [0, 1, 2]


def test_a_whole_last_line_gets_no_extra_newline(local_run_dir: RunDir):
    local_run_dir.write_bytes_atomic("h.jsonl", b"a\n")
    fresh = RunDir(local_run_dir.fs, local_run_dir.root)
    fresh.append_text("h.jsonl", "b\n")
    fresh.close()
    assert RunDir(local_run_dir.fs, local_run_dir.root).read_bytes("h.jsonl") == b"a\nb\n"


def test_iter_lines_streams_across_chunks_and_cuts_overlong_lines(run_dir: RunDir):
    """The streaming reader behind `raygpt status`: the same lines as a whole-file split, over
    any chunk size, and a line longer than max_line comes back as its head + b"..." (never a
    valid JSON record, never held whole)."""
    lines = [b"a" * n for n in (0, 1, 5, 7, 8, 9, 30, 2)] + [b'{"k": 1}']
    run_dir.write_bytes_atomic("h.jsonl", b"\n".join(lines) + b"\n")
    for chunk in (1, 3, 8, 64):
        got = list(run_dir.iter_lines("h.jsonl", max_line=10, chunk_bytes=chunk))
        want = [x if len(x) <= 10 else x[:10] + b"..." for x in lines]
        assert got == want, chunk
    run_dir.write_bytes_atomic("t.jsonl", b"one\ntorn-no-newline")
    assert list(run_dir.iter_lines("t.jsonl", chunk_bytes=4)) == [b"one", b"torn-no-newline"]


def test_bounded_reads_refuse_more_than_asked(run_dir: RunDir):
    from raygpt.storage import FileTooLarge, read_json_bounded
    run_dir.write_bytes_atomic("x.json", b'{"a": "' + b"b" * 100 + b'"}')
    assert run_dir.read_bytes("x.json", max_bytes=200)[:6] == b'{"a": '
    with pytest.raises(FileTooLarge, match="x.json: expected at most 50 bytes"):
        run_dir.read_bytes("x.json", max_bytes=50)
    with pytest.raises(ValueError, match="at most 10 bytes"):
        read_json_bounded(run_dir, "x.json", max_bytes=10)
    with pytest.raises(FileTooLarge):
        run_dir.sha256_of("x.json", max_bytes=10)
    assert run_dir.sha256_of("x.json", max_bytes=109) == run_dir.sha256_of("x.json")


# ---------------------------------------------------------------------- object stores: endpoint,
# timeouts, causes

def test_the_endpoint_comes_from_the_uri_the_flag_or_the_aws_variables_in_that_order():
    from raygpt.storage import with_endpoint
    both = {"AWS_ENDPOINT_URL_S3": "http://s3only:1", "AWS_ENDPOINT_URL": "https://all:2/"}
    assert with_endpoint("s3://b/r", "", both) == "s3://b/r?endpoint_override=s3only:1&scheme=http"
    assert with_endpoint("s3://b/r", "", {"AWS_ENDPOINT_URL": "https://all:2/"}) == (
        "s3://b/r?endpoint_override=all:2&scheme=https")
    assert with_endpoint("s3://b/r?region=x", "http://flag:3", both) == (
        "s3://b/r?region=x&endpoint_override=flag:3&scheme=http")
    own = "s3://b/r?endpoint_override=mine:4&scheme=http"
    assert with_endpoint(own, "http://flag:3", both) == own  # the URI's own wins
    assert with_endpoint("s3://b/r", "", {}) == "s3://b/r"  # AWS's own endpoint
    assert with_endpoint("gs://b/r", "", both) == "gs://b/r"  # S3 variables are S3's
    for bad in ("minio:9000", "http://", "http://h:1/path", "http://u:p@h:1"):
        with pytest.raises(ValueError, match="^AWS_ENDPOINT_URL: expected an endpoint URL"):
            with_endpoint("s3://b/r", "", {"AWS_ENDPOINT_URL": bad})


def test_object_store_filesystems_are_opened_with_bounded_timeouts_keeping_the_uris_options():
    from raygpt import storage
    rd = open_run_dir("s3://AK:SE@b/r?endpoint_override=h:1&scheme=http&region=eu-west-3")
    options = rd.fs.__reduce__()[1][0]
    assert (options["connect_timeout"], options["request_timeout"]) == (
        storage.CONNECT_TIMEOUT_S, storage.REQUEST_TIMEOUT_S)
    assert (options["access_key"], options["secret_key"], options["region"],
            options["endpoint_override"], options["scheme"]) == ("AK", "SE", "eu-west-3", "h:1", "http")
    # what Ray's workers get (the filesystem pickled) keeps the timeouts
    assert pickle.loads(pickle.dumps(rd.fs)).__reduce__()[1][0]["connect_timeout"] == 5.0
    gs = open_run_dir("gs://b/r?endpoint_override=127.0.0.1:1&scheme=http")
    assert gs.fs.__reduce__()[1][0]["retry_time_limit"].total_seconds() == storage.GCS_RETRY_LIMIT_S
    assert gs.fs.__reduce__()[1][0]["endpoint_override"] == "127.0.0.1:1"


def test_a_refused_request_names_missing_credentials_or_refused_ones(tmp_path):
    from raygpt.storage import storage_cause
    e = OSError("When getting information for key 'r' in bucket 'b': AWS Error ACCESS_DENIED "
                "during HeadObject operation: No response body.")
    nothing = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    assert storage_cause(e, nothing).startswith("access denied, no credentials found (set "
                                                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    assert storage_cause(e, {**nothing, "AWS_PROFILE": "p"}).startswith(
        "access denied, credentials refused: When getting")
    (tmp_path / "credentials").write_text("[default]\n")
    assert storage_cause(e, {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials")}
                         ).startswith("access denied, credentials refused")
    multi = OSError("When listing objects under key 'r' in bucket 'b': AWS Error NETWORK_CONNECTION"
                    "\nduring ListObjectsV2 operation: curlCode: 7, Could not connect to server")
    assert storage_cause(multi, nothing) == (
        "the endpoint does not answer (unreachable, or it timed out): When listing objects under key "
        "'r' in bucket 'b': AWS Error NETWORK_CONNECTION during ListObjectsV2 operation: curlCode: "
        "7, Could not connect to server")


def test_move_file_renames_inside_the_run_directory(run_dir: RunDir):
    run_dir.write_bytes_atomic(".prepare/a.bin", b"shard")
    run_dir.move_file(".prepare/a.bin", "a.bin")
    assert run_dir.read_bytes("a.bin") == b"shard" and not run_dir.exists(".prepare/a.bin")


def test_move_file_replaces_a_link_at_its_target_and_refuses_one_at_its_source(local_run_dir,
                                                                              tmp_path):
    from raygpt.storage.atomic_file import RefusedPath
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    local_run_dir.write_bytes_atomic("staged.bin", b"shard")
    (tmp_path / "run" / "final.bin").symlink_to(victim)
    local_run_dir.move_file("staged.bin", "final.bin")
    assert victim.read_bytes() == b"precious"
    assert not (tmp_path / "run" / "final.bin").is_symlink()
    (tmp_path / "run" / "planted.bin").symlink_to(victim)
    with pytest.raises(RefusedPath, match="planted.bin: is a symbolic link"):
        local_run_dir.move_file("planted.bin", "other.bin")
    assert victim.read_bytes() == b"precious" and not (tmp_path / "run" / "other.bin").exists()
