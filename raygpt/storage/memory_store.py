"""A store in a dict, for tests and as the reference of the store contract
(tests/storage/test_store_contract.py). Its capabilities are chosen when it is made: by default
what a dict honestly has (atomic rename, appends, a lock within this process, never shared with
another process), and `MemoryStore(caps=Capabilities(shared=False))` behaves as an object store
(no append, no rename, no lock),
which is how a test runs an object store's code paths without a server."""

from __future__ import annotations

import contextlib
import io
import threading

from raygpt.storage.store import Capabilities, Entry, Store, Unsupported

DEFAULT_CAPS = Capabilities(atomic_rename=True, appends=True, locks=True, shared=False)


class MemoryStore(Store):
    def __init__(self, root: str = "/", caps: Capabilities = DEFAULT_CAPS):
        self.root = root.rstrip("/") or root
        self.caps = caps
        self._files: dict[str, bytes] = {}
        self._dirs: set[str] = set()
        self._mutex = threading.Lock()  # every change to the two above
        self._locks: dict[str, threading.Lock] = {}

    def __repr__(self) -> str:
        return f"MemoryStore({self.uri()})"

    def __reduce__(self):
        # another process would get a copy that silently diverges: refuse (caps.shared false)
        raise TypeError(f"{self.uri()}: an in-memory store lives in one process; it cannot be "
                        f"sent to another")

    def uri(self, rel: str = "") -> str:
        return f"memory://{self.path(rel).lstrip('/')}"

    def _key(self, rel: str) -> str:
        return rel.strip("/")

    def _add_parents(self, key: str) -> None:
        parts = key.split("/")[:-1] if key else []
        self._dirs.update(["", *("/".join(parts[:i + 1]) for i in range(len(parts)))])

    def info(self, rel: str) -> Entry | None:
        key = self._key(rel)
        with self._mutex:
            if key in self._files:
                return Entry("file", len(self._files[key]))
            return Entry("dir") if key in self._dirs else None

    def list(self, rel: str = "") -> dict[str, Entry]:
        key = self._key(rel)
        prefix = f"{key}/" if key else ""
        with self._mutex:
            if key in self._files:
                return {}
            found = {k[len(prefix):]: Entry("file", len(v)) for k, v in self._files.items()
                     if k.startswith(prefix) and "/" not in k[len(prefix):]}
            found.update({d[len(prefix):]: Entry("dir") for d in self._dirs
                          if d and d.startswith(prefix) and "/" not in d[len(prefix):]})
        return found

    def open_read(self, rel: str):
        key = self._key(rel)
        with self._mutex:
            if key not in self._files:
                raise FileNotFoundError(f"{self.uri(rel)}: no such file")
            return io.BytesIO(self._files[key])

    def makedirs(self, rel: str = "") -> None:
        key = self._key(rel)
        with self._mutex:
            if key in self._files:
                raise FileExistsError(f"{self.uri(rel)}: a file is there")
            self._add_parents(key)
            self._dirs.add(key)

    @contextlib.contextmanager
    def open_publish(self, rel: str):
        buf = io.BytesIO()
        yield buf  # an error in the block leaves the old bytes: nothing is stored
        self._put(self._key(rel), buf.getvalue())

    def _put(self, key: str, data: bytes) -> None:
        with self._mutex:
            if key in self._dirs:
                raise IsADirectoryError(f"{self.uri(key)}: a directory is there")
            self._add_parents(key)
            self._files[key] = bytes(data)

    def append(self, rel: str, data: bytes) -> None:
        if not self.caps.appends:
            super().append(rel, data)
        key = self._key(rel)
        with self._mutex:
            self._add_parents(key)
            self._files[key] = self._files.get(key, b"") + bytes(data)

    def move(self, src: str, dst: str) -> None:
        with self._mutex:
            data = self._files.pop(self._key(src), None)
            if data is None:
                raise FileNotFoundError(f"{self.uri(src)}: no such file")
            self._add_parents(self._key(dst))
            self._files[self._key(dst)] = data

    def delete_file(self, rel: str) -> None:
        with self._mutex:
            self._files.pop(self._key(rel), None)

    def delete_tree(self, rel: str) -> None:
        key = self._key(rel)
        prefix = f"{key}/" if key else ""
        with self._mutex:
            if key not in self._dirs:
                return
            self._files = {k: v for k, v in self._files.items() if not k.startswith(prefix)}
            self._dirs = {d for d in self._dirs if d != key and not d.startswith(prefix)}

    @contextlib.contextmanager
    def lock(self, rel: str):
        if not self.caps.locks:
            raise Unsupported(f"{self.uri(rel)}: this store has no lock")
        with self._mutex:
            lock = self._locks.setdefault(self._key(rel), threading.Lock())
        with lock:
            yield
