"""Several GPUs under Ray Train (NCCL): scaling, ZeRO-1 memory at GPT-2 1558M, exact resume after
a killed worker, and a resume on half the GPUs. Numbers and checks printed as they come; not a
test (the CPU tests cover the same paths on gloo).

    NCCL_NVLS_ENABLE=0 python bench/multi_gpu.py [--depth 12] [--batch 16] [--steps 16]
                                                 [--sections scaling,zero,exact] [--cpu]

scaling: tokens/s per GPU on 1, 2, 4, 8 GPUs (those present), same per-GPU micro-batch, median
  step after 5 warm-up steps, from the loop's own per-step dt; beside each width, llm.c's own
  train_gpt2.py on the same GPUs (torchrun beyond one; bench/anchor.py; --no-llmc skips it).
zero:    GPT-2 1558M (d48) for a few steps unsharded and with ZeRO-1 on all GPUs; rank 0's
  peak tensor memory for each (eager, B=4). This section runs the loop's step pieces (model,
  FlatParameters, AdamW with its ZeRO stage, reduce_gradients, the norm, the update) in plain
  processes over NCCL, not the Ray loop: the loop always saves at its last step, and d48's
  unsharded checkpoint (m, v and master weights on every rank) is ~75 GB of disk writes.
exact:   on 2 GPUs in deterministic mode (bf16 + master weights, ZeRO-1), a run whose rank 1 is SIGKILLed
  at step 6 against an uninterrupted one (losses equal as floats, recovery time); then a run
  stopped by SIGTERM on 2 GPUs and resumed on 1 (the same global batch through gradient
  accumulation: equal within float tolerance, not bit-exact, as the reduction order changes).
--cpu runs every section on 2 gloo CPU workers with a tiny model: a dry run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on these machines

import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raygpt.config import DEFAULT_TRAIN, TrainConfig
from raygpt.data.loader import DistributedDataLoader
from raygpt.model.gpt import GPT, GPTConfig
from raygpt.ray.driver import run
from raygpt.train.optim import AdamW, FlatParameters, random_u32

import anchor  # bench/anchor.py (bench/ is this script's directory): llm.c's trainer


def losses(run_dir) -> dict:
    """step -> (loss, dt, world) of the final curve (a re-trained step's last record wins)."""
    out = {}
    for line in Path(run_dir, "loss_history.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "train":
            out[r["step"]] = (r["loss"], r["dt"], r.get("world"))
    return out


def zero_worker(rank, world, zero, depth, batch, seq, port, backend, results) -> None:
    """One rank of a few d`depth` training steps with ZeRO stage `zero`; rank 0 puts its peak
    tensor memory and losses on `results`."""
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    on_gpu = backend == "nccl"
    dev = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(dev)
    model = GPT(GPTConfig.from_depth(depth), init_seed=1337).to(dev)
    flat = FlatParameters(model, dev, torch.bfloat16 if on_gpu else torch.float32, pad_multiple=world)
    dist.broadcast(flat.params, src=0)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, rank=rank, world=world,
                zero_stage=zero)
    loader = DistributedDataLoader(DEFAULT_TRAIN, batch, seq, rank, world)
    tokens, rng, losses = batch * seq * world, 1337, []
    for t in range(1, 4):
        flat.zero_grad()
        x, y = loader.next_batch(dev)
        loss_sum, _ = model(x, y)
        (loss_sum / tokens).backward()
        opt.reduce_gradients()
        agree = torch.stack([loss_sum.detach().float(), opt.grad_norm_squared()
                             if zero == 1 or rank == 0 else torch.zeros((), device=dev)])
        dist.all_reduce(agree)
        loss, norm = agree[0].item() / tokens, agree[1].item() ** 0.5
        seed, rng = random_u32(rng)
        opt.step(lr=1e-4, grad_scale=min(1.0, 1.0 / norm), t=t, seed=seed)
        losses.append(round(loss, 4))
    if rank == 0:
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if on_gpu else float("nan")
        results.put((peak, losses, flat.num_parameters))
    dist.barrier()
    dist.destroy_process_group()


def zero_memory(zero, world, depth, batch, seq, backend) -> tuple:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 29500 + zero + 10 * world
    procs = [ctx.Process(target=zero_worker, args=(r, world, zero, depth, batch, seq, port,
                                                    backend, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"zero section: a rank failed (exit codes {[p.exitcode for p in procs]})")
    return results.get(timeout=10)


def say(*a) -> None:
    print(*a, flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--sections", default="scaling,zero,exact")
    p.add_argument("--exact-zero", type=int, default=1, choices=(0, 1),
                   help="ZeRO stage of the exact section's runs (1: the NCCL reduce-scatter path)")
    p.add_argument("--cpu", action="store_true", help="dry run on 2 gloo CPU workers, tiny model")
    p.add_argument("--no-llmc", action="store_true",
                   help="scaling without llm.c's train_gpt2.py beside each width (bench/anchor.py)")
    p.add_argument("--anchors", default=None, help="folder of llm.c's file and its runner")
    args = p.parse_args()
    llmc = not (args.cpu or args.no_llmc)
    if llmc:
        anchor.runner_path(args.anchors)  # missing: say so before any run
    sections = args.sections.split(",")
    if args.cpu:
        devices, dev, seq, name = 2, "cpu", 64, "CPU (gloo)"
        args.depth, args.batch, args.steps = 2, 4, 8
        ray.init(num_cpus=4, include_dashboard=False)
    else:
        devices, dev, seq = torch.cuda.device_count(), "gpu", 1024
        name = torch.cuda.get_device_name()
        ray.init(num_gpus=devices, include_dashboard=False)
    root = tempfile.mkdtemp(prefix="raygpt-multi-")
    common = dict(val_every=0, sample_every=0, device=dev, warmup_steps=0)

    if "scaling" in sections:
        rows = []
        say(f"\nscaling, GPT-2 d{args.depth}, B={args.batch} T={seq} per {dev}, {name}")
        say(f"{'workers':>7s} {'tok/s':>10s} {'tok/s/each':>10s} {'efficiency':>10s}")
        for n in [w for w in (1, 2, 4, 8) if w <= devices]:
            cfg = TrainConfig(model=f"d{args.depth}", batch_size=args.batch, seq_len=seq,
                              max_steps=args.steps, checkpoint_every=0, num_workers=n,
                              output_dir=f"{root}/scale{n}", **common).resolve(devices)
            run(cfg)
            dts = [dt for _, dt, _ in losses(cfg.output_dir).values()][5:]
            tps = args.batch * seq * n / statistics.median(dts)
            rows.append((n, tps, tps / n))
            line = f"{n:7d} {tps:10.0f} {tps / n:10.0f} {tps / n / rows[0][2]:10.1%}"
            if llmc:  # llm.c's trainer on the same GPUs right after (torchrun beyond one)
                r = anchor.run(anchor.command(depth=args.depth, batch=args.batch, seq=seq,
                                              steps=args.steps, gpus=n, anchors=args.anchors))
                ref = r.median_tok_per_s(5)
                line += f" | llm.c train_gpt2.py {ref:10.0f} tok/s, raygpt / llm.c {tps / ref:.3f}"
            say(line)

    if "zero" in sections and devices >= 2:
        depth = 2 if args.cpu else 48
        say(f"\nZeRO-1 memory, GPT-2 d{depth}, {devices} x {name}, B=4 T={seq} per rank, eager")
        for zero in (0, 1):
            t0 = time.time()
            peak, step_losses, n = zero_memory(zero, devices, depth, 4, seq,
                                               "gloo" if args.cpu else "nccl")
            say(f"zero_stage {zero}: {n:,} parameters | rank 0 peak tensor memory {peak:.2f} GiB"
                f" | losses {step_losses} | {time.time() - t0:.0f} s")

    if "exact" in sections and devices >= 2:
        base = dict(model="d4" if not args.cpu else "d2", batch_size=8, seq_len=256 if not args.cpu else 64,
                    max_steps=12, checkpoint_every=4, num_workers=2, deterministic=True,
                    compile=False, zero_stage=args.exact_zero, **common)
        base["total_batch_size"] = base["batch_size"] * base["seq_len"] * 2
        full = TrainConfig(output_dir=f"{root}/full", **base).resolve(devices)
        run(full)
        killed = TrainConfig(output_dir=f"{root}/killed", fault="kill:rank=1,step=6", **base).resolve(devices)
        summary = run(killed)
        a, b = losses(full.output_dir), losses(killed.output_dir)
        same = sorted(a) == sorted(b) and all(a[s][0] == b[s][0] for s in a)
        say(f"\n2 workers, ZeRO-{args.exact_zero}, rank 1 SIGKILLed at step 6: failures {summary['failures']}, recovery "
            f"{summary['recovery_s']} s, losses equal as floats at all {len(a)} steps: {same}")
        if not same:
            say("  uninterrupted:", [a[s][0] for s in sorted(a)])
            say("  killed:       ", [b[s][0] for s in sorted(b)])
        half = TrainConfig(output_dir=f"{root}/half", fault="sigterm:rank=0,step=6", **base).resolve(devices)
        run(half)
        run(TrainConfig(output_dir=f"{root}/half", **{**base, "num_workers": 1}, resume=1).resolve(devices))
        c = losses(half.output_dir)
        worst = max(abs(c[s][0] - a[s][0]) / abs(a[s][0]) for s in a)
        say(f"2 workers -> 1 resume: worlds {sorted({w for _, _, w in c.values()})}, steps "
            f"{len(c)}, largest relative loss difference vs uninterrupted {worst:.2e}")


if __name__ == "__main__":
    main()
