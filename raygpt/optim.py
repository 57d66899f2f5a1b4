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
from raygpt.model import LLMC_DECAY, llmc_parameter_layout

MASK64 = (1 << 64) - 1


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
        offset = 0
        for _, params in layout:
            for p in params:
                n = p.numel()
                self.params[offset:offset + n].copy_(p.data.reshape(-1))
                p.data = _alias(self.params, offset, p.shape)
                p.grad = _alias(self.grads, offset, p.shape)
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
                 weight_decay: float, rank: int = 0, world: int = 1, zero_stage: int = 0):
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

    @property
    def shard_params(self) -> torch.Tensor:
        return self.flat.params[self.lo:self.hi]

    @property
    def shard_grads(self) -> torch.Tensor:
        return self.flat.grads[self.lo:self.hi]

    def step(self, *, lr: float, grad_scale: float, t: int, seed: int) -> None:
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
            self.before_write()
            self.master.copy_(self.shard_params)

    def rederive_working_weights(self, seed: int) -> None:
        """Write the working weights from the master weights with the stochastic-rounding seed of
        the last update (llm.c's `init_from_master_only`): reproduces them bit for bit."""
        if self.master is not None:
            self.before_write()
            ops.copy_master_to_params(self.shard_params, self.master, self.segments, seed)
            self.gather_params()

    # ------------------------------------------------------------------ data parallelism
    def grad_norm_squared(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient shard, as an fp32 0-dim tensor on device."""
        return ops.global_norm_squared(self.shard_grads)

    def reduce_gradients(self) -> None:
        """Sum the gradients over ranks: all of them (DDP), or this rank's shard (ZeRO-1, through
        reduce-scatter where the backend has it; gloo all-reduces and each rank reads its slice)."""
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
        """ZeRO-1: every rank updated its shard of the working weights; gather them all."""
        if self.world == 1 or self.zero_stage == 0:
            return
        self.before_write()
        params = self.flat.params
        shard = params.numel() // self.world
        mine = params[self.rank * shard:(self.rank + 1) * shard].clone()
        dist.all_gather_into_tensor(params, mine)
