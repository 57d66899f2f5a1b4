"""raygpt prepare (Ray Data) against llm.c's approach (a multiprocessing.Pool over the documents,
dev/data/fineweb.py's loop), on the same generated Parquet corpus on this machine.

    python bench/prepare.py [--mb 200] [--cpus 1,2] [--out /tmp/prepare_bench]

Each side reads the same Parquet files, tokenizes (<|endoftext|> + encode_ordinary per
document), and writes llm.c shards; the two outputs are compared byte for byte. Prints one row
per side and CPU count: documents, tokens, seconds (Ray Data's excludes starting Ray, shown
apart), tokens/s.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raygpt.data.shard_writer import ShardCutter, shard_bytes, shard_name  # noqa: E402
from raygpt.data.tokenizer import EOT, get_encoding  # noqa: E402

SHARD = 10**7


def make_corpus(root: Path, mb: int) -> int:
    """Parquet files of documents drawn from Tiny Shakespeare's paragraphs (a few KB each, as
    FineWeb-Edu's are), about `mb` MB of text in files of 1,000-row groups."""
    text = (Path(__file__).resolve().parents[1] / "raygpt" / "data_files" / "input.txt").read_text()
    paras = [p for p in text.split("\n\n") if p]
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    total, docs, f = 0, [], 0
    while total < mb * 10**6:
        doc = "\n\n".join(rng.choice(paras, int(rng.integers(5, 40))))
        docs.append(doc)
        total += len(doc)
        if len(docs) == 20_000:
            pq.write_table(pa.table({"text": docs}), root / f"part_{f:03d}.parquet", row_group_size=1000)
            docs, f = [], f + 1
    if docs:
        pq.write_table(pa.table({"text": docs}), root / f"part_{f:03d}.parquet", row_group_size=1000)
    return total


def _tokenize(doc: str) -> np.ndarray:  # llm.c's tokenize_gpt2
    tokens = [EOT]
    tokens.extend(get_encoding().encode_ordinary(doc))
    return np.array(tokens, dtype=np.uint16)


def llmc_pool(corpus: Path, out: Path, cpus: int) -> tuple[int, int, float]:
    """llm.c's fineweb.py: documents streamed to a Pool (imap, chunksize 16), shards cut in order."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    docs = (t for p in sorted(corpus.glob("*.parquet")) for t in pq.read_table(p).column("text").to_pylist())

    def emit(i, tokens):
        (out / shard_name("bench", i)).write_bytes(shard_bytes(tokens))
    cutter, n_docs, n_tok = ShardCutter(SHARD, SHARD, emit), 0, 0
    with mp.get_context("fork").Pool(cpus) as pool:
        for tokens in pool.imap(_tokenize, docs, chunksize=16):
            cutter.add(tokens)
            n_docs, n_tok = n_docs + 1, n_tok + len(tokens)
    cutter.finish()
    return n_docs, n_tok, time.perf_counter() - start


def ray_data(corpus: Path, out: Path, cpus: int) -> tuple[int, int, float, float]:
    import ray

    from raygpt.ray import prepare
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    t1 = time.perf_counter()
    p = prepare.plan(prepare.PrepareSettings((str(corpus),), str(out), name="bench", shard_size=SHARD))
    manifest = prepare.run(p, report=_Quiet())
    t2 = time.perf_counter()
    ray.shutdown()
    return manifest["documents"], manifest["tokens"], t2 - t1, t1 - t0


class _Quiet:
    def unit_done(self, *a):
        pass

    def done(self, *a):
        pass


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.glob("bench_*.bin")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--cpus", default="1,2")
    ap.add_argument("--out", default="/tmp/prepare_bench")
    a = ap.parse_args()
    root = Path(a.out)
    shutil.rmtree(root, ignore_errors=True)
    size = make_corpus(root / "corpus", a.mb)
    print(f"corpus: {size / 1e6:.0f} MB of text in {len(list((root / 'corpus').glob('*.parquet')))} "
          f"Parquet files; machine: {os.cpu_count()} CPUs")
    rows = []
    for cpus in [int(c) for c in a.cpus.split(",")]:
        docs, tok, s = llmc_pool(root / "corpus", root / f"llmc_{cpus}", cpus)
        rows.append(("llm.c Pool.imap", cpus, docs, tok, s, 0.0, digest(root / f"llmc_{cpus}")))
        docs, tok, s, start = ray_data(root / "corpus", root / f"ray_{cpus}", cpus)
        rows.append(("raygpt prepare (Ray Data)", cpus, docs, tok, s, start, digest(root / f"ray_{cpus}")))
    print(f"{'side':<27}{'CPUs':>5}{'documents':>11}{'tokens':>13}{'seconds':>9}{'+Ray start':>11}"
          f"{'tok/s':>12}  shards sha256")
    for side, cpus, docs, tok, s, start, d in rows:
        print(f"{side:<27}{cpus:>5}{docs:>11,}{tok:>13,}{s:>9.1f}{start:>11.1f}{tok / s:>12,.0f}  {d}")
    same = len({r[-1] for r in rows}) == 1
    print(f"every output byte-identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
