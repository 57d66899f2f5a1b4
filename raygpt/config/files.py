"""A config read from or written to a file (--config, a sweep's sweep.json and best_config.json,
stored trial overrides): which fields a file may set (each knob's `from_file`), their types, the
command line a stored config needs beside it."""

from __future__ import annotations

import dataclasses

from raygpt.config import mixture
from raygpt.config.train_config import TrainConfig
from raygpt.train.knobs import SpikeConfig
from raygpt.config.errors import ConfigError
from raygpt.config.knobs import _from_file

CONFIG_FILE_MAX_BYTES = 1 << 20


def flag_of(name: str) -> str:
    """The command-line flag of a TrainConfig field ('spike.x' for SpikeConfig's)."""
    cls, key = (SpikeConfig, name[6:]) if name.startswith("spike.") else (TrainConfig, name)
    meta = next(f for f in dataclasses.fields(cls) if f.name == key).metadata
    return meta["long"] or "--" + name.replace(".", "-").replace("_", "-")


def knob_hints() -> dict[str, str]:
    """Another tool's name for a knob -> raygpt's flag as an error shows it ("-l/--learning-rate"):
    every knob's `hints`."""
    out = {}
    for cls, prefix in ((TrainConfig, ""), (SpikeConfig, "spike.")):
        for f in dataclasses.fields(cls):
            if f.name != "spike" and f.metadata["hints"]:
                shown = "/".join(n for n in (f.metadata["short"], flag_of(prefix + f.name)) if n)
                out.update({hint: shown for hint in f.metadata["hints"]})
    return out


# The fields no file may set (each knob's `from_file`): where a run writes, whether it overwrites
# or resumes, fault injection, servers (storage endpoint, MLflow, W&B), the shard cache's directory.
FILE_REFUSED = tuple(f.name for f in dataclasses.fields(TrainConfig)
                     if f.name != "spike" and not _from_file(f))


assert all(_from_file(f) for f in dataclasses.fields(SpikeConfig))  # (numbers: none to refuse)
CONFIG_FILE_FORBIDDEN = FILE_REFUSED  # (the name launchers and sweeps know it by)


# ...of which the launcher of each run sets these three itself (a sweep's trials, a resume)
PLACEMENT = ("output_dir", "overwrite", "resume")


# ...and the rest only the command line gives: a stored config holds them at their defaults, and
# the command that reads it back hands on its own (`command_line_only`).
COMMAND_LINE_ONLY = {name: flag_of(name) for name in FILE_REFUSED if name not in PLACEMENT}


def check_file_fields(d: dict, where: str) -> None:
    """The fields of a config read from a file (`--config`, sweep.json, a stored search space)
    against each knob's declaration: ConfigError naming `where` and the fields a file may not
    set, or the field whose URI carries options (an endpoint, credentials: `storage.uri`)."""
    flat = dict(d)
    spike = flat.pop("spike", None)
    if isinstance(spike, dict):
        flat.update({f"spike.{k}": v for k, v in spike.items()})
    refused = sorted(k for k in flat if k in FILE_REFUSED)  # (spike.* are numbers: none refused)
    if refused:
        raise ConfigError(f"{where}: may not set {refused} (a file names no place this run "
                          f"writes or caches in, no server, and neither arms nor deletes; give "
                          f"them on the command line: {', '.join(flag_of(k) for k in refused)})")
    from raygpt.storage.uri import URIRefused, check_plain
    for key, value in flat.items():
        try:
            items = (value if isinstance(value, list) else mixture.patterns(value)
                     if key == "input_bin" and isinstance(value, str) else [value])
            for item in items:
                check_plain(_uri_of(item), f"{where}: {key}")
        except URIRefused as e:
            raise ConfigError(str(e)) from None


def _uri_of(item):
    """The URI (or path) an item of a field names: an --eval-set's NAME=GLOB names its GLOB."""
    if isinstance(item, str) and "=" in item.split("://", 1)[0]:
        return item.partition("=")[2]
    return item


def stored_fields(d: dict) -> dict:
    """A config dict as raygpt writes it into a file it will read back (`check_file_fields`):
    every URI without its options (the endpoint comes back from the reading command's
    --storage-endpoint or environment)."""
    from raygpt.storage.uri import without_options

    def plain(v):
        if isinstance(v, dict):
            return stored_fields(v)
        if isinstance(v, list):  # an --eval-set's NAME=GLOB: the name kept, the URI plain
            return [v_ if (u := _uri_of(v_)) is v_ else v_[:len(v_) - len(u)] + without_options(u)
                    for v_ in v]
        return without_options(v)
    return {k: mixture.with_patterns(v, lambda _, p: without_options(p))
            if k == "input_bin" and isinstance(v, str) else plain(v) for k, v in d.items()}


def as_command(cfg: "TrainConfig") -> tuple[dict, list[str]]:
    """`cfg` split as a launcher hands it to `raygpt train --config FILE FLAGS...`: the fields a
    --config file may hold, and flags for the rest (FILE_REFUSED, and a URI with options, which
    only a command line may give), those at their defaults left out. The writer beside
    read_config_file's reader."""
    from raygpt.storage.uri import uri_options
    fields, default = cfg.to_dict(), TrainConfig()
    flags = ["-o", fields.pop("output_dir"), "-y", str(fields.pop("resume"))]
    if fields.pop("overwrite"):
        flags.append("--overwrite")
    def has_options(v) -> bool:
        return any(uri_options(_uri_of(i)) for i in (v if isinstance(v, list) else [v]))

    for name in [*COMMAND_LINE_ONLY, *(k for k, v in fields.items() if has_options(v))]:
        value = fields.pop(name)
        if value != getattr(default, name):
            if isinstance(value, bool):
                flags += [flag_of(name)]
            elif isinstance(value, list):  # a repeatable flag, once per value
                flags += [a for item in value for a in (flag_of(name), str(item))]
            else:
                flags += [flag_of(name), str(value)]
    return fields, flags


def read_config_file(path: str) -> dict:
    """The fields of a --config JSON file: bounded in size, an object, each one a file may set
    (`check_file_fields`; the types are checked by TrainConfig.from_dict)."""
    try:
        with open(path, "rb") as f:
            data = f.read(CONFIG_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e})") from e
    if len(data) > CONFIG_FILE_MAX_BYTES:
        raise ConfigError(f"--config {path}: expected a JSON file of at most "
                          f"{CONFIG_FILE_MAX_BYTES:,} bytes, found a larger one")
    from raygpt.storage import JSONError, parse_json  # pyarrow: imported only when used
    try:
        d = parse_json(data, f"--config {path}")
    except JSONError as e:
        raise ConfigError(f"--config {path}: expected a JSON object of config fields "
                          f"({e.reason})") from e
    if not isinstance(d, dict):
        raise ConfigError(f"--config {path}: expected a JSON object of config fields, "
                          f"found {type(d).__name__}")
    check_file_fields(d, f"--config {path}")
    return d


def config_read_back(d, where: str) -> "TrainConfig":
    """A TrainConfig that raygpt wrote into a directory and reads back (a sweep's base config):
    typed like a --config file, and refused (ConfigError naming `where` and the field) when it
    sets a COMMAND_LINE_ONLY field to anything but its default, or names a URI with options,
    since whoever can write the directory could have. raygpt writes such configs with those
    fields at their defaults (`without_command_line_only`) and its URIs plain (`stored_fields`),
    and takes them from the reading command's own line."""
    cfg = TrainConfig.from_dict(d, where)
    default = TrainConfig()
    for name, flag in COMMAND_LINE_ONLY.items():
        value = getattr(cfg, name)
        if value != getattr(default, name):
            raise ConfigError(f"{where}: {name}: expected {getattr(default, name)!r} (only the "
                              f"command line sets it: {flag}), found {value!r}")
    check_file_fields({k: v for k, v in cfg.to_dict().items() if k not in FILE_REFUSED}, where)
    return cfg


def command_line_only(cfg: "TrainConfig") -> dict:
    """The COMMAND_LINE_ONLY fields of `cfg`: what a process hands on beside a stored config."""
    return {name: getattr(cfg, name) for name in COMMAND_LINE_ONLY}


def without_command_line_only(cfg: "TrainConfig") -> "TrainConfig":
    """`cfg` with every COMMAND_LINE_ONLY field at its default: what raygpt stores in a file."""
    default = TrainConfig()
    return cfg.with_overrides({name: getattr(default, name) for name in COMMAND_LINE_ONLY})
