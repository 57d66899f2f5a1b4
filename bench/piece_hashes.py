"""What the state file's hashes cost its writer and save its reader: numbers, not a test.

Writes `--gib` of random bytes (GPT-2 124M's unsharded state file is 1.5 GB) to a local file,
fsync included: with the whole-file sha256 on the writing thread (hash, then write: how the
model file is written), and the way a rank writes its state file (`HashingWriter(borrow=True)`:
the whole-file sha256 behind the writes on a thread of its own, each 64 MiB piece's sha256 on
`protocol.PIECE_THREADS` more threads); then checks the bytes read back the way a resuming rank
does (`protocol.verify_bytes`: one sha256 over the file, or its pieces in parallel). Best of
`--repeat` runs each. (Until 2026-12-01 the state file's whole-file sha256 ran in step with its
writes, each 16 MiB chunk waited for: 2.40-2.67 s for 1.5 GiB on the H200 machine against
1.55 s behind, `bench/results/h200_piece_hashes_2026-12-01_*.log`.)

`--parts` splits the writer's time: the same bytes written with no hash at all, without the
fsync, with the pieces' hashes only, and one sha256 over the bytes in memory (the whole-file
hash's floor: one stream, one core), so a row says whether the writer waits for the disk, the
page cache or the serial hash.

    python bench/piece_hashes.py [--gib 1.5] [--repeat 3] [--dir /tmp] [--parts]
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
from raygpt.storage import open_run_dir  # noqa: E402
from raygpt.storage.hashing_writer import PIECE_BYTES, HashingWriter  # noqa: E402


class _NoHash:
    """A hashlib stand-in that hashes nothing (the rows without the whole-file sha256)."""

    def update(self, b) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


def write(path: Path, data: memoryview, pieces: bool, whole: bool = True,
          fsync: bool = True, borrow: bool = True) -> tuple[float, dict]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(ck.PIECE_THREADS) as piece_pool, open(path, "wb") as f:
        hw = HashingWriter(f, hasher=None if whole else _NoHash(),
                           pieces=piece_pool if pieces else None, borrow=borrow)
        hw.write(data[:1024])  # the header: the large writes start off a piece's edge
        for lo in range(1024, len(data), 512 << 20):  # m, v, master: a few large writes
            hw.write(data[lo:lo + (512 << 20)])
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        digest = hw.hexdigest()
    entry = {"size": hw.size, "sha256": digest}
    if pieces:
        entry.update(piece_bytes=hw.piece_bytes, piece_sha256=hw.piece_digests())
    return time.perf_counter() - t0, entry


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.5)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--parts", action="store_true",
                   help="also time the writer without hashes, without fsync, with the pieces' "
                        "hashes only, and one in-memory sha256 over the bytes")
    args = p.parse_args(argv)
    data = memoryview(os.urandom(int(args.gib * (1 << 30))))
    d = Path(tempfile.mkdtemp(dir=args.dir, prefix="raygpt_piece_hashes_"))
    run_dir = open_run_dir(str(d))
    name = ck.state_file(1, 0)
    (d / ck.step_dir(1)).mkdir()
    path = d / ck.step_dir(1) / name
    rows = {}
    try:
        entries = []
        for label, kw in (("write + hash (whole file, on this thread)", dict(pieces=False, borrow=False)),
                          ("write + hash (whole behind, pieces)", dict(pieces=True))):
            times, entry = [], None
            for _ in range(args.repeat):
                t, entry = write(path, data, **kw)
                times.append(t)
            rows[label] = min(times)
            entries.append(entry)
            manifest = {"files": {name: entry}}
            read = path.read_bytes()
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                ck.verify_bytes(run_dir, 1, name, read, manifest)
                times.append(time.perf_counter() - t0)
            rows[f"verify on load ({'pieces, parallel' if kw['pieces'] else 'one sha256'})"] = min(times)
        assert path.read_bytes() == data
        t0 = time.perf_counter()
        whole = hashlib.sha256(data).hexdigest()
        sha256_s = time.perf_counter() - t0
        assert entries[0]["sha256"] == entries[1]["sha256"] == whole
        if args.parts:
            rows["one sha256 over the bytes in memory"] = sha256_s
            for label, kw in (("write, no hash", dict(pieces=False, whole=False)),
                              ("write, no hash, no fsync", dict(pieces=False, whole=False, fsync=False)),
                              ("write + hash (whole behind, pieces), no fsync", dict(pieces=True, fsync=False)),
                              ("write + hash (pieces only)", dict(pieces=True, whole=False))):
                rows[label] = min(write(path, data, **kw)[0] for _ in range(args.repeat))
    finally:
        path.unlink(missing_ok=True)
        (d / ck.step_dir(1)).rmdir()
        d.rmdir()
    print(f"piece hashes | {args.gib} GiB | pieces of {PIECE_BYTES >> 20} MiB on "
          f"{ck.PIECE_THREADS} thread(s) | {os.cpu_count()} CPU(s) | best of {args.repeat}")
    for label, seconds in rows.items():
        print(f"  {label:48s} {seconds:7.3f} s")


if __name__ == "__main__":
    main()
