"""What the artifact signature costs a new node: sign and verify (raygpt.artifacts.signed_file) of
compiled-artifact files of several sizes, read from a run directory as the loader reads them.

    python bench/signed_file.py [--sizes-mb 10,100,500] [--repeat 3]

Prints one row per size: the best of `--repeat` for reading the file, verifying it (the read
included, as compile_cache does it), and signing it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raygpt.artifacts import signed_file  # noqa: E402
from raygpt.storage import open_run_dir  # noqa: E402


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="10,100,500")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    key = signed_file.ArtifactKey(os.urandom(32))
    name = "compile_cache/bench.bin"
    print(f"{'size':>8}{'read ms':>10}{'verify ms':>11}{'sign ms':>9}{'verify MB/s':>13}")
    with tempfile.TemporaryDirectory() as d:
        rd = open_run_dir(d)
        for mb in (int(x) for x in a.sizes_mb.split(",")):
            payload = os.urandom(mb << 20)
            rd.write_bytes_atomic(name, signed_file.sign(key, name, payload))
            read = best(lambda: rd.read_bytes(name), a.repeat)
            verify = best(lambda: signed_file.verified(key, name, rd.read_bytes(name)), a.repeat)
            sign = best(lambda: signed_file.sign(key, name, payload), a.repeat)
            print(f"{mb:>6}MB{read * 1e3:>10.1f}{verify * 1e3:>11.1f}{sign * 1e3:>9.1f}"
                  f"{mb / verify:>13,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
