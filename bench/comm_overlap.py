"""The gradient reduction overlapped with the backward pass (raygpt.train.optim.OverlappedReduction):
the time per step exposed to communication, without and with the overlap. Plain processes over
NCCL (torch.multiprocessing, no Ray), the loop's step pieces (FlatParameters, AdamW, the
micro-steps, the reduction, the norm, the update), random tokens.

    NCCL_NVLS_ENABLE=0 python bench/comm_overlap.py [--depths 12,24] [-b 16] [-t 1024]
        [--grad-accum 1] [--worlds 1,2] [--transports socket,nvlink] [--modes eager,compiled,blocks]
        [--steps 12] [--bucket-mb 32] [--zero-stage 0]
    python bench/comm_overlap.py --cpu [--zero-stage 1]  # a dry run: 2 gloo processes, a tiny model

For each depth, world (GPUs, those present), transport and model mode, one process group runs
three reductions, each for --steps steps after 3 warm-up ones, and rank 0 prints the median:
  none:    no reduction at all (the control: compute alone)
  single:  one collective after the whole backward (--no-overlap-comm)
  overlap: buckets launched during the last backward (--overlap-comm)
  gather:  (--zero-stage 1 only) overlap, and the update's gather overlapped with the next
           forward, waited for block by block (AdamW.gather_during_forward; --overlap-comm)
exposed = step time - none's. Transports: socket = NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (NCCL
over TCP, standing in for a network between nodes); nvlink = NCCL's default on one host.
Model modes (raygpt.train.loop.compile_model's): eager (--no-compile), compiled (the whole model, the
GPU default: backward is one graph, the hooks fire at its end and nothing overlaps), blocks
(--compile-scope blocks: a backward node per block, the hooks fire as each finishes). world=1
is the no-regression check of the machinery (hooks, staging copies and 1-rank collectives
against none). Deterministic kernels (raygpt.train.determinism), so "same" says whether single and
overlap gave equal losses as floats.
The table comes last.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on these machines

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raygpt.model.gpt import GPT, GPTConfig, kernels_for
from raygpt.train.determinism import run_switches
from raygpt.train.loop import compile_model
from raygpt.train.optim import AdamW, FlatParameters, OverlappedReduction

REDUCTIONS = ("none", "single", "overlap", "gather")
SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
TINY = GPTConfig(block_size=64, vocab_size=512, padded_vocab_size=512, n_layer=4, n_head=2,
                 n_embd=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(depth: int, mode: str, dev: torch.device, world: int, rank: int, bucket_bytes: int,
          zero_stage: int):
    """The model in `mode`, its flat buffers and AdamW with an overlapped reduction built (also
    on one rank, where AdamW would not build it: the bench measures its cost there; "single"
    on one rank reduces nothing, as the loop does)."""
    on_gpu = dev.type == "cuda"
    config = GPTConfig.from_depth(depth) if depth else TINY
    model = GPT(config, init_seed=1337).use_kernels(**kernels_for(True, dev.type)).to(dev)
    flat = FlatParameters(model, dev, torch.bfloat16 if on_gpu else torch.float32,
                          pad_multiple=world)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, rank=rank, world=world,
                zero_stage=zero_stage)
    opt.overlap = OverlappedReduction(flat, rank=rank, world=world, zero_stage=zero_stage,
                                      sharded_collectives=on_gpu, bucket_bytes=bucket_bytes)
    forward = model if mode == "eager" else compile_model(
        model, "default", "model" if mode == "compiled" else "blocks")  # the loop's compiles
    return model, forward, flat, opt


def step(forward, flat, opt, reduction: str, batches, tokens: int) -> torch.Tensor:
    """One training step as raygpt.train.loop takes it; returns the agreed loss (on the device)."""
    flat.zero_grad()
    loss_acc = torch.zeros((), device=flat.grads.device)
    for micro, (x, y) in enumerate(batches):
        loss_sum, _ = forward(x, y)
        if reduction in ("overlap", "gather") and micro == len(batches) - 1:
            opt.reduce_during_backward()
        (loss_sum / tokens).backward()
        loss_acc += loss_sum.detach()
    if reduction != "none":
        opt.reduce_gradients()
    agree = torch.stack([loss_acc, opt.grad_norm_squared()])
    dist.all_reduce(agree)  # the loop's one agreement collective
    opt.step(lr=1e-4, grad_scale=1.0, t=1, seed=0)
    return agree[0] / tokens


def worker(rank, world, port, depth, mode, batch, seq, grad_accum, steps, bucket_bytes, zero_stage,
           results):
    torch.set_num_threads(1 if not torch.cuda.is_available() else 4)
    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, **({"device_id": dev} if on_gpu else {}))
    with run_switches(True):
        model, forward, flat, opt = build(depth, mode, dev, world, rank, bucket_bytes, zero_stage)
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randint(0, vocab, (batch, seq), generator=g).to(dev),
                    torch.randint(0, vocab, (batch, seq), generator=g).to(dev))
                   for _ in range(grad_accum)]
        tokens = batch * seq * grad_accum * world
        start = flat.params.clone()
        row = {}
        for reduction in REDUCTIONS[:4 if zero_stage == 1 else 3]:
            # every reduction from the same weights and optimizer state: comparable losses
            flat.params.copy_(start)
            opt.m.zero_(), opt.v.zero_(), opt.take_master_from_params()
            if reduction == "gather":
                opt.gather_during_forward(model, per_block=mode != "compiled")
            times, losses = [], []
            for i in range(3 + steps):
                t0 = time.perf_counter()
                loss = step(forward, flat, opt, reduction, batches, tokens)
                losses.append(loss.item())  # the loop's one host sync a step
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            row[reduction] = (statistics.median(times), losses)
        if opt.gather is not None:
            opt.gather.remove()
    if rank == 0:
        results.put(row)
    dist.barrier()
    dist.destroy_process_group()


def measure(world, transport, depth, mode, args) -> dict:
    env = dict(os.environ)
    os.environ.update(SOCKET_ENV if transport == "socket" else {})
    if transport != "socket":
        for k in SOCKET_ENV:
            os.environ.pop(k, None)
    try:
        ctx = mp.get_context("spawn")
        results, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, depth, mode, args.batch,
                                                  args.seq, args.grad_accum, args.steps,
                                                  int(args.bucket_mb * 2**20), args.zero_stage,
                                                  results))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"d{depth} world={world} {transport} {mode}: a rank failed "
                             f"(exit codes {[p.exitcode for p in procs]})")
        return results.get(timeout=10)
    finally:
        os.environ.clear()
        os.environ.update(env)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="12,24")
    p.add_argument("-b", "--batch", type=int, default=16)
    p.add_argument("-t", "--seq", type=int, default=1024)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--worlds", default="1,2", help="GPUs per run (those beyond the GPUs present "
                                                    "are left out)")
    p.add_argument("--transports", default="socket,nvlink")
    p.add_argument("--modes", default="eager,compiled,blocks")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--bucket-mb", type=float, default=32)
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1),
                   help="1: each rank sums only its shard (reduce-scatter / reduces on NCCL)")
    p.add_argument("--cpu", action="store_true", help="a dry run: 2 gloo processes, tiny model")
    args = p.parse_args()
    if args.cpu:
        depths, worlds, transports, modes = [0], [2], ["gloo"], ["eager"]
        args.batch, args.seq, args.steps, args.bucket_mb = 2, 64, 3, 0.05
    else:
        if not torch.cuda.is_available():
            raise SystemExit("comm_overlap: no GPU (--cpu runs the dry run)")
        gpus = torch.cuda.device_count()
        depths = [int(d) for d in args.depths.split(",")]
        worlds = [w for w in map(int, args.worlds.split(",")) if w <= gpus]
        transports, modes = args.transports.split(","), args.modes.split(",")
    rows = []
    for depth in depths:
        for world in worlds:
            for transport in (transports if world > 1 else transports[-1:]):
                for mode in modes:
                    r = measure(world, transport, depth, mode, args)
                    rows.append((depth, world, transport, mode, r))
                    print(f"d{depth} world={world} {transport} {mode}: "
                          + ", ".join(f"{k} {v[0] * 1e3:.1f} ms" for k, v in r.items()),
                          flush=True)
    print(f"\nB={args.batch} T={args.seq} grad_accum={args.grad_accum} zero={args.zero_stage} "
          f"bucket={args.bucket_mb} MB; ms per step (median of {args.steps}), exposed = step - none")
    gather = args.zero_stage == 1
    print(f"{'model':>6} {'world':>5} {'transport':>9} {'mode':>8} {'none':>8} {'single':>8} "
          f"{'overlap':>8} {'exp.single':>10} {'exp.overlap':>11}"
          + (f" {'gather':>8} {'exp.gather':>10}" if gather else "") + f" {'same':>5}")
    for depth, world, transport, mode, r in rows:
        none, single, overlap = (r[k][0] * 1e3 for k in REDUCTIONS[:3])
        same = all(r[k][1] == r["single"][1] for k in REDUCTIONS[2:] if k in r)
        print(f"{'d' + str(depth) if depth else 'tiny':>6} {world:>5} {transport:>9} {mode:>8} "
              f"{none:8.1f} {single:8.1f} {overlap:8.1f} {single - none:10.1f} "
              f"{overlap - none:11.1f}"
              + (f" {r['gather'][0] * 1e3:8.1f} {(r['gather'][0] - r['none'][0]) * 1e3:10.1f}"
                 if gather else "") + f" {str(same):>5}")


if __name__ == "__main__":
    main()
