"""The store contract (raygpt.storage.store), one suite run against every backend: the local
disk, S3 (moto's server over HTTP, made through the URI door), the in-memory store, and the
in-memory store stating an object store's capabilities. A new backend is its module and one
line in BACKENDS. What a backend lacks is asserted as refused, by its stated capabilities."""

import os
import pickle
import threading
import uuid

import pytest

from raygpt.storage import RunDir, Unsupported, open_store
from raygpt.storage.local_store import LocalStore
from raygpt.storage.memory_store import MemoryStore
from raygpt.storage.store import Capabilities, Entry
from tests.helpers import S3Server

BACKENDS = {
    "local": lambda tmp_path, s3: LocalStore(tmp_path / "store"),
    "s3": lambda tmp_path, s3: open_store(f"s3://bucket/{uuid.uuid4().hex}",
                                          endpoint=s3.endpoint),
    "memory": lambda tmp_path, s3: MemoryStore("/r"),
    "memory-as-object-store": lambda tmp_path, s3: MemoryStore("/r", Capabilities(shared=False)),
}


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto.server")
    with pytest.MonkeyPatch.context() as env, S3Server() as server:
        env.setenv("AWS_ACCESS_KEY_ID", S3Server.KEY)
        env.setenv("AWS_SECRET_ACCESS_KEY", S3Server.SECRET)
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        server.fs().create_dir("bucket")
        yield server


@pytest.fixture(params=sorted(BACKENDS))
def store(request, tmp_path):
    s3 = request.getfixturevalue("s3") if request.param == "s3" else None
    return BACKENDS[request.param](tmp_path, s3)


def read(store, rel) -> bytes:
    with store.open_read(rel) as f:
        return f.read()


def test_the_s3_backend_is_made_through_the_door_with_bounded_calls(s3):
    store = BACKENDS["s3"](None, s3)
    options = store.fs.__reduce__()[1][0]
    assert options["endpoint_override"] == s3.address and options["connect_timeout"] > 0
    assert store.caps == Capabilities() and store.uri("a/b").startswith("s3://bucket/")


def test_publish_read_list_and_sizes(store):
    assert store.info("d/a.bin") is None and store.list("nope") == {}
    store.publish("d/a.bin", b"first")
    store.publish("d/a.bin", b"second!")  # replaced whole
    store.publish("d/sub/g", b"")
    assert read(store, "d/a.bin") == b"second!"
    assert store.info("d/a.bin") == Entry("file", 7) and store.info("d/sub").kind == "dir"
    assert store.list("d") == {"a.bin": Entry("file", 7), "sub": Entry("dir")}
    assert store.list("d/sub") == {"g": Entry("file", 0)}
    with pytest.raises(FileNotFoundError):
        read(store, "d/missing")


def test_read_range(store):
    store.publish("r.bin", bytes(range(256)))
    assert store.read_range("r.bin", 10, 5) == bytes(range(10, 15))
    assert store.read_range("r.bin", 0, 1) == b"\x00"
    assert store.read_range("r.bin", 250, 100) == bytes(range(250, 256))  # fewer at the end
    assert store.read_range("r.bin", 256, 4) == b""


def test_a_failed_publish_never_leaves_a_partial_file(store):
    store.publish("f", b"old bytes")
    with pytest.raises(RuntimeError, match="mid-write"):
        with store.open_publish("f") as f:
            f.write(b"partial")
            raise RuntimeError("mid-write")
    assert store.info("f") is None or read(store, "f") == b"old bytes"
    if store.caps.atomic_rename:  # a temporary renamed into place keeps the old bytes
        assert read(store, "f") == b"old bytes"
    assert [n for n in store.list() if n != "f"] == []  # no temporary left beside it


def test_append_or_its_refusal(store):
    if not store.caps.appends:
        with pytest.raises(Unsupported, match="no append"):
            store.append("log.txt", b"a\n")
        assert store.info("log.txt") is None
        return
    store.append("logs/log.txt", b"a\n")  # made when missing, parents too
    store.append("logs/log.txt", b"bc\n")
    assert read(store, "logs/log.txt") == b"a\nbc\n"


def test_move_replaces_the_target_and_removes_the_source(store):
    store.publish("src", b"new")
    store.publish("dst/x", b"older")
    store.move("src", "dst/x")
    assert store.info("src") is None and read(store, "dst/x") == b"new"


def test_deletes_are_idempotent_and_stay_in_their_tree(store):
    store.publish("t/a", b"1")
    store.publish("t/u/b", b"2")
    store.publish("keep", b"3")
    store.publish("t2/c", b"4")  # a sibling whose name starts with the tree's
    store.delete_file("t/a")
    store.delete_file("t/a")  # already gone: no error
    assert store.info("t/a") is None and read(store, "t/u/b") == b"2"
    store.delete_tree("t")
    store.delete_tree("t")
    store.delete_tree("never")
    assert store.info("t") is None and store.info("t/u/b") is None
    assert read(store, "keep") == b"3" and read(store, "t2/c") == b"4"


def test_makedirs_makes_an_empty_directory(store):
    store.makedirs("x/y")
    assert store.info("x/y") == Entry("dir") and store.list("x") == {"y": Entry("dir")}


def test_owner_or_none(store):
    store.publish("o", b"mine")
    owner = store.owner("o")
    if store.caps.owners:
        assert owner.uid == os.geteuid() and owner.regular
        assert store.owner("missing") is None
        os.symlink(store.local_path("o"), store.local_path("link"))
        assert not store.owner("link").regular  # the link itself, not its target
    else:
        assert owner is None


def test_lock_excludes_another_holder(store):
    if not store.caps.locks:
        with pytest.raises(Unsupported, match="no lock"):
            with store.lock(".lock"):
                pass
        return
    entered = threading.Event()

    def other():
        with store.lock(".lock"):
            entered.set()

    with store.lock(".lock"):
        thread = threading.Thread(target=other, daemon=True)
        thread.start()
        assert not entered.wait(0.3), "a second holder entered while the lock was held"
    assert entered.wait(10), "the second holder never got the lock once it was released"
    thread.join(10)


def test_a_shared_store_pickles_to_the_same_place(store):
    store.publish("p", b"sent")
    if not store.caps.shared:
        with pytest.raises(TypeError, match="one process"):
            pickle.dumps(store)
        return
    again = pickle.loads(pickle.dumps(store))
    assert again.caps == store.caps and read(again, "p") == b"sent"
    again.publish("q", b"back")
    assert read(store, "q") == b"back"


def test_a_run_dir_on_the_store_keeps_its_logs(store):
    """RunDir's logs on any store: one appended file where the store appends, immutable
    segments where it does not; read back the same either way."""
    from raygpt.runlog import segments
    from raygpt.runlog.history import LOSS_HISTORY_LOG

    rd = RunDir(store)
    log = segments.LogFile(rd, LOSS_HISTORY_LOG)
    for line in ('{"step": 1}\n', '{"step": 2}\n', '{"step": 3}\n'):
        log.append(line)
    log.close()
    assert list(segments.read_lines(rd, LOSS_HISTORY_LOG)) == [b'{"step": 1}', b'{"step": 2}',
                                                                b'{"step": 3}']
    assert rd.exists(LOSS_HISTORY_LOG.legacy) == store.caps.appends
    assert rd.is_dir(LOSS_HISTORY_LOG.folder) != store.caps.appends


def test_one_lease_holder_per_run_dir(store):
    from raygpt.storage.ownership import Lease, RunDirBusy

    first = Lease(RunDir(store), settle_s=0.0)
    first.acquire()
    with pytest.raises(RunDirBusy, match="holds its lease"):
        Lease(RunDir(store), settle_s=0.0).acquire()
    first.release()
    assert RunDir(store).exists("raygpt_lease.json") is False
