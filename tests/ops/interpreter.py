"""Running a test module's `__main__` checks under Triton's CPU interpreter.

TRITON_INTERPRET must be set before Triton is first imported, so the checks run in a fresh
interpreter process; they print "interpreter checks passed" when every assertion held."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton installed")


def run_in_interpreter(script: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "interpreter checks passed" in proc.stdout
