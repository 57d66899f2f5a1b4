"""Tests of raygpt.data.sources: shards in a bucket (moto's S3 server over HTTP) and the node's
shard cache, without Ray. Listing and order, headers read by range, the fingerprint a local copy
shares, and the cache: bounded, private, verified, atomic, one download per shard per node."""

from __future__ import annotations

import hashlib
import json
import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from raygpt.data.shard_writer import shard_bytes
from raygpt.data.sources import (ShardCache, data_fingerprint, list_shards,
                                 shard_token_counts)
from raygpt.llmc.shards import HEADER_BYTES, ShardError, write_shard
from raygpt.train.errors import EXIT_BAD_INPUT, stop_code


pytest.importorskip("moto.server")


def tokens_of(s: int, n: int) -> np.ndarray:
    return (s * 1000 + np.arange(n)) % 65536


def put_shards(s3, prefix: str, sizes, local=None, manifest=False) -> str:
    """Shards of `sizes` tokens under bucket/prefix (and in `local`, a directory, when given);
    with `manifest`, a prepare manifest.json listing them. Their s3:// glob."""
    fs, entries = s3.fs(), []
    for s, n in enumerate(sizes):
        name, data = f"shard_{s:06d}.bin", shard_bytes(tokens_of(s, n))
        with fs.open_output_stream(f"bucket/{prefix}/{name}") as f:
            f.write(data)
        if local is not None:
            (local / name).write_bytes(data)
        entries.append({"name": name, "tokens": n, "sha256": hashlib.sha256(data).hexdigest()})
    if manifest:
        doc = {"format": "raygpt-shards", "version": 1, "identity": "x", "documents": 1,
               "shards": entries}
        with fs.open_output_stream(f"bucket/{prefix}/manifest.json") as f:
            f.write(json.dumps(doc).encode())
    return s3.uri(f"bucket/{prefix}/shard_*.bin")


class Counted(pafs.FileSystemHandler):
    """A pyarrow filesystem (the store's) that counts the bytes read from it and the whole-object
    streams opened on it."""

    def __init__(self, fs):
        self.fs, self.bytes_read, self.streams = fs, 0, 0
        self.lock = threading.Lock()

    def _count(self, f):
        handler = self

        class Reader:  # the file-like PythonFile wraps: every read counted
            closed = False

            def read(self, n=-1):
                data = f.read() if n is None or n < 0 else f.read(n)
                with handler.lock:
                    handler.bytes_read += len(data)
                return data

            def seek(self, pos, whence=0):
                return f.seek(pos, whence)

            def tell(self):
                return f.tell()

            def size(self):
                return f.size()

            def close(self):
                self.closed = True
                f.close()

        return pa.PythonFile(Reader(), mode="r")

    def open_input_file(self, path):
        return self._count(self.fs.open_input_file(path))

    def open_input_stream(self, path):
        with self.lock:
            self.streams += 1
        return self._count(self.fs.open_input_stream(path))

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def get_type_name(self):
        return "s3"

    def equals(self, other):
        return other is self

    def normalize_path(self, path):
        return path

    def _unused(self, *args):  # writes: sources never writes to a store
        raise NotImplementedError

    copy_file = create_dir = delete_dir = delete_dir_contents = delete_file = _unused
    delete_root_dir_contents = move = open_append_stream = open_output_stream = _unused


def counted(s3) -> tuple[pafs.FileSystem, Counted]:
    handler = Counted(s3.fs())
    return pafs.PyFileSystem(handler), handler


# ------------------------------------------------------------------------ listing and reading

def test_a_bucket_glob_lists_its_shards_sorted_within_one_segment(s3, tmp_path):
    uri = put_shards(s3, "list", [300, 200, 100])
    fs = s3.fs()
    with fs.open_output_stream("bucket/list/sub/shard_000009.bin") as f:  # one level deeper
        f.write(shard_bytes(tokens_of(9, 50)))
    source = list_shards(uri)
    assert [s.uri for s in source.shards] == [f"s3://bucket/list/shard_{i:06d}.bin" for i in range(3)]
    assert [s.size for s in source.shards] == [HEADER_BYTES + 2 * n for n in (300, 200, 100)]
    assert shard_token_counts(uri) == [(f"s3://bucket/list/shard_{i:06d}.bin", n)
                                       for i, n in enumerate((300, 200, 100))]
    # the same order glob.glob gives the local copy (llm.c's)
    for i, n in enumerate((300, 200, 100)):
        write_shard(tmp_path / f"shard_{i:06d}.bin", tokens_of(i, n))
    assert [os.path.basename(s.path) for s in list_shards(str(tmp_path / "shard_*.bin")).shards] == \
        [os.path.basename(s.path) for s in source.shards]
    # the store's capabilities say where shards are read: in place locally, else through the cache
    assert list_shards(str(tmp_path / "shard_*.bin")).caps.local_paths
    assert not source.caps.local_paths and not source.caps.appends


def test_a_bucket_glob_matching_nothing_is_one_line_naming_it(s3):
    uri = s3.uri("bucket/nothing-here/shard_*.bin")
    with pytest.raises(ShardError) as e:
        list_shards(uri)
    assert str(e.value) == (f"shard pattern {uri}: expected at least one matching object, "
                            f"found none")


def test_an_unreachable_store_is_one_line_naming_the_pattern():
    import socket
    with socket.socket() as sock:  # a port bound, then released: nothing listens there
        sock.bind(("127.0.0.1", 0))
        where = "%s:%d" % sock.getsockname()
    uri = f"s3://bucket/d/shard_*.bin?endpoint_override={where}&scheme=http&region=us-east-1"
    with pytest.raises(ShardError) as e:
        list_shards(uri)
    (line,) = str(e.value).splitlines()
    assert line.startswith(f"shard pattern {uri}: cannot list the store: a network failure: "
                           f"{where} refused or dropped the connection"), line


def test_headers_and_fingerprint_are_range_reads(s3):
    """A 3 MiB shard: its header costs HEADER_BYTES, its fingerprint its first and last MiB."""
    n = 3 * (1 << 20) // 2
    uri = put_shards(s3, "ranges", [n, 1000])
    fs, handler = counted(s3)
    source = list_shards(uri, fs=fs)
    assert [source.header_tokens(i) for i in range(2)] == [n, 1000]
    assert handler.bytes_read == 2 * HEADER_BYTES and handler.streams == 0
    handler.bytes_read = 0
    source.ends_sha256(0)
    assert handler.bytes_read == 2 << 20  # of 3 MiB + 1 KiB


def test_the_fingerprint_of_a_bucket_equals_its_local_copys(s3, tmp_path):
    """Only basename, size and bytes are hashed: resume compares a bucket's shards with the
    local ones a checkpoint was written with (and back), by their bytes."""
    uri = put_shards(s3, "print", [3 * (1 << 20) // 2, 5000], local=tmp_path)
    local = str(tmp_path / "shard_*.bin")
    assert data_fingerprint(uri) == data_fingerprint(local)
    # a token changed in the last MiB of the large shard shows, remotely as locally
    data = bytearray((tmp_path / "shard_000000.bin").read_bytes())
    data[-1] ^= 0x01
    with s3.fs().open_output_stream("bucket/print/shard_000000.bin") as f:
        f.write(bytes(data))
    assert data_fingerprint(uri) != data_fingerprint(local)
    (tmp_path / "shard_000000.bin").write_bytes(bytes(data))
    assert data_fingerprint(uri) == data_fingerprint(local)


def test_a_manifest_token_count_the_header_contradicts_is_named(s3):
    uri = put_shards(s3, "lying", [400, 500], manifest=True)
    fs = s3.fs()
    doc = json.loads(fs.open_input_stream("bucket/lying/manifest.json").read())
    doc["shards"][1]["tokens"] = 501
    with fs.open_output_stream("bucket/lying/manifest.json") as f:
        f.write(json.dumps(doc).encode())
    with pytest.raises(ShardError) as e:
        shard_token_counts(uri)
    assert str(e.value) == ("s3://bucket/lying/shard_000001.bin: token count (header[2]): "
                            "expected 501 (manifest.json beside it), found 500")


# ------------------------------------------------------------------------ the node's cache

def cache_files(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n != ".locks")


def test_the_cache_stays_within_its_bound_evicting_the_least_recently_used(s3, tmp_path):
    uri = put_shards(s3, "evict", [1000, 1000, 1000, 1000])
    size = HEADER_BYTES + 2000
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=2 * size)
    source = list_shards(uri)
    for i in (0, 1, 0, 2, 3):  # 0 used again after 1: 1 is the least recently used when 2 comes
        held = cache.open(source, i)
        assert np.array_equal(np.fromfile(held.path, dtype="<u2", offset=HEADER_BYTES),
                              tokens_of(i, 1000))
        held.close()
        assert cache.cached_bytes() <= 2 * size
    assert sorted(n.split("-", 1)[1] for n in cache_files(cache.root)) == \
        ["shard_000002.bin", "shard_000003.bin"]


def test_a_shard_held_open_is_not_evicted(s3, tmp_path):
    uri = put_shards(s3, "held", [1000, 1000, 1000])
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=2 * (HEADER_BYTES + 2000))
    source = list_shards(uri)
    first = cache.open(source, 0)  # held: a loader has it mapped
    cache.open(source, 1).close()
    cache.open(source, 2).close()  # room made by evicting 1, not 0
    assert os.path.exists(first.path)
    assert sorted(n.split("-", 1)[1] for n in cache_files(cache.root)) == \
        ["shard_000000.bin", "shard_000002.bin"]
    first.close()


def test_a_file_gone_between_the_listing_and_its_stat_is_counted_as_gone(s3, tmp_path, monkeypatch):
    """Another worker of the node renames its fetched file into place, or evicts a shard, while
    this one lists the cache: counting bytes and making room go on without the file."""
    uri = put_shards(s3, "racing", [1000, 1000])
    size = HEADER_BYTES + 2000
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=2 * size)
    source = list_shards(uri)
    real_scandir = os.scandir

    def listed_then_gone(path):
        entries = list(real_scandir(path))
        for e in entries:
            if e.is_file(follow_symlinks=False):
                os.unlink(e.path)
        return iter(entries)

    def cached_and_fetching():  # shard 0 cached, and a live fetch's temp file about to be renamed
        cache.open(source, 0).close()
        with open(os.path.join(cache.root, f".tmp-{os.getpid()}-racing"), "wb") as f:
            f.write(bytes(size))

    cached_and_fetching()
    with monkeypatch.context() as m:
        m.setattr(os, "scandir", listed_then_gone)
        assert cache.cached_bytes() == 0
    cached_and_fetching()
    with monkeypatch.context() as m:
        m.setattr(os, "scandir", listed_then_gone)
        held = cache.open(source, 1)  # making room lists the cache
    assert np.array_equal(np.fromfile(held.path, dtype="<u2", offset=HEADER_BYTES),
                          tokens_of(1, 1000))
    held.close()
    assert cache_files(cache.root) == [cache.name_of(source, 1, None)]


def test_a_planted_symlink_as_the_cache_is_refused(tmp_path):
    """Another user of the node plants the cache's name as a link to a directory of theirs:
    raygpt must neither follow it nor write shards there."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    planted = tmp_path / "raygpt_shards"
    planted.symlink_to(theirs)
    with pytest.raises(ShardError) as e:
        ShardCache(str(planted))
    assert str(e.value).startswith(f"{planted}: expected a private shard cache (or give "
                                   f"--shard-cache-dir), found a symlink")
    assert list(theirs.iterdir()) == []
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(ShardError, match="no group or other permissions.*found mode 0755"):
        ShardCache(str(shared))
    made = ShardCache(str(tmp_path / "new")).root
    assert os.stat(made).st_mode & 0o777 == 0o700


def test_a_tampered_shard_is_refused_in_one_line_and_never_cached(s3, tmp_path):
    uri = put_shards(s3, "tampered", [1000, 1000], manifest=True)
    fs = s3.fs()
    data = bytearray(fs.open_input_stream("bucket/tampered/shard_000001.bin").read())
    data[HEADER_BYTES + 10] ^= 1  # one token changed: same size, same header
    with fs.open_output_stream("bucket/tampered/shard_000001.bin") as f:
        f.write(bytes(data))
    source = list_shards(uri)
    expected = source.manifest()
    cache = ShardCache(str(tmp_path / "cache"))
    cache.open(source, 0, expected[source.shards[0].path]).close()
    with pytest.raises(ShardError) as e:
        cache.open(source, 1, expected[source.shards[1].path])
    want = expected[source.shards[1].path]["sha256"]
    found = hashlib.sha256(bytes(data)).hexdigest()
    assert str(e.value) == (f"s3://bucket/tampered/shard_000001.bin: sha256: expected {want} "
                            f"(manifest.json beside it), found {found} -- the shard's bytes are "
                            f"not the ones prepared")
    assert stop_code(e.value) == EXIT_BAD_INPUT  # bad input: a restart would meet it again
    assert [n.split("-", 1)[1] for n in cache_files(cache.root)] == ["shard_000000.bin"]


def test_without_a_manifest_a_fetched_shard_is_checked_against_its_header(s3, tmp_path):
    fs = s3.fs()
    with fs.open_output_stream("bucket/badmagic/shard_000000.bin") as f:
        f.write(b"\0" * HEADER_BYTES + b"\1\0" * 10)
    source = list_shards(s3.uri("bucket/badmagic/shard_*.bin"))
    with pytest.raises(ShardError, match=r"^s3://bucket/badmagic/shard_000000\.bin: magic "):
        ShardCache(str(tmp_path / "cache")).open(source, 0)
    assert cache_files(tmp_path / "cache") == []


def test_a_fetch_cut_off_midway_leaves_nothing_under_a_cache_name(s3, tmp_path):
    uri = put_shards(s3, "cut", [200_000])
    fs, handler = counted(s3)
    source = list_shards(uri, fs=fs)
    real = handler.open_input_stream

    def cut(path):  # the connection dies after the first chunk
        f = real(path)
        f.read(HEADER_BYTES)
        raise OSError("connection reset by peer")

    handler.open_input_stream = cut
    cache = ShardCache(str(tmp_path / "cache"))
    with pytest.raises(ShardError, match=r"^s3://bucket/cut/shard_000000\.bin: cannot fetch "
                                         r"shard \(connection reset by peer\)$") as e:
        cache.open(source, 0)
    assert stop_code(e.value) is None  # the store's failure: Ray's restart may cure it
    assert cache_files(cache.root) == []
    # a temp file of a fetcher killed outright (its pid gone) is removed by the next fetch
    (tmp_path / "cache" / ".tmp-999999999-dead").write_bytes(b"partial")
    handler.open_input_stream = real
    cache.open(source, 0).close()
    assert [n.split("-", 1)[1] for n in cache_files(cache.root)] == ["shard_000000.bin"]


def test_two_workers_fetching_one_shard_download_it_once(s3, tmp_path):
    """Two loaders of one node (threads here: flock sees each open of the lock file as its own,
    as it sees two processes) ask for the same shard at once: one downloads, the other waits
    and finds it; both read the right tokens."""
    uri = put_shards(s3, "twice", [300_000])
    fs, handler = counted(s3)
    source = list_shards(uri, fs=fs)
    cache = ShardCache(str(tmp_path / "cache"))
    start, got, errors = threading.Barrier(2), [], []

    def worker():
        try:
            start.wait()
            held = cache.open(source, 0)
            got.append(np.fromfile(held.path, dtype="<u2", offset=HEADER_BYTES))
            held.close()
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert handler.streams == 1
    assert all(np.array_equal(g, tokens_of(0, 300_000)) for g in got) and len(got) == 2
    assert len(cache_files(cache.root)) == 1


# ------------------------------------------------------------ what the cache may delete (issue 53)

def test_a_directory_holding_other_files_is_never_a_cache(s3, tmp_path):
    """--shard-cache-dir ~ (or a config file's): eviction would delete the user's files as if they
    were shards. A private directory holding anything but the cache's own names is refused, its
    files untouched."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    os.chmod(home, 0o700)
    (home / "thesis.tex").write_text("years of work")
    with pytest.raises(ShardError) as e:
        ShardCache(str(home), max_bytes=1)
    (line,) = str(e.value).splitlines()
    assert line.startswith(f"{home}: expected a shard cache raygpt made, or an empty directory")
    assert "'thesis.tex'" in line
    assert sorted(os.listdir(home)) == ["thesis.tex"]
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    os.chmod(empty, 0o700)
    assert ShardCache(str(empty)).root == str(empty)  # an empty one is adopted, and marked
    assert os.path.isfile(empty / ".locks" / "raygpt-shard-cache")


def test_eviction_deletes_only_what_the_cache_fetched(s3, tmp_path):
    """A file that reaches a marked cache later (moved there, another tool's) is left alone, even
    when the bound makes the cache evict everything it can."""
    uri = put_shards(s3, "foreign", [1000, 1000])
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=HEADER_BYTES + 2000)
    source = list_shards(uri)
    cache.open(source, 0).close()
    root = tmp_path / "cache"
    (root / "photos.tar").write_bytes(b"x" * 50_000)
    os.utime(root / "photos.tar", (1, 1))  # the oldest entry: first in line were it a shard
    (root / "notes").mkdir()
    (root / ".tmp-1-not-ours-but-named-so").mkdir()  # our temp name, but not a regular file
    cache.open(source, 1).close()
    assert sorted(os.listdir(root)) == sorted([".locks", ".tmp-1-not-ours-but-named-so", "notes",
                                               "photos.tar", cache.name_of(source, 1, None)])
    assert cache.cached_bytes() == HEADER_BYTES + 2000  # the foreign file is not counted


def test_an_object_replaced_by_a_shorter_valid_shard_after_listing_is_refused(s3, tmp_path):
    """The listed size is what the fingerprint and the plan saw: a valid shard of another size
    served in its place is refused, not cached."""
    uri = put_shards(s3, "shrunk", [1000])
    source = list_shards(uri)
    with s3.fs().open_output_stream("bucket/shrunk/shard_000000.bin") as f:
        f.write(shard_bytes(tokens_of(0, 900)))
    with pytest.raises(ShardError, match=rf"size: expected {HEADER_BYTES + 2000:,} bytes \(as "
                                         rf"listed\), fetched {HEADER_BYTES + 1800:,}"):
        ShardCache(str(tmp_path / "cache")).open(source, 0)
    assert cache_files(tmp_path / "cache") == []


def test_an_object_that_grew_after_listing_is_read_only_one_byte_past_its_size(s3, tmp_path):
    uri = put_shards(s3, "grown", [1000])
    fs, handler = counted(s3)
    source = list_shards(uri, fs=fs)
    with s3.fs().open_output_stream("bucket/grown/shard_000000.bin") as f:
        f.write(shard_bytes(tokens_of(0, 400_000)))  # 800 KB where 2 KB were listed
    handler.bytes_read = 0
    with pytest.raises(ShardError, match=r"size: expected .* \(as listed\), fetched "
                                         rf"{HEADER_BYTES + 2001:,}"):
        ShardCache(str(tmp_path / "cache")).open(source, 0)
    assert handler.bytes_read == HEADER_BYTES + 2001
    assert cache_files(tmp_path / "cache") == []


@pytest.mark.timeout(20)
def test_a_fifo_among_local_shards_is_refused_without_waiting_on_it(tmp_path):
    write_shard(tmp_path / "shard_000000.bin", tokens_of(0, 100))
    os.mkfifo(tmp_path / "shard_000001.bin")
    with pytest.raises(ShardError) as e:
        list_shards(str(tmp_path / "shard_*.bin"))
    assert str(e.value) == (f"shard {str(tmp_path / 'shard_000001.bin')!r}: expected a regular "
                            f"file, found a FIFO")
    assert stop_code(e.value) == EXIT_BAD_INPUT
