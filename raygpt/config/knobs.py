"""The knob: one declaration per config field of its flag, help section, closed choices, resume
rule and whether a file may set it; and the readers of those declarations (a field's value type,
whether it repeats, its docstring as --help's text)."""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from dataclasses import field

from raygpt.config.errors import ConfigError

SECTION_TITLES = {
    "data": "data: the token shards and the batch", "model": "model",
    "optimizer": "optimizer: AdamW, clipping, ZeRO, llm.c's z-score skip",
    "schedule": "schedule: the learning rate over the steps",
    "eval": "evaluation, sampling and watch metrics", "checkpoint": "checkpoints and resuming",
    "spike": "the loss-spike monitor", "run": "the run directory, logging and fault injection",
    "ray": "Ray: workers and their restarts",
    "performance": "performance: speed switches (the function computed stays the same)"}



def knob(default=dataclasses.MISSING, *, section: str, factory=dataclasses.MISSING,
         short: str | None = None, long: str | None = None, choices: tuple | None = None,
         metavar: str | None = None, may_change_on_resume: bool = False,
         from_file: bool | None = None, hints: tuple[str, ...] = (),
         action: type | None = None):
    """A config field and everything the rest of raygpt needs to know about it, in one place:
    its `section` (a SECTION_TITLES key: --help groups the flags by it), its llm.c `short` flag,
    a `long` flag that is not the name with dashes (a boolean whose default is on has a flag
    that turns it off), its closed set of `choices` (validate() checks the same tuples), the
    `metavar` --help shows, whether it `may_change_on_resume` (a checkpoint's identity,
    `TrainConfig.identity`, leaves those fields out: e.g. extending -x), and whether a file
    (a --config file, a sweep's sweep.json, a stored search space) may set it: `from_file`.
    Unsaid, a free text field may not (it can name a place on this machine, a server or a
    credential) and every other field may (a number, a switch or one of `choices` names none);
    a field that arms or deletes says False, a path read only as data says True. `hints`: the
    names other tools (nanoGPT, llm.c's train_gpt2.py, Hugging Face) give this knob; not flags,
    only what an unknown flag's error points from (config/flag_hints.py). `action`: an argparse
    Action of its own (-i's: each use adds a weighted source)."""
    assert section in SECTION_TITLES, section
    return field(default=default, default_factory=factory, metadata=dict(
        section=section, short=short, long=long, choices=choices, metavar=metavar,
        may_change_on_resume=may_change_on_resume, from_file=from_file, hints=hints,
        action=action))



def need(ok: bool, flag: str, expected: str, found) -> None:
    """A component's check: ConfigError naming the flag, what was expected and what was found."""
    if not ok:
        raise ConfigError(f"{flag}: expected {expected}, found {found!r}")



def _is_list(f: dataclasses.Field) -> bool:
    """A field of repeatable values (`list[str]`: a flag given once per value)."""
    return str(f.type).startswith("list[")



def _value_type(f: dataclasses.Field) -> type:
    """bool, int, float or str from a field's annotation ('int | None' is int; 'list[str]'
    is str, its items' type)."""
    hint = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    parts = {p.strip() for p in str(hint).split("|")}
    return next((t for t in (bool, int, float) if t.__name__ in parts), str)



def _from_file(f: dataclasses.Field) -> bool:
    """Whether a file may set field `f` (its knob's `from_file`; unsaid: any but free text)."""
    allowed = f.metadata["from_file"]
    if allowed is None:
        allowed = bool(f.metadata["choices"]) or _value_type(f) is not str
    return allowed



def field_docs(cls) -> dict[str, str]:
    """{field: docstring} of a dataclass, read from its source: the string literal right after
    each annotated field (what Sphinx and torchtitan treat as the field's documentation); a
    config composed of components' dataclasses has each component's docs."""
    import ast
    import inspect
    import textwrap
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _typed(cls, d: dict, where: str) -> dict:
    """`d` with every value checked against `cls`'s annotation for it (and ints made floats
    where a float is expected); ConfigError naming the first field that does not fit."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)} - {"spike"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{where}unknown config field(s) {unknown}; expected some of {sorted(known)}")
    out = {}
    for key, value in d.items():
        hint = hints[key]
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        for t in allowed:
            ok, converted = _fits(value, t)
            if ok:
                out[key] = converted
                break
        else:
            names = " or ".join("null" if t is type(None) else str(t) if typing.get_origin(t)
                                else t.__name__ for t in allowed)
            raise ConfigError(f"{where}{key}: expected {names}, found {value!r} "
                              f"({type(value).__name__})")
    return out



def _fits(value, t) -> tuple[bool, object]:
    if t is type(None):
        return value is None, None
    if t is bool:
        return isinstance(value, bool), value
    if isinstance(value, bool):  # a bool is an int to Python, never to a config
        return False, value
    if t is int:
        return isinstance(value, numbers.Integral), int(value) if isinstance(value, numbers.Integral) else value
    if t is float:
        ok = isinstance(value, numbers.Real)
        return ok, float(value) if ok else value
    if typing.get_origin(t) is list:  # list[str]: a list of items of that type
        (item,) = typing.get_args(t)
        ok = isinstance(value, (list, tuple)) and all(_fits(v, item)[0] for v in value)
        return ok, list(value) if ok else value
    return isinstance(value, t), value
