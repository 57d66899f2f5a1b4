"""The suite cleans up after itself (pyproject's tmp_path retention, tests/conftest.py): what a
passing test or module wrote is gone before the next module runs, and a failing one keeps
everything for debugging. Run on three generated modules in a pytest of their own, with this
suite's conftest and settings."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from raygpt.checkpointing.local_copy import LOCAL_COPY_ROOT

ROOT = Path(__file__).resolve().parents[1]

MODULE = '''
import os
import pytest

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    d = tmp_path_factory.mktemp("shared_{name}")
    (d / "checkpoint").write_bytes(b"x")
    os.makedirs(os.path.join({local_root!r}, {probe!r}))  # a run's local checkpoint copies
    return d

written = []

def test_{name}(shared, tmp_path):
    (tmp_path / "checkpoint").write_bytes(b"x")
    written.append(tmp_path)
    assert {passes}
'''

NEXT = '''
def test_a_next():  # in the same module: the passing test's tmp_path is gone already
    assert written and not written[0].exists()
'''

CHECK = '''
import os

def test_b_sees_nothing_of_a(tmp_path_factory):
    left = sorted(p.name for p in tmp_path_factory.getbasetemp().iterdir() if not p.is_symlink())
    assert [n for n in left if n.startswith(("shared_a", "test_a"))] == [], left
    assert not os.path.exists(os.path.join({local_root!r}, {probe!r}))
'''


def test_a_passing_module_leaves_nothing_and_a_failing_one_keeps_all(tmp_path):
    probes = {name: f"suite-disk-probe-{name}-{uuid.uuid4().hex}" for name in "ac"}
    gen = tmp_path / "gen"
    gen.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", gen / "conftest.py")
    for name, passes in (("a", True), ("c", False)):
        (gen / f"test_{name}.py").write_text(MODULE.format(
            name=name, local_root=LOCAL_COPY_ROOT, probe=probes[name], passes=passes)
            + (NEXT if passes else ""))
    (gen / "test_b.py").write_text(CHECK.format(local_root=LOCAL_COPY_ROOT, probe=probes["a"]))
    base = tmp_path / "base"
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(gen),
                            f"--basetemp={base}", str(gen)],
                           capture_output=True, text=True, timeout=300, cwd=gen)
        assert "1 failed, 3 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
        assert "test_c.py::test_c" in r.stdout  # the one meant to fail, not the check
        kept = sorted(p.name for p in base.iterdir() if not p.is_symlink())
        assert kept == ["shared_c0", "test_c0"], kept
        assert (Path(LOCAL_COPY_ROOT) / probes["c"]).is_dir()
    finally:
        for probe in probes.values():
            shutil.rmtree(Path(LOCAL_COPY_ROOT) / probe, ignore_errors=True)
