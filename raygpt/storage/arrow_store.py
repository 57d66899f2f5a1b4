"""A store on any pyarrow filesystem (S3, GCS, fsspec's through `PyFileSystem`): an object
store's rules. Publishing a file is one PUT (all-or-nothing), there is no append, no rename
(`move` is a copy then a delete), no owner raygpt can read and no lock. It is made from a URI
only through the door (`raygpt.storage.uri.open_store`: endpoint, credentials, timeouts)."""

from __future__ import annotations

import contextlib

import pyarrow.fs as pafs

from raygpt.storage.store import Capabilities, Entry, Store

_KINDS = {pafs.FileType.File: "file", pafs.FileType.Directory: "dir"}


def entry_of(info: pafs.FileInfo) -> Entry | None:
    if info.type == pafs.FileType.NotFound:
        return None
    kind = _KINDS.get(info.type, "other")
    return Entry(kind, info.size if kind == "file" else 0)


class ArrowStore(Store):
    caps = Capabilities()

    def __init__(self, fs: pafs.FileSystem, root: str):
        self._fs = fs
        self.root = root.rstrip("/") or root  # keep "/" itself

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri()})"

    def __reduce__(self):
        return type(self), (self._fs, self.root)

    @property
    def fs(self) -> pafs.FileSystem:
        return self._fs

    def uri(self, rel: str = "") -> str:
        return f"{self._fs.type_name}://{self.path(rel).lstrip('/')}"

    def info(self, rel: str) -> Entry | None:
        return entry_of(self._fs.get_file_info(self.path(rel)))

    def list(self, rel: str = "") -> dict[str, Entry]:
        infos = self._fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True))
        return {i.base_name: entry_of(i) for i in infos}

    def open_read(self, rel: str):
        return self._fs.open_input_stream(self.path(rel))

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        with self._fs.open_input_file(self.path(rel)) as f:  # one ranged GET on an object store
            return f.read_at(max(0, min(length, f.size() - offset)), offset)

    def makedirs(self, rel: str = "") -> None:
        self._fs.create_dir(self.path(rel), recursive=True)

    @contextlib.contextmanager
    def open_publish(self, rel: str):
        """One upload, stored when the block ends (a PUT is all-or-nothing on an object store).
        pyarrow's streams have no abort and store what was written when closed, even by an
        error, so on an error the object is deleted again: the name then holds nothing rather
        than a partial file (the old bytes are gone: no rename to keep them)."""
        f = self._fs.open_output_stream(self.path(rel))
        try:
            yield f
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()
            with contextlib.suppress(FileNotFoundError):  # nothing was stored
                self._fs.delete_file(self.path(rel))
            raise
        f.close()

    def move(self, src: str, dst: str) -> None:
        self._fs.move(self.path(src), self.path(dst))

    def delete_file(self, rel: str) -> None:
        if (e := self.info(rel)) is not None and e.kind == "file":
            self._fs.delete_file(self.path(rel))

    def delete_tree(self, rel: str) -> None:
        if (e := self.info(rel)) is not None and e.kind == "dir":
            self._fs.delete_dir(self.path(rel))
