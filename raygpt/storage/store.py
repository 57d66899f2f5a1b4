"""What raygpt asks of a place that holds bytes: the `Store` protocol and its `Capabilities`.

A store is a root and every path below it, `/`-separated and relative to the root. It reads
(whole, streamed or a byte range), lists one level, publishes a whole file atomically (a reader
sees the old bytes or all the new ones), moves, deletes, and makes directories. What differs
between backends is stated as capabilities, never guessed from the backend's type:

- `local_paths`: its files are this machine's files (a path can be handed to a library that
  wants one: TensorBoard, a rename of staged checkpoint files, fsync);
- `atomic_rename`: `move` is a rename (the file appears whole under its new name, no copy);
- `appends`: `append` adds bytes in place (else the logs are immutable segments);
- `owners`: `owner` says which uid owns an entry and whether it is a regular file;
- `locks`: `lock` excludes other processes from a read-check-write;
- `shared`: other processes reach the same bytes (a pickled store, sent to a Ray worker, is the
  same place; an in-memory store is not).

A method a store lacks the capability for raises `Unsupported`, naming the place. Backends:
`local_store` (a local or NFS directory), `arrow_store` (any pyarrow filesystem: S3, GCS, made
only through the URI door, `uri.open_store`), `memory_store` (a dict: tests, and the reference
of the contract that tests/storage/test_store_contract.py holds every backend to).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Capabilities:
    local_paths: bool = False
    atomic_rename: bool = False
    appends: bool = False
    owners: bool = False
    locks: bool = False
    shared: bool = True


@dataclass(frozen=True)
class Entry:
    """One listed name: "file" or "dir", and a file's size in bytes (0 for a directory)."""
    kind: str
    size: int = 0


@dataclass(frozen=True)
class Owner:
    """Who owns an entry where the store can tell (`Capabilities.owners`)."""
    uid: int
    regular: bool  # a regular file (not a link, FIFO, directory...): only such a file is trusted


class Unsupported(ValueError):
    """A store was asked for what its capabilities say it lacks: one line naming the place."""


def join(root: str, rel: str) -> str:
    """`rel` below `root` as the backend names it ("/" itself kept as a root)."""
    rel = rel.strip("/")
    if not rel:
        return root
    return f"{root.rstrip('/')}/{rel}" if root else rel


class Store:
    """The protocol; every path is relative to `root`. Subclasses set `caps` and implement the
    abstract methods; the others are defined here in their terms."""

    caps = Capabilities()
    root = ""

    # ------------------------------------------------------------------ naming
    def path(self, rel: str = "") -> str:
        """The backend's own name of `rel` (what its calls take)."""
        return join(self.root, rel)

    def uri(self, rel: str = "") -> str:
        """How a message names `rel`: a plain path locally, scheme://path otherwise."""
        raise NotImplementedError

    def local_path(self, rel: str = "") -> Path:
        """`rel` as a path of this machine (`caps.local_paths` only)."""
        raise Unsupported(f"{self.uri(rel)}: not on a local filesystem")

    @property
    def fs(self):
        """The pyarrow filesystem behind this store (Ray's checkpoint upload takes one), or
        None where there is none."""
        return None

    # ------------------------------------------------------------------ reading
    def info(self, rel: str) -> Entry | None:
        """What `rel` is, None when nothing is there."""
        raise NotImplementedError

    def list(self, rel: str = "") -> dict[str, Entry]:
        """{name: Entry} directly under `rel`; {} when `rel` does not exist."""
        raise NotImplementedError

    def open_read(self, rel: str):
        """A binary stream of the file `rel` (FileNotFoundError when missing)."""
        raise NotImplementedError

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """At most `length` bytes of `rel` from `offset` (fewer at its end)."""
        with self.open_read(rel) as f:
            f.seek(offset)
            return f.read(length)

    # ------------------------------------------------------------------ writing
    def makedirs(self, rel: str = "") -> None:
        raise NotImplementedError

    def open_publish(self, rel: str):
        """A binary stream whose bytes become the whole file `rel` when it closes without an
        error (never a partial file to a reader); the parent directory must exist."""
        raise NotImplementedError

    def publish(self, rel: str, data: bytes) -> None:
        """Store `data` as the whole file `rel`, atomically; parents are made."""
        self.makedirs(rel.strip("/").rpartition("/")[0])
        with self.open_publish(rel) as f:
            f.write(data)

    def append(self, rel: str, data: bytes) -> None:
        """Add `data` at the end of `rel` (made if missing), durable on return (`caps.appends`)."""
        raise Unsupported(f"{self.uri(rel)}: this store has no append (an object store's logs "
                          f"are immutable segments, raygpt.runlog.segments)")

    def move(self, src: str, dst: str) -> None:
        """Rename the file `src` to `dst` (a rename with `caps.atomic_rename`, else a copy and a
        delete)."""
        raise NotImplementedError

    def delete_file(self, rel: str) -> None:
        """Remove a file; one already gone is no error (deletes are retried)."""
        raise NotImplementedError

    def delete_tree(self, rel: str) -> None:
        """Remove a directory and everything below it; a missing one is no error."""
        raise NotImplementedError

    def make_durable(self, rels) -> None:
        """Make entries something else wrote durable (locally an fsync each); a store whose
        completed writes are durable has nothing to do."""

    # ------------------------------------------------------------------ owners and locks
    def owner(self, rel: str) -> Owner | None:
        """Who owns the entry `rel` (not what a link there points to); None where the store
        cannot tell (`caps.owners` false) or nothing is there."""
        return None

    @contextlib.contextmanager
    def lock(self, rel: str):
        """Hold an exclusive lock named `rel` among every process using this store
        (`caps.locks`)."""
        raise Unsupported(f"{self.uri(rel)}: this store has no lock")
        yield  # pragma: no cover
