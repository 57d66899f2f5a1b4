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


def assert_fake_outputs_match(op, args: tuple, real) -> None:
    """The custom op's fake implementation (what torch.compile traces the model with) gives
    outputs of the shapes, strides, dtypes and devices of `real`, the op's outputs for `args`."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        fake = op(*fake_args)
    fake, real = (x if isinstance(x, (tuple, list)) else (x,) for x in (fake, real))
    layout = lambda ts: [(tuple(t.shape), t.stride(), t.dtype, t.device.type) for t in ts]
    assert layout(fake) == layout(real), f"{op}: fake {layout(fake)} != real {layout(real)}"
