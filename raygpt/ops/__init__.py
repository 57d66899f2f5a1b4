"""raygpt's kernels, one interface: the optimizer's two hot loops (global gradient norm, fused
AdamW), the classifier's cross-entropy gradient, and the deterministic causal attention and
token-embedding backward that --deterministic uses on GPUs (`causal_attention`, `embedding`:
autograd-aware; triton_attention.py holds their kernels).

CUDA tensors go to the Triton kernels (triton_kernels.py, registered as torch custom ops under
`torch.ops.raygpt`); anything else goes to the plain-PyTorch reference (reference.py), which is
the specification of the math and of the stochastic-rounding hash. Both paths give bitwise-equal
bf16 for the same fp32 master weights and seed.

All tensors are flat 1-D buffers in llm.c's parameter order (train_gpt2.cu's ParameterTensors;
raygpt.model.gpt's llmc_parameter_layout). A `Segments` says which model tensors a shard [lo, hi) of
that buffer holds (ZeRO-1 updates such a slice; without ZeRO lo=0 and hi=total); build it once
per run, on the device of the buffers.

    segments = Segments.build(sizes, decay, lo, hi, device="cuda")
    norm = global_norm_squared(grad_shard).sqrt()            # all-reduce first under ZeRO
    adamw_update(param, grad, m, v, master, segments, lr=lr, beta1=0.9, beta2=0.95, eps=1e-8,
                 weight_decay=0.1, grad_scale=min(1.0, clip / norm), step=step + 1, seed=seed)
"""

from __future__ import annotations

import torch

from . import reference
from .reference import Segments

__all__ = ["Segments", "global_norm_squared", "adamw_update", "copy_master_to_params",
           "stochastic_round_bf16", "cross_entropy_grad", "attention_forward",
           "attention_backward", "causal_attention", "embedding_backward", "embedding"]


def _triton():
    """The Triton module, imported on first use (it needs Triton; CPU-only machines never get
    here). An import statement, deliberately not a module global filled in on first use: the
    compiled forward calls this (cross_entropy_grad) and torch.compile guards on every global
    it reads, so a global still None when step 1 is traced, then set by the eager optimizer's
    first call, would fail that guard on step 2 and compile the training step again
    (docs/performance.md). After the first import this is a sys.modules lookup."""
    from . import triton_kernels
    return triton_kernels


def _triton_attention():
    """triton_attention, imported on first use (as _triton)."""
    from . import triton_attention
    return triton_attention


def global_norm_squared(grad: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a flat grad buffer (fp32 or bf16) as a 0-dim fp32 tensor on its device.

    Accumulated in fp32; on CUDA per-block partial sums then an in-order final sum (no atomics),
    so repeated calls are bitwise identical. NaN/Inf in the buffer propagate to the result. The
    caller takes the sqrt, after summing over ranks when each rank holds a shard.
    """
    if grad.dim() != 1 or not grad.is_contiguous():
        raise ValueError(f"global_norm_squared: expected a contiguous 1-D buffer, found shape "
                         f"{tuple(grad.shape)}")
    if grad.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"global_norm_squared: expected fp32 or bf16, found {grad.dtype}")
    if grad.is_cuda:
        return _triton().global_norm_squared(grad)
    return reference.global_norm_squared(grad)


def adamw_update(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 master: torch.Tensor | None, segments: Segments, *, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float, grad_scale: float, step: int,
                 seed: int) -> None:
    """One AdamW step over the shard, in place (llm.c's form, one pass over memory):

        g = grad * grad_scale                      (fp32)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**step);  v_hat = v / (1 - beta2**step)
        w = w - lr * (m_hat / (sqrt(v_hat) + eps) + wd * w)   wd = weight_decay on decay tensors

    fp32 mode: param is the fp32 weights, master is None. bf16 mode: master holds the fp32
    weights (updated), and param is re-derived from it by stochastic rounding with `seed`.
    `step` counts from 1. grad is in the working dtype; m, v are fp32.
    """
    impl = _triton() if param.is_cuda else reference
    impl.adamw_update(param, grad, m, v, master, segments, lr=lr, beta1=beta1, beta2=beta2,
                      eps=eps, weight_decay=weight_decay, grad_scale=grad_scale, step=step,
                      seed=seed)


def stochastic_round_bf16(x: torch.Tensor, segments: Segments, seed: int) -> torch.Tensor:
    """fp32 shard -> bf16 by stochastic rounding keyed on (seed, tensor id, index in tensor)."""
    if x.is_cuda:
        return _triton().stochastic_round_bf16(x, segments, seed)
    return reference.stochastic_round_bf16(x, segments, seed)


def copy_master_to_params(param: torch.Tensor, master: torch.Tensor, segments: Segments,
                          seed: int) -> None:
    """Re-derive the working weights from master: bitwise what adamw_update wrote with `seed`.

    Checkpoint resume stores master and the last update's seed, and calls this.
    """
    if param.shape != master.shape or master.dtype != torch.float32:
        raise ValueError(f"copy_master_to_params: expected fp32 master of shape "
                         f"{tuple(param.shape)}, found {master.dtype} {tuple(master.shape)}")
    if param.dtype == torch.float32:
        param.copy_(master)
    elif param.is_cuda:
        _triton().stochastic_round_bf16(master, segments, seed, out=param)  # no temporary
    else:
        param.copy_(reference.stochastic_round_bf16(master, segments, seed))


def cross_entropy_grad(L: torch.Tensor, t: torch.Tensor, vocab_size: int):
    """For one chunk of classifier logits L (n, Vp) and targets t (n,) (-1 = ignore; columns
    >= vocab_size are padding): (G, lse, target_logit, row_max, row_min). G (n, Vp), L's dtype,
    is d(sum of the kept rows' cross-entropy)/dL = keep * (softmax - onehot(t)); the rest are
    fp32 (n,): logsumexp, the target's logit, max and min over the real columns.

    Statistics in fp32 from the working-dtype logits. On CUDA one Triton kernel reads each
    logit once from memory and writes G (reference.py is the math, summed in another order:
    the two agree to fp32 rounding, and each is deterministic)."""
    if L.dim() != 2 or t.shape != L.shape[:1] or not 0 < vocab_size <= L.shape[1]:
        raise ValueError(f"cross_entropy_grad: expected logits (n, Vp), targets (n,) and "
                         f"0 < vocab_size <= Vp, found {tuple(L.shape)}, {tuple(t.shape)}, "
                         f"{vocab_size}")
    if L.is_cuda:
        return _triton().cross_entropy_grad(L, t, vocab_size)
    return reference.cross_entropy_grad(L, t, vocab_size)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Causal self-attention of q, k, v (B, H, T, D), scale 1/sqrt(D): (o, lse), o (B, H, T, D)
    in q's dtype, lse (B, H, T) fp32 the row log-sum-exp of the scaled scores (what the
    backward needs). On CUDA a FlashAttention-2-style Triton kernel (head dims 16-128), fixed
    summation order; elsewhere reference.attention_forward."""
    reference.check_attention_args(q, k, v)
    if q.is_cuda:
        return _triton_attention().attention_forward(q, k, v)
    return reference.attention_forward(q, k, v)


def attention_backward(do, q, k, v, o, lse):
    """(dq, dk, dv) of attention_forward for the upstream gradient do. On CUDA two Triton
    kernels with no atomics (dK/dV per key block, dQ per query block), so repeated calls are
    bitwise identical; elsewhere reference.attention_backward."""
    if q.is_cuda:
        return _triton_attention().attention_backward(do, q, k, v, o, lse)
    return reference.attention_backward(do, q, k, v, o, lse)


def embedding_backward(grad: torch.Tensor, ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The weight gradient (num_rows, C) of an embedding lookup of ids (N,) whose output got
    grad (N, C): row r sums grad over the positions with id r, in fp32, in position order. On
    CUDA a Triton kernel over a stable sort of the ids (no atomics: bitwise repeatable, unlike
    PyTorch's default embedding backward); elsewhere reference.embedding_backward."""
    if grad.dim() != 2 or ids.shape != grad.shape[:1]:
        raise ValueError(f"embedding_backward: expected grad (N, C) and ids (N,), found "
                         f"{tuple(grad.shape)}, {tuple(ids.shape)}")
    if grad.is_cuda:
        return _triton_attention().embedding_backward(grad, ids, num_rows)
    return reference.embedding_backward(grad, ids, num_rows)


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        o, lse = attention_forward(q, k, v)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        return attention_backward(do, *ctx.saved_tensors)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, is_causal=True) with raygpt's kernels, forward
    and backward deterministic (autograd-aware; torch.compile sees the custom ops inside)."""
    return _CausalAttention.apply(q, k, v)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.num_rows = weight.shape[0]
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        dw = embedding_backward(grad.reshape(-1, grad.shape[-1]), ids.reshape(-1), ctx.num_rows)
        return None, dw


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(ids, weight) whose weight gradient is embedding_backward's."""
    return _Embedding.apply(ids, weight)
