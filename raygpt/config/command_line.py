"""`raygpt train`'s command line, generated from the knobs: every TrainConfig field is a flag whose
help is its docstring, parsed into an unresolved TrainConfig (`parse_args`; `--config FILE` first,
flags beside it win)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from raygpt.config.train_config import TrainConfig
from raygpt.data.knobs import DATA_DIR
from raygpt.train.knobs import SpikeConfig
from raygpt.config.errors import ConfigError, usage_error
from raygpt.config.files import knob_hints, read_config_file
from raygpt.config.flag_hints import HintingParser
from raygpt.config.knobs import SECTION_TITLES, _is_list, _value_type, field_docs

# The command line is generated from the dataclasses above: every field is a flag, its help is
# the field's docstring (read from this file's source with `ast`, so the two cannot drift), its
# default the field's default, its short flag, choices and metavar the field's `knob` metadata.
# llm.c's one- and two-letter flags keep llm.c's meanings.
EXIT_CODES = """exit status:
  0  finished (every step of -x trained)
  1  failed (Ray's retry budget spent, or an error raygpt cannot recover from)
  2  bad input: a flag, a file or the run directory refused before Ray started, or one a
     worker met (a corrupt shard, a checkpoint it cannot use), which is not retried
  3  stopped early by SIGTERM, Ctrl-C or a preemption, after a checkpoint: -y 1 resumes it
  130  aborted by a second Ctrl-C: -y 1 resumes from the last verified checkpoint"""



def _show(value) -> str:
    if isinstance(value, str) and value.startswith(str(DATA_DIR)):
        return f"the bundled {Path(value).name}"
    return "'' (off)" if value == "" else str(value)



def _flag_specs():
    """(section, dest, names, argparse kwargs) of every config field: TrainConfig's, then
    SpikeConfig's as spike_<name> (the --spike-* flags)."""
    import re
    for cls, prefix in ((TrainConfig, ""), (SpikeConfig, "spike.")):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name == "spike":
                continue
            meta = f.metadata
            key = prefix + f.name
            dest = key.replace(".", "_")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            # the flag is shown beside the help, so the docstring's own "(-x)" goes
            doc = re.sub(r"\s*\((-\w+ ?)+\)", "", docs.get(f.name, "")).replace("%", "%%")
            long = meta["long"] or "--" + key.replace(".", "-").replace("_", "-")
            names = [n for n in (meta["short"], long) if n]
            typ = _value_type(f)
            if _is_list(f):  # repeatable: each use adds a value
                yield meta["section"], dest, names, dict(
                    dest=dest, action="append", type=typ, default=None,
                    metavar=meta["metavar"] or typ.__name__.upper().replace("STR", "TEXT"),
                    help=doc + " (repeatable; default: none)")
                continue
            if typ is bool:
                if default is True:  # the flag turns a default-on feature off
                    yield meta["section"], dest, names, dict(
                        action="store_false", default=None,
                        help=f"{doc} (default: on; this flag turns it off)")
                else:
                    shown = "" if default is None else " (default: off)"
                    yield meta["section"], dest, names, dict(action="store_true", default=None,
                                                             help=doc + shown)
                    if default is None:
                        yield meta["section"], dest, ["--no-" + long[2:]], dict(
                            action="store_false", help=f"turn {long} off")
                continue
            kw = dict(dest=dest, type=typ, default=None,
                      metavar=meta["metavar"] or typ.__name__.upper().replace("STR", "TEXT"),
                      **({"action": meta["action"]} if meta["action"] else {}))
            if meta["choices"]:
                kw.update(choices=meta["choices"],
                          metavar="{" + ",".join(map(str, meta["choices"])) + "}")
            shown = "" if default is None else f" (default: {_show(default)})"
            kw["help"] = doc + shown
            yield meta["section"], dest, names, kw



class FlagParser(HintingParser):
    """argparse for raygpt's commands (train, and sweep's own flags): a usage mistake is a
    ConfigError like any other bad value, in raygpt's form (flag, expected, found); an unknown
    flag names the nearest known ones and the knob another tool's name means (`flag_hints`)."""

    hints = None  # built on first use: every knob's `hints` (raygpt.config.flag_hints)

    def parse_known_args(self, args=None, namespace=None):
        if self.hints is None:
            self.hints = knob_hints()
        return super().parse_known_args(args, namespace)

    def error(self, message):
        raise ConfigError(usage_error(message))



def build_parser(prog: str = "raygpt train") -> argparse.ArgumentParser:
    p = FlagParser(prog=prog, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Pretrain GPT-2 on Ray Train. llm.c's flags keep llm.c's meanings;\n"
                            "every field of raygpt.config.TrainConfig is a flag (its docstring is "
                            "the help).",
                epilog=EXIT_CODES)
    groups = {name: p.add_argument_group(title) for name, title in SECTION_TITLES.items()}
    for section, dest, names, kw in _flag_specs():
        if "dest" not in kw:
            kw["dest"] = dest
        groups[section].add_argument(*names, **kw)
    p.add_argument("--cpu", dest="device", action="store_const", const="cpu", help="--device cpu")
    p.add_argument("--gpu", dest="device", action="store_const", const="gpu", help="--device gpu")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a JSON file of TrainConfig fields (e.g. a sweep's best_config.json); "
                        "flags given beside it win")
    return p



def parse_args(argv: list[str] | None = None, base: TrainConfig | None = None, *,
               prog: str = "raygpt train", also_known: dict[str, str] | None = None) -> TrainConfig:
    """Parse the command line into an unresolved TrainConfig (call `.resolve()` next). `prog`
    and `also_known` (the flags a command reads beside train's: `flag_hints.shown_flags`) are
    for the error an unknown flag gets."""
    parser = build_parser(prog)
    parser.also_known = also_known or {}
    ns = parser.parse_args(argv)
    cfg = base or TrainConfig()
    if ns.config:
        fields = read_config_file(ns.config)
        spike = fields.pop("spike", None)
        if spike is not None:
            if not isinstance(spike, dict):
                raise ConfigError(f"--config {ns.config}: spike: expected an object, found {spike!r}")
            fields.update({f"spike.{k}": v for k, v in spike.items()})
        try:
            cfg = cfg.with_overrides(fields)
        except ConfigError as e:
            raise ConfigError(f"--config {ns.config}: {e}") from e
    overrides = {}
    for key, value in vars(ns).items():
        if value is None or key == "config":
            continue
        if key.startswith("spike_"):
            overrides["spike." + key[len("spike_"):]] = value
        else:
            overrides[key] = value
    return cfg.with_overrides(overrides)
