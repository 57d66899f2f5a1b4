"""Every knob of a raygpt run, as typed dataclasses, and the command line that fills them.

The command line takes long options and llm.c's short flags with llm.c's meanings (`-i -j -o -e
-b -t -d -l -u -q -c -k -x -v -m -s -g -sl -sg -n -nk -nm -y -z -r`). It is generated from the
dataclasses: every field is a flag whose help is the field's docstring (`field_docs`, read with
`ast`) and whose default is the field's default, so `--help` and the code cannot drift.

`resolve()` fills the fields left unset from the hardware and the data (a micro-batch the
shards can feed on this many workers, validation batches that fit the validation set) and
validates every value: a bad one is a `ConfigError` naming the flag, what was expected and what
was found. What needs files or the run directory is checked next by `raygpt.config.preflight`, still
before Ray starts. A Ray Tune search space is an override of `TrainConfig` fields (see
`with_overrides`), not a second config system.
"""

from __future__ import annotations

import importlib

# The vocabulary every component declares its knobs with (its own folder's knobs.py) loads at once.
from raygpt.config.errors import ConfigError  # noqa: F401
from raygpt.config.knobs import SECTION_TITLES, field_docs, knob, need  # noqa: F401

# The face: each name from the module that owns it, loaded on first use (PEP 562). TrainConfig
# composes the components' knobs, which import raygpt.config.knobs: loading it here at once
# would import a component back into itself whenever that component is imported first.
_FACE = {
    "raygpt.config.train_config": ("FILE_FIELDS", "RESUME_MUTABLE_FIELDS", "TrainConfig"),
    "raygpt.data.knobs": ("DATA_DIR", "DEFAULT_TRAIN", "DEFAULT_VAL", "PACKAGE_DIR"),
    "raygpt.train.knobs": ("SCHEDULERS", "SpikeConfig"),
    "raygpt.config.files": (
        "COMMAND_LINE_ONLY", "CONFIG_FILE_FORBIDDEN", "CONFIG_FILE_MAX_BYTES", "FILE_REFUSED",
        "PLACEMENT", "as_command", "check_file_fields", "command_line_only", "config_read_back",
        "flag_of", "knob_hints", "read_config_file", "stored_fields", "without_command_line_only"),
    "raygpt.config.paths": ("absolute_paths", "output_dir_with_endpoint", "shards_with_endpoint"),
    "raygpt.data.fit": ("DEFAULT_VAL_BATCHES",),
    "raygpt.ray.knobs": ("local_gpus",),
    "raygpt.config.command_line": ("EXIT_CODES", "FlagParser", "build_parser", "parse_args"),
}
_OWNER = {name: module for module, names in _FACE.items() for name in names}
_MODULES = ("command_line", "errors", "eval_sets", "files", "flag_hints", "knobs", "mixture",
            "paths", "preflight", "train_config")
__all__ = ["ConfigError", "SECTION_TITLES", "field_docs", "knob", "need", *_OWNER]


def __getattr__(name: str):
    if name in _OWNER:
        value = getattr(importlib.import_module(_OWNER[name]), name)
        globals()[name] = value  # once: later lookups are plain attributes
        return value
    if name in _MODULES:  # a module of this package, by name
        return importlib.import_module(f"raygpt.config.{name}")
    raise AttributeError(f"module 'raygpt.config' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_OWNER))
