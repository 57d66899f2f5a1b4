"""llm.c's state file (`state_<step>_<rank>.bin`), byte for byte: train_gpt2.cu's save_state
writes it and load_state reads it, one file per rank. Reader and writer side by side; every
mismatch is a StateFileError naming the file, the field, what was expected and what was found.

Layout (native byte order, little-endian on every machine raygpt runs on; no swapping):

  int32 header[256], zero except:
    [0] 20240527 magic   [1] 1 version   [2] num_processes   [3] process_rank
    [4] use_master_weights   [5] should_shuffle   [10] step
    u64 at int offset 20 rng_state, 22 rng_state_last_update,
    u64 (size_t) at 30 current_shard_idx, 32 current_sample_idx
  f32 m[P], f32 v[P], f32 master[P] if use_master_weights       P = shard_num_parameters
  if should_shuffle:
    u64 gl_pathc, i32 shard_indices[gl_pathc],
    u64 shard_num_samples, i32 intra_shard_indices[shard_num_samples],
    mt19937_state shuffle_rng (llmc/rand.h, 2520 bytes, below)
  ---- llm.c's load_state stops reading here; raygpt's trailer follows ----
  i32 TRAILER_MAGIC, i32 TRAILER_VERSION, u64 n, n bytes of UTF-8 JSON
    {"loader": <loader fields not stored above>, "extras": <caller's extras>}

P is not in the header (llm.c takes it from the model), so the reader is told P and the file
size must match exactly.

Which files make a checkpoint, and when one is complete, is raygpt.checkpointing.protocol's.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raygpt.storage.atomic_file import write_local_atomic

STATE_MAGIC = 20240527
STATE_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TRAILER_MAGIC = 20250704
TRAILER_VERSION = 1
_TRAILER_HEAD = struct.Struct("<iiQ")  # magic, version, JSON byte length
_U64 = struct.Struct("<Q")

# llmc/rand.h's mt19937_state, field for field (C layout: 8 + 4 + 4 + 624*4 + 2*4 = 2520 bytes,
# already 8-byte aligned, so no tail padding).
MT_N = 624
MT19937_DTYPE = np.dtype([("seed_", "<u8"), ("left_", "<i4"), ("next_", "<u4"),
                          ("state_", "<u4", (MT_N,)), ("MATRIX_A", "<u4", (2,))])
assert MT19937_DTYPE.itemsize == 2520
_MT_MATRIX_A = (0x0, 0x9908B0DF)  # llm.c re-seeds with 5489 if these differ, so they must be set
# Mapping of the loader's shuffle_rng {"key": uint32[624], "pos": p} (numpy's MT19937 state: the
# next output is tempered key[p]; p == 624 means "twist before the next draw") onto llm.c:
#   state_ = key, next_ = p, left_ = 625 - p.
# llm.c's randint32 does `if (--left_ <= 0) twist; return temper(state_[next_++])`, so with
# left_ = 625 - p it draws state_[p], ..., state_[623] and then twists: the same stream as numpy.
# (llm.c's own freshly seeded state, left_ = 1 and next_ = 0, maps back to p = 624.) The reader
# inverts it as p = 625 - left_. seed_ is unused by llm.c; raygpt stores the loader seed there.

# Loader-state keys (raygpt/data/loader.py's state dict). Those in _LOADER_HEADER_KEYS always live in
# llm.c's header, those in _LOADER_SHUFFLE_KEYS in llm.c's shuffle section when should_shuffle;
# every other key (epoch, skip_ranges, seed, num_shards, ...) goes to the trailer JSON.
LOADER_KEYS = ("epoch", "shard_pos", "sample_pos", "should_shuffle", "shard_indices",
               "shard_num_samples", "intra_shard_indices", "shuffle_rng", "skip_ranges", "seed",
               "num_shards")
_LOADER_HEADER_KEYS = ("shard_pos", "sample_pos", "should_shuffle")
_LOADER_SHUFFLE_KEYS = ("shard_indices", "shard_num_samples", "intra_shard_indices", "shuffle_rng")

_I32 = (-(2**31), 2**31 - 1)
_U64_RANGE = (0, 2**64 - 1)


class StateFileError(ValueError):
    """A state file (or a value to write into one) does not match llm.c's format; the message
    names the file, the field, what was expected and what was found."""


@dataclass
class StateFile:
    """Everything one rank's state file holds (m/v/master as float32 numpy arrays)."""

    name: str
    step: int
    num_processes: int
    process_rank: int
    use_master_weights: bool
    should_shuffle: bool
    rng_state: int
    rng_state_last_update: int
    current_shard_idx: int
    current_sample_idx: int
    m: np.ndarray
    v: np.ndarray
    master: np.ndarray | None
    loader_state: dict
    extras: dict


def write_state_file(path_or_fileobj, *, step: int, num_processes: int, process_rank: int,
                     rng_state: int, rng_state_last_update: int, m, v, master,
                     loader_state: dict, extras: dict) -> None:
    """Write one rank's llm.c state file (+ raygpt trailer) to a local path or a binary stream.

    Everything is validated and encoded before the file is opened, so a bad value leaves no file.
    A path is written through a temp file + fsync + rename: the name never holds a torn file.
    """
    name = _name_of(path_or_fileobj)
    m = _as_f32(m, "m", name)
    v = _as_f32(v, "v", name)
    n = m.size
    if v.size != n:
        raise StateFileError(f"{name}: v: expected {n} floats (the size of m), found {v.size}")
    if master is not None:
        master = _as_f32(master, "master", name)
        if master.size != n:
            raise StateFileError(f"{name}: master: expected {n} floats (the size of m), found {master.size}")
    for key in _LOADER_HEADER_KEYS:
        if key not in loader_state:
            raise StateFileError(f"{name}: loader_state: missing field {key!r} "
                                  f"(expected the keys {list(LOADER_KEYS)})")
    should_shuffle = bool(loader_state["should_shuffle"])

    header = np.zeros(HEADER_INTS, dtype="<i4")  # zero = llm.c's memset: gaps are reserved padding
    header[0] = STATE_MAGIC
    header[1] = STATE_VERSION
    header[2] = _checked(name, "num_processes", num_processes, 1, _I32[1])
    header[3] = _checked(name, "process_rank", process_rank, 0, num_processes - 1)
    header[4] = int(master is not None)
    header[5] = int(should_shuffle)
    header[10] = _checked(name, "step", step, 0, _I32[1])
    header64 = header.view("<u8")  # u64 index k covers int32 slots 2k, 2k+1
    header64[20 // 2] = _checked(name, "rng_state", rng_state, *_U64_RANGE)
    header64[22 // 2] = _checked(name, "rng_state_last_update", rng_state_last_update, *_U64_RANGE)
    header64[30 // 2] = _checked(name, "loader_state.shard_pos", loader_state["shard_pos"], *_U64_RANGE)
    header64[32 // 2] = _checked(name, "loader_state.sample_pos", loader_state["sample_pos"], *_U64_RANGE)

    chunks = [header, m, v] + ([master] if master is not None else [])
    if should_shuffle:
        chunks += _encode_shuffle(loader_state, name)
    binary_keys = _LOADER_HEADER_KEYS + (_LOADER_SHUFFLE_KEYS if should_shuffle else ())
    rest = {k: val for k, val in loader_state.items() if k not in binary_keys}
    try:
        payload = json.dumps({"loader": rest, "extras": extras}, default=json_default).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise StateFileError(f"{name}: extras/loader_state: expected JSON-serialisable values ({e})")
    chunks += [_TRAILER_HEAD.pack(TRAILER_MAGIC, TRAILER_VERSION, len(payload)), payload]

    if hasattr(path_or_fileobj, "write"):
        for c in chunks:
            path_or_fileobj.write(_bytes_view(c))
        return
    write_local_atomic(Path(path_or_fileobj), (_bytes_view(ch) for ch in chunks))


def _encode_shuffle(loader_state: dict, name: str) -> list:
    for key in _LOADER_SHUFFLE_KEYS:
        if loader_state.get(key) is None:
            raise StateFileError(f"{name}: loader_state.{key}: expected a value when should_shuffle "
                                  f"is true, found {loader_state.get(key)!r}")
    shard_indices = _as_i32(loader_state["shard_indices"], "loader_state.shard_indices", name)
    intra = _as_i32(loader_state["intra_shard_indices"], "loader_state.intra_shard_indices", name)
    num_samples = int(loader_state["shard_num_samples"])
    if num_samples != intra.size:  # llm.c writes exactly shard_num_samples ints
        raise StateFileError(f"{name}: loader_state.shard_num_samples: expected len(intra_shard_indices)"
                              f" = {intra.size}, found {num_samples}")
    rng = loader_state["shuffle_rng"]
    if not isinstance(rng, dict) or "key" not in rng or "pos" not in rng:
        found = sorted(rng) if isinstance(rng, dict) else type(rng).__name__
        raise StateFileError(f"{name}: loader_state.shuffle_rng: expected {{'key': uint32[{MT_N}], "
                              f"'pos': int}}, found {found}")
    key = np.asarray(rng["key"])
    if key.shape != (MT_N,) or key.size and (key.min() < 0 or key.max() > 0xFFFFFFFF):
        raise StateFileError(f"{name}: loader_state.shuffle_rng.key: expected {MT_N} uint32 values, "
                              f"found shape {key.shape}")
    pos = _checked(name, "loader_state.shuffle_rng.pos", rng["pos"], 0, MT_N)
    mt = np.zeros((), dtype=MT19937_DTYPE)
    seed = loader_state.get("seed")
    mt["seed_"] = int(seed) & 0xFFFFFFFFFFFFFFFF if seed is not None else 0
    mt["left_"] = MT_N + 1 - pos
    mt["next_"] = pos
    mt["state_"] = key.astype("<u4")
    mt["MATRIX_A"] = _MT_MATRIX_A
    return [_U64.pack(shard_indices.size), shard_indices, _U64.pack(num_samples), intra, mt]


def read_state_file(path_or_bytes, *, num_parameters: int, expect_processes: int | None = None,
                    expect_rank: int | None = None, copy: bool = True) -> StateFile:
    """Read a state file written by `write_state_file` (from a path, bytes, or a binary stream).

    num_parameters is this rank's shard_num_parameters; the file size must match it exactly.
    copy=False: read from bytes, m, v and master are read-only views of them, not copies (a
    restore that only copies them to the device saves a pass over 1.5 GB at GPT-2 124M).
    """
    with _Source(path_or_bytes) as src:
        name = src.name
        header = src.array(0, "<i4", HEADER_INTS, "header")
        _expect(name, "header[0] magic", STATE_MAGIC, int(header[0]))
        _expect(name, "header[1] version", STATE_VERSION, int(header[1]))
        num_processes, rank = int(header[2]), int(header[3])
        if expect_processes is not None:
            _expect(name, "header[2] num_processes", expect_processes, num_processes,
                    " (state files are per rank: resume with the world size that wrote them)")
        if expect_rank is not None:
            _expect(name, "header[3] process_rank", expect_rank, rank)
        for i, field in ((4, "use_master_weights"), (5, "should_shuffle")):
            if header[i] not in (0, 1):
                raise StateFileError(f"{name}: header[{i}] {field}: expected 0 or 1, found {int(header[i])}")
        use_master, should_shuffle = bool(header[4]), bool(header[5])
        h64 = header.view("<u8")
        shard_pos, sample_pos = int(h64[30 // 2]), int(h64[32 // 2])

        n = int(num_parameters)
        off = HEADER_BYTES
        src.hint = f", or num_parameters={n} is wrong"
        src.need(off, 4 * n * (3 if use_master else 2), f"m/v{'/master' if use_master else ''} "
                 f"({n} floats each)")
        m = src.array(off, "<f4", n, "m", copy=copy)
        v = src.array(off + 4 * n, "<f4", n, "v", copy=copy)
        master = src.array(off + 8 * n, "<f4", n, "master", copy=copy) if use_master else None
        off += 4 * n * (3 if use_master else 2)

        loader = {"shard_pos": shard_pos, "sample_pos": sample_pos, "should_shuffle": should_shuffle}
        if should_shuffle:
            gl_pathc = src.u64(off, "gl_pathc")
            shard_indices = src.array(off + 8, "<i4", gl_pathc, "shard_indices")
            off += 8 + 4 * gl_pathc
            num_samples = src.u64(off, "shard_num_samples")
            intra = src.array(off + 8, "<i4", num_samples, "intra_shard_indices")
            off += 8 + 4 * num_samples
            mt = src.array(off, MT19937_DTYPE, 1, "shuffle_rng (mt19937_state)")[0]
            off += MT19937_DTYPE.itemsize
            left = int(mt["left_"])
            if not 1 <= left <= MT_N + 1:
                raise StateFileError(f"{name}: shuffle_rng.left_: expected 1..{MT_N + 1}, found {left}")
            loader.update(shard_indices=shard_indices.tolist(), shard_num_samples=num_samples,
                          intra_shard_indices=intra.tolist(),
                          shuffle_rng={"key": mt["state_"].tolist(), "pos": MT_N + 1 - left})

        trailer = _read_trailer(src, off, n)
    rest = trailer["loader"]
    if isinstance(rest.get("skip_ranges"), list):  # JSON has no tuples: (shard, start, end) again
        rest["skip_ranges"] = [tuple(r) for r in rest["skip_ranges"]]
    loader.update(rest)
    ordered = {k: loader[k] for k in LOADER_KEYS if k in loader}
    ordered.update({k: val for k, val in loader.items() if k not in ordered})
    return StateFile(name=name, step=int(header[10]), num_processes=num_processes, process_rank=rank,
                     use_master_weights=use_master, should_shuffle=should_shuffle,
                     rng_state=int(h64[20 // 2]), rng_state_last_update=int(h64[22 // 2]),
                     current_shard_idx=shard_pos, current_sample_idx=sample_pos,
                     m=m, v=v, master=master, loader_state=ordered, extras=trailer["extras"])


def _read_trailer(src: "_Source", off: int, n: int) -> dict:
    name = src.name
    if src.size == off:
        raise StateFileError(f"{name}: raygpt trailer: expected it at byte {off}, found end of file "
                              "(truncated, or an llm.c state file without raygpt's extra state)")
    src.need(off, _TRAILER_HEAD.size, "raygpt trailer header")
    magic, version, length = _TRAILER_HEAD.unpack(src.read(off, _TRAILER_HEAD.size))
    _expect(name, f"raygpt trailer magic at byte {off}", TRAILER_MAGIC, magic,
            f" (file is {src.size} bytes: is num_parameters={n} right?)")
    _expect(name, "raygpt trailer version", TRAILER_VERSION, version)
    off += _TRAILER_HEAD.size
    src.need(off, length, "raygpt trailer JSON")
    if src.size != off + length:
        raise StateFileError(f"{name}: file size: expected {off + length} bytes (end of the trailer), "
                              f"found {src.size}")
    from raygpt.storage import JSONError, parse_json  # pyarrow: not needed to write a state file
    try:
        payload = parse_json(bytes(src.read(off, length)), name)
    except JSONError as e:
        raise StateFileError(f"{name}: raygpt trailer JSON: expected UTF-8 JSON, found an unreadable "
                              f"payload ({e.reason})")
    if not (isinstance(payload, dict) and isinstance(payload.get("loader"), dict)
            and isinstance(payload.get("extras"), dict)):
        raise StateFileError(f"{name}: raygpt trailer JSON: expected an object with 'loader' and "
                              f"'extras' objects, found {type(payload).__name__}")
    return payload


class _Source:
    """Random-access reads from a local file, bytes, or a stream (read whole), with size checks
    that turn a short file into a StateFileError naming the field that did not fit."""

    def __init__(self, obj):
        self._file = None
        self._buf = None
        self.hint = ""  # appended to size errors once num_parameters decides the layout
        if isinstance(obj, (bytes, bytearray, memoryview)):
            self.name, self._buf = "<bytes>", memoryview(obj).cast("B")
        elif hasattr(obj, "read"):
            self.name = str(getattr(obj, "path", None) or getattr(obj, "name", None) or "<stream>")
            self._buf = memoryview(obj.read()).cast("B")
        else:
            self.name = os.fspath(obj)
            self._file = open(self.name, "rb")
        self.size = len(self._buf) if self._buf is not None else os.fstat(self._file.fileno()).st_size

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._file is not None:
            self._file.close()

    def need(self, off: int, nbytes: int, field: str) -> None:
        if off + nbytes > self.size:
            raise StateFileError(f"{self.name}: {field}: expected {nbytes} bytes at byte {off}, "
                                  f"found {max(self.size - off, 0)} (file of {self.size} bytes "
                                  f"truncated{self.hint})")

    def read(self, off: int, nbytes: int):
        if self._buf is not None:
            return self._buf[off:off + nbytes]
        self._file.seek(off)
        return self._file.read(nbytes)

    def array(self, off: int, dtype, count: int, field: str, copy: bool = True) -> np.ndarray:
        dtype = np.dtype(dtype)
        self.need(off, dtype.itemsize * count, field)
        if self._buf is not None:  # copy: writable arrays; else views that keep the bytes alive
            view = np.frombuffer(self._buf, dtype=dtype, count=count, offset=off)
            if not copy:
                view.flags.writeable = False  # over a bytearray too: a restore only reads it
                return view
            return view.copy()
        self._file.seek(off)
        return np.fromfile(self._file, dtype=dtype, count=count)

    def u64(self, off: int, field: str) -> int:
        self.need(off, 8, field)
        return _U64.unpack(bytes(self.read(off, 8)))[0]


def _name_of(obj) -> str:
    if hasattr(obj, "write"):
        return str(getattr(obj, "path", None) or getattr(obj, "name", None) or "<stream>")
    return os.fspath(obj)


def _as_f32(x, field: str, name: str) -> np.ndarray:
    """A 1-D float32 numpy view of a numpy array or CPU torch tensor (no dtype conversion: a bf16
    or fp64 buffer here is a caller bug, not something to round silently)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        if str(x.dtype) != "torch.float32" or x.device.type != "cpu":
            raise StateFileError(f"{name}: {field}: expected a CPU float32 tensor, "
                                  f"found {x.dtype} on {x.device}")
        x = x.detach().contiguous().numpy()
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim != 1:
        raise StateFileError(f"{name}: {field}: expected a 1-D float32 array, "
                              f"found {x.dtype} with shape {x.shape}")
    return np.ascontiguousarray(x, dtype="<f4")


def _as_i32(x, field: str, name: str) -> np.ndarray:
    a = np.asarray(x if x is not None else [], dtype=np.int64).reshape(-1)
    if a.size and (a.min() < _I32[0] or a.max() > _I32[1]):
        raise StateFileError(f"{name}: {field}: expected int32 values, found range [{a.min()}, {a.max()}]")
    return a.astype("<i4")


def _checked(name: str, field: str, value, lo: int, hi: int) -> int:
    try:
        iv = int(value)
    except (TypeError, ValueError):
        raise StateFileError(f"{name}: {field}: expected an integer in [{lo}, {hi}], found {value!r}")
    if iv != value or not lo <= iv <= hi:
        raise StateFileError(f"{name}: {field}: expected an integer in [{lo}, {hi}], found {value!r}")
    return iv


def _expect(name: str, field: str, expected, found, hint: str = "") -> None:
    if expected != found:
        raise StateFileError(f"{name}: {field}: expected {expected}, found {found}{hint}")


def _bytes_view(chunk) -> memoryview | bytes:
    return chunk if isinstance(chunk, bytes) else memoryview(np.ascontiguousarray(chunk)).cast("B")


def json_default(o):
    """JSON for what training state holds besides plain values: numpy arrays and scalars, torch
    tensors, sets (sorted). Anything else is a TypeError, so a bad value fails before a file is
    opened."""
    if isinstance(o, np.ndarray) or hasattr(o, "tolist"):  # numpy arrays/scalars, torch tensors
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")
