"""raygpt prepare against llm.c's dev/data/fineweb.py (its tokenize_gpt2 under a
multiprocessing Pool.imap), on the same generated Parquet corpus, every output's digest compared.

    python bench/prepare.py [--mb 800] [--cpus 4,16] [--cluster 16,8+8] [--repeat 3]
                            [--anchor PATH/fineweb.py] [--out /tmp/prepare_bench]

Sides, each timed from the first read of the corpus to the last shard written:
- llm.c Pool: the anchor's own `tokenize_gpt2` (read from `--anchor` and run as written, its
  tiktoken handed raygpt's offline copy of the same GPT-2 ranks) over `Pool(cpus).imap(...,
  chunksize=16)`, cut and written by the anchor's loop, restated.
- raygpt in-process: `ray.init(num_cpus=cpus)` (shown apart as "start"), then prepare's plan
  and run.
- raygpt on a cluster: `ray start --head --num-cpus N` (and, for "8+8", a second `ray start
  --address ... --num-cpus 8` on this machine), then `python -m raygpt prepare` with
  RAY_ADDRESS set, as a user submits it; timed as the command's wall time, its fixed start
  included. Each cluster is started once (its start shown apart) and runs every repeat. Only
  the clusters this script started are stopped (their processes found by their own
  --temp-dir), never `ray stop`.

Warm-up, run and printed but not counted: before the measured rows, each in-process side once
at the largest CPU count on the corpus's first file (a fresh machine's first run reads Python's
and Ray's files from a cold disk), and on each cluster the command on a 200-document corpus,
whose wall time is that cluster's fixed start for a job. Then `--repeat` rounds of every row;
the summary takes each row's median and says in how many rounds each goal held.

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

    from raygpt.ray import prepare, ray_logs
    ray_logs.quiet_ray_console()  # Ray's INFO lines to its logs, not between the table's rows
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


class Cluster:
    """`ray start` a head (and more nodes) on this machine with a token of its own (token auth,
    as a cluster's: docs/security.md); `stop()` kills this cluster's processes alone."""

    def __init__(self, nodes: list[int], port: int):
        import secrets
        self.temp_dir = f"/tmp/rgpb_{port}"
        self.address = f"127.0.0.1:{port}"
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        t0 = time.perf_counter()
        try:
            _ray("start", "--head", f"--port={port}", f"--num-cpus={nodes[0]}", "--num-gpus=0",
                 "--node-ip-address=127.0.0.1", f"--temp-dir={self.temp_dir}",
                 "--include-dashboard=false", env=self.env)
            for n in nodes[1:]:
                _ray("start", f"--address={self.address}", f"--num-cpus={n}", "--num-gpus=0",
                     "--node-ip-address=127.0.0.1", env=self.env)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def prepare(self, corpus: Path, out: Path) -> tuple[int, int, float]:
        """`python -m raygpt prepare` with RAY_ADDRESS set; (documents, tokens, wall seconds)."""
        import json
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "raygpt", "prepare", str(corpus), "-o", str(out),
               "--name", "bench", "--shard-size", str(SHARD)]
        t0 = time.perf_counter()
        run = subprocess.run(cmd, env={**self.env, "RAY_ADDRESS": self.address,
                                       "PYTHONPATH": f"{REPO}:{self.env.get('PYTHONPATH', '')}"},
                             capture_output=True, text=True, timeout=900)
        seconds = time.perf_counter() - t0
        if run.returncode:
            raise RuntimeError(f"raygpt prepare: exit {run.returncode}: {run.stderr[-2000:]}")
        manifest = json.loads((out / "manifest.json").read_text())
        return manifest["documents"], manifest["tokens"], seconds

    def job_start(self) -> dict:
        """Where a job's fixed start goes: a driver like prepare's (Python and its imports,
        ray.init joining this cluster, then one task per CPU, whose workers Ray starts for the
        new job, and ray.shutdown), each in seconds, and the whole process's wall time."""
        import json
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", _JOB_START],
                             env={**self.env, "RAY_ADDRESS": self.address,
                                  "PYTHONPATH": f"{REPO}:{self.env.get('PYTHONPATH', '')}"},
                             capture_output=True, text=True, timeout=300)
        if run.returncode:
            raise RuntimeError(f"job start probe: exit {run.returncode}: {run.stderr[-2000:]}")
        return {**json.loads(run.stdout.splitlines()[-1]), "wall": time.perf_counter() - t0}

    def stop(self) -> None:
        _stop_cluster(self.temp_dir)


_JOB_START = """
import json, os, time
t0 = time.perf_counter()
import ray
from raygpt.ray import prepare
from raygpt.ray.connect import init_ray
t1 = time.perf_counter()
init_ray()
t2 = time.perf_counter()
@ray.remote(num_cpus=1)
def pid():
    import raygpt.data.staging  # what a prepare task imports first
    time.sleep(0.05)  # held, so that each CPU's task needs a worker of its own
    return os.getpid()
pids = ray.get([pid.remote() for _ in range(int(ray.cluster_resources()["CPU"]))])
t3 = time.perf_counter()
ray.shutdown()
t4 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "init": t2 - t1, "workers": t3 - t2,
                  "worker_pids": len(set(pids)), "shutdown": t4 - t3}))
"""


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.glob("bench_*.bin")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def import_seconds(modules: str, times: int = 3) -> float:
    """Median wall seconds of a fresh Python that imports `modules` (a driver's start)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    took = []
    for _ in range(times):
        t = time.perf_counter()
        if subprocess.run([sys.executable, "-c", f"import {modules}"], env=env).returncode:
            return float("nan")  # a module missing here: said as nan, the summary still comes
        took.append(time.perf_counter() - t)
    return float(np.median(took))


def goal(name: str, values: list[float], median: float, ok) -> str:
    held = sum(1 for v in values if ok(v))
    return (f"  {name}: median {median:.2f}x ({'met' if ok(median) else 'NOT met'}); rounds "
            f"{', '.join(f'{v:.2f}x' for v in values)}: met in {held} of {len(values)}")


def main() -> int:
    global _anchor_tokenize
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=800, help="MB of text in the corpus")
    ap.add_argument("--cpus", default="4,16", help="CPU counts for the Pool and in-process Ray")
    ap.add_argument("--cluster", default="", help="clusters started with `ray start`, e.g. 16,8+8")
    ap.add_argument("--anchor", type=Path, default=ANCHOR, help="llm.c's dev/data/fineweb.py")
    ap.add_argument("--out", default="/tmp/prepare_bench")
    ap.add_argument("--port", type=int, default=26380)
    ap.add_argument("--repeat", type=int, default=3, help="measured rounds of every row; the "
                                                         "summary takes each row's median")
    a = ap.parse_args()
    _anchor_tokenize = load_anchor_tokenize(a.anchor)
    cpu_list = [c for c in a.cpus.split(",") if c]
    specs = [c for c in a.cluster.split(",") if c]
    root = Path(a.out)
    shutil.rmtree(root, ignore_errors=True)
    t = time.perf_counter()
    size, n_docs = make_corpus(root / "corpus", a.mb)
    first = sorted((root / "corpus").glob("*.parquet"))[0]
    (root / "warmup").mkdir()
    shutil.copyfile(first, root / "warmup" / first.name)
    tiny = pq.read_table(first).slice(0, 200)
    (root / "tiny").mkdir()
    pq.write_table(tiny, root / "tiny" / "part_000.parquet", row_group_size=100)
    print(f"corpus: {size / 1e6:.0f} MB of text, {n_docs:,} documents in "
          f"{len(list((root / 'corpus').glob('*.parquet')))} Parquet files, made in "
          f"{time.perf_counter() - t:.1f} s; machine: {os.cpu_count()} CPUs", flush=True)
    print("rows marked warm-up are run and printed but not counted; 'start' (a Ray's start) "
          "is not counted in 's'")
    rows = []  # (side, cpus, round, docs, tokens, seconds, digest); round 0 is the warm-up

    def row(side, cpus, rnd, docs, tok, s, start, out, mb):
        rows.append((side, cpus, rnd, docs, tok, s, digest(out)))
        print(f"{side:<24}{cpus:>6}{'warm-up' if rnd == 0 else rnd:>8}{docs:>10,}{tok:>13,}"
              f"{s:>8.2f}{start:>7.1f}{docs / s:>10,.0f}{tok / s:>13,.0f}{mb / s:>8.1f}  "
              f"{rows[-1][-1]}", flush=True)

    print(f"{'side':<24}{'CPUs':>6}{'round':>8}{'docs':>10}{'tokens':>13}{'s':>8}{'start':>7}"
          f"{'docs/s':>10}{'tok/s':>13}{'MB/s':>8}  shards sha256")
    warm_mb = sum(len(t.encode()) for t in pq.read_table(first).column("text").to_pylist()) / 1e6
    top = cpu_list[-1]
    out = root / "warm_llmc"
    row("llm.c Pool.imap", top, 0, *llmc_pool(root / "warmup", out, int(top)), 0.0, out, warm_mb)
    out = root / "warm_ray"
    row("raygpt (in-process)", top, 0, *raygpt_local(root / "warmup", out, int(top)), out,
        warm_mb)
    for rnd in range(1, a.repeat + 1):
        for cpus in cpu_list:
            out = root / f"llmc_{cpus}"
            shutil.rmtree(out, ignore_errors=True)
            row("llm.c Pool.imap", cpus, rnd, *llmc_pool(root / "corpus", out, int(cpus)), 0.0,
                out, size / 1e6)
            out = root / f"ray_{cpus}"
            shutil.rmtree(out, ignore_errors=True)
            row("raygpt (in-process)", cpus, rnd, *raygpt_local(root / "corpus", out, int(cpus)),
                out, size / 1e6)
    tiny_mb = sum(len(t.encode()) for t in tiny.column("text").to_pylist()) / 1e6
    for i, spec in enumerate(specs):
        nodes = [int(n) for n in spec.split("+")]
        side = f"raygpt ({len(nodes)} node{'s' * (len(nodes) > 1)}, CLI)"
        try:
            cluster = Cluster(nodes, a.port + 10 * i)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"cluster {spec}: failed to start: {e}", flush=True)
            continue
        try:
            probe = cluster.job_start()
            print(f"cluster {spec}, a job's fixed start (not counted): Python and imports "
                  f"{probe['imports']:.2f} s, ray.init {probe['init']:.2f} s, a task on each CPU "
                  f"{probe['workers']:.2f} s ({probe['worker_pids']} workers started), "
                  f"ray.shutdown {probe['shutdown']:.2f} s; the process {probe['wall']:.2f} s",
                  flush=True)
            out = root / f"tiny_{i}"
            row(side, spec, 0, *cluster.prepare(root / "tiny", out), cluster.start_s, out,
                tiny_mb)
            for rnd in range(1, a.repeat + 1):
                out = root / f"cluster_{i}"
                row(side, spec, rnd, *cluster.prepare(root / "corpus", out), cluster.start_s,
                    out, size / 1e6)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"cluster {spec}: failed: {e}", flush=True)
        finally:
            cluster.stop()
    counted = [r for r in rows if r[2] > 0]
    same = len({r[-1] for r in counted}) == 1 and len({r[-1] for r in rows if r[2] == 0
                                                      and "CLI" not in r[0]}) == 1
    print(f"every output byte-identical (measured rows; in-process warm-ups): {same}")
    now = import_seconds("ray, raygpt.cli, raygpt.ray.prepare, raygpt.ray.connect")
    before = import_seconds("ray, raygpt.cli, raygpt.ray.prepare, raygpt.ray.driver")
    print(f"a prepare driver's Python start and imports: {now:.2f} s (ray, raygpt.cli, "
          f"raygpt.ray.prepare, raygpt.ray.connect); {before:.2f} s with raygpt.ray.driver "
          f"(torch, Ray Train), what it imported before 2026-12-06b (medians of 3)")
    rate: dict = {}
    for r in counted:
        rate.setdefault((r[0], r[1]), {})[r[2]] = r[4] / r[5]
    med = {k: float(np.median(list(v.values()))) for k, v in rate.items()}
    print(f"\nsummary: median tokens/s of {a.repeat} round(s), warm-ups not counted")
    print("| CPUs | llm.c Pool | raygpt | raygpt / Pool |\n| --- | --- | --- | --- |")
    for cpus in cpu_list:
        pool, ours = med.get(("llm.c Pool.imap", cpus)), med.get(("raygpt (in-process)", cpus))
        if pool and ours:
            print(f"| {cpus} | {pool / 1e6:.2f}M | {ours / 1e6:.2f}M | {ours / pool:.2f}x |")
    for k in [k for k in med if "CLI" in k[0]]:
        print(f"| {k[1]}, {k[0]} | | {med[k] / 1e6:.2f}M | |")
    print("goals:")
    ray_side, hi, lo = "raygpt (in-process)", cpu_list[-1], cpu_list[0]
    pool_rate, ray_rate = rate.get(("llm.c Pool.imap", hi), {}), rate.get((ray_side, hi), {})
    if pool_rate and ray_rate:
        per = [ray_rate[r] / pool_rate[r] for r in sorted(ray_rate)]
        print(goal(f"raygpt / Pool at {hi} CPUs >= 1.0x", per,
                   med[(ray_side, hi)] / med[("llm.c Pool.imap", hi)], lambda v: v >= 1.0))
    if lo != hi and (ray_side, lo) in rate:
        for side, need in ((ray_side, 3.2), ("llm.c Pool.imap", None)):
            per = [rate[(side, hi)][r] / rate[(side, lo)][r] for r in sorted(rate[(side, hi)])]
            m = med[(side, hi)] / med[(side, lo)]
            print(goal(f"{side}, {hi} vs {lo} CPUs >= {need}x", per, m, lambda v: v >= need)
                  if need else f"  {side}, {hi} vs {lo} CPUs: median {m:.2f}x, rounds "
                  f"{', '.join(f'{v:.2f}x' for v in per)}")
    made = [k for k in rate if "CLI" in k[0]]
    if len(made) > 1:
        one, two = rate[made[0]], rate[made[-1]]
        per = [two[r] / one[r] for r in sorted(two) if r in one]
        print(goal(f"cluster {made[-1][1]} vs {made[0][1]} within 10% (>= 0.90x)", per,
                   med[made[-1]] / med[made[0]], lambda v: v >= 0.9))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
