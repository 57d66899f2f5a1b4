"""Flat parameter, gradient and optimizer buffers in llm.c's tensor order, and AdamW over them.

Every model parameter is re-pointed at a slice of one contiguous working buffer (fp32 on CPU,
bf16 on GPU) laid out as llm.c's `params_memory`; every gradient at a slice of one flat gradient
buffer of the same layout. The fp32 master weights and AdamW's m and v are flat fp32 buffers of
the same layout again, so:

- the state file's m, v and master arrays are in llm.c's order (llm.c can read them);
- the global grad norm and the AdamW step are one kernel launch each over one buffer;
- data parallelism is one collective on one buffer, and ZeRO-1 shards are plain slices [lo, hi).

Gradient accumulation relies on autograd accumulating *in place* into an existing `.grad`
(AccumulateGrad does when grad mode is off, as it is during backward), so `.grad` must never be
set to None: `zero_grad()` zeroes the flat buffer.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from raygpt import ops
from raygpt.model.gpt import LLMC_DECAY, llmc_parameter_layout

MASK64 = (1 << 64) - 1
# llm.c's tensors that are not stacked per layer (the rest have one slice per layer)
WHOLE_MODEL_TENSORS = frozenset({"wte", "wpe", "lnfw", "lnfb"})
# Bytes of gradients per bucket of the overlapped reduction: a collective this size runs near
# the link's bandwidth, and the first launches after a layer or two of backward (DDP's default
# is 25 MB; one GPT-2 d12 layer is 14 MB in bf16, 28 MB in fp32).
BUCKET_BYTES = 32 * 2**20


def random_u32(state: int) -> tuple[int, int]:
    """llm.c's xorshift* generator: returns (value, new_state) for a 64-bit state."""
    state ^= state >> 12
    state ^= (state << 25) & MASK64
    state ^= state >> 27
    return ((state * 0x2545F4914F6CDD1D) & MASK64) >> 32, state


def _alias(buffer: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    """`shape` over `buffer`'s memory from element `offset`: the memory of
    buffer[offset:offset + n].view(shape), but not an autograd view of the buffer. torch.compile
    makes each view among a graph's inputs (a parameter's .grad among them) a fake tensor by
    replaying the view from its base, at every start and restart, several times slower than
    for an alias (docs/faults.md; bench/restart_parts.py)."""
    return torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), buffer.storage_offset() + offset, shape)


class FlatParameters:
    """The model's parameters and gradients as aliases of two flat buffers in llm.c order:
    the optimizer, the gradient all-reduce and checkpoints work on the buffers, the model on
    its tensors, one memory."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 pad_multiple: int = 1):
        layout = llmc_parameter_layout(model)
        self.names = [name for name, _ in layout]
        self.tensor_sizes = [sum(p.numel() for p in params) for _, params in layout]
        self.decay = [name in LLMC_DECAY for name in self.names]
        self.num_parameters = sum(self.tensor_sizes)
        # ZeRO-1 collectives want equal shards: the buffers get a zero tail up to a multiple of
        # the world size, which belongs to no parameter and is never updated.
        self.padded_size = -(-self.num_parameters // pad_multiple) * pad_multiple
        self.params = torch.zeros(self.padded_size, dtype=dtype, device=device)
        self.grads = torch.zeros(self.padded_size, dtype=dtype, device=device)
        # (parameter, its llm.c tensor's name, its layer or None, its slice [offset, offset + n))
        self.slices: list[tuple[torch.nn.Parameter, str, int | None, int, int]] = []
        offset = 0
        for name, params in layout:
            for i, p in enumerate(params):
                n = p.numel()
                self.params[offset:offset + n].copy_(p.data.reshape(-1))
                p.data = _alias(self.params, offset, p.shape)
                p.grad = _alias(self.grads, offset, p.shape)
                self.slices.append((p, name, None if name in WHOLE_MODEL_TENSORS else i, offset, n))
                offset += n
        assert offset == self.num_parameters
        self._model = model

    def zero_grad(self) -> None:
        self.grads.zero_()


def shard_range(num_parameters: int, rank: int, world: int, zero_stage: int) -> tuple[int, int]:
    """The slice [lo, hi) of the flat buffers whose optimizer state this rank owns.
    Without ZeRO every rank owns everything; with ZeRO-1 rank r owns the r-th of `world` equal
    pieces of the padded buffer, clipped to the real parameters (llm.c's
    multi_gpu_get_shard_offset, with padding instead of requiring divisibility)."""
    if zero_stage == 0 or world == 1:
        return 0, num_parameters
    shard = -(-num_parameters // world)
    return min(rank * shard, num_parameters), min((rank + 1) * shard, num_parameters)


class AdamW:
    """AdamW on the flat buffers (llm.c's form: decoupled weight decay on 2-D tensors), with
    fp32 master weights when the working weights are bf16. The update itself is `ops.adamw_update`
    (Triton on CUDA, the PyTorch reference elsewhere); gradients are never modified: clipping is
    the scalar `grad_scale` passed in."""

    def __init__(self, flat: FlatParameters, *, beta1: float, beta2: float, eps: float,
                 weight_decay: float, rank: int = 0, world: int = 1, zero_stage: int = 0,
                 overlap: bool = False, bucket_bytes: int = BUCKET_BYTES):
        self.flat = flat
        self.rank, self.world, self.zero_stage = rank, world, zero_stage
        lo, hi = shard_range(flat.num_parameters, rank, world, zero_stage)
        self.lo, self.hi = lo, hi
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        n = self.hi - self.lo
        device = flat.params.device
        self.m = torch.zeros(n, dtype=torch.float32, device=device)
        self.v = torch.zeros(n, dtype=torch.float32, device=device)
        self.use_master_weights = flat.params.dtype != torch.float32
        self.master = (flat.params[self.lo:self.hi].float().clone() if self.use_master_weights
                       else None)
        self.segments = ops.Segments.build(flat.tensor_sizes, flat.decay, self.lo, self.hi,
                                           device=device)
        # called before anything here writes m, v, the master or the working weights: a
        # checkpoint's copy of them may still be reading them (the checkpointer sets it to
        # raygpt.checkpointing.snapshot's before_write, a wait on the device)
        self.before_write: Callable[[], None] = lambda: None
        self.overlap = (OverlappedReduction(flat, rank=rank, world=world, zero_stage=zero_stage,
                                            sharded_collectives=dist.get_backend() == "nccl",
                                            bucket_bytes=bucket_bytes)
                        if overlap and world > 1 else None)
        # ZeRO-1's gather overlapped with the next forward (gather_during_forward), or None:
        # the blocking all-gather
        self.gather: OverlappedGather | None = None

    @property
    def shard_params(self) -> torch.Tensor:
        return self.flat.params[self.lo:self.hi]

    @property
    def shard_grads(self) -> torch.Tensor:
        return self.flat.grads[self.lo:self.hi]

    def gather_during_forward(self, model: torch.nn.Module, *, per_block: bool) -> None:
        """With the overlapped reduction under ZeRO-1, each update's gather runs beside the next
        forward (OverlappedGather) instead of blocking at the end of `step`: per_block, each
        block waits for its own weights (forward pre-hooks); otherwise (a whole-model compile,
        which would trace per-block hooks) the model's forward waits for all of them first."""
        if self.overlap is not None and self.zero_stage == 1 and self.gather is None:
            self.gather = OverlappedGather(self.flat, world=self.world)
            self.gather.attach(model, per_block=per_block)

    def params_ready(self) -> None:
        """Wait for every piece of the working weights still being gathered (nothing to do
        without the overlapped gather). Whatever reads or writes them outside the training
        forward calls this first: a checkpoint, a restore, the next update, the watch metrics."""
        if self.gather is not None:
            self.gather.wait_all()

    def step(self, *, lr: float, grad_scale: float, t: int, seed: int) -> None:
        self.params_ready()  # the last gather still reads this shard and writes the others
        self.before_write()
        ops.adamw_update(self.shard_params, self.shard_grads, self.m, self.v, self.master,
                         self.segments, lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                         weight_decay=self.weight_decay, grad_scale=grad_scale, step=t, seed=seed)
        self.gather_params()

    def take_master_from_params(self) -> None:
        """Master weights copied from the working weights, as the constructor does: for working
        weights set after the optimizer was built (a model initialised once no checkpoint was
        found to load)."""
        if self.master is not None:
            self.params_ready()
            self.before_write()
            self.master.copy_(self.shard_params)

    def rederive_working_weights(self, seed: int) -> None:
        """Write the working weights from the master weights with the stochastic-rounding seed of
        the last update (llm.c's `init_from_master_only`): reproduces them bit for bit."""
        if self.master is not None:
            self.params_ready()
            self.before_write()
            ops.copy_master_to_params(self.shard_params, self.master, self.segments, seed)
            self.gather_params()
            self.params_ready()  # a restore or a rewind: rare, so gathered before it returns

    # ------------------------------------------------------------------ data parallelism
    def grad_norm_squared(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient shard, as an fp32 0-dim tensor on device."""
        return ops.global_norm_squared(self.shard_grads)

    def reduce_during_backward(self) -> None:
        """With overlap, the next backward pass (a window's last) launches the reduction bucket
        by bucket as its gradients land (OverlappedReduction); without, nothing."""
        if self.overlap is not None:
            self.overlap.arm()

    def reduce_gradients(self) -> None:
        """Sum the gradients over ranks: all of them (DDP), or this rank's shard (ZeRO-1, through
        reduce-scatter where the backend has it; gloo all-reduces and each rank reads its slice).
        After a backward pass that reduced during itself, wait for its collectives instead.
        Every piece of the last update's gather is waited for too (the forward's hooks did:
        this holds whatever a forward did not reach)."""
        self.params_ready()
        if self.overlap is not None and self.overlap.armed:
            self.overlap.wait()
            return
        if self.world == 1:
            return
        grads = self.flat.grads
        if self.zero_stage == 1 and dist.get_backend() == "nccl":
            shard = grads.numel() // self.world
            out = grads[self.rank * shard:(self.rank + 1) * shard]
            dist.reduce_scatter_tensor(out, grads, op=dist.ReduceOp.SUM)
        else:
            dist.all_reduce(grads, op=dist.ReduceOp.SUM)

    def gather_params(self) -> None:
        """ZeRO-1: every rank updated its shard of the working weights; gather them all (with
        the overlapped gather, launched: the next forward or `params_ready` waits)."""
        if self.world == 1 or self.zero_stage == 0:
            return
        self.params_ready()
        self.before_write()
        if self.gather is not None:
            self.gather.launch()
            return
        params = self.flat.params
        shard = params.numel() // self.world
        mine = params[self.rank * shard:(self.rank + 1) * shard].clone()
        dist.all_gather_into_tensor(params, mine)


# ---------------------------------------------------------------------- overlapped reduction


def bucket_plan(layers: list[int | None], sizes: list[int], element_size: int,
                bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """The buckets of the overlapped reduction as indices into FlatParameters.slices (each
    slice's layer, None for wte / wpe / ln_f, and its size), in the order backward completes
    them: the layers from the last to the first, consecutive layers together until a bucket
    holds bucket_bytes; then one bucket of the whole-model tensors, last because wte (also the
    tied lm_head, whose gradient comes first) is complete only after the embedding's backward,
    backward's last node."""
    by_layer: dict[int, list[int]] = {}
    rest = []
    for i, layer in enumerate(layers):
        (rest if layer is None else by_layer.setdefault(layer, [])).append(i)
    buckets, current, current_bytes = [], [], 0
    for layer in sorted(by_layer, reverse=True):
        current += by_layer[layer]
        current_bytes += sum(sizes[i] for i in by_layer[layer]) * element_size
        if current_bytes >= bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
    return [b for b in buckets + [current, rest] if b]


def shard_pieces(spans: list[tuple[int, int]], shard: int, world: int) -> list[list[tuple[int, int]]]:
    """Spans (offset, n) of the flat buffer cut at ZeRO-1's shard boundaries (multiples of
    `shard`): for each rank, the pieces of them it owns, in order."""
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for offset, n in spans:
        end = offset + n
        while offset < end:
            r = offset // shard
            cut = min(end, (r + 1) * shard)
            pieces[r].append((offset, cut - offset))
            offset = cut
    return pieces


def zero1_collective(parts: list[list[tuple[int, int]]]) -> str:
    """How a ZeRO-1 bucket is summed where NCCL's collectives are at hand, given each rank's
    part of it: the one that moves fewer elements per rank. For a bucket of b elements whose
    largest part has m: "reduce_scatter" (collectives want equal parts, so each is padded to m)
    moves (world - 1) m, "reduce" (one reduce of each part to its owner, one after the other
    on NCCL's stream) about b (an all-reduce, 2 (world - 1) b / world, is never fewer). llm.c's
    layout puts a layer's 12 slices in one or two ranks' shards: on 2 ranks the reduce-scatter
    wins, on more the reduces."""
    shares = [sum(n for _, n in p) for p in parts]
    return "reduce_scatter" if (len(parts) - 1) * max(shares) <= sum(shares) else "reduce"


class _Bucket:
    """One bucket's staging buffer and the copies in and out of the flat gradient buffer (a
    bucket's gradients are many slices of it: each layer's 12 tensors lie apart)."""

    def __init__(self, grads: torch.Tensor, spans: list[tuple[int, int]], *, rank: int,
                 world: int, zero_stage: int, sharded_collectives: bool):
        spans = sorted(spans)
        self.count = len(spans)  # parameters whose gradient must land before the launch
        # each rank's part of the bucket (one part without ZeRO); in rank order they are spans
        parts = shard_pieces(spans, grads.numel() // world, world) if zero_stage == 1 else [spans]
        self.shares = [sum(n for _, n in part) for part in parts]
        mine = rank if zero_stage == 1 else 0
        new = dict(dtype=grads.dtype, device=grads.device)
        self.collective = (zero1_collective(parts) if zero_stage == 1 and sharded_collectives
                           else "all_reduce")
        if self.collective == "reduce_scatter":  # part r zero-padded to m, at [r m, (r + 1) m)
            m = max(self.shares)
            zeros = torch.zeros(m, **new)
            self.sources = [v for part, share in zip(parts, self.shares)
                            for v in [grads[o:o + n] for o, n in part] + [zeros[:m - share]]]
            self.staging, self.result, at = torch.empty(world * m, **new), torch.empty(m, **new), 0
        else:  # the parts back to back; under ZeRO-1 only this rank's is read back
            self.sources = [grads[o:o + n] for o, n in spans]
            self.staging = self.result = torch.empty(sum(self.shares), **new)
            at = sum(self.shares[:mine])
        self.targets = []  # (this rank's slice of the gradients, its reduced values)
        for o, n in parts[mine]:
            self.targets.append((grads[o:o + n], self.result[at:at + n]))
            at += n

    def launch(self) -> list:
        """The bucket's collectives, launched (asynchronous work handles)."""
        torch.cat(self.sources, out=self.staging)  # on the backward's stream, which NCCL waits on
        if self.collective == "reduce_scatter":
            return [dist.reduce_scatter_tensor(self.result, self.staging, op=dist.ReduceOp.SUM,
                                               async_op=True)]
        if self.collective == "reduce":  # each rank's part summed on that rank
            starts = [sum(self.shares[:r]) for r in range(len(self.shares))]
            return [dist.reduce(self.staging[at:at + n], dst=r, op=dist.ReduceOp.SUM,
                                async_op=True)
                    for r, (at, n) in enumerate(zip(starts, self.shares)) if n]
        return [dist.all_reduce(self.staging, op=dist.ReduceOp.SUM, async_op=True)]

    def copy_out(self) -> None:
        for grad, reduced in self.targets:
            grad.copy_(reduced)


class OverlappedReduction:
    """The gradients summed over ranks bucket by bucket during the backward pass. A hook on
    each parameter (run when its gradient has been accumulated into the flat buffer) counts the
    bucket's gradients down; a complete bucket is copied into its staging buffer and reduced
    with an asynchronous collective (NCCL runs it on its own stream after waiting for the
    copy), while backward computes the next layers. `wait` then makes the current stream wait
    for each collective and copies the sums back, before anything reads the gradients.

    Without ZeRO a bucket is all-reduced; under ZeRO-1 each rank needs only its shard's sums,
    which NCCL gives by reduce-scatter or reduces (zero1_collective), and gloo by all-reduce.
    Each bucket has its own staging buffer: one more gradient buffer's memory in all.

    Only an `arm`ed backward launches anything: the earlier micro-steps of a window only
    accumulate. Buckets launch in a fixed order (a bucket complete before an earlier one waits
    for it), so every rank issues the same collectives in the same order. With world = 2 each
    sum is of two terms, which is exact in any order: the gradients equal the single
    collective's bit for bit (on more ranks NCCL's order may differ by a rounding)."""

    def __init__(self, flat: FlatParameters, *, rank: int, world: int, zero_stage: int,
                 sharded_collectives: bool, bucket_bytes: int = BUCKET_BYTES):
        plan = bucket_plan([layer for _, _, layer, _, _ in flat.slices],
                           [n for *_, n in flat.slices], flat.grads.element_size(), bucket_bytes)
        self.buckets = [_Bucket(flat.grads, [flat.slices[i][3:] for i in b], rank=rank,
                                world=world, zero_stage=zero_stage,
                                sharded_collectives=sharded_collectives) for b in plan]
        self._bucket_of = {flat.slices[i][0]: k for k, b in enumerate(plan) for i in b}
        self._hooks = [p.register_post_accumulate_grad_hook(self._landed)
                       for p in self._bucket_of]
        self.armed = False
        self._pending: list[int] = []
        self._works: list = []

    def arm(self) -> None:
        """The next backward pass launches the reductions."""
        self.armed, self._works = True, []
        self._pending = [b.count for b in self.buckets]

    def _landed(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        self._pending[self._bucket_of[param]] -= 1
        while len(self._works) < len(self.buckets) and self._pending[len(self._works)] == 0:
            self._works.append(self.buckets[len(self._works)].launch())

    def wait(self) -> None:
        """Launch any bucket still waiting (a parameter this backward did not reach), wait for
        every collective and copy the sums into the flat gradient buffer."""
        while len(self._works) < len(self.buckets):
            self._works.append(self.buckets[len(self._works)].launch())
        for bucket, works in zip(self.buckets, self._works):
            for work in works:
                work.wait()  # NCCL: the current stream waits; gloo: the host
            bucket.copy_out()
        self.armed, self._works = False, []

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


# ---------------------------------------------------------------------- overlapped gather


def forward_units(slices: list[tuple[str, int | None]], n_layer: int) -> list[list[int]]:
    """FlatParameters.slices' indices (given each slice's llm.c name and layer) grouped by the
    part of the forward that first reads them, in that order: the embeddings (wte, wpe; wte is
    also the tied lm_head, read again at the end), block 0, ..., block n_layer - 1, ln_f."""
    units: list[list[int]] = [[] for _ in range(n_layer + 2)]
    for i, (name, layer) in enumerate(slices):
        unit = n_layer + 1 if name in ("lnfw", "lnfb") else 0 if layer is None else layer + 1
        units[unit].append(i)
    return units


class OverlappedGather:
    """ZeRO-1's gather of the working weights, overlapped with the next forward. After an
    update each rank's shard holds new values of parts of many tensors (llm.c's layout spreads
    a block's 12 tensors over the whole buffer); every piece of a tensor that lies in one
    rank's shard is broadcast from that rank straight into every rank's flat buffer
    (asynchronous: the same bytes as the all-gather, and the same values bit for bit), launched
    in the order the forward reads them: the embeddings, block 0, ..., ln_f. Forward pre-hooks
    wait for a unit's pieces before it runs (on NCCL the current stream waits, the host does
    not; gloo's wait is the host's), so block i computes while block i + 1's weights arrive.

    All ranks launch the same broadcasts in the same order. `wait_all` is the barrier that
    everything else reading or writing the weights goes through (AdamW.params_ready)."""

    def __init__(self, flat: FlatParameters, *, world: int):
        self.params = flat.params
        shard = flat.params.numel() // world
        n_layer = 1 + max((layer for *_, layer, _, _ in flat.slices if layer is not None),
                          default=-1)
        units = forward_units([(name, layer) for _, name, layer, _, _ in flat.slices], n_layer)
        # per unit, (owner, offset, n) for each piece of its slices in one shard
        self.pieces = [[(owner, o, n)
                        for owner, part in enumerate(shard_pieces(
                            [flat.slices[i][3:] for i in unit], shard, world))
                        for o, n in part] for unit in units]
        self._works: list[list] = [[] for _ in units]
        self._hooks: list = []

    @property
    def in_flight(self) -> list[int]:
        """The units whose pieces are launched and not yet waited for."""
        return [u for u, works in enumerate(self._works) if works]

    def launch(self) -> None:
        assert not self.in_flight, "a gather launched over one still in flight"
        for u, pieces in enumerate(self.pieces):
            self._works[u] = [dist.broadcast(self.params[o:o + n], src=owner, async_op=True)
                              for owner, o, n in pieces]

    def wait(self, unit: int) -> None:
        works, self._works[unit] = self._works[unit], []
        for work in works:
            work.wait()  # NCCL: the current stream waits; gloo: the host

    def wait_all(self) -> None:
        for unit in range(len(self._works)):
            self.wait(unit)

    def attach(self, model: torch.nn.Module, *, per_block: bool) -> None:
        """The forward pre-hooks that wait: on the model (the embeddings; or everything when
        not per_block), each block and ln_f. torch.compiler.disable: a compiled block (or the
        compiled model's wrapper) runs them outside its graph, every call."""
        def waiting(units):
            @torch.compiler.disable
            def hook(module, args):
                for unit in units:
                    self.wait(unit)
            return hook

        last = len(self._works) - 1
        self._hooks.append(model.register_forward_pre_hook(
            waiting([0] if per_block else range(last + 1))))
        if per_block:
            for i, block in enumerate(model.transformer.h):
                self._hooks.append(block.register_forward_pre_hook(waiting([i + 1])))
            self._hooks.append(model.transformer.ln_f.register_forward_pre_hook(waiting([last])))

    def remove(self) -> None:
        self.wait_all()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
