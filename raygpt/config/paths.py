"""Paths and URIs in a config: the storage endpoint carried into shard and run-directory URIs,
local paths made absolute (a config that travels)."""

from __future__ import annotations

import os
from pathlib import Path

from raygpt.config import eval_sets, mixture
from raygpt.config.errors import ConfigError

def _remote(pattern: str) -> bool:
    from raygpt.data.sources import is_remote
    return is_remote(pattern)



def shards_with_endpoint(flag: str, pattern: str, endpoint: str) -> str:
    """An s3:// shard glob carrying its endpoint as a run directory does (`storage.with_endpoint`);
    any other pattern unchanged. ConfigError naming `flag` for a URI of a scheme raygpt cannot
    read shards from."""
    if "://" not in pattern:
        return pattern
    from raygpt.data.sources import REMOTE_SCHEMES
    if not _remote(pattern):
        raise ConfigError(f"{flag}: expected a local glob or an {' / '.join(REMOTE_SCHEMES)} URI, "
                          f"found {pattern!r}")
    from raygpt.storage import with_endpoint  # pyarrow: only for shards in a bucket
    try:
        return with_endpoint(pattern, endpoint)
    except ValueError as e:
        raise ConfigError(str(e)) from None



def output_dir_with_endpoint(output_dir: str, endpoint: str, data: tuple[str, ...] = ()) -> str:
    """An s3:// run (or sweep) directory carrying its endpoint (--storage-endpoint or the AWS
    variables), so that Ray's workers, elsewhere, open the same store (`storage.with_endpoint`).
    `data`: the run's shard globs, which may be what the endpoint is for."""
    if not output_dir.startswith("s3://"):
        if endpoint and not any(p.startswith("s3://") for p in data):
            raise ConfigError(f"--storage-endpoint: expected with an s3:// -o/--output-dir, -i "
                              f"or -j, found -o {output_dir!r}")
        return output_dir
    from raygpt.storage import with_endpoint  # pyarrow: only for object-store run directories
    try:
        return with_endpoint(output_dir, endpoint)
    except ValueError as e:
        raise ConfigError(str(e)) from None



def absolute_paths(cfg, cwd: str = ""):
    """`cfg` (a TrainConfig) with every local path it names made absolute against `cwd` (default: this process's
    working directory; ~ as the user's home): the run directory, the train and validation shard
    globs, the shard cache directory, an -e model file or folder, a HellaSwag file. The driver
    does it before anything reads them; Ray's workers run
    with another working directory, where a path given relative to the user's would name
    nothing (or something else). URIs, an empty -o (refused by validate(), never made the
    working directory), an empty -j (validation off) and a dN model spec are left as they are."""
    base = cwd or os.getcwd()

    def absolute(path: str) -> str:  # ~ too: a quoted glob ('~/data/*.bin') reaches us as typed
        return (path if not path or "://" in path
                else os.path.normpath(os.path.join(base, os.path.expanduser(path))))

    paths = {"input_bin": mixture.with_patterns(cfg.input_bin, lambda _, p: absolute(p)),
             "input_val_bin": absolute(cfg.input_val_bin),
             "hellaswag": absolute(cfg.hellaswag),
             "eval_set": eval_sets.with_patterns(cfg.eval_set, lambda _, p: absolute(p))}
    if cfg.output_dir.strip() and "://" not in cfg.output_dir:
        paths["output_dir"] = str((Path(base) / Path(cfg.output_dir).expanduser()).resolve())
    if cfg.shard_cache_dir:
        paths["shard_cache_dir"] = absolute(cfg.shard_cache_dir)
    if cfg.depth is None and cfg.model:
        paths["model"] = absolute(cfg.model)
    return cfg.with_overrides(paths)
