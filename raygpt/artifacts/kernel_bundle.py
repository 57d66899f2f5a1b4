"""raygpt's own Triton kernels, compiled once per run: the bundle a replacement node installs.

torch.compiler.save_cache_artifacts carries Inductor's generated kernels, not raygpt.ops' own
(AdamW, the gradient norm, the stochastic rounding, the loss gradient, the deterministic attention
and embedding backward), which Triton would otherwise compile, with its C launchers, inside a new
node's recovery. A run stores those it launches from Python, with the C modules, beside its
compiled artifacts; a new node installs them into its Triton cache before its first launch.
(Inductor's copies of the triton_op kernels get other keys on a new node: not stored.)

A bundle is a zip archive (each member CRC-checked on read). `index.json` names, for every
kernel, its Triton cache key (`CompiledKernel.hash`), the group file Triton looks it up by
(`<kernel name>.json`) and its files; each file is the member `<key>/<file>`. `install` writes
through Triton's own cache manager (`triton.runtime.cache.get_cache_manager`) with the group
last, as Triton does, so a half-installed kernel is a miss, never a broken hit; one compiled for
another GPU or Triton has another key and is never looked up. These checks catch damage, not an
author: in the run directory a bundle is signed (raygpt.artifacts.signed_file), checked by
raygpt.artifacts.compile_cache before `read_bundle` sees a byte. Use: `record_compiled_kernels`, then
`launched_kernels` and `write_bundle` to store; `read_bundle` and `install` on a new node.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
import time
import zipfile
from dataclasses import dataclass

INDEX = "index.json"
FORMAT = "raygpt-triton-kernels-1"
# the modules whose Triton kernels raygpt launches itself (Inductor's come with its artifacts)
KERNEL_MODULES = ("raygpt.ops.triton_kernels", "raygpt.ops.triton_attention")
_KEY = re.compile(r"[0-9a-f]{64}")  # Triton's cache key: a sha256 in hex
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")  # a plain file name, no path
_MODULE = re.compile(r"(cuda_utils|__triton_launcher)[A-Za-z0-9_.\-]*\.(so|pyd)")  # C modules


class BundleError(ValueError):
    """A bundle that is not one raygpt wrote (or was damaged): nothing of it was installed."""


@dataclass(frozen=True)
class Kernel:
    """One compiled kernel as Triton's cache holds it: its key, its group file's name, and
    {file name: bytes} (the group file among them); or, with group None, one C module Triton
    built for launching kernels (its CUDA utilities, a launcher), the only file of its entry."""

    key: str
    group: str | None
    files: dict[str, bytes]


_compiled: dict[str, tuple[str, dict[str, str]]] = {}  # key -> (kernel name, group's paths)
_recording = False
_recording_since = 0.0  # wall time: Triton cache entries written after it are this run's


def record_compiled_kernels() -> None:
    """From now on note every Triton kernel this process compiles or finds in its cache
    (Triton's compilation listener, chained after one already set), once per process. raygpt's
    kernels reach Triton two ways: launched from Python (the optimizer's, the re-derive's), and
    inlined by Inductor into a compiled graph (torch.library.triton_op: the loss gradient, the
    attention), compiled from Inductor's copy of their source under another cache key (not
    bundled: see launched_kernels). The listener sees what this process compiles or loads."""
    global _recording, _recording_since
    if _recording:
        return
    from triton import knobs

    # a file's time can lag the clock by a filesystem's granularity (up to 2 s on some): a
    # module built just before this call is taken too, which costs nothing but its bytes
    _recording_since = time.time() - 2.0
    before = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        key, name = metadata.get("hash"), metadata.get("name")
        if isinstance(key, str) and isinstance(name, str) and isinstance(metadata_group, dict):
            _compiled[key] = (name, dict(metadata_group))
        if before is not None:
            before(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                   cache_hit=cache_hit)

    knobs.compilation.listener = listener
    _recording = True


def raygpt_kernel_names() -> set[str]:
    """The names of raygpt's Triton kernels (the JITFunctions of KERNEL_MODULES)."""
    import importlib

    from triton.runtime.jit import JITFunction

    names = set()
    for module in map(importlib.import_module, KERNEL_MODULES):
        for obj in vars(module).values():
            if isinstance(obj, JITFunction):
                names.add(obj.fn.__name__)
    return names


def launched_kernels(names: set[str] | None = None) -> list[Kernel]:
    """raygpt's kernels (by name: `names`, raygpt_kernel_names() by default) among those this
    process compiled or loaded since record_compiled_kernels, with the C modules Triton built
    into this node's cache since then (its CUDA utilities and kernel launchers, compiled by the
    host's C compiler on a node's first launch), their files read back from the cache.
    Inductor's own kernels are left out (its artifacts carry them), and so are its copies of
    raygpt's triton_op kernels: a new node compiles those under other keys than the node that
    stored them, so they would never be found. Empty when this process records nothing (a CPU run)."""
    if not _recording:
        return []
    names = raygpt_kernel_names() if names is None else names
    found = {key: group for key, (name, group) in _compiled.items() if name in names}
    found.update(_modules_built_since(_recording_since))
    kernels = [_from_cache(key, paths) for key, paths in sorted(found.items())]
    return [k for k in kernels if k is not None]


def _modules_built_since(since: float) -> dict[str, dict[str, str]]:
    """{key: {file: path}} of the C modules Triton built into this node's cache
    (TRITON_CACHE_DIR, Triton's file cache: one directory per entry, named by its key) at
    `since` or later: an entry holding a single `cuda_utils*` or `__triton_launcher*` module.
    Only directories changed since then are opened (a node's cache holds thousands)."""
    from triton import knobs

    found = {}
    try:
        entries = list(os.scandir(knobs.cache.dir))
    except OSError:
        return found
    for entry in entries:
        try:
            if not entry.is_dir() or entry.stat().st_mtime < since:
                continue
            for f in os.scandir(entry.path):
                if _MODULE.fullmatch(f.name) and f.stat().st_mtime >= since:
                    found[_key_of_directory(entry.name)] = {f.name: f.path}
        except (OSError, ValueError, binascii.Error):
            continue  # not an entry of Triton's, or one being written: Triton builds it
    return found


def _key_of_directory(name: str) -> str:
    """The hex key of a Triton cache directory (named by the key in base32, unpadded)."""
    return base64.b32decode(name + "=" * (-len(name) % 8)).hex()


def _from_cache(key: str, paths: dict[str, str]) -> Kernel | None:
    """The entry `key` read from its files' paths, or None where they are gone or are not what
    a bundle holds (a kernel's group names one metadata file; a module is one file)."""
    groups = [n for n in paths if n.endswith(".json")]
    try:
        files = {}
        for name, path in paths.items():
            with open(path, "rb") as f:
                files[name] = f.read()
        kernel = Kernel(key, groups[0] if len(groups) == 1 else None, files)
        _check_kernel(kernel, "Triton's cache")
    except (OSError, BundleError):
        return None
    return kernel


def write_bundle(kernels: list[Kernel]) -> bytes:
    """The bundle's bytes (see the module's notes); checked as read_bundle reads it."""
    for k in kernels:
        _check_kernel(k, "write_bundle")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        index = {"format": FORMAT,
                 "kernels": [{"key": k.key, "group": k.group, "files": sorted(k.files)}
                             for k in kernels]}
        z.writestr(INDEX, json.dumps(index, indent=1))
        for k in kernels:
            for name in sorted(k.files):
                z.writestr(f"{k.key}/{name}", k.files[name])
    return buf.getvalue()


def read_bundle(data: bytes, source: str) -> list[Kernel]:
    """The kernels of a bundle, every member read and CRC-checked; BundleError naming `source`
    and what was wrong for anything else (a truncated or foreign file, an index that names a
    path or a missing member)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            try:
                index = json.loads(z.read(INDEX))
            except KeyError:
                raise BundleError(f"{source}: not a raygpt kernel bundle (no {INDEX})") from None
            if not isinstance(index, dict) or index.get("format") != FORMAT:
                raise BundleError(f"{source}: {INDEX} says format "
                                  f"{index.get('format') if isinstance(index, dict) else index!r},"
                                  f" expected {FORMAT!r}")
            kernels = []
            for entry in index.get("kernels", []):
                if not (isinstance(entry, dict) and isinstance(entry.get("files"), list)):
                    raise BundleError(f"{source}: {INDEX}: a kernel entry {entry!r} is not "
                                      f"{{key, group, files}}")
                key, group = entry.get("key"), entry.get("group")
                if not (isinstance(key, str) and _KEY.fullmatch(key)):
                    raise BundleError(f"{source}: {INDEX}: kernel key {key!r} is not a Triton "
                                      f"cache key (64 hex digits)")
                files = {}
                for name in entry["files"]:
                    if not (isinstance(name, str) and _FILE.fullmatch(name)):
                        raise BundleError(f"{source}: {INDEX}: kernel {key} names file "
                                          f"{name!r}, expected a plain file name")
                    try:
                        files[name] = z.read(f"{key}/{name}")
                    except KeyError:
                        raise BundleError(f"{source}: {INDEX} names {key}/{name}, which the "
                                          f"archive does not hold") from None
                kernels.append(Kernel(key, group, files))
                _check_kernel(kernels[-1], source)
            return kernels
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, json.JSONDecodeError,
            UnicodeDecodeError) as e:
        raise BundleError(f"{source}: not a readable kernel bundle ({type(e).__name__}: {e})") \
            from None


def _check_kernel(k: Kernel, source: str) -> None:
    if not (isinstance(k.key, str) and _KEY.fullmatch(k.key)):
        raise BundleError(f"{source}: kernel key {k.key!r} is not a Triton cache key (64 hex "
                          f"digits)")
    bad = [n for n in k.files if not _FILE.fullmatch(n) or n.startswith("__grp__")]
    if bad:
        raise BundleError(f"{source}: kernel {k.key}: file names {bad} are not plain files")
    if k.group is None:  # a C module Triton built: one file
        if len(k.files) != 1 or not _MODULE.fullmatch(next(iter(k.files))):
            raise BundleError(f"{source}: entry {k.key} has no group, so it must be one of "
                              f"Triton's C modules (cuda_utils*, __triton_launcher*); found "
                              f"files {sorted(k.files)}")
    elif not (isinstance(k.group, str) and k.group.endswith(".json") and k.group in k.files):
        raise BundleError(f"{source}: kernel {k.key}: group {k.group!r} is not one of its "
                          f"files' names ending .json")


def install(kernels: list[Kernel]) -> int:
    """Put each kernel (its files, then its group, as Triton writes a compiled kernel) and C
    module this node's Triton cache lacks into it; returns how many were put."""
    from triton.runtime.cache import get_cache_manager

    put = 0
    for k in kernels:
        cache = get_cache_manager(k.key)
        if k.group is None:
            [(name, data)] = k.files.items()
            if cache.get_file(name) is None:
                cache.put(data, name)
                put += 1
            continue
        if k.group in (cache.get_group(k.group) or {}):
            continue  # Triton would find it: this node compiled or installed it already
        paths = {name: cache.put(data, name) for name, data in k.files.items()}
        cache.put_group(k.group, paths)
        put += 1
    return put
