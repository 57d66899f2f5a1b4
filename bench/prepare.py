"""raygpt prepare against llm.c's dev/data/fineweb.py (its tokenize_gpt2 under a
multiprocessing Pool.imap), on the same generated Parquet corpus, every output's digest compared.

    python bench/prepare.py [--mb 200] [--cpus 4,8,16] [--cluster 16,8+8]
                            [--anchor PATH/fineweb.py] [--out /tmp/prepare_bench]

Sides, each timed from the first read of the corpus to the last shard written:
- llm.c Pool: the anchor's own `tokenize_gpt2` (read from `--anchor` and run as written, its
  tiktoken handed raygpt's offline copy of the same GPT-2 ranks) over `Pool(cpus).imap(...,
  chunksize=16)`, cut and written by the anchor's loop, restated.
- raygpt in-process: `ray.init(num_cpus=cpus)` (shown apart as "Ray start"), then prepare's
  plan and run.
- raygpt on a cluster: `ray start --head --num-cpus N` (and, for "8+8", a second `ray start
  --address ... --num-cpus 8` on this machine), then `python -m raygpt prepare` with
  RAY_ADDRESS set, as a user submits it; timed as the command's wall time. Only the cluster
  this script started is stopped (its processes found by its own --temp-dir), never `ray stop`.

Prints one row per run (documents/s, tokens/s, MB/s of text), then a short table of ratios.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from raygpt.data.shard_writer import shard_bytes, shard_name  # noqa: E402
from raygpt.data.tokenizer import get_encoding  # noqa: E402

SHARD = 10**7
ANCHOR = Path("/work/shared/anchors/llmc_dev/fineweb.py")


def make_corpus(root: Path, mb: int) -> tuple[int, int]:
    """Parquet files of documents of 5-40 paragraphs of Tiny Shakespeare drawn with
    random.choices (a few KB each, as FineWeb-Edu's are), about `mb` MB of text, 20,000
    documents a file in 1,000-row groups; (bytes of text, documents)."""
    text = (REPO / "raygpt" / "data_files" / "input.txt").read_text()
    paras = [p for p in text.split("\n\n") if p]
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    total, docs, n, f = 0, [], 0, 0
    while total < mb * 10**6:
        doc = "\n\n".join(rng.choices(paras, k=rng.randint(5, 40)))
        docs.append(doc)
        total += len(doc.encode())
        if len(docs) == 20_000:
            pq.write_table(pa.table({"text": docs}), root / f"part_{f:03d}.parquet",
                           row_group_size=1000)
            n, docs, f = n + len(docs), [], f + 1
    if docs:
        pq.write_table(pa.table({"text": docs}), root / f"part_{f:03d}.parquet",
                       row_group_size=1000)
        n += len(docs)
    return total, n


# ---------------------------------------------------------------------- llm.c's side

_anchor_tokenize = None  # the anchor's tokenize_gpt2, loaded before the Pool forks


def load_anchor_tokenize(path: Path):
    """The anchor's `tokenize_gpt2`, compiled from its own source; `tiktoken.get_encoding`
    inside it returns raygpt's offline copy of GPT-2's encoding (the same ranks file)."""
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "tokenize_gpt2")
    shim = types.SimpleNamespace(get_encoding=lambda name: get_encoding())
    scope = {"np": np, "tiktoken": shim}
    exec(compile(ast.Module([fn], []), str(path), "exec"), scope)
    return scope["tokenize_gpt2"]


def _tokenize(doc):
    return _anchor_tokenize(doc)


def llmc_pool(corpus: Path, out: Path, cpus: int) -> tuple[int, int, float]:
    """fineweb.py's main loop: documents streamed to Pool.imap (chunksize 16), each shard
    filled, written, and the document's rest starting the next."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    docs = ({"text": t} for p in sorted(corpus.glob("*.parquet"))
            for t in pq.read_table(p).column("text").to_pylist())
    buf, count, index, n_docs, n_tok = np.empty(SHARD, np.uint16), 0, 0, 0, 0
    with mp.get_context("fork").Pool(cpus) as pool:
        for tokens in pool.imap(_tokenize, docs, chunksize=16):
            n_docs, n_tok = n_docs + 1, n_tok + len(tokens)
            if count + len(tokens) < SHARD:
                buf[count:count + len(tokens)] = tokens
                count += len(tokens)
            else:
                remainder = SHARD - count
                buf[count:] = tokens[:remainder]
                (out / shard_name("bench", index)).write_bytes(shard_bytes(buf))
                index += 1
                buf[:len(tokens) - remainder] = tokens[remainder:]
                count = len(tokens) - remainder
    if count:
        (out / shard_name("bench", index)).write_bytes(shard_bytes(buf[:count]))
    return n_docs, n_tok, time.perf_counter() - start


# ---------------------------------------------------------------------- raygpt's sides

class _Quiet:
    def unit_done(self, *a):
        pass

    def done(self, *a):
        pass


def raygpt_local(corpus: Path, out: Path, cpus: int) -> tuple[int, int, float, float]:
    import ray

    from raygpt.ray import prepare
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    t1 = time.perf_counter()
    p = prepare.plan(prepare.PrepareSettings((str(corpus),), str(out), name="bench",
                                             shard_size=SHARD))
    manifest = prepare.run(p, report=_Quiet())
    t2 = time.perf_counter()
    ray.shutdown()
    return manifest["documents"], manifest["tokens"], t2 - t1, t1 - t0


def _ray(*args: str, env: dict) -> None:
    r = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], env=env,
                       capture_output=True, text=True, timeout=180)
    if r.returncode:
        raise RuntimeError(f"ray {' '.join(args)}: exit {r.returncode}: {r.stderr[-3000:]}")


def _stop_cluster(temp_dir: str) -> None:
    """SIGKILL every process whose command line names this cluster's temp dir (its GCS,
    raylets, workers): this cluster's alone."""
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if temp_dir.encode() in cmd:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def raygpt_cluster(corpus: Path, out: Path, nodes: list[int], port: int) -> tuple[int, int, float,
                                                                                   float]:
    """`ray start` a head (and more nodes) on this machine, then `python -m raygpt prepare`
    with RAY_ADDRESS set; (documents, tokens, the command's seconds, the cluster's start)."""
    import json
    temp_dir = f"/tmp/rgpb_{port}"
    import secrets
    # token auth with a token of its own, as a cluster's (docs/security.md)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    address = f"127.0.0.1:{port}"
    t0 = time.perf_counter()
    try:
        _ray("start", "--head", f"--port={port}", f"--num-cpus={nodes[0]}", "--num-gpus=0",
             "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
             "--include-dashboard=false", env=env)
        for n in nodes[1:]:
            _ray("start", f"--address={address}", f"--num-cpus={n}", "--num-gpus=0",
                 "--node-ip-address=127.0.0.1", env=env)
        t1 = time.perf_counter()
        cmd = [sys.executable, "-m", "raygpt", "prepare", str(corpus), "-o", str(out),
               "--name", "bench", "--shard-size", str(SHARD)]
        run = subprocess.run(cmd, env={**env, "RAY_ADDRESS": address,
                                       "PYTHONPATH": f"{REPO}:{env.get('PYTHONPATH', '')}"},
                             capture_output=True, text=True, timeout=900)
        t2 = time.perf_counter()
        if run.returncode:
            raise RuntimeError(f"raygpt prepare: exit {run.returncode}: {run.stderr[-2000:]}")
    finally:
        _stop_cluster(temp_dir)
    manifest = json.loads((out / "manifest.json").read_text())
    return manifest["documents"], manifest["tokens"], t2 - t1, t1 - t0


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.glob("bench_*.bin")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def main() -> int:
    global _anchor_tokenize
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--cpus", default="4,8,16", help="CPU counts for the Pool and in-process Ray")
    ap.add_argument("--cluster", default="", help="clusters started with `ray start`, e.g. 16,8+8")
    ap.add_argument("--anchor", type=Path, default=ANCHOR, help="llm.c's dev/data/fineweb.py")
    ap.add_argument("--out", default="/tmp/prepare_bench")
    ap.add_argument("--port", type=int, default=26380)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each row; the summary takes "
                                                         "each row's median")
    a = ap.parse_args()
    _anchor_tokenize = load_anchor_tokenize(a.anchor)
    root = Path(a.out)
    shutil.rmtree(root, ignore_errors=True)
    t = time.perf_counter()
    size, n_docs = make_corpus(root / "corpus", a.mb)
    print(f"corpus: {size / 1e6:.0f} MB of text, {n_docs:,} documents in "
          f"{len(list((root / 'corpus').glob('*.parquet')))} Parquet files, made in "
          f"{time.perf_counter() - t:.1f} s; machine: {os.cpu_count()} CPUs", flush=True)
    rows = []

    def row(side, cpus, docs, tok, s, start, out):
        rows.append((side, cpus, docs, tok, s, start, digest(out)))
        r = rows[-1]
        print(f"{side:<24}{cpus:>6}{docs:>10,}{tok:>12,}{s:>8.2f}{start:>8.1f}{docs / s:>10,.0f}"
              f"{tok / s:>13,.0f}{size / 1e6 / s:>8.1f}  {r[-1]}", flush=True)

    print(f"{'side':<24}{'CPUs':>6}{'docs':>10}{'tokens':>12}{'s':>8}{'start':>8}{'docs/s':>10}"
          f"{'tok/s':>13}{'MB/s':>8}  shards sha256")
    for _ in range(a.repeat):
        for cpus in [int(c) for c in a.cpus.split(",") if c]:
            out = root / f"llmc_{cpus}"
            shutil.rmtree(out, ignore_errors=True)
            row("llm.c Pool.imap", str(cpus), *llmc_pool(root / "corpus", out, cpus), 0.0, out)
            out = root / f"ray_{cpus}"
            shutil.rmtree(out, ignore_errors=True)
            row("raygpt (in-process)", str(cpus), *raygpt_local(root / "corpus", out, cpus), out)
    clusters = [c for c in a.cluster.split(",") if c] * a.repeat
    for i, spec in enumerate(clusters):
        out = root / f"cluster_{spec}"
        shutil.rmtree(out, ignore_errors=True)
        nodes = [int(n) for n in spec.split("+")]
        try:
            result = raygpt_cluster(root / "corpus", out, nodes, a.port + 10 * i)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"cluster {spec}: failed: {e}", flush=True)
            rows.append(("failed", spec, 0, 0, 1.0, 0.0, "none"))
            continue
        row(f"raygpt ({len(nodes)} node{'s' * (len(nodes) > 1)}, CLI)", spec, *result, out)
    same = len({r[-1] for r in rows}) == 1
    print(f"every output byte-identical: {same}")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import ray, raygpt.ray.prepare"], check=True,
                   env={**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"})
    print(f"a CLI driver's Python start and imports (ray, raygpt.ray.prepare): "
          f"{time.perf_counter() - t:.2f} s")
    print(f"\nsummary (median tokens/s of {a.repeat} run(s); start excluded)")
    runs: dict = {}
    for r in rows:
        runs.setdefault((r[0], r[1]), []).append(r[3] / r[4])
    by = {k: float(np.median(v)) for k, v in runs.items()}
    for cpus in [c for c in a.cpus.split(",") if c]:
        pool, ours = by.get(("llm.c Pool.imap", cpus)), by.get(("raygpt (in-process)", cpus))
        if pool and ours:
            print(f"  {cpus:>5} CPUs: raygpt {ours / 1e6:.2f}M, Pool {pool / 1e6:.2f}M, "
                  f"raygpt/Pool {ours / pool:.2f}x")
    cpu_list = [c for c in a.cpus.split(",") if c]
    if len(cpu_list) > 1:
        lo, hi = cpu_list[0], cpu_list[-1]
        for side in ("raygpt (in-process)", "llm.c Pool.imap"):
            print(f"  {side}: {hi} vs {lo} CPUs {by[(side, hi)] / by[(side, lo)]:.2f}x")
    made = [k for k in by if "CLI" in k[0]]
    for k in made:
        print(f"  {k[0]} {k[1]}: {by[k] / 1e6:.2f}M")
    if len(made) > 1:
        print(f"  cluster {made[-1][1]} vs {made[0][1]}: {by[made[-1]] / by[made[0]]:.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
