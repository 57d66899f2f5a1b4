"""What a checkpoint must agree with to be resumed, computed one way on the driver (preflight,
before Ray, without importing torch) and in the workers (the restore): the config's hash, the
tokenizer's, and the fingerprints of the files the config names (config.FILE_FIELDS: by their
bytes, not their paths)."""

from __future__ import annotations

import os

from raygpt.config import FILE_FIELDS, TrainConfig
from raygpt.data.sources import data_fingerprint, file_ends_sha256
from raygpt.data.tokenizer import tokenizer_fingerprint

# the file fingerprints a manifest carries besides data_hash (which every manifest has)
FILE_PRINTS = ("val_data_hash", "model_source")


def model_source(model: str, depth: int | None) -> str:
    """What a run starts from, as a checkpoint compares it: a depth spec (`model`, e.g. "d12",
    whose `depth` is given) as written; an llm.c model file by its bytes (size, sha256 of the
    first and last MiB: the header with every dimension is in the first), not by its path."""
    if depth is not None:
        return model
    if os.path.isdir(model):
        from raygpt.interop.hf import hf_fingerprint
        return hf_fingerprint(model)
    size = os.path.getsize(model)
    return f"llm.c model file, {size} bytes, ends sha256 {file_ends_sha256(model, size)}"


def run_fingerprints(cfg: TrainConfig) -> dict:
    """The hashes a checkpoint must agree with to be resumed by this config (write_manifest's
    keyword arguments of the same names)."""
    return {"config_hash": cfg.hash(), "tokenizer_hash": tokenizer_fingerprint(),
            "data_hash": data_fingerprint(cfg.input_bin),
            "val_data_hash": data_fingerprint(cfg.input_val_bin) if cfg.input_val_bin else "",
            "model_source": model_source(cfg.model, cfg.depth)}


def compatibility(fingerprints: dict) -> dict:
    """check_compatible's keyword arguments from run_fingerprints' dict (with the manifest, the
    config's identity and the world size)."""
    return dict(tokenizer_hash=fingerprints["tokenizer_hash"],
                data_hash=fingerprints["data_hash"], by_content=FILE_FIELDS,
                content={k: fingerprints[k] for k in FILE_PRINTS})
