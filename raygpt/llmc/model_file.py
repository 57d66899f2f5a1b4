"""llm.c's model file (`model_*.bin`), byte for byte: train_gpt2.cu's gpt2_write_to_checkpoint
writes it and gpt2_build_from_checkpoint reads it. Reader and writer side by side; every mismatch
is a ModelFileError naming the file, the field, what was expected and what was found.

    int32 header[256], zero except:
      [0] 20240326 magic   [1] version: 3 = every tensor fp32, 5 = every tensor bf16
      [2] max_seq_len  [3] vocab_size  [4] num_layers  [5] num_heads  [6] channels
      [7] padded_vocab_size
    then llm.c's 16 parameter tensors back to back in llm.c's order (raygpt.model.gpt's
    llmc_tensor_shapes), each layer-stacked, as fp32 or as raw bf16 words.

The network and the map between its Parameters and llm.c's tensors are raygpt.model.gpt's; this module
only reads and writes the bytes.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from raygpt.storage.atomic_file import atomic_local_file
from raygpt.storage.hashing_writer import HashingWriter
from raygpt.model.gpt import (GPT, GPTConfig, llmc_num_elements, llmc_parameter_layout,
                          llmc_tensor_shapes)

MODEL_MAGIC = 20240326
MODEL_VERSION_FP32 = 3   # every tensor fp32, padded vocab
MODEL_VERSION_BF16 = 5   # every tensor bf16 (layernorms too), padded vocab
MODEL_HEADER_INTS = 256  # int32s, 1024 bytes
_VERSION_OF_DTYPE = {torch.float32: MODEL_VERSION_FP32, torch.bfloat16: MODEL_VERSION_BF16}
_DTYPE_OF_VERSION = {v: d for d, v in _VERSION_OF_DTYPE.items()}
_BYTES_OF_VERSION = {MODEL_VERSION_FP32: 4, MODEL_VERSION_BF16: 2}
# Header slots (train_gpt2.cu's gpt2_write_to_checkpoint / gpt2_build_from_checkpoint).
_HEADER_FIELDS = (("max_seq_len", 2, "block_size"), ("vocab_size", 3, "vocab_size"),
                  ("num_layers", 4, "n_layer"), ("num_heads", 5, "n_head"),
                  ("channels", 6, "n_embd"), ("padded_vocab_size", 7, "padded_vocab_size"))
_WRITE_CHUNK = 1 << 22  # elements converted per write: bounds the extra host memory


class ModelFileError(ValueError):
    """An llm.c model file does not match the format; the message names file, field, expected
    and found."""

    def __init__(self, path, field: str, expected, found):
        self.path, self.field, self.expected, self.found = str(path), field, expected, found
        super().__init__(f"{path}: model file field '{field}': expected {expected}, found {found}")


def model_header(cfg: GPTConfig, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """The 256-int32 header of a model file for cfg written in dtype (fp32 or bf16)."""
    header = np.zeros(MODEL_HEADER_INTS, dtype="<i4")
    header[0] = MODEL_MAGIC
    header[1] = _version_of(dtype)
    for _, slot, attr in _HEADER_FIELDS:
        header[slot] = getattr(cfg, attr)
    return header


def parse_model_header(header: np.ndarray, path="<model file>") -> tuple[GPTConfig, int]:
    """Check magic and version, return (GPTConfig, version). Raises ModelFileError."""
    if int(header[0]) != MODEL_MAGIC:
        raise ModelFileError(path, "magic", MODEL_MAGIC, int(header[0]))
    version = int(header[1])
    if version not in _DTYPE_OF_VERSION:
        raise ModelFileError(path, "version", f"{MODEL_VERSION_FP32} (fp32) or "
                             f"{MODEL_VERSION_BF16} (bf16)", version)
    values = {}
    for field, slot, attr in _HEADER_FIELDS:
        values[attr] = int(header[slot])
        if values[attr] < 1:
            raise ModelFileError(path, field, "an integer >= 1", values[attr])
    if values["padded_vocab_size"] < values["vocab_size"]:
        raise ModelFileError(path, "padded_vocab_size", f">= vocab_size {values['vocab_size']}",
                             values["padded_vocab_size"])
    if values["n_embd"] % values["n_head"]:
        raise ModelFileError(path, "channels", f"a multiple of num_heads {values['n_head']}",
                             values["n_embd"])
    return GPTConfig(**values), version


def model_file_size(cfg: GPTConfig, dtype: torch.dtype) -> int:
    """Bytes of a model file: 1024 header bytes + every parameter at 4 (fp32) or 2 (bf16) bytes."""
    return MODEL_HEADER_INTS * 4 + llmc_num_elements(cfg) * _BYTES_OF_VERSION[_version_of(dtype)]


def write_model_file(path, model: GPT, dtype: torch.dtype = torch.float32) -> None:
    """Write model as an llm.c model file (version 3 fp32 or 5 bf16), atomically."""
    header = model_header(model.config, dtype)
    with atomic_local_file(path) as f:
        f.write(header.tobytes())
        for _, params in llmc_parameter_layout(model):
            for p in params:
                _write_values(f, p.detach().reshape(-1), dtype)


def write_model_file_from_flat(path, cfg: GPTConfig, flat_params, dtype: torch.dtype = torch.float32,
                               hasher=None) -> None:
    """Write an llm.c model file from a flat parameter buffer already in llm.c order (the
    checkpointer's host copy): a torch tensor of any float dtype, a float32 numpy array, or a
    uint16/int16 numpy array holding raw bf16 bits. Atomic like write_model_file. `hasher` (a
    hashlib object), if given, is fed every byte written (the checkpointer's sha256 without
    reading the file back)."""
    if isinstance(flat_params, np.ndarray):
        if flat_params.dtype in (np.uint16, np.int16):  # numpy has no bf16: raw bits
            flat = torch.from_numpy(np.ascontiguousarray(flat_params).view(np.int16)).view(torch.bfloat16)
        else:
            flat = torch.from_numpy(np.ascontiguousarray(flat_params))
    else:
        flat = flat_params.detach()
    flat = flat.reshape(-1)
    expected = llmc_num_elements(cfg)
    if flat.numel() != expected:
        raise ModelFileError(path, "flat_params", f"{expected} elements in llm.c order for {cfg}",
                             f"{flat.numel()} elements")
    if not flat.is_floating_point():
        raise ModelFileError(path, "flat_params", "a floating-point buffer", flat.dtype)
    header = model_header(cfg, dtype)
    with atomic_local_file(path) as f:
        if hasher is not None:
            f = HashingWriter(f, hasher)
        f.write(header.tobytes())
        _write_values(f, flat, dtype)


def read_model_header(path) -> tuple[GPTConfig, torch.dtype]:
    """The shape and dtype of the llm.c model file at path, from its header, checked against the
    file's size without reading the weights. Raises ModelFileError on a malformed file (OSError
    if it cannot be read)."""
    path = str(path)
    size = os.path.getsize(path)
    if size < MODEL_HEADER_INTS * 4:
        raise ModelFileError(path, "header", f"{MODEL_HEADER_INTS * 4} bytes", f"a {size}-byte file")
    header = np.fromfile(path, dtype="<i4", count=MODEL_HEADER_INTS)
    cfg, version = parse_model_header(header, path)
    dtype = _DTYPE_OF_VERSION[version]
    expected = model_file_size(cfg, dtype)
    if size != expected:
        raise ModelFileError(path, "file size", f"{expected} bytes (1024 + {llmc_num_elements(cfg)} "
                             f"parameters x {_BYTES_OF_VERSION[version]} bytes for {cfg})",
                             f"{size} bytes")
    return cfg, dtype


def read_model_file(path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Read an llm.c model file: (config, {llm.c name: tensor in llm.c's shape}), tensors fp32
    for version 3 and bf16 for version 5. Raises ModelFileError on a malformed file."""
    path = str(path)
    cfg, dtype = read_model_header(path)
    raw = np.fromfile(path, dtype="<f4" if dtype == torch.float32 else "<i2", offset=MODEL_HEADER_INTS * 4)
    flat = torch.from_numpy(raw)
    if dtype == torch.bfloat16:
        flat = flat.view(torch.bfloat16)
    tensors, offset = {}, 0
    for name, shape in llmc_tensor_shapes(cfg):
        n = math.prod(shape)
        tensors[name] = flat[offset:offset + n].view(shape)
        offset += n
    return cfg, tensors


def read_model_file_flat(data: bytes, path: str = "<model file>") -> tuple[GPTConfig, torch.Tensor]:
    """The weights of an llm.c model file held in memory (e.g. read from remote storage), as one
    flat tensor in llm.c order: fp32 for version 3, bf16 for version 5."""
    if len(data) < MODEL_HEADER_INTS * 4:
        raise ModelFileError(path, "header", f"{MODEL_HEADER_INTS * 4} bytes", f"a {len(data)}-byte file")
    header = np.frombuffer(data, dtype="<i4", count=MODEL_HEADER_INTS)
    cfg, version = parse_model_header(header, path)
    dtype = _DTYPE_OF_VERSION[version]
    expected = model_file_size(cfg, dtype)
    if len(data) != expected:
        raise ModelFileError(path, "file size", f"{expected} bytes for {cfg}", f"{len(data)} bytes")
    raw = np.frombuffer(data, dtype="<f4" if dtype == torch.float32 else "<i2",
                        offset=MODEL_HEADER_INTS * 4).copy()
    flat = torch.from_numpy(raw)
    return cfg, flat.view(torch.bfloat16) if dtype == torch.bfloat16 else flat


def load_model_file(path, device="cpu") -> GPT:
    """A GPT (fp32 parameters) holding the weights of an llm.c model file."""
    cfg, tensors = read_model_file(path)
    model = GPT(cfg, init_seed=None)
    with torch.no_grad():
        for name, params in llmc_parameter_layout(model):
            pieces = tensors[name].reshape(len(params), -1)  # one row per layer (or the whole)
            for p, piece in zip(params, pieces):
                p.copy_(piece.view_as(p))
    return model.to(device)


def _version_of(dtype: torch.dtype) -> int:
    if dtype not in _VERSION_OF_DTYPE:
        raise ValueError(f"llm.c model file dtype: expected torch.float32 or torch.bfloat16, "
                         f"found {dtype}")
    return _VERSION_OF_DTYPE[dtype]


def _write_values(f, flat: torch.Tensor, dtype: torch.dtype) -> None:
    """Append a 1-D tensor to f as little-endian fp32, or bf16 as raw 16-bit words (round to
    nearest even when narrowing), chunk by chunk."""
    for lo in range(0, flat.numel(), _WRITE_CHUNK):
        chunk = flat[lo:lo + _WRITE_CHUNK].to(device="cpu", dtype=dtype).contiguous()
        if dtype == torch.bfloat16:
            chunk = chunk.view(torch.int16)
        f.write(memoryview(chunk.numpy()).cast("B"))
