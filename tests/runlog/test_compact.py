"""raygpt compact on a run directory whose files are hostile: one line on stderr, exit 2, and
nothing touched."""

from __future__ import annotations

import json
import os

import pytest

from raygpt.cli import main as cli
from raygpt.storage.ownership import LEASE, MARKER, MARKER_FORMAT


def _deep(tmp):
    (tmp / MARKER).write_text("[" * 100_000 + "]" * 100_000)


def _huge(tmp):
    with open(tmp / MARKER, "wb") as f:
        f.truncate(64 << 20)  # sparse: larger than any JSON file raygpt reads


def _list(tmp):
    (tmp / MARKER).write_text(json.dumps([1, 2, 3]))


def _fields_of_wrong_type(tmp):
    (tmp / MARKER).write_text(json.dumps({"format": MARKER_FORMAT, "version": 2, "kind": {},
                                          "uid": os.geteuid(), "user": [1]}))


def _version_of_wrong_type(tmp):
    (tmp / MARKER).write_text(json.dumps({"format": MARKER_FORMAT, "version": [2]}))


@pytest.mark.parametrize("plant", [_deep, _huge, _list, _fields_of_wrong_type,
                                   _version_of_wrong_type])
def test_a_hostile_marker_is_one_line_and_exit_2(tmp_path, capsys, plant):
    run = tmp_path / "run"
    run.mkdir()
    plant(run)
    before = sorted(p.name for p in run.iterdir())
    assert cli(["compact", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and MARKER in err[0], err
    assert sorted(p.name for p in run.iterdir()) == before and not (run / LEASE).exists()
