"""Where token shards live: a local glob, or an s3:// / gs:// glob read through a node-local cache.

`list_shards(pattern)` is a `ShardSource`: the shards matching the pattern, sorted by path (llm.c's
glob order), with each one's size. What the driver needs of them reads headers only:
`header_tokens` is one range read of HEADER_BYTES on an object store, and `data_fingerprint`
hashes (basename, size, first MiB + last MiB) with two range reads per shard, so the fingerprint
of a bucket's shards equals the fingerprint of a local copy of them (where shards lie is not
part of it). An s3:// pattern takes its endpoint as a run directory does (`storage.with_endpoint`:
the URI's own, else --storage-endpoint, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL), and every
call to the store is bounded (`storage.bounded_filesystem`). `?` is a URI's query on an object
store, never a glob character there; `*` and `[...]` match within one path segment, as glob's.

Local shards are read where they are (memory-mapped by the loader, no copy). A remote shard is
read from the node's `ShardCache`: a directory private to the user, bounded in bytes, least
recently used shards evicted first unless a process has them open (a shared flock on each file
in use). A shard is fetched whole into a temp file and renamed once verified, so a crash never
leaves a partial shard under its cache name: against the prepare's manifest.json beside it
(raygpt.data.shard_writer: token count and sha256) when there is one, else against its header
and size. Workers of one node fetching the same shard take turns on its lock file: one
downloads, the others find it in place. `ShardFetcher` runs the fetches on a background thread,
so the loader asks for the next shard of its stream when it starts the current one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import fnmatch
import glob
import hashlib
import os
import posixpath
import queue
import re
import stat
import tempfile
import threading
import uuid

from raygpt.data.network import endpoint_host, network_failure
from raygpt.llmc.shards import HEADER_BYTES, ShardError, check_shard_header
from raygpt.storage.atomic_file import NotPrivateError, private_dir
from raygpt.storage.local_store import store_for
from raygpt.storage.store import Capabilities

REMOTE_SCHEMES = ("s3://", "gs://", "gcs://")
_GLOB_CHARS = "*[?"  # on an object store '?' starts the URI's query (see the module's notes)
_MIB = 1 << 20
_CHUNK = 8 << 20  # streaming unit of a fetch
DEFAULT_CACHE_GB = 50.0


def is_remote(pattern: str) -> bool:
    """True for a pattern on an object store (s3://, gs://), False for a local glob."""
    return str(pattern).startswith(REMOTE_SCHEMES)


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard of a source: `uri` names it in messages (a local path, or scheme://bucket/key),
    `path` is where its filesystem finds it, `size` its bytes, `mtime_ns` when it was written."""
    uri: str
    path: str
    size: int
    mtime_ns: int


@dataclasses.dataclass(frozen=True)
class ShardSource:
    """The shards a pattern names, sorted by path. `fs` is None for local files (read with the
    os module, as they always were), else the object store's bounded pyarrow filesystem."""
    pattern: str
    shards: tuple[Shard, ...]
    fs: object = None

    @property
    def caps(self) -> Capabilities:
        """What the shards' store can do (raygpt.storage.store): shards with local paths are
        read where they lie, the others through the node's cache."""
        import pyarrow.fs as pafs
        return store_for(self.fs or pafs.LocalFileSystem(), "/").caps

    def __len__(self) -> int:
        return len(self.shards)

    def read_at(self, i: int, offset: int, nbytes: int) -> bytes:
        """`nbytes` bytes of shard `i` from `offset` (fewer at its end): one range read."""
        shard = self.shards[i]
        try:
            if self.fs is None:
                with open(shard.path, "rb") as f:
                    return os.pread(f.fileno(), nbytes, offset)
            with self.fs.open_input_file(shard.path) as f:
                return f.read_at(nbytes, offset)
        except OSError as e:
            raise ShardError(f"{shard.uri}: cannot read shard ({_one_line(e)})") from e  # an OSError: a restart may cure it

    def header_tokens(self, i: int) -> int:
        """Shard `i`'s token count, its header checked against llm.c's format and its size
        (HEADER_BYTES read, nothing more)."""
        return check_shard_header(self.read_at(i, 0, HEADER_BYTES), self.shards[i].size,
                                  self.shards[i].uri)

    def ends_sha256(self, i: int) -> str:
        """sha256 of shard `i`'s first MiB and last MiB (the whole file when it is smaller)."""
        return ends_sha256(lambda offset, n: self.read_at(i, offset, n), self.shards[i].size)

    def manifest(self) -> dict[str, dict]:
        """{shard name: manifest entry (name, tokens, sha256)} from the prepare manifests
        (manifest.json) in the directories the shards are in; {} where there is none."""
        from raygpt.data.shard_writer import PrepareError, read_manifest
        from raygpt.storage import RunDir
        import pyarrow.fs as pafs

        fs = self.fs if self.fs is not None else pafs.LocalFileSystem()
        entries: dict[str, dict] = {}
        for parent in sorted({posixpath.dirname(s.path) for s in self.shards}):
            try:
                found = read_manifest(RunDir(fs, parent))
            except PrepareError as e:
                raise ShardError(str(e)) from None
            except OSError as e:
                raise ShardError(f"{self._uri_of(parent)}/manifest.json: cannot read it "
                                 f"({_one_line(e)})") from e
            for entry in (found or {}).get("shards", []):
                entries[posixpath.join(parent, entry["name"])] = entry
        return {s.path: entries[s.path] for s in self.shards if s.path in entries}

    def _uri_of(self, path: str) -> str:
        return path if self.fs is None else f"{self.pattern.split('://', 1)[0]}://{path.lstrip('/')}"


def ends_sha256(read_at, size: int) -> str:
    """sha256 of a file's first MiB and last MiB (the whole file when it is smaller), given
    `read_at(offset, nbytes)`: the same bytes hashed wherever the file is."""
    inner = hashlib.sha256()
    inner.update(read_at(0, min(size, _MIB)))
    if size > _MIB:
        inner.update(read_at(size - _MIB, _MIB))
    return inner.hexdigest()


def file_ends_sha256(path: str, size: int) -> str:
    """`ends_sha256` of a local file."""
    with open(path, "rb") as f:
        return ends_sha256(lambda offset, n: os.pread(f.fileno(), n, offset), size)


def list_shards(pattern: str, endpoint: str = "", *, fs=None) -> ShardSource:
    """The shards matching `pattern` (a local glob, or an s3:// / gs:// one), sorted by path;
    ShardError (one line naming the pattern) when none match or the store cannot be listed.
    `fs` replaces the store's filesystem (tests count its reads)."""
    pattern = os.fspath(pattern)
    if not is_remote(pattern):
        if "://" in pattern:
            raise ShardError(f"shard pattern {pattern!r}: expected a local glob or an "
                             f"{' / '.join(REMOTE_SCHEMES)} URI, found another scheme")
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise ShardError(f"shard pattern {pattern!r}: expected at least one matching file, "
                             f"found none")
        return ShardSource(pattern, tuple(_local_shard(p) for p in paths))
    from raygpt.storage import redact
    store_fs, path = _open_store(pattern, endpoint) if fs is None else (fs, _path_of(pattern))
    infos = _list_matching(store_fs, path, redact(pattern))
    if not infos:
        raise ShardError(f"shard pattern {redact(pattern)}: expected at least one matching "
                         f"object, found none")
    scheme = pattern.split("://", 1)[0]
    return ShardSource(pattern, tuple(
        Shard(f"{scheme}://{i.path.lstrip('/')}", i.path, i.size, int(i.mtime_ns or 0))
        for i in sorted(infos, key=lambda i: i.path)), store_fs)


def _local_shard(path: str) -> Shard:
    st = os.stat(path)
    from raygpt.storage.uri import URIRefused, check_mode
    try:
        check_mode(st.st_mode, path, "shard")  # a FIFO would block its reader forever
    except URIRefused as e:
        raise ShardError(str(e)) from None
    return Shard(path, path, st.st_size, st.st_mtime_ns)


def _path_of(pattern: str) -> str:
    return pattern.split("://", 1)[1].split("?", 1)[0]


def _open_store(pattern: str, endpoint: str):
    from raygpt.storage import redact
    from raygpt.storage.uri import open_filesystem
    try:
        fs, path = open_filesystem(pattern, endpoint)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad URI
        # S3 without an endpoint asks AWS for the bucket's region here: a network call
        if (failed := network_failure(_one_line(e), endpoint_host(pattern, endpoint))):
            raise ShardError(f"shard pattern {redact(pattern)}: cannot reach the store: {failed}: "
                             f"{_one_line(e)}") from e
        raise ShardError(f"shard pattern {redact(pattern)}: expected a URI pyarrow can open "
                         f"({_one_line(e)})") from None
    return fs, path


def _list_matching(fs, path: str, shown: str) -> list:
    """The files of `fs` whose path matches the glob `path` segment by segment."""
    import pyarrow.fs as pafs

    from raygpt.storage import storage_cause
    first = min((path.index(c) for c in _GLOB_CHARS if c in path), default=len(path))
    root = path[:first].rpartition("/")[0] if first < len(path) else path.rpartition("/")[0]
    parts = path.split("/")
    recursive = path[first:].count("/") > 0
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=recursive,
                                                   allow_not_found=True))
    except Exception as e:  # noqa: BLE001 - OSError, or pyarrow's own for a missing bucket
        # chained: an OSError (a store that did not answer) is one a restart may cure
        failed = network_failure(_one_line(e), endpoint_host(shown))
        cause = f"{failed}: {_one_line(e)}" if failed else storage_cause(e)
        raise ShardError(f"shard pattern {shown}: cannot list the store: {cause}") from e
    return [i for i in infos if i.type == pafs.FileType.File
            and len(i.path.strip("/").split("/")) == len(parts)
            and all(fnmatch.fnmatchcase(a, b) for a, b in zip(i.path.strip("/").split("/"), parts))]


def shard_token_counts(pattern: str, endpoint: str = "") -> list[tuple[str, int]]:
    """(uri, token count) of every shard matching `pattern`, each header checked (range reads,
    no tokens read), and where a prepare manifest lists the shard, its token count and size
    against the manifest's: what the driver needs to fit B, T and the world size to the data
    before Ray starts."""
    source = list_shards(pattern, endpoint)
    manifest = {} if source.caps.local_paths else source.manifest()
    out = []
    for i, shard in enumerate(source.shards):
        ntok = source.header_tokens(i)
        entry = manifest.get(shard.path)
        if entry is not None and entry["tokens"] != ntok:
            raise ShardError(f"{shard.uri}: token count (header[2]): expected {entry['tokens']:,} "
                             f"(manifest.json beside it), found {ntok:,}")
        out.append((shard.uri, ntok))
    return out


def data_fingerprint(pattern: str, endpoint: str = "") -> str:
    """A cheap identity of a set of shards for checkpoint compatibility checks: sha256 over
    (basename, size, sha256 of the first MiB + the last MiB) of every shard. The first MiB holds
    the header, so a changed token count always shows. Where the shards lie (a directory, a
    bucket) is not part of it. Sources mixed by weight (-i NAME=WEIGHT:GLOB): sha256 over each
    one's name, weight and fingerprint (one source alone: its glob's)."""
    from raygpt.config.mixture import parse
    sources = parse(pattern)
    if sources is not None and len(sources) > 1:
        return hashlib.sha256("".join(f"{s.name}\t{s.weight!r}\t{data_fingerprint(s.pattern, endpoint)}\n"
                                      for s in sources).encode()).hexdigest()
    if sources is not None:
        pattern = sources[0].pattern
    source = list_shards(pattern, endpoint)
    outer = hashlib.sha256()
    for i, shard in enumerate(source.shards):
        outer.update(f"{posixpath.basename(shard.path)}\t{shard.size}\t"
                     f"{source.ends_sha256(i)}\n".encode())
    return outer.hexdigest()


# ---------------------------------------------------------------------------- the node's cache

def default_cache_dir() -> str:
    """The node's shard cache when --shard-cache-dir is not given: one per user."""
    return os.path.join(tempfile.gettempdir(), f"raygpt_shards_{os.getuid()}")


# What the cache writes, and all it ever deletes: a fetched shard "<20 hex>-<its basename>", a
# fetch's temp file ".tmp-<pid>-<id>", the lock directory (which holds the cache's marker).
_CACHED_NAME = re.compile(r"^[0-9a-f]{20}-[^/]+$")
_TMP_NAME = re.compile(r"^\.tmp-([0-9]+)-[^/]+$")
LOCKS = ".locks"
MARKER = "raygpt-shard-cache"  # in LOCKS: this directory is a cache raygpt made


def _is_own_name(name: str) -> bool:
    return name == LOCKS or bool(_CACHED_NAME.match(name) or _TMP_NAME.match(name))


def _private_cache_dir(path: str) -> str:
    """`path` as a directory only this user can use (atomic_file.private_dir: a directory another
    user made first, or a planted link, would let them feed this user's training its data), and
    one the cache may evict from: made by it (its marker in LOCKS), or holding nothing but names
    of the cache's own form (an empty directory, an earlier raygpt's cache), which it then marks.
    Any other directory (a home, a project) is refused: eviction would delete its files. A
    ShardError naming it otherwise."""
    from raygpt.runlog.terminal import printable
    try:
        root = str(private_dir(path, "shard cache (or give --shard-cache-dir)"))
    except NotPrivateError as e:
        raise ShardError(str(e)) from None
    marker = os.path.join(root, LOCKS, MARKER)
    if os.path.isfile(marker) and not os.path.islink(marker):
        return root
    foreign = sorted(n for n in os.listdir(root) if not _is_own_name(n))
    if foreign:
        raise ShardError(f"{printable(root)}: expected a shard cache raygpt made, or an empty "
                         f"directory (or give --shard-cache-dir a new one), found "
                         f"{len(foreign)} file(s) of something else, e.g. "
                         f"{printable(foreign[0])!r}: the cache evicts what it holds")
    os.makedirs(os.path.join(root, LOCKS), mode=0o700, exist_ok=True)
    _write_marker(marker)
    return root


def _write_marker(marker: str) -> None:
    with contextlib.suppress(FileExistsError):  # another worker of the node marked it first
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            _write_all(fd, b"a raygpt shard cache: raygpt evicts the shards it fetched here\n")
        finally:
            os.close(fd)


@dataclasses.dataclass
class CachedShard:
    """A shard in the cache, held open: while held (a shared flock on `fd`) no process evicts
    it. `close()` lets it go."""
    path: str
    fd: int

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the flock
            self.fd = -1


def cache_root(root: str | None) -> str:
    """The node's shard cache directory as ShardCache takes it (made, or checked and marked);
    ShardError naming it when it is not one the cache may evict from."""
    return _private_cache_dir(root or default_cache_dir())


class ShardCache:
    """A node's cache of remote shards in a private directory, at most `max_bytes` of them
    (plus the shards processes hold open, which are never evicted)."""

    def __init__(self, root: str | None = None, max_bytes: int = int(DEFAULT_CACHE_GB * 2**30)):
        if max_bytes < 1:
            raise ValueError(f"ShardCache: max_bytes: expected an integer >= 1, found {max_bytes}")
        self.root = cache_root(root)
        self.max_bytes = int(max_bytes)

    def name_of(self, source: ShardSource, i: int, expected: dict | None) -> str:
        """A shard's cache name: its basename after a hash of its store, path, size, mtime and
        manifest sha256, so a rewritten object is a new entry, never a stale hit."""
        shard = source.shards[i]
        key = "\n".join([_store_id(source), shard.path, str(shard.size), str(shard.mtime_ns),
                         (expected or {}).get("sha256", "")])
        return f"{hashlib.sha256(key.encode()).hexdigest()[:20]}-{posixpath.basename(shard.path)}"

    def open(self, source: ShardSource, i: int, expected: dict | None = None) -> CachedShard:
        """Shard `i` of `source` in the cache, held open (fetched and verified first if it is not
        there). `expected`: its manifest entry, if a manifest lists it."""
        name = self.name_of(source, i, expected)
        final = os.path.join(self.root, name)
        held = self._hold(final)
        if held is not None:
            return held
        with _flocked(os.path.join(self.root, ".locks", name), fcntl.LOCK_EX):
            held = self._hold(final)  # another worker of this node fetched it meanwhile
            if held is None:
                self._fetch(source, i, expected, final)
                held = self._hold(final)
        if held is None:
            raise ShardError(f"{source.shards[i].uri}: fetched into {final}, then found it gone")
        return held

    def _hold(self, final: str) -> CachedShard | None:
        try:
            fd = os.open(final, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.utime(fd)  # most recently used
        return CachedShard(final, fd)

    def _fetch(self, source: ShardSource, i: int, expected: dict | None, final: str) -> None:
        shard = source.shards[i]
        with _flocked(os.path.join(self.root, ".locks", ".evict"), fcntl.LOCK_EX):
            self._make_room(shard.size)
        tmp = os.path.join(self.root, f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            digest, head, size = hashlib.sha256(), b"", 0
            try:
                with source.fs.open_input_stream(shard.path) as f:
                    # at most one byte past the listed size: an object grown since is refused
                    # (verify_fetched) without filling the cache with it
                    while size <= shard.size and (
                            chunk := f.read(min(_CHUNK, shard.size + 1 - size))):
                        if len(head) < HEADER_BYTES:
                            head += chunk[:HEADER_BYTES - len(head)]
                        digest.update(chunk)
                        size += len(chunk)
                        _write_all(fd, chunk)
            except OSError as e:
                raise ShardError(f"{shard.uri}: cannot fetch shard ({_one_line(e)})") from e  # an OSError: a restart may cure it
            verify_fetched(shard, head, size, digest.hexdigest(), expected)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, final)  # whole and verified, or not under its name at all
        finally:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _make_room(self, incoming: int) -> None:
        """Evict least recently used shards no process holds until `incoming` more bytes fit
        (temp files of dead fetches removed first). Only names of the cache's own form are
        counted or removed, and only regular files: anything else here is left alone."""
        entries = []
        for entry in os.scandir(self.root):
            if (tmp := _TMP_NAME.match(entry.name)) and not _pid_alive(tmp.group(1)):
                if _is_regular(entry):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                continue
            if not (tmp or _CACHED_NAME.match(entry.name)):
                continue
            st = _stat_or_none(entry)
            if st is not None and stat.S_ISREG(st.st_mode):
                entries.append((st.st_mtime_ns, entry.path, st.st_size, bool(tmp)))
        used = sum(size for _, _, size, _ in entries)
        for _, path, size, is_tmp in sorted(entries):
            if used + incoming <= self.max_bytes:
                break
            if not is_tmp and _evict_if_unheld(path):
                used -= size

    def cached_bytes(self) -> int:
        """Bytes of the shards in the cache now."""
        sizes = (_stat_or_none(e) for e in os.scandir(self.root) if _CACHED_NAME.match(e.name))
        return sum(st.st_size for st in sizes if st is not None and stat.S_ISREG(st.st_mode))


def verify_fetched(shard: Shard, head: bytes, size: int, sha256: str, expected: dict | None) -> None:
    """A fetched shard against what it must be: its listed size and llm.c's header; and its
    manifest entry's token count and sha256 when a manifest lists it. ShardError, one line
    naming the shard and what was expected, otherwise."""
    if size != shard.size:
        raise ShardError(f"{shard.uri}: size: expected {shard.size:,} bytes (as listed), fetched "
                         f"{size:,} -- the object changed while it was read")
    ntok = check_shard_header(head, size, shard.uri)
    if expected is None:
        return
    if ntok != expected["tokens"]:
        raise ShardError(f"{shard.uri}: token count (header[2]): expected {expected['tokens']:,} "
                         f"(manifest.json beside it), found {ntok:,}")
    if sha256 != expected["sha256"]:
        raise ShardError(f"{shard.uri}: sha256: expected {expected['sha256']} (manifest.json "
                         f"beside it), found {sha256} -- the shard's bytes are not the ones "
                         f"prepared")


def _store_id(source: ShardSource) -> str:
    """The store a source's shards are on: its scheme and, for S3, the endpoint."""
    fs = source.fs
    endpoint = ""
    with contextlib.suppress(Exception):  # only S3 and GCS filesystems carry these options
        endpoint = str(fs.__reduce__()[1][0].get("endpoint_override", ""))
    return f"{source.pattern.split('://', 1)[0]}|{endpoint}"


def _stat_or_none(entry: os.DirEntry) -> os.stat_result | None:
    """An entry's stat, or None when it went between the listing and now: another worker of the
    node renamed its fetched file into place, or evicted a shard."""
    try:
        return entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None


def _is_regular(entry: os.DirEntry) -> bool:
    st = _stat_or_none(entry)
    return st is not None and stat.S_ISREG(st.st_mode)


def _evict_if_unheld(path: str) -> bool:
    """Remove a cached shard unless a process holds it (a shared flock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    try:
        os.unlink(path)
    finally:
        os.close(fd)
    return True


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _flocked(path: str, how: int):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _one_line(e: BaseException) -> str:
    return " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()) or type(e).__name__


# ---------------------------------------------------------------------------- background fetches

class ShardFetcher:
    """Fetches shards of a remote source into a cache on one background thread, so that a
    loader reaching a new shard finds it on disk: `want(shards)` queues the ones not yet asked
    for (and lets go of fetched ones no longer wanted), `take(shard)` hands one over, held open,
    waiting for its fetch if it is still under way."""

    def __init__(self, source: ShardSource, cache: ShardCache):
        self.source, self.cache = source, cache
        self._expected = source.manifest()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._queue: queue.Queue = queue.Queue()
        from raygpt.storage import redact
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"raygpt-shards {redact(source.pattern)}")
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            shard, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.cache.open(self.source, shard, self._expected.get(
                    self.source.shards[shard].path)))
            except BaseException as e:  # noqa: BLE001 - raised by take() on the loader's thread
                future.set_exception(e)

    def want(self, shards) -> None:
        wanted = [int(s) for s in shards]
        for shard in list(self._futures):
            future = self._futures[shard]
            if shard not in wanted and future.done():
                del self._futures[shard]
                if future.exception() is None:
                    future.result().close()
        for shard in wanted:
            if shard not in self._futures:
                self._futures[shard] = future = concurrent.futures.Future()
                self._queue.put((shard, future))

    def take(self, shard: int) -> CachedShard:
        if shard not in self._futures:
            self.want(list(self._futures) + [shard])
        return self._futures.pop(shard).result()

    def close(self) -> None:
        """Stop the thread (after the fetch under way) and let go of every fetched shard."""
        for future in self._futures.values():
            future.cancel()  # those not started yet
        self._queue.put(None)
        self._thread.join()
        for future in self._futures.values():
            if not future.cancelled() and future.exception() is None:
                future.result().close()
        self._futures.clear()
