"""What the state file's piece hashes cost its writer and save its reader: numbers, not a test.

Writes `--gib` of random bytes (GPT-2 124M's unsharded state file is 1.5 GB) to a local file the
way a rank writes its state file (`HashingWriter` with the whole-file sha256 on its helper
thread, fsync), without and with the pieces' sha256 on `protocol.PIECE_THREADS` more threads,
then checks the bytes read back the way a resuming rank does (`protocol.verify_bytes`: one
sha256 over the file, or its pieces in parallel). Best of `--repeat` runs each.

    python bench/piece_hashes.py [--gib 1.5] [--repeat 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raygpt.checkpointing import protocol as ck  # noqa: E402
from raygpt.hashing_writer import PIECE_BYTES, HashingWriter  # noqa: E402
from raygpt.storage import open_run_dir  # noqa: E402


def write(path: Path, data: memoryview, pieces: bool) -> tuple[float, dict]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as pool, ThreadPoolExecutor(ck.PIECE_THREADS) as piece_pool, \
            open(path, "wb") as f:
        hw = HashingWriter(f, pool=pool, pieces=piece_pool if pieces else None)
        for lo in range(0, len(data), 512 << 20):  # m, v, master: a few large writes
            hw.write(data[lo:lo + (512 << 20)])
        f.flush()
        os.fsync(f.fileno())
    entry = {"size": hw.size, "sha256": hw.h.hexdigest()}
    if pieces:
        entry.update(piece_bytes=hw.piece_bytes, piece_sha256=hw.piece_digests())
    return time.perf_counter() - t0, entry


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.5)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    args = p.parse_args(argv)
    data = memoryview(os.urandom(int(args.gib * (1 << 30))))
    d = Path(tempfile.mkdtemp(dir=args.dir, prefix="raygpt_piece_hashes_"))
    run_dir = open_run_dir(str(d))
    name = ck.state_file(1, 0)
    (d / ck.step_dir(1)).mkdir()
    path = d / ck.step_dir(1) / name
    rows = {}
    try:
        for pieces in (False, True):
            times, entry = [], None
            for _ in range(args.repeat):
                t, entry = write(path, data, pieces)
                times.append(t)
            rows[f"write + hash ({'whole + pieces' if pieces else 'whole file'})"] = min(times)
            manifest = {"files": {name: entry}}
            read = path.read_bytes()
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                ck.verify_bytes(run_dir, 1, name, read, manifest)
                times.append(time.perf_counter() - t0)
            rows[f"verify on load ({'pieces, parallel' if pieces else 'one sha256'})"] = min(times)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    finally:
        path.unlink(missing_ok=True)
        (d / ck.step_dir(1)).rmdir()
        d.rmdir()
    print(f"piece hashes | {args.gib} GiB | pieces of {PIECE_BYTES >> 20} MiB on "
          f"{ck.PIECE_THREADS} thread(s) | {os.cpu_count()} CPU(s) | best of {args.repeat}")
    for label, seconds in rows.items():
        print(f"  {label:40s} {seconds:7.3f} s")


if __name__ == "__main__":
    main()
