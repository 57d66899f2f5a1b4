"""One worker's peak memory, estimated from the run's shape before anything is allocated.

The preflight (raygpt.config.preflight.check_memory) refuses a configuration whose estimate cannot fit
the machine, and an out-of-memory error in a worker is reported with it (raygpt.train.errors). Pure
functions of the config and numbers: no torch, no Ray.

What one worker holds at its peak (the end of the forward pass, where the saved activations
and the loss's chunk are all alive), in bytes, with N parameters, w bytes per working weight
(4 fp32 on CPUs, 2 bf16 on GPUs), world ranks sharing the optimizer under ZeRO-1:

    weights      N w                      the flat working buffer (raygpt.train.optim.FlatParameters)
    grads        N w                      the flat gradient buffer
    optimizer    (8 + 4 master) N / shard AdamW's m and v in fp32, fp32 master weights when w = 2;
                                          shard = world under ZeRO-1, else 1
    snapshot     optimizer + N w (rank 0) the checkpoint's copy of that state
                                          (raygpt.checkpointing.snapshot): host memory on a
                                          CPU; on a GPU only with --checkpoint-snapshot device
                                          (the default copies straight to pinned host memory)
    staging      N w (world > 1)          --overlap-comm's bucket buffers (raygpt.train.optim)
    activations  B T (L a C + 4 C) w      what backward keeps: a C-wide values a layer (below),
                 + L B nh T 4             the attention's fp32 row log-sum-exp
    loss         chunk Vp k + 2 Vp C 4    the fused loss's chunk of logits with its k bytes a
                 + B T C 4                logit of temporaries, the fp32 (Vp, C) weight gradient
                                          and its per-chunk term, the fp32 (B T, C) input gradient
                                          (the reference loss holds the whole (B T, V) instead)
    runtime      a constant               the process itself (CPU: Python, torch, the loader's
                                          buffers; GPU: the CUDA context and cuBLAS workspace)

Activations a layer, in units of B T C: ln_1's input and output (2), q, k, v (3), the attention
output before c_proj (1), ln_2's input and output (2), c_fc's output and GELU's (8), and the
LayerNorm statistics and copies autograd keeps besides: 18 measured on a CPU (the resident set
after an eager forward pass at d2 and d4, the allocator told to return freed memory). The runtime
is fitted to peak resident sets of the real loop on a CPU, where the C library's allocator keeps
some freed memory: tests/model/test_memory.py states the margin at the shapes it measures.
The GPU's figures (compiled by Inductor, bf16) are the same formula: bench/memory_estimate.py
prints estimate against torch.cuda.max_memory_allocated there.
`recompute` (--recompute: 1 recomputes the MLP's hidden values in backward, 2 the whole block)
keeps fewer per layer and adds one layer's worth back while that layer's backward runs.
"""

from __future__ import annotations

import dataclasses
import os

from raygpt.model.shapes import CE_CHUNK_ROWS, MODEL_SHAPES

GPT2_VOCAB, GPT2_PADDED_VOCAB = 50257, 50304
LLMC_MODEL_MAGIC = 20240326  # raygpt.llmc.model_file.MODEL_MAGIC (that module imports torch)
GiB = 1 << 30

# B T C values kept a layer, by --recompute: all of them, without the MLP's 8 (1), the
# block's input only (2).
ACTIVATIONS_PER_LAYER = {0: 18, 1: 10, 2: 1}
# ...plus the embeddings' sum, ln_f's input and output and the loss's input (B T C each).
ACTIVATIONS_OUTSIDE_LAYERS = 4
# Bytes a logit of the loss's chunk costs while it is alive: on a GPU the bf16 logits and the
# bf16 gradient written over them (Inductor fuses the fp32 work); on a CPU the eager fp32
# logits, their masked copy, the softmax scratch and the one-hot (raygpt.ops.reference).
LOSS_BYTES_PER_LOGIT = {"gpu": 4, "cpu": 16}
# The reference loss holds the whole (B T, V) logits: working dtype, an fp32 copy, the
# softmax its backward reads and that backward's fp32 gradient.
REFERENCE_LOSS_BYTES_PER_LOGIT = {"gpu": 2 + 4 + 4 + 4, "cpu": 4 + 4 + 4}
# The process before it trains: on a CPU the Python process with torch, the data loader and
# what the allocator keeps of freed memory (resident set); on a GPU the CUDA context, cuBLAS's
# workspace and the compiled kernels, which torch.cuda.max_memory_allocated does not count but
# the GPU's memory must hold.
RUNTIME_BYTES = {"cpu": 600 << 20, "gpu": 1 * GiB}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A GPT-2 network's dimensions: L layers, C channels, nh heads, V / Vp the (padded)
    vocabulary, max_t the positions wpe holds."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int = GPT2_VOCAB
    padded_vocab_size: int = GPT2_PADDED_VOCAB
    max_t: int = 1024

    @property
    def num_parameters(self) -> int:
        """As llm.c counts them: wte (Vp, C), wpe (maxT, C), 12 C^2 + 13 C a layer, ln_f."""
        L, C = self.n_layer, self.n_embd
        return (self.padded_vocab_size + self.max_t) * C + L * (12 * C * C + 13 * C) + 2 * C


def shape_of(model: str) -> Shape | None:
    """The Shape behind -e: dN, an llm.c model file's header, a Hugging Face GPT-2 folder's
    config.json (read only by raygpt.interop.hf.read_hf_config, the bounded reader that checks it);
    None when it cannot be read (raygpt.config.preflight.check_model names that)."""
    if model.startswith("d") and model[1:].isdigit() and int(model[1:]) in MODEL_SHAPES:
        C, nh = MODEL_SHAPES[int(model[1:])]
        return Shape(int(model[1:]), C, nh)
    try:
        if os.path.isdir(model):  # raygpt.interop.hf imports torch: only for a Hugging Face folder
            from raygpt.interop.hf import HFError, read_hf_config
            try:
                c = read_hf_config(model)
            except HFError:
                return None
            return Shape(c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.padded_vocab_size,
                         c.block_size)
        import numpy as np
        h = np.fromfile(model, dtype="<i4", count=256)  # llm.c: maxT, V, L, nh, C, Vp at 2..7
        if len(h) < 8 or int(h[0]) != LLMC_MODEL_MAGIC or min(h[2:8]) < 1:
            return None
        return Shape(int(h[4]), int(h[6]), int(h[5]), int(h[3]), int(h[7]), int(h[2]))
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One worker's peak, in bytes, by what holds it (see the module docstring)."""

    weights: int
    grads: int
    optimizer: int
    snapshot: int
    activations: int
    loss: int
    runtime: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    @property
    def allocated(self) -> int:
        """What the tensors hold: the total less the runtime (torch.cuda.max_memory_allocated's
        counterpart)."""
        return self.total - self.runtime

    def line(self) -> str:
        parts = ", ".join(f"{f.name} {getattr(self, f.name) / GiB:.2f}"
                          for f in dataclasses.fields(self))
        return f"{self.total / GiB:.1f} GiB ({parts})"


def estimate(shape: Shape, *, device: str, batch_size: int, seq_len: int, world: int = 1,
             zero_stage: int = 0, loss_impl: str = "fused", ce_chunk_rows: int | None = None,
             recompute: int = 0, rank: int = 0, snapshot_to: str = "host",
             overlap: bool = False) -> Estimate:
    """One worker's peak bytes for a micro-batch (batch_size, seq_len) of `shape` on `device`
    ("cpu": fp32 eager; "gpu": bf16 working weights, fp32 master, compiled). snapshot_to:
    --checkpoint-snapshot (a GPU's snapshot holds device memory only when "device"); overlap:
    --overlap-comm."""
    B, T, L, C = batch_size, seq_len, shape.n_layer, shape.n_embd
    Vp, V, N = shape.padded_vocab_size, shape.vocab_size, shape.num_parameters
    w = 2 if device == "gpu" else 4
    shard = world if zero_stage == 1 else 1
    optimizer = (8 + (4 if w == 2 else 0)) * (-(-N // shard))
    snapshot = optimizer + (N * w if rank == 0 else 0)
    if device == "gpu" and snapshot_to != "device":
        snapshot = 0  # pinned host memory, not the GPU's
    staging = N * w if overlap and world > 1 else 0
    per_layer = ACTIVATIONS_PER_LAYER[recompute]
    # one layer's full set again while that layer's backward recomputes it
    regrown = (ACTIVATIONS_PER_LAYER[0] - per_layer) if recompute else 0
    activations = (B * T * C * (L * per_layer + ACTIVATIONS_OUTSIDE_LAYERS + regrown) * w
                   + L * B * shape.n_head * T * 4)
    if loss_impl == "reference":
        loss = B * T * V * REFERENCE_LOSS_BYTES_PER_LOGIT[device]
    else:
        rows = min(B * T, ce_chunk_rows or CE_CHUNK_ROWS[device])
        loss = rows * Vp * LOSS_BYTES_PER_LOGIT[device] + 2 * Vp * C * 4 + B * T * C * 4
    return Estimate(weights=N * w, grads=N * w + staging, optimizer=optimizer, snapshot=snapshot,
                    activations=activations, loss=loss, runtime=RUNTIME_BYTES[device])


def estimate_for(cfg) -> Estimate | None:
    """estimate() for a resolved TrainConfig's rank 0 (the rank that holds the most: the
    snapshot's working weights) at its largest world size; None when -e cannot be read."""
    shape = shape_of(cfg.model)
    if shape is None:
        return None
    return estimate(shape, device=cfg.device, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                    world=cfg.num_workers, zero_stage=cfg.zero_stage, loss_impl=cfg.loss_impl,
                    ce_chunk_rows=cfg.ce_chunk_rows, recompute=cfg.recompute,
                    snapshot_to=cfg.checkpoint_snapshot, overlap=bool(cfg.overlap_comm))


def out_of_memory_line(cfg, where: str, limit: int | None, *, step: int | None = None,
                       workers: int = 1) -> str:
    """The one line that reports a worker out of memory `where` ("on the GPU", "in host
    memory", ...): the step, this shape's estimate against `limit` bytes (None: not known),
    and the flag to change."""
    est = estimate_for(cfg)
    at = "" if step is None else f" at step {step}"
    if est is None:
        need = "no estimate for this model"
    elif workers > 1:
        need = (f"the estimate for this shape is {est.total / GiB:.1f} GiB a worker x {workers} "
                f"workers = {workers * est.total / GiB:.1f} GiB")
    else:
        need = f"the estimate for this shape is {est.total / GiB:.1f} GiB"
    of = "" if limit is None else f" of {limit / GiB:.1f} GiB"
    return f"out of memory {where}{at}: {need}{of}; lower -b (now {cfg.batch_size})"
