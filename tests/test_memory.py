"""A CPU worker's real peak memory, and raygpt.memory's estimate of it.

Each measurement is a child process running the real loop (raygpt.loop.train under a
LocalSession, no Ray) for two steps with a checkpoint after the first, as bench/memory_estimate.py
does; its peak resident set (ru_maxrss of the child) is what Ray's memory monitor and the
machine see.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raygpt.memory import GiB, Shape, estimate, shape_of

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, resource, sys, tempfile, torch
torch.set_num_threads(1)
from raygpt.config import TrainConfig
from raygpt.loop import train
from raygpt.session import LocalSession
from raygpt.storage import open_run_dir
run_dir = tempfile.mkdtemp(dir=sys.argv[1])
fields = dict(json.loads(sys.argv[2]), max_steps=2, checkpoint_every=1, val_every=0,
              sample_every=0, output_dir=run_dir, device="cpu", num_workers=1, warmup_steps=0)
train(TrainConfig(**fields).resolve(0), LocalSession(open_run_dir(run_dir), torch.device("cpu")))
print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@functools.cache
def peak_rss(tmp: str, **fields) -> int:
    """Peak resident bytes of a child that trains two steps of `fields` on the CPU."""
    proc = subprocess.run([sys.executable, "-c", CHILD, tmp, json.dumps(fields)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split("PEAK ")[-1])


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("memory"))


def test_a_d2_worker_at_b64_t256_peaks_under_3_gb(tmp):
    # the fused loss's chunk by device: 512 rows on a CPU (16384 held 14 GB of fp32 logits here)
    peak = peak_rss(tmp, model="d2", batch_size=64, seq_len=256)
    assert peak < 3 * 10**9, f"peak RSS {peak / GiB:.2f} GiB"
