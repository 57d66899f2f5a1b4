"""Checkpoint cost: numbers, not a test. Three modes.

`--mode driver` (CPU, no Ray, any world size): what the driver pays per checkpoint as the world
grows. For each world size N it stages a checkpoint as N ranks would leave it in storage (a model
file and N state files of the sizes a d`--depth` model's ranks write, with or without ZeRO-1,
each hashed while written like the ranks do), then calls the real `CheckpointFinalizer.
after_report` the way Ray's controller does, with the ranks' reported metrics. It prints the time
the callback held the controller, the time until MANIFEST landed (DONE comes before it), and the
bytes the finalizer read from storage (counted by wrapping RunDir's reads, cross-checked with
/proc/self/io's rchar of this process), plus what one rank reads and hashes to pick and verify
the checkpoint it resumes from (`Checkpointer.resume_reads`, the real selection code, when this
checkout has it; else `find_latest_verified` + its own state file, as the old restore path did).

    python bench/checkpoint.py --mode driver --world-sizes 1,2,4,8,16,64 [--depth 12] [-z 0]

`--mode ray` (Ray Train workers, CPU by default, GPUs with --device gpu): real runs of N workers,
checkpointing every `--every` steps. Per world size: the training stall per checkpoint (host
copies, from the summary), the time from the step a checkpoint was taken (its train record) to
its DONE file, and the resume time to the first step (a second run with -y 1: from the call to
the first train record of the resumed attempt). The stall is the training thread's time in the
checkpoint's capture (on a GPU the copy to the host runs on a side stream: what of it the next
update waits for lands in that step's time; `--mode snapshot` measures it); "waited" is its
time waiting for the previous checkpoint when checkpoints come faster than they are written.
step -> DONE is broken down from rank 0's checkpoint timeline: the end of the step to the
capture, the capture to the files written (background thread), written to reported (the
ranks agree at the next step), reported to stored in the run directory (Ray's upload thread: a
rename on one filesystem, else a copy), stored to DONE (the other ranks, Ray's controller poll,
the finalizer).

    python bench/checkpoint.py --mode ray --world-sizes 1,2,4 [--model d2 --seq-len 64]
    python bench/checkpoint.py --mode ray --world-sizes 2 --device gpu --model d12 --seq-len 1024 \
        --batch 16 --steps 30 --every 10

`--mode gpu1` is the original one-GPU benchmark (stall, write, load; no Ray).

`--mode snapshot` (one process, no Ray; one GPU with --device gpu, a CPU smoke test without):
the checkpoint snapshot's two paths (`--checkpoint-snapshot host`, straight to pinned host
memory on a side stream; `device`, a device copy first) on the same run, per model size. For
each path it trains `--gap` steps, takes a checkpoint, and trains on until the checkpoint's
DONE exists, `--checkpoints` times; each step ends with a wait for the compute stream only (not
the snapshot's side stream), so a step's time holds whatever the checkpoint made it wait for.
It prints per size and path: the median normal step, the training thread's time in the save
(the capture), the checkpoint's step (its update waits for the copy on the host path), the
stall (save + that step - a normal step), the step after it, step -> DONE (the save to the
DONE file's mtime), the peak GPU memory over the path's steps (torch.cuda.max_memory_allocated)
and the seconds the host buffers took to pin (on a background thread, once). One size per
command keeps each within a few minutes; one checkpoint is on disk at a time (d48's: 22 GB).

    python bench/checkpoint.py --mode snapshot --device gpu --depths 24 --batches 32 --seq-len 1024
    python bench/checkpoint.py --mode snapshot --device gpu --depths 48 --batches 8 --seq-len 1024
    python bench/checkpoint.py --mode snapshot --depths 2 --batches 4 --seq-len 64  # CPU smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from raygpt.checkpointing import protocol as ck
from raygpt.llmc import state_file


# ---------------------------------------------------------------------------------- driver mode
class ReadCounter:
    """Counts the bytes read through RunDir (read_bytes, sha256_of, iter_lines) in this process."""

    def __init__(self):
        from raygpt.storage import RunDir
        self.cls, self.bytes, self.saved = RunDir, 0, {}

    def __enter__(self):
        cls, counter = self.cls, self
        for name in ("read_bytes", "sha256_of", "iter_lines"):
            orig = getattr(cls, name)
            self.saved[name] = orig

            def wrapped(run_dir, rel, *a, _orig=orig, _name=name, **kw):
                if _name == "read_bytes":
                    out = _orig(run_dir, rel, *a, **kw)
                    counter.bytes += len(out)
                    return out
                if _name == "sha256_of":
                    counter.bytes += run_dir.size_of(rel)
                    return _orig(run_dir, rel, *a, **kw)
                return _count_lines(_orig(run_dir, rel, *a, **kw), counter)
            setattr(cls, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(self.cls, name, orig)


def _count_lines(it, counter):
    for line in it:
        counter.bytes += len(line) + 1
        yield line


def rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _write_hashed(path: Path, nbytes: int, rng) -> dict:
    h, left = hashlib.sha256(), nbytes
    with open(path, "wb") as f:
        while left:
            chunk = rng.bytes(min(left, 8 << 20))
            h.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    return {"sha256": h.hexdigest(), "size": nbytes}


class _FakeCheckpoint:  # what Ray hands after_report: only .path is used
    def __init__(self, path):
        self.path = path


def driver_bench(args) -> list[dict]:
    from raygpt.config import TrainConfig
    from raygpt.model.gpt import GPTConfig
    from raygpt.ray.checkpoints import CheckpointFinalizer
    from raygpt.storage import open_run_dir

    from raygpt.model.gpt import llmc_num_elements
    P = llmc_num_elements(GPTConfig.from_depth(args.depth))
    rng = np.random.default_rng(0)
    rows = []
    for n in args.world_sizes:
        root = Path(tempfile.mkdtemp(prefix=f"raygpt-ckbench-{n}-"))
        try:
            step = 4
            sdir = root / ck.step_dir(step)
            sdir.mkdir()
            shard = -(-P // n) if args.zero == 1 and n > 1 else P
            metrics = []
            for r in range(n):
                files = {}
                name = ck.state_file(step, r)
                files[name] = _write_hashed(sdir / name,
                                            state_file.HEADER_BYTES + 4 * 2 * shard + 64, rng)
                if r == 0:
                    files[ck.model_file(step)] = _write_hashed(sdir / ck.model_file(step),
                                                               1024 + 4 * P, rng)
                metrics.append({"step": step, "raygpt_files": files})
            cfg = TrainConfig(model=f"d{args.depth}", output_dir=str(root), device="cpu",
                              num_workers=n, zero_stage=args.zero)
            # rank 0's report; the finalizer adds the config's fingerprints and retention
            metrics[0]["raygpt_manifest"] = {
                "step": step, "world_size": n, "num_parameters": P, "max_steps": step,
                "extra": {"zero_stage": args.zero}}
            total = sum(f["size"] for m in metrics for f in m["raygpt_files"].values())
            fin = CheckpointFinalizer(cfg)
            with ReadCounter() as counter:
                r0 = rchar()
                t0 = time.perf_counter()
                fin.after_report(None, metrics, _FakeCheckpoint(str(sdir)))
                held = time.perf_counter() - t0
                if hasattr(fin, "drain"):
                    fin.drain()
                done = time.perf_counter() - t0
                driver_read, driver_rchar = counter.bytes, rchar() - r0
            rd = open_run_dir(str(root))
            assert not ck.verify_checkpoint(rd, step), ck.verify_checkpoint(rd, step)
            # one rank's resume: what it reads to pick and verify the checkpoint it loads
            with ReadCounter() as counter:
                t0 = time.perf_counter()
                rank_read = _resume_reads(rd, n - 1, n)
                resume_s = time.perf_counter() - t0
                assert rank_read == counter.bytes or rank_read is None
                rank_read = counter.bytes
            rows.append({"world": n, "stored_mb": total / 1e6, "controller_held_s": held,
                         "to_manifest_s": done, "driver_read_mb": driver_read / 1e6,
                         "driver_rchar_mb": driver_rchar / 1e6, "rank_read_mb": rank_read / 1e6,
                         "rank_verify_s": resume_s})
            print(json.dumps(rows[-1]), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def _resume_reads(rd, rank: int, world: int):
    """What one rank reads to choose and verify its resume checkpoint (not the loading itself).
    Uses the checkpointer's own selection (`resume_reads`) when this checkout has it."""
    from raygpt.checkpointing import reading as checkpointer
    if hasattr(checkpointer, "resume_reads"):
        checkpointer.resume_reads(rd, rank=rank, world=world)
        return None
    step = ck.find_latest_verified(rd)  # the old restore path: every rank hashes every file
    rd.read_bytes(f"{ck.step_dir(step)}/{ck.state_file(step, rank)}")
    return None


def print_driver(rows, args):
    print(f"\ndriver cost per checkpoint, d{args.depth} ZeRO-{args.zero} (storage: local disk)")
    print(f"{'world':>5} {'stored MB':>10} {'ctrl held s':>11} {'to MANIFEST s':>13} "
          f"{'driver read MB':>14} {'rchar MB':>9} {'rank read MB':>12} {'rank verify s':>13}")
    for r in rows:
        print(f"{r['world']:>5} {r['stored_mb']:>10.1f} {r['controller_held_s']:>11.3f} "
              f"{r['to_manifest_s']:>13.3f} {r['driver_read_mb']:>14.1f} {r['driver_rchar_mb']:>9.1f}"
              f" {r['rank_read_mb']:>12.1f} {r['rank_verify_s']:>13.3f}")


# ---------------------------------------------------------------------------------- ray mode
def ray_bench(args) -> list[dict]:
    import ray

    from raygpt.config import TrainConfig
    from raygpt.ray.driver import run

    if not ray.is_initialized():
        ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False,
                 **({"num_cpus": max(args.world_sizes)} if args.ray_address == "local" else {}))
    rows = []
    for n in args.world_sizes:
        root = Path(tempfile.mkdtemp(prefix=f"raygpt-raybench-{n}-"))
        try:
            base = dict(model=args.model, batch_size=args.batch, seq_len=args.seq_len,
                        total_batch_size=args.batch * args.seq_len * n, max_steps=args.steps,
                        val_every=0, sample_every=0, checkpoint_every=args.every,
                        output_dir=str(root), device=args.device, num_workers=n,
                        compile=args.device == "gpu", warmup_steps=0)
            if args.zero is not None:
                base["zero_stage"] = args.zero
            summary = run(TrainConfig(**base).resolve(0))
            recs = _records(root)
            t_step = {r["step"]: r["time"] for r in recs if r["kind"] == "train"}
            lat = []
            for s in range(args.every, args.steps + 1, args.every):
                done = root / ck.step_dir(s) / ck.done_file(s)
                # the train record of step s-1 is logged when step s begins, where the save is
                if done.exists() and (s - 1) in t_step:
                    lat.append(done.stat().st_mtime - t_step[s - 1])
            n_saves = max(1, summary.get("checkpoints_written", len(lat)))
            stall = summary.get("checkpoint_stall_s", float("nan")) / n_saves
            waited = sum(w for _, w in summary.get("checkpoint_waits", [])) / n_saves
            dts = sorted(r["dt"] for r in recs if r["kind"] == "train")
            # rank 0's peak tensor memory (the end record; None on CPUs): ZeRO-1's saving
            peak = next((r.get("peak_memory_gib") for r in reversed(recs) if r["kind"] == "end"), None)
            parts = _done_breakdown(root, summary.get("checkpoint_timeline", []), t_step, args)
            # the training thread's time in ray.train.report (a barrier of the ranks) per checkpoint
            reports = [t["publish_s"] for t in summary.get("checkpoint_timeline", []) if "publish_s" in t]
            parts["report_s"] = statistics.mean(reports) if reports else float("nan")
            t0 = time.time()
            run(TrainConfig(**{**base, "max_steps": args.steps + 2, "resume": 1}).resolve(0))
            recs2 = _records(root)
            last = max(r.get("attempt") or 0 for r in recs2)
            first = min(r["time"] for r in recs2 if r["kind"] == "train" and r.get("attempt") == last)
            rows.append({"world": n, "step_s": dts[len(dts) // 2], "stall_s": stall,
                         "step_to_done_s": statistics.mean(lat) if lat else float("nan"),
                         "max_step_to_done_s": max(lat) if lat else float("nan"),
                         "resume_to_first_step_s": first - t0, "wait_s": waited,
                         "load_s": summary.get("checkpoint_load_s"), "peak_gib": peak, **parts})
            print(json.dumps(rows[-1]), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows


# the parts of step -> DONE, in order, from rank 0's checkpoint timeline (the summary's
# checkpoint_timeline: wall times of each checkpoint's capture, files written, report and
# files stored) and the DONE file's mtime
DONE_PARTS = (("to_save", "step end -> captured"), ("write", "captured -> written"),
              ("agree", "written -> reported"), ("store", "reported -> stored"),
              ("to_done", "stored -> DONE"))


def _done_breakdown(root: Path, timeline: list[dict], t_step: dict, args) -> dict:
    """Mean seconds of each DONE_PARTS over the periodic checkpoints (the last, blocking one
    is left out like in step -> DONE)."""
    rows = []
    for t in timeline:
        s = t["step"]
        done = root / ck.step_dir(s) / ck.done_file(s)
        if s % args.every or s == args.steps or not done.exists() or (s - 1) not in t_step:
            continue
        marks = [t_step[s - 1], t["saved"], t.get("written"), t.get("published"), t.get("stored"),
                 done.stat().st_mtime]
        if None in marks:
            continue
        rows.append([b - a for a, b in zip(marks, marks[1:])])
    if not rows:
        return {}
    return {f"{key}_s": statistics.mean(r[i] for r in rows) for i, (key, _) in enumerate(DONE_PARTS)}


def _records(root: Path) -> list[dict]:
    return [json.loads(l) for l in (root / "loss_history.jsonl").read_text().splitlines() if l.strip()]


def print_ray(rows, args):
    print(f"\nRay runs: {args.model} T={args.seq_len} B={args.batch} on {args.device}, "
          f"checkpoint every {args.every} of {args.steps} steps")
    print(f"{'world':>5} {'median step s':>13} {'stall s':>8} {'waited s':>8} {'report s':>8} {'step->DONE s':>12} "
          f"{'max step->DONE s':>16} {'resume->1st step s':>18} {'peak GiB':>8}")
    for r in rows:
        print(f"{r['world']:>5} {r['step_s']:>13.3f} {r['stall_s']:>8.4f} {r.get('wait_s', 0):>8.3f}"
              f" {r.get('report_s', float('nan')):>8.3f}"
              f" {r['step_to_done_s']:>12.2f}"
              f" {r['max_step_to_done_s']:>16.2f} {r['resume_to_first_step_s']:>18.2f}"
              f" {r['peak_gib'] if r['peak_gib'] is not None else '-':>8}")
    print("\nstep -> DONE, mean seconds per part (rank 0's timeline; the DONE file's mtime)")
    print(f"{'world':>5} " + " ".join(f"{label:>20}" for _, label in DONE_PARTS))
    for r in rows:
        print(f"{r['world']:>5} " + " ".join(
            f"{r[key + '_s']:>20.3f}" if key + "_s" in r else f"{'-':>20}" for key, _ in DONE_PARTS))


# ---------------------------------------------------------------------------------- gpu1 mode
def gpu1(args):
    import torch

    from raygpt.config import TrainConfig
    from raygpt.storage import open_run_dir
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession

    def one(every, resume=0, run_dir=None):
        run_dir = run_dir or tempfile.mkdtemp(prefix="raygpt-ckpt-bench-")
        cfg = TrainConfig(model=f"d{args.depth}", batch_size=args.batch, seq_len=1024,
                          max_steps=args.steps, val_every=0, sample_every=0,
                          checkpoint_every=every, output_dir=run_dir, device="gpu",
                          num_workers=1, warmup_steps=0, resume=resume).resolve(1)
        summary = train(cfg, LocalSession(open_run_dir(run_dir), torch.device("cuda")))
        return summary, [r["dt"] for r in _records(Path(run_dir)) if r["kind"] == "train"], run_dir

    base, base_dts, _ = one(0)
    ck_sum, ck_dts, run_dir = one(args.every)
    resumed, _, _ = one(args.every, resume=1, run_dir=run_dir)
    med = lambda xs: statistics.median(xs[5:])
    n = ck_sum["checkpoints_written"]
    print(f"\n{torch.cuda.get_device_name()} | d{args.depth} B={args.batch} T=1024")
    print(f"step: {1000 * med(base_dts):.1f} ms without, {1000 * med(ck_dts):.1f} ms with checkpoints")
    print(f"stall per checkpoint: {1000 * ck_sum['checkpoint_stall_s'] / n:.1f} ms")
    print(f"write (background): {statistics.mean(ck_sum['checkpoint_write_s']):.2f} s")
    print(f"load: {resumed['checkpoint_load_s']:.2f} s")


# ---------------------------------------------------------------------------------- snapshot mode
def snapshot_bench(args) -> list[dict]:
    import contextlib

    import torch

    from raygpt.checkpointing.snapshot import nbytes
    from raygpt.config import TrainConfig
    from raygpt.storage import open_run_dir
    from raygpt.train.determinism import run_switches
    from raygpt.train.loop import build_run, forward_backward
    from raygpt.train.session import LocalSession

    gpu = args.device == "gpu"
    device = torch.device("cuda" if gpu else "cpu")
    # the compute stream only: a step waits for the snapshot's side stream only where its own
    # work does (the host path's update), as in the loop
    sync = (lambda: torch.cuda.current_stream().synchronize()) if gpu else (lambda: None)
    rows = []
    for depth, batch in zip(args.depths, args.batches):
        root = Path(tempfile.mkdtemp(prefix=f"raygpt-snapbench-d{depth}-"))
        try:
            cfg = TrainConfig(model=f"d{depth}", batch_size=batch, seq_len=args.seq_len,
                              total_batch_size=batch * args.seq_len, max_steps=1_000_000,
                              val_every=0, sample_every=0, checkpoint_every=0,
                              output_dir=str(root), device=args.device,
                              num_workers=1, compile=gpu and not args.no_compile,
                              warmup_steps=0).resolve(1 if gpu else 0)
            with contextlib.ExitStack() as stack:
                stack.enter_context(run_switches(cfg.deterministic))  # as train() runs the loop
                r = build_run(cfg, LocalSession(open_run_dir(str(root)), device), stack)
                snap = r.ckpt._snapshot
                state_gib = nbytes(r.ckpt._checkpointed()) / 2**30
                step = 0

                def one_step() -> float:
                    nonlocal step
                    t0 = time.perf_counter()
                    forward_backward(r.micro, step)
                    r.opt.reduce_gradients()
                    r.opt.step(lr=1e-5, grad_scale=1.0, t=step + 1, seed=step)
                    sync()
                    step += 1
                    return time.perf_counter() - t0

                for _ in range(args.warmup):  # compile, the allocator's pools
                    one_step()
                snap._join_reserve()  # the one-time pinning, measured apart
                for mode in args.snapshot_modes:  # host first: the device buffers stay once made
                    snap.mode, snap.on_device = mode, None
                    if gpu:
                        torch.cuda.reset_peak_memory_stats()
                    normal, per_ckpt = [], []
                    for _ in range(args.checkpoints):
                        normal += [one_step() for _ in range(args.gap)]
                        r.state.step = saved = step
                        t_wall, t0 = time.time(), time.perf_counter()
                        r.ckpt.save(r.state, r.train_loader, blocking=False)
                        save_s = time.perf_counter() - t0
                        ckpt_step = one_step()
                        next_step = one_step()
                        while not r.ckpt.ready():  # training goes on while the files are written
                            one_step()
                        r.ckpt.publish_pending({"step": saved})
                        done = root / ck.step_dir(saved) / ck.done_file(saved)
                        per_ckpt.append({"save_s": save_s, "ckpt_step_s": ckpt_step,
                                         "next_step_s": next_step,
                                         "to_done_s": done.stat().st_mtime - t_wall})
                        # one checkpoint on disk at a time (d48's are 22 GB): this one and
                        # the node's fast-resume links to it go
                        r.ckpt.local.remove_all()
                        shutil.rmtree(root / ck.step_dir(saved))
                    normal_s = statistics.median(normal)
                    med = {k: statistics.median(c[k] for c in per_ckpt) for k in per_ckpt[0]}
                    rows.append({
                        "depth": depth, "batch": batch, "mode": mode, "state_gib": state_gib,
                        "pin_s": snap.reserve_seconds, "on_device": snap.on_device,
                        "normal_step_s": normal_s, **med,
                        "stall_s": med["save_s"] + med["ckpt_step_s"] - normal_s,
                        "first_stall_s": (per_ckpt[0]["save_s"] + per_ckpt[0]["ckpt_step_s"]
                                          - normal_s),
                        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None})
                    print(json.dumps(rows[-1]), flush=True)
                r.ckpt.finish()
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if gpu:
            torch.cuda.empty_cache()
    return rows


def print_snapshot(rows, args):
    import torch
    where = torch.cuda.get_device_name() if args.device == "gpu" else "CPU"
    print(f"\ncheckpoint snapshot paths on {where}, T={args.seq_len}: medians over "
          f"{args.checkpoints} checkpoints (ms unless named)")
    print(f"{'model':>5} {'B':>3} {'path':>6} {'state GiB':>9} {'pinned s':>8} {'step':>7} "
          f"{'save':>7} {'ckpt step':>9} {'stall':>7} {'1st stall':>9} {'next step':>9} "
          f"{'step->DONE s':>12} {'peak GiB':>8}")
    for r in rows:
        ms = lambda k: f"{1000 * r[k]:.1f}"  # noqa: E731
        pin = f"{r['pin_s']:.1f}" if r["pin_s"] is not None else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        path = r["mode"] if r["on_device"] is not False or r["mode"] == "host" else "host*"
        print(f"{'d' + str(r['depth']):>5} {r['batch']:>3} {path:>6} {r['state_gib']:>9.2f} "
              f"{pin:>8} {ms('normal_step_s'):>7} {ms('save_s'):>7} {ms('ckpt_step_s'):>9} "
              f"{ms('stall_s'):>7} {ms('first_stall_s'):>9} {ms('next_step_s'):>9} "
              f"{r['to_done_s']:>12.2f} {peak:>8}")
    if any(r["mode"] == "device" and r["on_device"] is False for r in rows):
        print("host*: --checkpoint-snapshot device fell back to the host path (no GPU memory "
              "for the device copy)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("driver", "ray", "gpu1", "snapshot"), default="driver")
    p.add_argument("--world-sizes", default="1,2,4,8,16,64",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--depth", type=int, default=2, help="driver/gpu1 modes: model depth")
    p.add_argument("-z", "--zero", type=int, default=None, help="ZeRO stage (default: raygpt's)")
    p.add_argument("--model", default="d2")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ray-address", default="local")
    p.add_argument("--out", help="also write the rows as JSON here")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--depths", default="24,48", type=ints, help="snapshot mode: model depths")
    p.add_argument("--batches", default="32,8", type=ints,
                   help="snapshot mode: the micro-batch of each depth")
    p.add_argument("--snapshot-modes", default="host,device", type=lambda s: s.split(","),
                   help="snapshot mode: the paths to measure, in order (host before device: "
                        "the device buffers stay once allocated)")
    p.add_argument("--checkpoints", type=int, default=2, help="snapshot mode: per path")
    p.add_argument("--gap", type=int, default=10,
                   help="snapshot mode: normal steps before each checkpoint")
    p.add_argument("--warmup", type=int, default=5, help="snapshot mode: steps before measuring")
    p.add_argument("--no-compile", action="store_true", help="snapshot mode: eager on the GPU")
    args = p.parse_args()
    if args.mode == "gpu1":
        return gpu1(args)
    if args.mode == "snapshot":
        rows = snapshot_bench(args)
        print_snapshot(rows, args)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return
    if args.mode == "driver":
        args.zero = 0 if args.zero is None else args.zero
        rows = driver_bench(args)
        print_driver(rows, args)
    else:
        rows = ray_bench(args)
        print_ray(rows, args)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
