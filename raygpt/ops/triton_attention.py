"""Deterministic causal self-attention and token-embedding backward in Triton, as torch custom ops.

reference.py's math with a fixed summation order and no atomics: two calls on the same inputs
give the same bits (what --deterministic needs) at close to the speed of PyTorch's defaults.

* `attn_fwd`: FlashAttention-2's forward, one program per (query block, batch*head) walking the
  key blocks left to right with an online softmax (exp2 of scores pre-scaled by log2(e)); stores
  o and the row log-sum-exp (natural log, fp32). Only the diagonal key blocks are masked.
* `attn_bwd_delta`: delta = rowsum(do * o), fp32. `attn_bwd_dkdv`: one program per (key block,
  batch*head) owns dK, dV of its keys and walks the query blocks that see them; `attn_bwd_dq`:
  one per query block owns dQ and walks its key blocks. (FlashAttention-2 adds dQ atomically, in
  an order that varies; recomputing the probabilities here costs two matmuls per block pair.)
* `embedding_backward_rows`: one program per (weight row, column block) sums the gradient rows of
  that id's positions in the order of a stable sort of the ids, ROWS at a time; no atomics.

Block sizes are fixed per head dimension (ATTN_CONFIGS), not autotuned: they set the order of
every sum, and a pick by timing could differ between two runs. Under TRITON_INTERPRET=1 the
entry points take CPU tensors; the loops are a `for` over range() on the GPU (pipelined) and a
`while` in the interpreter (its range() takes no runtime bound under numpy 2), one body.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .reference import check_attention_args
from .triton_kernels import _identity, _interpreting

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LOG2E_K = tl.constexpr(LOG2E)  # the same constants inside kernels
LN2_K = tl.constexpr(LN2)


@dataclass(frozen=True)
class AttnConfig:
    """Block sizes and launch shape of the three main kernels. fwd_m % fwd_n == 0 and
    dq_m % dq_n == 0 (a query block's diagonal is whole key blocks); dkdv_n % dkdv_m == 0."""
    fwd_m: int
    fwd_n: int
    fwd_warps: int
    fwd_stages: int
    dkdv_m: int
    dkdv_n: int
    dq_m: int
    dq_n: int
    bwd_warps: int
    bwd_stages: int

    def check(self) -> None:
        if self.fwd_m % self.fwd_n or self.dq_m % self.dq_n or self.dkdv_n % self.dkdv_m:
            raise ValueError(f"AttnConfig: block sizes must nest, found {self}")


# Hopper sizes, FlashAttention-2 style; the interpreter's small ones exercise the
# same code paths (unequal blocks, ragged T) at test sizes.
ATTN_CONFIGS = {
    16: AttnConfig(128, 64, 4, 3, 32, 128, 128, 32, 4, 3),
    32: AttnConfig(128, 64, 4, 3, 32, 128, 128, 32, 4, 3),
    64: AttnConfig(64, 64, 4, 4, 64, 64, 64, 64, 4, 3),  # bench/ops.py --det-kernels --sweep
    128: AttnConfig(128, 64, 8, 3, 32, 64, 64, 32, 8, 2),
}
INTERPRETER_CONFIG = AttnConfig(32, 16, 4, 1, 16, 32, 32, 16, 4, 1)


# fp32 inputs (an fp32 run under --deterministic): exact fp32 products take twice the shared
# memory of bf16 ones per block, so smaller blocks, for every head dim
FP32_CONFIG = AttnConfig(64, 32, 4, 2, 32, 64, 64, 32, 4, 2)


def attn_config(head_dim: int, dtype: torch.dtype = torch.bfloat16,
                interpreting: bool = False) -> AttnConfig:
    if interpreting:
        return INTERPRETER_CONFIG
    return FP32_CONFIG if dtype == torch.float32 else ATTN_CONFIGS[head_dim]


# ---------------------------------------------------------------------------------------------
# Forward

@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    """a @ b with fp32 accumulation. Triton 3.6's interpreter multiplies bf16 operands wrongly
    (it reads their bits as other numbers), so there the operands go in as fp32: products of
    bf16 values are exact in fp32, which is what the tensor cores compute too."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    if a.dtype.is_fp32():  # an fp32 run stays fp32: TF32 products would change its numerics
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _fwd_block(acc, l, m, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, start_n, T,
               qk_scale, BLOCK_N: tl.constexpr, MASK: tl.constexpr, INTERPRET: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_t = offs_n < T
    k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=in_t[:, None],
                other=0.0)
    s = _dot(q, tl.trans(k), INTERPRET) * qk_scale          # (BLOCK_M, BLOCK_N), log2 units
    if MASK:
        s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=in_t[:, None],
                other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, INTERPRET)
    return acc, l, m_new


@triton.jit
def _fwd_blocks(acc, l, m, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, hi, T,
                qk_scale, BLOCK_N: tl.constexpr, MASK: tl.constexpr, INTERPRET: tl.constexpr):
    if INTERPRET:  # see the module docstring: the interpreter's range() takes no runtime bound
        start_n = lo
        while start_n < hi:
            acc, l, m = _fwd_block(acc, l, m, q, k_base, v_base, stride_kt, stride_vt, offs_m,
                                   offs_d, start_n, T, qk_scale, BLOCK_N, MASK, INTERPRET)
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, l, m = _fwd_block(acc, l, m, q, k_base, v_base, stride_kt, stride_vt, offs_m,
                                   offs_d, start_n, T, qk_scale, BLOCK_N, MASK, INTERPRET)
    return acc, l, m


@triton.jit
def attn_fwd(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
             sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
             H, T, qk_scale: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr,
             INTERPRET: tl.constexpr):
    # The scales are constexprs (fixed by D anyway): Inductor passes a Python float argument to a
    # user kernel as an fp64 scalar, which turned the scores and the loop-carried accumulators
    # fp64 under torch.compile.
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    in_t = offs_m < T
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :],
                mask=in_t[:, None], other=0.0)
    k_base = k_ptr + b * sk_b + h * sk_h
    v_base = v_ptr + b * sv_b + h * sv_h
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    # keys left of the block: all visible; then the diagonal keys, masked
    acc, l, m = _fwd_blocks(acc, l, m, q, k_base, v_base, sk_t, sv_t, offs_m, offs_d, 0, start_m,
                            T, qk_scale, BLOCK_N, False, INTERPRET)
    acc, l, m = _fwd_blocks(acc, l, m, q, k_base, v_base, sk_t, sv_t, offs_m, offs_d, start_m,
                            tl.minimum(start_m + BLOCK_M, T), T, qk_scale, BLOCK_N, True,
                            INTERPRET)
    o = acc / l[:, None]
    tl.store(o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=in_t[:, None])
    tl.store(lse_ptr + bh.to(tl.int64) * T + offs_m, (m + tl.math.log2(l)) * LN2_K,
             mask=in_t)


# ---------------------------------------------------------------------------------------------
# Backward

@triton.jit
def attn_bwd_delta(o_ptr, do_ptr, delta_ptr, so_b, so_h, so_t, sdo_b, sdo_h, sdo_t, H, T,
                   D: tl.constexpr, BLOCK: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    in_t = offs_m < T
    o = tl.load(o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_d[None, :],
                mask=in_t[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_t + offs_d[None, :],
                 mask=in_t[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * T + offs_m, tl.sum(o * do, 1), mask=in_t)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, stride_qt, stride_dot,
                offs_n, offs_d, start_m, T, qk_scale, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                INTERPRET: tl.constexpr):
    # Query rows past T load q = do = 0 and lse = delta = 0: their p is 1, finite, and their
    # contributions p do and ds q are exactly 0, so only the causal mask needs a MASK pass.
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_t = offs_m < T
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=in_t[:, None],
                other=0.0)
    lse2 = tl.load(lse_ptr + offs_m, mask=in_t, other=0.0) * LOG2E_K
    pT = tl.math.exp2(_dot(k, tl.trans(q), INTERPRET) * qk_scale - lse2[None, :])  # (N, M)
    if MASK:
        pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=in_t[:, None], other=0.0)
    dv += _dot(pT.to(do.dtype), do, INTERPRET)
    delta = tl.load(delta_ptr + offs_m, mask=in_t, other=0.0)
    dsT = pT * (_dot(v, tl.trans(do), INTERPRET) - delta[None, :])
    dk += _dot(dsT.to(q.dtype), q, INTERPRET)
    return dk, dv


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, stride_qt, stride_dot,
                 offs_n, offs_d, lo, hi, T, qk_scale, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                 INTERPRET: tl.constexpr):
    if INTERPRET:
        start_m = lo
        while start_m < hi:
            dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, stride_qt,
                                 stride_dot, offs_n, offs_d, start_m, T, qk_scale, BLOCK_M, MASK,
                                 INTERPRET)
            start_m += BLOCK_M
    else:
        for start_m in range(lo, hi, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, stride_qt,
                                 stride_dot, offs_n, offs_d, start_m, T, qk_scale, BLOCK_M, MASK,
                                 INTERPRET)
    return dk, dv


@triton.jit
def attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                  sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                  sg_b, sg_h, sg_t, H, T, qk_scale: tl.constexpr, sm_scale: tl.constexpr,
                  D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    in_t = offs_n < T
    k = tl.load(k_ptr + b * sk_b + h * sk_h + offs_n[:, None] * sk_t + offs_d[None, :],
                mask=in_t[:, None], other=0.0)
    v = tl.load(v_ptr + b * sv_b + h * sv_h + offs_n[:, None] * sv_t + offs_d[None, :],
                mask=in_t[:, None], other=0.0)
    q_base = q_ptr + b * sq_b + h * sq_h
    do_base = do_ptr + b * sdo_b + h * sdo_h
    lse_row = lse_ptr + bh.to(tl.int64) * T
    delta_row = delta_ptr + bh.to(tl.int64) * T
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    # the queries on the key block's diagonal (masked), then every query below it
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_row, delta_row, sq_t, sdo_t, offs_n,
                          offs_d, start_n, tl.minimum(start_n + BLOCK_N, T), T, qk_scale, BLOCK_M,
                          True, INTERPRET)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_row, delta_row, sq_t, sdo_t, offs_n,
                          offs_d, start_n + BLOCK_N, T, T, qk_scale, BLOCK_M, False, INTERPRET)
    g = b * sg_b + h * sg_h + offs_n[:, None] * sg_t + offs_d[None, :]
    tl.store(dk_ptr + g, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=in_t[:, None])
    tl.store(dv_ptr + g, dv.to(dv_ptr.dtype.element_ty), mask=in_t[:, None])


@triton.jit
def _dq_block(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
              start_n, T, qk_scale, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
              INTERPRET: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_t = offs_n < T
    k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=in_t[:, None],
                other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=in_t[:, None],
                other=0.0)
    p = tl.math.exp2(_dot(q, tl.trans(k), INTERPRET) * qk_scale - lse2[:, None])  # (M, N)
    if MASK:
        p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
    ds = p * (_dot(do, tl.trans(v), INTERPRET) - delta[:, None])
    return dq + _dot(ds.to(k.dtype), k, INTERPRET)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo,
               hi, T, qk_scale, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               INTERPRET: tl.constexpr):
    if INTERPRET:
        start_n = lo
        while start_n < hi:
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m,
                           offs_d, start_n, T, qk_scale, BLOCK_N, MASK, INTERPRET)
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m,
                           offs_d, start_n, T, qk_scale, BLOCK_N, MASK, INTERPRET)
    return dq


@triton.jit
def attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                sg_b, sg_h, sg_t, H, T, qk_scale: tl.constexpr, sm_scale: tl.constexpr,
                D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    in_t = offs_m < T
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :],
                mask=in_t[:, None], other=0.0)
    do = tl.load(do_ptr + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_t + offs_d[None, :],
                 mask=in_t[:, None], other=0.0)
    lse2 = tl.load(lse_ptr + bh.to(tl.int64) * T + offs_m, mask=in_t, other=0.0) * LOG2E_K
    delta = tl.load(delta_ptr + bh.to(tl.int64) * T + offs_m, mask=in_t, other=0.0)
    k_base = k_ptr + b * sk_b + h * sk_h
    v_base = v_ptr + b * sv_b + h * sv_h
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    # key blocks left of the query block (unmasked), then the diagonal ones (masked)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, sk_t, sv_t, offs_m, offs_d, 0,
                    start_m, T, qk_scale, BLOCK_N, False, INTERPRET)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, sk_t, sv_t, offs_m, offs_d, start_m,
                    tl.minimum(start_m + BLOCK_M, T), T, qk_scale, BLOCK_N, True, INTERPRET)
    tl.store(dq_ptr + b * sg_b + h * sg_h + offs_m[:, None] * sg_t + offs_d[None, :],
             (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=in_t[:, None])


# ---------------------------------------------------------------------------------------------
# Embedding backward

EMB_ROWS = 16      # gradient rows summed per loop iteration (a frequent token has thousands)
EMB_BLOCK_C = 128  # columns per program (GPT-2's 768: six programs share a frequent token)
EMB_WARPS = 2  # the fastest rows x columns x warps in bench/ops.py --det-kernels --sweep


@triton.jit
def embedding_backward_rows(grad_ptr, order_ptr, offsets_ptr, out_ptr, C, stride_g, stride_o,
                            ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = cols < C
    lo = tl.load(offsets_ptr + r)
    hi = tl.load(offsets_ptr + r + 1)
    acc = tl.zeros([BLOCK_C], tl.float32)
    start = lo
    while start < hi:  # a while loop: the trip count differs per program
        i = start + tl.arange(0, ROWS)
        in_run = i < hi
        pos = tl.load(order_ptr + i, mask=in_run, other=0)
        g = tl.load(grad_ptr + pos[:, None] * stride_g + cols[None, :],
                    mask=in_run[:, None] & in_c[None, :], other=0.0)
        acc += tl.sum(g.to(tl.float32), 0)
        start += ROWS
    tl.store(out_ptr + r * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=in_c)


# ---------------------------------------------------------------------------------------------
# Launchers (wrap = wrap_triton under the custom ops, identity in the interpreter)

def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _empty_bthd(like: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) as a view of a (B, T, H, D) buffer: the layout the model's heads come back
    to, so its transpose-and-merge after attention is free."""
    B, H, T, D = like.shape
    return torch.empty(B, T, H, D, dtype=like.dtype, device=like.device).transpose(1, 2)


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _launch_attn_fwd(wrap, q, k, v, cfg: AttnConfig):
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, H, T, D = q.shape
    o = _empty_bthd(q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    if q.numel():
        wrap(attn_fwd)[(triton.cdiv(T, cfg.fwd_m), B * H)](
            q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o), H, T,
            LOG2E / math.sqrt(D), D=D, BLOCK_M=cfg.fwd_m, BLOCK_N=cfg.fwd_n,
            INTERPRET=not q.is_cuda,
            num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)
    return o, lse


def _launch_attn_bwd(wrap, do, q, k, v, o, lse, cfg: AttnConfig):
    do, q, k, v, o = (_unit_last(t) for t in (do, q, k, v, o))
    B, H, T, D = q.shape
    dq, dk, dv = _empty_bthd(q), _empty_bthd(k), _empty_bthd(v)
    if not q.numel():
        return dq, dk, dv
    lse = lse.contiguous()
    delta = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    wrap(attn_bwd_delta)[(triton.cdiv(T, 64), B * H)](
        o, do, delta, *_strides(o), *_strides(do), H, T, D=D, BLOCK=64, num_warps=4)
    sm_scale = 1.0 / math.sqrt(D)
    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq), H, T,
              LOG2E * sm_scale, sm_scale)
    wrap(attn_bwd_dkdv)[(triton.cdiv(T, cfg.dkdv_n), B * H)](
        q, k, v, do, lse, delta, dk, dv, *common, D=D, BLOCK_M=cfg.dkdv_m, BLOCK_N=cfg.dkdv_n,
        INTERPRET=not q.is_cuda,
        num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages)
    wrap(attn_bwd_dq)[(triton.cdiv(T, cfg.dq_m), B * H)](
        q, k, v, do, lse, delta, dq, *common, D=D, BLOCK_M=cfg.dq_m, BLOCK_N=cfg.dq_n,
        INTERPRET=not q.is_cuda,
        num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages)
    return dq, dk, dv


def _launch_embedding_backward(wrap, grad, ids, num_rows):
    grad = _unit_last(grad)
    N, C = grad.shape
    out = torch.empty(num_rows, C, dtype=grad.dtype, device=grad.device)
    # positions grouped by id, in position order inside a group (stable: the order is unique)
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    # run r of equal ids is order[offsets[r]:offsets[r + 1]]
    offsets = torch.searchsorted(sorted_ids, torch.arange(num_rows + 1, device=grad.device,
                                                          dtype=sorted_ids.dtype))
    if num_rows and C:
        wrap(embedding_backward_rows)[(num_rows, triton.cdiv(C, EMB_BLOCK_C))](
            grad, order, offsets, out, C, grad.stride(0), out.stride(0), ROWS=EMB_ROWS,
            BLOCK_C=EMB_BLOCK_C, num_warps=EMB_WARPS)
    return out


# ---------------------------------------------------------------------------------------------
# torch custom ops: torch.ops.raygpt.{attention_forward, attention_backward, embedding_backward}

@triton_op("raygpt::attention_forward", mutates_args=())
def _attention_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_attn_fwd(wrap_triton, q, k, v, attn_config(q.shape[-1], q.dtype))


@triton_op("raygpt::attention_backward", mutates_args=())
def _attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           o: torch.Tensor, lse: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_attn_bwd(wrap_triton, do, q, k, v, o, lse, attn_config(q.shape[-1], q.dtype))


@triton_op("raygpt::embedding_backward", mutates_args=())
def _embedding_backward_op(grad: torch.Tensor, ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    return _launch_embedding_backward(wrap_triton, grad, ids, num_rows)


# ---------------------------------------------------------------------------------------------
# Entry points (raygpt.ops dispatches CUDA tensors here; CPU tensors only under the interpreter).
# `config` overrides the block sizes (the tests and bench/ops.py's sweep); it runs eagerly.

def attention_forward(q, k, v, config: AttnConfig | None = None):
    check_attention_args(q, k, v)
    if _interpreting(q) or config is not None:
        cfg = config or attn_config(q.shape[-1], q.dtype, interpreting=not q.is_cuda)
        cfg.check()
        return _launch_attn_fwd(_identity, q, k, v, cfg)
    return _attention_forward_op(q, k, v)


def attention_backward(do, q, k, v, o, lse, config: AttnConfig | None = None):
    if _interpreting(q) or config is not None:
        cfg = config or attn_config(q.shape[-1], q.dtype, interpreting=not q.is_cuda)
        cfg.check()
        return _launch_attn_bwd(_identity, do, q, k, v, o, lse, cfg)
    return _attention_backward_op(do, q, k, v, o, lse)


def embedding_backward(grad, ids, num_rows: int):
    if _interpreting(grad):
        return _launch_embedding_backward(_identity, grad, ids, num_rows)
    return _embedding_backward_op(grad, ids, num_rows)
