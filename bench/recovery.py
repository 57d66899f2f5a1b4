"""What a lost worker costs: SIGKILL one worker mid-run and print the recovery ledger's split
(raygpt.runlog.history.recovery_split) for three starts of the replacement worker group:

  cold   the node's compile cache is emptied and the run's compiled artifacts are hidden right
         after the kill: the new workers compile everything again
  warm   nothing touched: the new workers find their graphs in the node's local cache
         (compile_cache.NODE_COMPILE_CACHE, per user and private, kept across worker restarts)
  new    the node's compile cache is emptied but the run's artifacts stay: the new workers fill
         their cache from <run dir>/compile_cache/ (what a replacement node does)

The kill comes from outside the run, as a crash or the OOM killer would strike: once
checkpoint --kill-after is complete (its DONE is in the run directory), the bench SIGKILLs one
Ray Train worker process of this machine (a real SIGKILL; recorded under <run dir>/faults/ first,
as `kill_worker`, so `raygpt status` lists it) and, for `cold` and `new`, empties the cache. A
kill at a fixed step instead would land before that checkpoint is complete on a fast GPU (an
async save and Ray's registration take seconds, dozens of steps), and the replacement workers
would start from an older checkpoint or from scratch: the table would then measure the
cadence, not the recovery.

    python bench/recovery.py                      # 2 GPUs, GPT-2 124M, B=16 T=1024, ckpt every 20
    python bench/recovery.py --tiny               # 2 CPU workers, d2 T=64 compiled: a dry run
    python bench/recovery.py --scenarios warm,new --kill-after 40

The node's compile cache for the bench lives under --root (TORCHINDUCTOR_CACHE_DIR is pointed
there before Ray starts, so the workers inherit it), not in the machine's usual one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on these machines

SCENARIOS = ("cold", "warm", "new")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="2 CPU workers, a depth-2 model, T=64, compiled with Inductor's C++ backend")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=150,
                   help="long enough that the run is still training when --kill-after is DONE")
    p.add_argument("--kill-after", type=int, default=20,
                   help="SIGKILL a worker once this checkpoint's DONE exists (a multiple of "
                        "--checkpoint-every)")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--root", default=None, help="where the runs and the bench's node cache go "
                   "(default: a new temporary directory)")
    p.add_argument("--json", default=None, help="also write the table's numbers to this file")
    args = p.parse_args(argv)
    if args.tiny:
        args.depth, args.batch_size, args.seq_len = 2, 4, 64
        args.checkpoint_every, args.max_steps, args.kill_after = 4, 60, 4
    if args.kill_after <= 0 or args.kill_after % args.checkpoint_every or args.kill_after >= args.max_steps:
        p.error(f"--kill-after: expected a checkpoint step (a multiple of --checkpoint-every "
                f"{args.checkpoint_every}) below --max-steps {args.max_steps}, found {args.kill_after}")
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"--scenarios: expected some of {','.join(SCENARIOS)}, found {','.join(bad)}")
    return args


def train_worker_pids() -> list[int]:
    """The pids of this bench's Ray Train worker processes: the processes titled
    ray::RayTrainWorker whose parent is the raylet this process's `ray.init` started (other Ray
    instances on the machine have workers of their own)."""
    import ray._private.worker as ray_worker

    raylet = ray_worker._global_node.all_processes["raylet"][0].process.pid
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    title = f.read().split(b"\0")[0]
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if title.startswith(b"ray::RayTrainWorker") and parent == raylet:
                pids.append(int(entry))
    return sorted(pids)


# Ray Train's controller logs its worker group's start at DEBUG, part by part, into the session's
# logs/train/ray-train-sys-controller-*.log (JSON lines) whatever the run's LoggingConfig says:
# the replacement group's start as Ray itself timed it, between "worker group up" and the
# failure. (message prefix after "[Worker Group Initialization] ", label)
RAY_GROUP_PARTS = (("Placement group ready in", "placement group ready"),
                   ("worker actors created in", "actors created (process + imports)"),
                   ("before_init_train_context callbacks completed in", "before-init callbacks"),
                   ("Train context initialized on workers in", "train context initialized"),
                   ("after_worker_group_start callbacks completed in",
                    "after-start callbacks (process group)"),
                   ("Train function launched on workers in", "train function launched"),
                   ("Worker group startup completed in", "start, whole (Ray's count)"))


def ray_group_start_split(since: float) -> dict:
    """{label: seconds} of the last worker group start Ray Train's controller logged, from the
    newest controller log of this bench's Ray session written after `since`; {} when there is
    none (another Ray layout, or the log not found)."""
    import re

    import ray._private.worker as ray_worker

    try:
        logs = Path(ray_worker._global_node.get_session_dir_path()) / "logs" / "train"
        newest = max((f for f in logs.glob("ray-train-sys-controller-*.log")
                      if f.stat().st_mtime >= since), key=lambda f: f.stat().st_mtime)
    except (AttributeError, OSError, ValueError):
        return {}
    starts: list[dict] = []
    for line in newest.read_text().splitlines():
        try:
            message = json.loads(line).get("message", "")
        except ValueError:
            continue
        if message.startswith("Attempting to start training worker group"):
            starts.append({})
        for prefix, label in RAY_GROUP_PARTS:
            m = re.search(re.escape(prefix) + r" ([0-9.]+)s", message)
            if m and starts:
                starts[-1][label] = float(m.group(1))
    return starts[-1] if starts else {}


class Killer(threading.Thread):
    """Waits for checkpoint `after`'s DONE, records the fault, SIGKILLs one Ray Train worker, and
    then empties the node's compile cache (and, for `cold`, moves the run's compiled artifacts
    away) before Ray has a new worker group compiling."""

    def __init__(self, run_dir: Path, cache_dir: Path, scenario: str, after: int,
                 deadline_s: float = 600):
        super().__init__(daemon=True)
        self.run_dir, self.cache_dir, self.scenario, self.after = run_dir, cache_dir, scenario, after
        self.deadline = time.monotonic() + deadline_s
        self.done = threading.Event()
        self.stopped = threading.Event()
        self.error: str | None = None

    def run(self):
        from raygpt.artifacts.compile_cache import COMPILE_ARTIFACTS
        from raygpt.checkpointing import protocol as ck
        from raygpt.runlog.history import read_history
        from raygpt.storage import open_run_dir
        from raygpt.train.faults import record_external

        done = self.run_dir / ck.step_dir(self.after) / ck.done_file(self.after)
        while not done.exists():
            if self.stopped.wait(0.02) or time.monotonic() > self.deadline:
                self.error = f"{done} never appeared"
                return
        pids = train_worker_pids()
        if not pids:
            self.error = "no Ray Train worker process to kill"
            return
        rd = open_run_dir(str(self.run_dir))
        steps = [r["step"] for r in read_history(rd) if r.get("kind") == "train"]
        record_external(rd, "kill_worker", steps[-1] if steps else 0, pid=pids[-1])
        os.kill(pids[-1], signal.SIGKILL)
        if self.scenario != "warm":
            shutil.rmtree(self.cache_dir, ignore_errors=True)
            if self.scenario == "cold" and (self.run_dir / COMPILE_ARTIFACTS).exists():
                (self.run_dir / COMPILE_ARTIFACTS).rename(self.run_dir / "compile_cache.hidden")
        self.done.set()


def one_run(args, scenario: str, root: Path, cache_dir: Path) -> dict:
    from raygpt.config import TrainConfig
    from raygpt.ray.driver import run
    from raygpt.runlog.history import read_history, summarize_run
    from raygpt.storage import open_run_dir
    from raygpt.train.faults import read_fired

    run_dir = root / scenario
    shutil.rmtree(cache_dir, ignore_errors=True)  # every run's own first start is cold
    cfg = TrainConfig(model=f"d{args.depth}", batch_size=args.batch_size, seq_len=args.seq_len,
                      max_steps=args.max_steps, checkpoint_every=args.checkpoint_every,
                      # the recovery reads the newest; a d12 checkpoint is 1.75 GB, and seven per
                      # run, kept by the default, filled a GPU machine's 64 GB beside its tests
                      checkpoints_keep=2, num_workers=args.workers, output_dir=str(run_dir),
                      val_every=0, sample_every=0, warmup_steps=2, compile=True,
                      device="cpu" if args.tiny else "gpu", deterministic=args.deterministic)
    cfg = cfg.resolve(0 if args.tiny else args.workers)
    killer = Killer(run_dir, cache_dir, scenario, args.kill_after)
    killer.start()
    t0 = time.time()
    summary = run(cfg)
    wall = time.time() - t0
    killer.stopped.set()
    killer.join()
    if not killer.done.is_set():
        raise SystemExit(f"{scenario}: no worker was killed: {killer.error or 'the run ended first'}")
    records = read_history(open_run_dir(str(run_dir)))
    ledger = summarize_run(records)
    if len(ledger["recoveries"]) != 1:
        raise SystemExit(f"{scenario}: expected one recovery, the ledger has "
                         f"{len(ledger['recoveries'])}: {ledger['recovery_lines']}")
    first = [r for r in records if r.get("kind") == "train" and r.get("attempt") == 1]
    failure = next(r for r in records if r.get("kind") == "failure")
    _, fired = read_fired(open_run_dir(str(run_dir)))
    kill = next(r for r in fired if r.get("kind") == "kill_worker")
    rec = ledger["recoveries"][0]
    resume = next(r for r in records if r.get("kind") == "resume" and r.get("attempt") == 2)
    return {"scenario": scenario, "parts": rec["parts"], "steps_retrained": rec["steps_retrained"],
            "setup": setup_split(failure["time"], resume.get("startup") or {}, resume["time"],
                                 next((r["time"] for r in records if r.get("kind") == "train"
                                       and r.get("attempt") == 2), None)),
            "kill_to_failure_record": failure["time"] - kill["time"],
            "ray_group_start": ray_group_start_split(t0),
            "first_start_step1_dt": first[0]["dt"] if first else None,
            "failures": summary.get("failures"), "wall_s": wall,
            "line": ledger["recovery_lines"][0]}


# rank 0's start-up after a restart, finer than the ledger: each mark's time after the one
# before it (raygpt.ray.worker's and raygpt.train.loop.build_run's marks, the ledger's own between)
SETUP_MARKS = (("process_started", "failure recorded -> worker process started"),
               ("group_up", "-> worker group up (controller)"),
               ("process_group", "-> process group formed"),
               ("train_func", "-> train function entered"),
               ("loop_imported", "-> raygpt.train.loop imported"),
               ("build_started", "-> session built"),
               ("weights_built", "-> model built (weights, on the device)"),
               ("model_built", "-> flat buffers + optimizer built"),
               ("loader_built", "-> data loader built"),
               ("compiler_imported", "-> torch.compile's imports"),
               ("compile_cache_ready", "-> compile caches filled (run's artifacts, kernels)"),
               ("fingerprints", "-> run fingerprints hashed"),
               ("restore_started", "-> (restore starts)"),
               ("checkpoint_chosen", "-> checkpoint chosen (complete)"),
               ("files_verified", "-> own files read + sha256"),
               ("ranks_agreed", "-> ranks agreed"),
               ("optimizer_state_copied", "-> m, v, master copied to the device"),
               ("weights_rederived", "-> working weights re-derived (launched)"),
               ("state_loaded", "-> state loaded"),
               ("attempt_recorded", "-> run log opened, attempt recorded"),
               ("first_step", "-> first step trained (compile)"))


def setup_split(failure_time: float, startup: dict, attempt_time: float | None,
                first_step_time: float | None) -> dict:
    """{label: seconds since the previous mark present} for SETUP_MARKS."""
    marks = {**startup.get("setup", {}), **{k: v for k, v in startup.items()
                                             if isinstance(v, (int, float))},
             "attempt_recorded": attempt_time, "first_step": first_step_time}
    out, prev = {}, failure_time
    for key, label in SETUP_MARKS:
        t = marks.get(key)
        if isinstance(t, (int, float)):
            out[label] = t - prev
            prev = t
    return out


def table(results: list[dict]) -> str:
    from raygpt.runlog.history import PART_LABELS, RECOVERY_PARTS

    names = [r["scenario"] for r in results]
    rows = [("kill -> failure recorded", [r["kill_to_failure_record"] for r in results])]
    rows += [(PART_LABELS[p], [r["parts"][p] for r in results]) for p in RECOVERY_PARTS]
    rows += [("  (steps re-trained, count)", [r["steps_retrained"] for r in results])]
    rows += [("TOTAL last step -> caught up", [r["parts"]["total"] for r in results]),
             ("to the first step trained again",
              [r["parts"]["total"] - (r["parts"]["retrained"] or 0) for r in results]),
             ("(1st attempt's step 1, cold)", [r["first_start_step1_dt"] for r in results])]
    rows += [("rank 0's start-up, finer:", [None] * len(results))]
    labels = [label for _, label in SETUP_MARKS]
    rows += [("  " + label, [r["setup"].get(label) for r in results]) for label in labels
             if any(label in r["setup"] for r in results)]
    ray_labels = [label for _, label in RAY_GROUP_PARTS]
    if any(r.get("ray_group_start") for r in results):
        rows += [("the new worker group's start, Ray's log:", [None] * len(results))]
        rows += [("  " + label, [r.get("ray_group_start", {}).get(label) for r in results])
                 for label in ray_labels]
    out = [f"{'seconds':44s}" + "".join(f"{n:>10s}" for n in names)]
    for label, vals in rows:
        out.append(f"{label:44s}" + "".join(f"{v:10.2f}" if v is not None else f"{'-':>10s}"
                                            for v in vals))
    return "\n".join(out)


def main(argv=None) -> None:
    args = parse_args(argv)
    root = Path(args.root or tempfile.mkdtemp(prefix="raygpt_recovery_"))
    root.mkdir(parents=True, exist_ok=True)
    cache_dir = root / "node_compile_cache"
    # before Ray starts: its workers inherit the driver's environment
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / "triton_user")
    import ray
    import torch

    if args.tiny:
        ray.init(address="local", num_cpus=args.workers, include_dashboard=False,
                 log_to_driver=False)
    else:
        ray.init(address="local", include_dashboard=False)
    print(f"recovery bench | {args.workers} x {'cpu' if args.tiny else 'gpu'} | d{args.depth} "
          f"B={args.batch_size} T={args.seq_len} | checkpoint every {args.checkpoint_every} | "
          f"a worker SIGKILLed once checkpoint {args.kill_after} is DONE | torch "
          f"{torch.__version__} | runs under {root}", flush=True)
    results = []
    try:
        for scenario in args.scenarios:
            r = one_run(args, scenario, root, cache_dir)
            print(f"{scenario}: {r['line']}", flush=True)
            results.append(r)
    finally:
        ray.shutdown()
    print(table(results), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
