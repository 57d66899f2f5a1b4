"""A restarted worker's own start, without Ray (issue 24): where the seconds between a new
process and its first trained step go, by variant.

A first process trains GPT-2 124M (B=16, T=1024, compiled, one GPU) to checkpoint 20 and is
lost at step 21 (an injected fault); each variant then resumes a copy of that run in a fresh
process with the node's compile cache warm, as a worker Ray restarts on the same node does, and
trains step 21. The printed table is the resumed process's start-up marks (loop.build_run's,
its resume record's), each the seconds since the mark above it; under it, torch.compile's own
phase timers in that process (torch._dynamo.utils.compilation_time_metrics, summed per phase;
nested: a phase's seconds include the phases it calls).

    python bench/restart_parts.py                          # one GPU: current,threads1,current
    python bench/restart_parts.py --variants current,current --profile /tmp/restart  # .0.prof, .1.prof
    python bench/restart_parts.py --tiny                   # d2 T=64 on the CPU: a dry run

Variants: current (the code as it is), threads1 (TORCHINDUCTOR_COMPILE_THREADS=1: no pool of
compile workers), regional (each transformer block compiled on its own instead of the whole
model, loop.compile_model replaced: Dynamo traces the blocks' shared code once; its first run
compiles its own graphs, so list it twice), pieces (regional plus the final norm and the loss
compiled on their own; list it twice too), pycache (bytecode written and read under PYTHONPYCACHEPREFIX: for
packages installed without it, e.g. `pip install --no-compile` beside PYTHONDONTWRITEBYTECODE, where
every new process compiles each module's source again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANT_ENV = {"current": {}, "threads1": {"TORCHINDUCTOR_COMPILE_THREADS": "1"},
               "regional": {"RESTART_PARTS_REGIONAL": "1"},
               "pieces": {"RESTART_PARTS_REGIONAL": "pieces"},
               "pycache": {"PYTHONPYCACHEPREFIX": "/tmp/raygpt_restart_parts_pycache",
                           "PYTHONDONTWRITEBYTECODE": ""}}

# The resumed (or priming) process: times its own imports, then runs the loop until the fault.
CHILD = r'''
import os, sys, time, json
t_start = time.time()
tiny, run_dir, stop, profile = sys.argv[1] == "1", sys.argv[2], int(sys.argv[3]), sys.argv[4]
import torch
t_torch = time.time()
import raygpt.train.loop
t_loop = time.time()
from raygpt.config import TrainConfig
from raygpt.storage import open_run_dir
from raygpt.train.faults import InjectedFault
from raygpt.train.session import LocalSession
torch.set_num_threads(1)  # as a Ray Train worker with one CPU
cfg = TrainConfig(model="d2" if tiny else "d12", batch_size=4 if tiny else 16,
                  seq_len=64 if tiny else 1024, max_steps=60, checkpoint_every=20, num_workers=1,
                  output_dir=run_dir, val_every=0, sample_every=0, warmup_steps=2, compile=True,
                  device="cpu" if tiny else "gpu", async_checkpoint=False, resume=1,
                  fault=f"raise:rank=0,step={stop}").resolve(0 if tiny else 1)
if os.environ.get("RESTART_PARTS_REGIONAL"):  # each block compiled on its own (shared code)
    def compile_blocks(model, mode, scope="model"):
        for block in model.transformer.h:
            block.compile(mode=mode, dynamic=False)
        return model
    raygpt.train.loop.compile_model = compile_blocks
if os.environ.get("RESTART_PARTS_REGIONAL") == "pieces":  # also the final norm, and the loss
    import raygpt.model.gpt
    def compile_pieces(model, mode, scope="model"):
        compile_blocks(model, mode)
        model.transformer.ln_f.compile(mode=mode, dynamic=False)
        return model
    raygpt.train.loop.compile_model = compile_pieces
    raygpt.model.gpt.fused_classifier_loss = torch.compile(raygpt.model.gpt.fused_classifier_loss,
                                                       dynamic=False)
prof = None
if profile:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
try:
    raygpt.train.loop.train(cfg, LocalSession(open_run_dir(run_dir), torch.device(
        "cpu" if tiny else "cuda")))
except InjectedFault:
    pass
if prof is not None:
    prof.disable()
    prof.dump_stats(profile)
from torch._dynamo.utils import compilation_time_metrics  # torch.compile's own phase timers
print("MARKS " + json.dumps({"start": t_start, "torch": t_torch, "loop": t_loop,
                             "compile_times": {k: sum(v) for k, v in
                                               compilation_time_metrics.items()}}))
'''

# build_run's marks and the resume record's, in their order (each row: since the one above)
SETUP_ORDER = ("build_started", "weights_built", "model_built", "loader_built",
               "compiler_imported", "compile_cache_ready", "fingerprints", "checkpoint_chosen", "files_verified",
               "ranks_agreed", "optimizer_state_copied", "weights_rederived")


def child(tiny: bool, run_dir: Path, stop: int, env: dict, profile: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, "1" if tiny else "0", str(run_dir),
                          str(stop), profile],
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(REPO), os.environ.get("PYTHONPATH", "")]), **env},
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{run_dir}: exit {out.returncode}\n{out.stdout[-2000:]}\n"
                         f"{out.stderr[-4000:]}")
    return json.loads(next(line for line in out.stdout.splitlines()
                           if line.startswith("MARKS "))[6:])


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "loss_history.jsonl").read_text().splitlines()
            if line.strip()]


def split(run_dir: Path, marks: dict) -> dict:
    """{row: seconds} of the resumed attempt, from the process's start to its first step."""
    resume = [r for r in records(run_dir) if r.get("kind") == "resume"][-1]
    startup = resume.get("startup", {})
    setup = startup.get("setup", {})
    first = next(r["time"] for r in records(run_dir)
                 if r.get("kind") == "train" and r.get("attempt") == resume["attempt"])
    timeline = [("process start -> torch imported", marks["torch"]),
                ("-> raygpt.train.loop imported", marks["loop"])]
    timeline += [(f"-> {k}", setup[k]) for k in SETUP_ORDER if k in setup]
    timeline += [("-> state loaded", startup.get("state_loaded")),
                 ("-> first step trained", first)]
    row, prev = {}, marks["start"]
    for label, t in timeline:
        if isinstance(t, (int, float)):
            row[label] = t - prev
            prev = t
    row["TOTAL process start -> first step"] = first - marks["start"]
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="d2, T=64 on the CPU")
    p.add_argument("--variants", default="current,threads1,current")
    p.add_argument("--root", default="/tmp/raygpt_restart_parts")
    p.add_argument("--profile", default="",
                   help="cProfile each variant's run into PROFILE.<i>.prof (i: its position)")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANT_ENV]
    if bad:
        p.error(f"--variants: expected some of {','.join(VARIANT_ENV)}, found {','.join(bad)}")
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    # the bench's own node cache: primed by the first run, warm for every variant
    env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "node_cache")}
    t0 = time.time()
    # (with PYTHONPYCACHEPREFIX's bytecode written too, when a variant reads it)
    child(args.tiny, root / "prime", 21,
          {**env, **(VARIANT_ENV["pycache"] if "pycache" in variants else {})})
    print(f"primed (cold compile, checkpoint 20, lost at step 21) in {time.time() - t0:.1f} s",
          flush=True)
    rows, times = [], []
    for i, variant in enumerate(variants):
        run_dir = root / f"{i}_{variant}"
        shutil.copytree(root / "prime", run_dir)  # the same checkpoint for every variant
        marks = child(args.tiny, run_dir, 22, {**env, **VARIANT_ENV[variant]},
                      f"{args.profile}.{i}.prof" if args.profile else "")
        rows.append((variant, split(run_dir, marks)))
        times.append(marks.get("compile_times", {}))
        print(f"{variant}: {rows[-1][1]['TOTAL process start -> first step']:.2f} s to the "
              f"first step", flush=True)
    labels = list(dict.fromkeys(k for _, r in rows for k in r))
    print(f"{'seconds':40s}" + "".join(f"{v:>10s}" for v, _ in rows))
    for label in labels:
        print(f"{label:40s}" + "".join(f"{r[label]:10.2f}" if label in r else f"{'-':>10s}"
                                       for _, r in rows))
    # torch.compile's own timers (nested: a phase's seconds include the phases it calls)
    phases = sorted({k for t in times for k in t}, key=lambda k: -max(t.get(k, 0) for t in times))
    print(f"{'torch.compile phases, s (nested)':40s}" + "".join(f"{v:>10s}" for v, _ in rows))
    for phase in phases[:25]:
        print(f"{phase[-40:]:40s}" + "".join(f"{t.get(phase, 0.0):10.2f}" for t in times))


if __name__ == "__main__":
    main()
