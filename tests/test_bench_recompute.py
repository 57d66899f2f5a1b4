"""bench/recompute.py: its search for the largest micro-batch, and its CPU smoke run end to end
(the GPU run is the lead's: the command is in the script's docstring)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def recompute(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its sibling throughput.py
    import recompute
    return recompute


@pytest.mark.parametrize("capacity, start, resolution, want", [
    (37, 1, 1, (37, 38)), (64, 1, 1, (64, 65)), (1, 1, 1, (1, 2)), (0, 1, 1, (0, 1)),
    (512, 1, 1, (512, None)), (37, 8, 1, (37, 38)), (5, 8, 1, (5, 6)), (37, 1, 4, (36, 40)),
])
def test_largest_fitting_doubles_then_bisects(recompute, capacity, start, resolution, want):
    tried = []

    def fits(b):
        tried.append(b)
        return b <= capacity

    assert recompute.largest_fitting(fits, start=start, limit=512, resolution=resolution) == want
    assert len(tried) == len(set(tried))  # no B is tried twice (each try is a compilation)
    if start == 1 and 1 < capacity < 512:
        doubling = [b for b in tried if b & (b - 1) == 0]
        assert tried[:len(doubling)] == [2 ** i for i in range(len(doubling))]


def test_smoke_run_prints_the_table_with_equal_losses():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(BENCH / "recompute.py"), "--smoke"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    table = proc.stdout.split("CPU (--smoke)")[-1].splitlines()[2:]
    assert [line.split()[:4] for line in table] == [["d2", str(r), "4", "4"] for r in (0, 1, 2)]
    assert all(line.split()[-1] == "yes" for line in table), proc.stdout
    held = [float(line.split()[-2]) for line in table]
    assert held[0] > held[1] > held[2], held
