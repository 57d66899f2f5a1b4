"""raygpt.ray.connect: the driver's one `ray.init`. Its start/join rules are tested through
driver.init_ray (tests/test_security.py, test_memory_kill.py, test_command_output.py), which
re-exports it; here, what `raygpt prepare` has imported by the time it joins a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# the real command's main up to ray.init, which records the modules loaded and ends the process
_PROBE = """
import json, os, sys
import ray
def init(address=None, **kw):
    heavy = sorted(m for m in ("torch", "ray.train", "ray.data", "raygpt.ray.driver")
                   if m in sys.modules)
    print(json.dumps({"address": address, "heavy": heavy}), flush=True)
    os._exit(0)
ray.init = init
from raygpt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_prepare_joins_a_cluster_without_importing_torch_or_ray_train(tmp_path):
    """`raygpt prepare` under RAY_ADDRESS (as a cluster job runs it) reaches ray.init having
    imported neither torch nor Ray Train: each costs a job seconds of fixed start
    (bench/prepare.py measures the command's wall time)."""
    book = tmp_path / "book.txt"
    book.write_text((REPO / "raygpt" / "data_files" / "input.txt").read_text()[:5000])
    p = subprocess.run([sys.executable, "-c", _PROBE, "prepare", str(book), "-o",
                        str(tmp_path / "out"), "--val-tokens", "512"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO),
                            "RAY_ADDRESS": "127.0.0.1:26999"})
    assert p.returncode == 0, p.stderr[-2000:]
    said = json.loads(p.stdout.splitlines()[-1])
    assert said == {"address": "127.0.0.1:26999", "heavy": []}
