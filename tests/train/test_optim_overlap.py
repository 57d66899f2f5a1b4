"""The gradient reduction overlapped with the backward pass (raygpt.train.optim.OverlappedReduction):
its bucket plan, and 2 real gloo processes training a tiny GPT with grad accumulation, whose
losses, reduced gradients and weights equal the single collective's bit for bit. Then ZeRO-1's
gather overlapped with the next forward (raygpt.train.optim.OverlappedGather): eager and compiled,
equal to the blocking all-gather, each forward unit waiting for its own weights, and a
checkpoint's capture seeing them whole."""

import functools
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raygpt.model.gpt import GPT, GPTConfig, kernels_for
from raygpt.train.determinism import run_switches
import raygpt.train.optim
from raygpt.train.optim import (AdamW, FlatParameters, OverlappedReduction, bucket_plan,
                          forward_units, shard_pieces, zero1_collective)

# head size 16: raygpt's attention kernel (the deterministic one on CUDA) takes it
TINY = GPTConfig(block_size=16, vocab_size=60, padded_vocab_size=64, n_layer=3, n_head=2,
                 n_embd=32)
STEPS, GRAD_ACCUM, B, T = 3, 2, 2, 8


def test_buckets_run_from_the_last_layer_to_the_first_and_the_embeddings_last():
    layers = [None, None, 0, 1, 2, 0, 1, 2, None]  # wte, wpe, two tensors per layer, ln_f
    sizes = [10] * 9
    # a layer is 40 bytes: 2 layers fill an 80-byte bucket; layer 0 alone; then wte, wpe, ln_f
    assert bucket_plan(layers, sizes, element_size=2, bucket_bytes=80) == [
        [4, 7, 3, 6], [2, 5], [0, 1, 8]]
    assert bucket_plan(layers, sizes, element_size=2, bucket_bytes=10**9) == [
        [4, 7, 3, 6, 2, 5], [0, 1, 8]]


def test_a_bucket_is_cut_at_the_shard_boundaries():
    assert shard_pieces([(0, 3), (5, 10)], shard=8, world=2) == [[(0, 3), (5, 3)], [(8, 7)]]
    assert shard_pieces([(9, 2)], shard=8, world=2) == [[], [(9, 2)]]


def test_zero1_sums_a_bucket_with_the_collective_that_moves_fewer_bytes():
    assert zero1_collective([[(0, 5)], [(5, 5)]]) == "reduce_scatter"  # half the bytes
    assert zero1_collective([[(0, 10)], []]) == "reduce_scatter"  # as many as a reduce: one call
    # 8 ranks, the bucket in two shards: the padded reduce-scatter moves 7 * 5, the reduces 10
    assert zero1_collective([[(0, 5)], [(5, 5)]] + [[]] * 6) == "reduce"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (ZeRO stage, reduction): the single collective after backward, or overlapped buckets, which
# under ZeRO-1 are all-reduced (gloo) or summed by NCCL's choice of reduce-scatter ("sharded",
# which gloo has too) or reduces to each part's owner (forced: 2 ranks never choose them)
VARIANTS = [(0, "single"), (0, "overlap"), (1, "single"), (1, "overlap"), (1, "overlap-sharded"),
            (1, "overlap-reduce")]


def _train(rank: int, world: int, port: int, out: str) -> None:
    """One of `world` ranks (gloo on the CPU, NCCL on GPU `rank` with bf16 weights and the
    deterministic kernels): each variant trains a fresh model STEPS steps of GRAD_ACCUM
    micro-steps, llm.c's step as raygpt.train.loop takes it (the window's last backward armed, the
    reduction waited, the norm of the shards, the update); saves the step losses, the reduced
    gradients and the final weights of each."""
    torch.set_num_threads(1)
    cuda = out.endswith("cuda.pt")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    with run_switches(cuda):
        results = {variant: _train_variant(rank, world, device, *variant) for variant in VARIANTS}
    torch.save(results, out)
    dist.destroy_process_group()


def _train_variant(rank: int, world: int, device: torch.device, zero_stage: int,
                   reduction: str) -> dict:
    cuda = device.type == "cuda"
    # the embedding as nn.Embedding on every device: the in-flight probe below hooks its
    # output (raygpt's embedding kernel, a GPU run's deterministic default, bypasses the module)
    model = GPT(TINY, init_seed=5).use_kernels(
        **kernels_for(cuda, device.type, embedding_impl="torch")).to(device)
    flat = FlatParameters(model, device, torch.bfloat16 if cuda else torch.float32,
                          pad_multiple=world)
    # 64-byte buckets: one per layer here, and the embeddings' bucket
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, rank=rank, world=world,
                zero_stage=zero_stage, overlap=reduction != "single", bucket_bytes=64)
    sharded = reduction in ("overlap-sharded", "overlap-reduce")
    if sharded or (world == 1 and reduction != "single"):
        # NCCL's collectives, which gloo has too; on one GPU AdamW builds none: the machinery
        # (hooks, staging, 1-rank collectives) must still leave the gradients exact
        if opt.overlap is not None:
            opt.overlap.remove()
        choose = raygpt.train.optim.zero1_collective
        if reduction == "overlap-reduce":
            raygpt.train.optim.zero1_collective = lambda parts: "reduce"
        opt.overlap = OverlappedReduction(flat, rank=rank, world=world, zero_stage=zero_stage,
                                          sharded_collectives=sharded, bucket_bytes=64)
        raygpt.train.optim.zero1_collective = choose
    # when the gradient reaches the embeddings' output every block's backward is done, and
    # the embedding's own is not: the layers' buckets must be in flight then
    in_flight = []

    def count_in_flight(grad):
        if opt.overlap is not None and opt.overlap.armed:
            in_flight.append(len(opt.overlap._works))

    model.transformer.wte.register_forward_hook(
        lambda m, i, o: o.register_hook(count_in_flight) and None)
    g = torch.Generator().manual_seed(rank)
    tokens = world * GRAD_ACCUM * B * T
    losses, grads = [], []
    for step in range(STEPS):
        flat.zero_grad()
        loss_acc = torch.zeros((), device=device)
        for micro in range(GRAD_ACCUM):
            x = torch.randint(0, TINY.vocab_size, (B, T), generator=g).to(device)
            loss_sum, _ = model(x, torch.roll(x, -1, 1))
            if micro == GRAD_ACCUM - 1:
                opt.reduce_during_backward()
            (loss_sum / tokens).backward()
            loss_acc += loss_sum.detach()
        opt.reduce_gradients()
        norm_sq = opt.grad_norm_squared()
        agreed = torch.stack([loss_acc, norm_sq if zero_stage or rank == 0 else norm_sq * 0])
        dist.all_reduce(agreed)
        losses.append(agreed[0].item() / tokens)
        grads.append(opt.shard_grads.cpu())
        norm = agreed[1].sqrt().item()
        opt.step(lr=1e-2, grad_scale=min(1.0, 1.0 / norm), t=step + 1, seed=step)
    buckets = opt.overlap.buckets if opt.overlap is not None else []
    return {"losses": losses, "grads": grads, "params": flat.params.cpu(),
            "in_flight": in_flight, "buckets": len(buckets),
            "collectives": sorted({b.collective for b in buckets})}


def spawn_ranks(target, out_dir, world: int, name: str, device: str,
                timeout: float = 300) -> list[dict]:
    """target(rank, world, port, out) in one spawned process per rank (out ends with the
    device's name, which the rank reads); each rank's results."""
    outs = [str(out_dir / f"{name}{r}_{device}.pt") for r in range(world)]
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, port, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return [torch.load(o) for o in outs]


def run_ranks(out_dir, world: int, device: str) -> list[dict]:
    """Every variant's results on each of `world` ranks (one process per rank for them all)."""
    return spawn_ranks(_train, out_dir, world, "rank", device)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(tmp_path_factory.mktemp("overlap"), 2, "cpu")


@pytest.mark.parametrize("zero_stage, reduction", [v for v in VARIANTS if v[1] != "single"])
def test_overlapped_reduction_equals_the_single_collective_bit_for_bit(two_ranks, zero_stage,
                                                                        reduction):
    for rank in (0, 1):
        a, b = two_ranks[rank][zero_stage, "single"], two_ranks[rank][zero_stage, reduction]
        assert b["buckets"] == TINY.n_layer + 1
        assert b["collectives"] == {"overlap": ["all_reduce"],
                                    "overlap-sharded": ["reduce_scatter"],
                                    "overlap-reduce": ["reduce"]}[reduction]
        assert a["losses"] == b["losses"]  # as Python floats, step by step
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
        assert torch.equal(a["params"], b["params"])
        # launched during backward: every layer's bucket before the embedding's backward ran
        assert a["in_flight"] == [] and b["in_flight"] == [TINY.n_layer] * STEPS
    single = two_ranks[0][zero_stage, "single"]["losses"]
    assert single == two_ranks[1][zero_stage, "single"]["losses"]
    assert len(set(single)) == STEPS  # it trains: the losses move


@pytest.mark.gpu
def test_on_gpus_the_overlapped_reduction_equals_the_single_collective(tmp_path):
    """The same on NCCL, bf16 (two GPUs where there are, else the machinery on one: hooks,
    staging copies and waits on NCCL's stream, a 1-rank collective), deterministic kernels."""
    world = min(2, torch.cuda.device_count())
    results = run_ranks(tmp_path, world, "cuda")
    for rank in range(world):
        for zero_stage, reduction in VARIANTS:
            a, b = results[rank][zero_stage, "single"], results[rank][zero_stage, reduction]
            assert a["losses"] == b["losses"], (zero_stage, reduction)
            assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
            assert torch.equal(a["params"], b["params"])
            if reduction != "single":
                assert b["in_flight"] == [TINY.n_layer] * STEPS


# ---------------------------------------------------------------------- the overlapped gather

def test_forward_units_are_the_embeddings_each_block_and_ln_f_in_forward_order():
    # llm.c's order: wte, wpe, then each kind stacked over the 2 layers, then ln_f
    slices = [("wte", None), ("wpe", None), ("ln1w", 0), ("ln1w", 1), ("qkvw", 0), ("qkvw", 1),
              ("lnfw", None), ("lnfb", None)]
    assert forward_units(slices, n_layer=2) == [[0, 1], [2, 4], [3, 5], [6, 7]]


class Deferred:
    """A broadcast that happens only when waited for: a read that does not wait for its
    unit then sees the weights of the step before, whatever the timing."""

    def __init__(self, broadcast, tensor, src):
        self.run = lambda: broadcast(tensor, src=src)

    def wait(self):
        self.run()
        self.run = lambda: None


# the model's modes (raygpt.train.loop.compile_model's scopes, or none) x the gathers: ZeRO-1's
# blocking all-gather, the overlapped one, and the overlapped one with its broadcasts deferred
GATHER_MODES = ("eager", "blocks", "model")
GATHERS = ("all_gather", "overlap", "deferred")


def _gather_ranks(rank: int, world: int, port: int, out: str) -> None:
    """One of `world` ranks: gloo on the CPU, or NCCL on GPU `rank` with bf16 weights, the
    deterministic kernels and inductor."""
    torch.set_num_threads(1)
    cuda = out.endswith("cuda.pt")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    if not cuda:  # Dynamo (what meets the hooks) with the eager backend: the loop's compiles
        # in seconds, not inductor's tens of seconds (this process only)
        torch.compile = functools.partial(torch.compile, backend="aot_eager")
    with run_switches(cuda):
        results = {(mode, gather): _train_gather(rank, device, mode, gather)
                   for mode in GATHER_MODES for gather in GATHERS}
    torch.save(results, out)
    dist.destroy_process_group()


def _train_gather(rank: int, device: torch.device, mode: str, gather: str) -> dict:
    """STEPS steps under ZeRO-1 with the overlapped reduction, as raygpt.train.loop takes them, with
    a validation-like forward before each; then the checkpoint's capture right after the last
    update. Returns the losses, what each unit's start saw in flight, the final weights and
    the captured ones."""
    from raygpt.checkpointing.runtime import Checkpointer
    from raygpt.checkpointing.snapshot import StateSnapshot
    from raygpt.train.loop import compile_model

    world, cuda = dist.get_world_size(), device.type == "cuda"
    model = GPT(TINY, init_seed=5).use_kernels(**kernels_for(cuda, device.type)).to(device)
    flat = FlatParameters(model, device, torch.bfloat16 if cuda else torch.float32,
                          pad_multiple=world)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, rank=rank, world=world,
                zero_stage=1, overlap=True, bucket_bytes=64)
    per_block = mode != "model"
    if gather != "all_gather":
        opt.gather_during_forward(model, per_block=per_block)
    seen = []  # (unit, the units in flight as it starts), after the gather's own hook

    def probe(unit):
        @torch.compiler.disable
        def hook(module, args):
            seen.append((unit, opt.gather.in_flight if opt.gather is not None else []))
        return hook

    model.register_forward_pre_hook(probe("model"))
    if per_block:  # hooks inside the whole-model graph would be traced
        for i, block in enumerate(model.transformer.h):
            block.register_forward_pre_hook(probe(i))
        model.transformer.ln_f.register_forward_pre_hook(probe("ln_f"))
    forward = model if mode == "eager" else compile_model(model, "default", mode)
    broadcast = dist.broadcast
    if gather == "deferred":
        dist.broadcast = lambda tensor, src, async_op=False: Deferred(broadcast, tensor, src)
    try:
        g = torch.Generator().manual_seed(rank)
        tokens = world * GRAD_ACCUM * B * T
        losses, val_losses = [], []
        for step in range(STEPS):
            with torch.no_grad():  # validation at the top of the loop: the gather in flight
                x = torch.randint(0, TINY.vocab_size, (B, T), generator=g).to(device)
                val_losses.append(forward(x, torch.roll(x, -1, 1))[0].item())
            flat.zero_grad()
            loss_acc = torch.zeros((), device=device)
            for micro in range(GRAD_ACCUM):
                x = torch.randint(0, TINY.vocab_size, (B, T), generator=g).to(device)
                loss_sum, _ = forward(x, torch.roll(x, -1, 1))
                if micro == GRAD_ACCUM - 1:
                    opt.reduce_during_backward()
                (loss_sum / tokens).backward()
                loss_acc += loss_sum.detach()
            opt.reduce_gradients()
            agreed = torch.stack([loss_acc, opt.grad_norm_squared()])
            dist.all_reduce(agreed)
            losses.append(agreed[0].item() / tokens)
            opt.step(lr=1e-2, grad_scale=min(1.0, 1.0 / agreed[1].sqrt().item()), t=step + 1,
                     seed=step)
        # a checkpoint right after the update, its gather still in flight: the checkpointer's
        # capture (rank 0 holds the working weights) must see them whole
        ckpt = object.__new__(Checkpointer)
        ckpt.opt, ckpt.flat, ckpt.rank, ckpt._snapshot = opt, flat, 0, StateSnapshot()
        in_flight_at_capture = opt.gather.in_flight if opt.gather is not None else []
        state = type("State", (), dict(step=STEPS, rng_state=1, rng_state_last_update=1,
                                       extras=lambda self: {}))()
        ckpt._host_snapshot(state, type("Loader", (), {"state_dict": lambda self: {}})())
        captured = ckpt._snapshot.to_host()["params"].clone()
        ckpt._snapshot.close()
        opt.params_ready()
    finally:
        dist.broadcast = broadcast
    return {"losses": losses, "val_losses": val_losses, "seen": seen,
            "in_flight_at_capture": in_flight_at_capture, "params": flat.params.cpu(),
            "captured": captured}


def gather_ranks(out_dir, world: int, device: str) -> list[dict]:
    """Every mode and gather's results on each of `world` ranks."""
    return spawn_ranks(_gather_ranks, out_dir, world, "gather", device, timeout=600)


@pytest.fixture(scope="module")
def gathered(tmp_path_factory) -> list[dict]:
    return gather_ranks(tmp_path_factory.mktemp("gather"), 2, "cpu")


def check_gather(results: list[dict], mode: str, gather: str) -> None:
    """The losses (training and validation) as floats at every step and the weights bit for
    bit; with the broadcasts deferred to their waits, equal only if every forward unit, the
    next update and the checkpoint's capture waited for their pieces."""
    n = TINY.n_layer
    per_forward = n + 2 if mode != "model" else 1  # the probes: model, blocks, ln_f
    # after an update (the validation forward of steps 1 and 2): each unit found its own
    # pieces waited for and the later units' still in flight; in the other forwards (the first
    # step's, the micro-steps after a validation forward) nothing was in flight
    after_update = {s * (1 + GRAD_ACCUM) for s in range(1, STEPS)}
    for rank, result in enumerate(results):
        a, b = result[mode, "all_gather"], result[mode, gather]
        assert a["losses"] == b["losses"] and a["val_losses"] == b["val_losses"], rank
        assert torch.equal(a["params"], b["params"])
        assert torch.equal(b["captured"], b["params"][:b["captured"].numel()])
        assert b["in_flight_at_capture"] == list(range(n + 2))  # captured mid-gather
        forwards = [b["seen"][i:i + per_forward] for i in range(0, len(b["seen"]), per_forward)]
        assert len(forwards) == STEPS * (1 + GRAD_ACCUM)
        for k, seen in enumerate(forwards):
            if mode == "model":  # the whole-model graph: everything waited for first
                assert seen == [("model", [])]
            elif k in after_update:
                assert seen == ([("model", list(range(1, n + 2)))]
                                + [(i, list(range(i + 2, n + 2))) for i in range(n)]
                                + [("ln_f", [])])
            else:
                assert all(flight == [] for _, flight in seen)
    assert len(set(results[0][mode, "all_gather"]["losses"])) == STEPS  # it trains


@pytest.mark.parametrize("mode", GATHER_MODES)
@pytest.mark.parametrize("gather", ["overlap", "deferred"])
def test_the_overlapped_gather_equals_the_all_gather_bit_for_bit(gathered, mode, gather):
    """2 gloo ranks, eager, compiled blocks, compiled model: see check_gather."""
    check_gather(gathered, mode, gather)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_on_two_gpus_the_overlapped_gather_equals_the_all_gather(tmp_path):
    """The same on NCCL (the hooks' waits are the stream's), bf16, deterministic kernels,
    inductor's compiles."""
    results = gather_ranks(tmp_path, 2, "cuda")
    for mode in GATHER_MODES:
        for gather in ("overlap", "deferred"):
            check_gather(results, mode, gather)
