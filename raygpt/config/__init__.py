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

# The face: each name from the module that owns it.
from raygpt.config.errors import ConfigError  # noqa: F401
from raygpt.config.knobs import SECTION_TITLES, field_docs, knob  # noqa: F401
from raygpt.config.train_config import (  # noqa: F401
    DATA_DIR, DEFAULT_TRAIN, DEFAULT_VAL, FILE_FIELDS, PACKAGE_DIR, RESUME_MUTABLE_FIELDS,
    SCHEDULERS, SpikeConfig, TrainConfig)
from raygpt.config.files import (  # noqa: F401
    COMMAND_LINE_ONLY, CONFIG_FILE_FORBIDDEN, CONFIG_FILE_MAX_BYTES, FILE_REFUSED, PLACEMENT,
    as_command, check_file_fields, command_line_only, config_read_back, flag_of, knob_hints,
    read_config_file, stored_fields, without_command_line_only)
from raygpt.config.paths import absolute_paths, output_dir_with_endpoint, shards_with_endpoint  # noqa: F401
from raygpt.config.fit import DEFAULT_VAL_BATCHES, local_gpus  # noqa: F401
from raygpt.config.command_line import EXIT_CODES, FlagParser, build_parser, parse_args  # noqa: F401
from raygpt.config import mixture  # noqa: F401,E402 (raygpt.config.mixture)
