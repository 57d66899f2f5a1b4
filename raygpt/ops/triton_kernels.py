"""Triton kernels for the gradient norm, fused AdamW and the loss gradient, as torch custom ops.

The math is reference.py's, element for element, with the same uint32 stochastic-rounding hash,
so a kernel and the reference round the same fp32 value to the same bf16. raygpt.ops imports
this module (and Triton) only when it meets a CUDA tensor. Kernels:

* `sumsq_partials` + `sum_partials`: a persistent grid of at most NORM_PROGRAMS programs sums
  x*x over grid-strided NORM_BLOCK blocks into fp32 partials, which one program sums in a fixed
  tree; the grid depends only on numel and there are no atomics, so calls are bitwise repeatable.
* `adamw`: one program per block of the shard, one launch for all tensors (Segments' block table
  says which tensor pieces a block touches). `stochastic_round`: fp32 -> bf16, the same rounding.
* `cross_entropy_rows`: one program per row of a chunk of classifier logits; pass 1 reads the row
  for max, min and sum of exp (online softmax), pass 2 writes keep * (softmax - onehot).
  Inductor's kernel for the same math reads each row three times; the variants tried (rows kept
  in L2 or in registers, per-lane sums) were slower (docs/performance.md).

Under TRITON_INTERPRET=1 (set before Triton is imported) the entry points at the bottom also take
CPU tensors and run these kernels in Triton's interpreter: the parity tests run them that way.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .reference import AdamWScalars, Segments, check_adamw_args

NORM_BLOCK = 4096  # elements per program per loop iteration
NORM_PROGRAMS = 1024  # persistent grid: about 8 programs of 8 warps per SM on a 132-SM Hopper
NORM_WARPS = 8


def _elementwise_warps(block: int) -> int:
    """Warps for AdamW: 4 elements per thread. Then its bf16 and fp32 accesses get the same
    register layout (16-byte fp32, 8-byte bf16 accesses); with 8 elements per thread Triton
    gives them different layouts and converts through shared memory. stochastic_round, with one
    load and one store, takes 8 per thread (half the warps) for more bytes in flight."""
    return max(1, min(32, block // 128))


# ---------------------------------------------------------------------------------------------
# The hash (reference.py: mix32, hash2), in wrapping uint32 arithmetic.

@triton.jit
def mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def hash2(key, counter):
    return mix32(mix32(counter + 0x9E3779B9) ^ key)


@triton.jit
def piece_fields(seg_ptr, n_seg, block_ptr, n_blocks, offs, seed, MAX_PIECES: tl.constexpr):
    """Per element of this block: index inside its tensor (uint32), that tensor's rounding
    seed (uint32), its decay flag (fp32 0/1).

    The block touches pieces first..last (at most MAX_PIECES of them). The loop over them is
    unrolled at compile time: a runtime loop would carry these per-element tensors in a layout
    other than the loads', and Triton would convert between the two through shared memory.
    Pieces past `last` repeat `last`, which changes nothing."""
    pid = tl.program_id(0)
    first = tl.load(block_ptr + pid)
    last = tl.load(block_ptr + n_blocks + pid)
    start = tl.load(seg_ptr + first)
    index = (offs - start + tl.load(seg_ptr + 3 * n_seg + first)).to(tl.uint32)
    tseed = hash2(seed, tl.load(seg_ptr + 2 * n_seg + first).to(tl.uint32)) + tl.zeros(
        offs.shape, tl.uint32)
    decay = tl.load(seg_ptr + 4 * n_seg + first).to(tl.float32) + tl.zeros(offs.shape,
                                                                           tl.float32)
    for j in tl.static_range(1, MAX_PIECES):
        s = tl.minimum(first + j, last)
        start = tl.load(seg_ptr + s)
        inside = offs >= start  # pieces are sorted: a later piece overrides from its start on
        offset = tl.load(seg_ptr + 3 * n_seg + s)
        index = tl.where(inside, (offs - start + offset).to(tl.uint32), index)
        tensor_id = tl.load(seg_ptr + 2 * n_seg + s).to(tl.uint32)
        tseed = tl.where(inside, hash2(seed, tensor_id), tseed)
        decay = tl.where(inside, tl.load(seg_ptr + 4 * n_seg + s).to(tl.float32), decay)
    return index, tseed, decay


@triton.jit
def round_bf16(w, index, tseed):
    """Stochastic rounding (reference.round_with_bits): upper 16 bits of bits + r."""
    r = hash2(tseed, index) >> 16
    bits = w.to(tl.uint32, bitcast=True)
    upper = ((bits + r) >> 16).to(tl.uint16)
    upper = tl.where(w != w, 0x7FC0, upper).to(tl.uint16)
    return upper.to(tl.bfloat16, bitcast=True)


# ---------------------------------------------------------------------------------------------
# Global norm.

@triton.jit
def sumsq_partials(x_ptr, partials_ptr, n, iters, BLOCK: tl.constexpr):
    """partials[pid] = sum of x*x over blocks pid, pid + P, pid + 2P, ... (P programs)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    i = 0
    # a while loop, not range(iters): Triton 3.6's interpreter cannot take a runtime value as a
    # range bound under numpy 2 (its scalars are 1-element arrays)
    while i < iters:
        offs = (pid + i * tl.num_programs(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc += x * x
        i += 1
    tl.store(partials_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def sum_partials(partials_ptr, out_ptr, num_partials, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(partials_ptr + offs, mask=offs < num_partials, other=0.0)
    tl.store(out_ptr, tl.sum(x, axis=0))


# ---------------------------------------------------------------------------------------------
# AdamW and stochastic rounding.

@triton.jit(do_not_specialize=["seed"])
def adamw(param_ptr, master_ptr, grad_ptr, m_ptr, v_ptr, seg_ptr, n_seg, block_ptr,
          n_blocks, n, lr, beta1, beta2, one_minus_beta1, one_minus_beta2,
          bias_correction1, bias_correction2, eps, weight_decay, grad_scale, seed,
          HAS_MASTER: tl.constexpr, BLOCK: tl.constexpr, MAX_PIECES: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # tl.cast, not .to(): under torch.compile a scalar can arrive as a Python constant, and the
    # floats arrive as fp64 (as fp32 from an eager launch); the math is fp32 either way
    seed = tl.cast(seed, tl.uint32, bitcast=True)
    lr = tl.cast(lr, tl.float32)
    beta1 = tl.cast(beta1, tl.float32)
    beta2 = tl.cast(beta2, tl.float32)
    one_minus_beta1 = tl.cast(one_minus_beta1, tl.float32)
    one_minus_beta2 = tl.cast(one_minus_beta2, tl.float32)
    bias_correction1 = tl.cast(bias_correction1, tl.float32)
    bias_correction2 = tl.cast(bias_correction2, tl.float32)
    eps = tl.cast(eps, tl.float32)
    weight_decay = tl.cast(weight_decay, tl.float32)
    grad_scale = tl.cast(grad_scale, tl.float32)
    index, tseed, decay = piece_fields(seg_ptr, n_seg, block_ptr, n_blocks, offs, seed,
                                       MAX_PIECES)

    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if HAS_MASTER:
        w = tl.load(master_ptr + offs, mask=mask, other=0.0)
    else:
        w = tl.load(param_ptr + offs, mask=mask, other=0.0)

    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    m_hat = tl.div_rn(m, bias_correction1)
    v_hat = tl.div_rn(v, bias_correction2)
    w = w - lr * (tl.div_rn(m_hat, tl.sqrt_rn(v_hat) + eps) + (weight_decay * decay) * w)

    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + offs, w, mask=mask)
        tl.store(param_ptr + offs, round_bf16(w, index, tseed), mask=mask)
    else:
        tl.store(param_ptr + offs, w, mask=mask)


@triton.jit(do_not_specialize=["seed"])
def stochastic_round(x_ptr, out_ptr, seg_ptr, n_seg, block_ptr, n_blocks, n, seed,
                     BLOCK: tl.constexpr, MAX_PIECES: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    seed = tl.cast(seed, tl.uint32, bitcast=True)
    index, tseed, _ = piece_fields(seg_ptr, n_seg, block_ptr, n_blocks, offs, seed, MAX_PIECES)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, round_bf16(x, index, tseed), mask=mask)


# ---------------------------------------------------------------------------------------------
# The classifier's cross-entropy gradient (reference.cross_entropy_grad).

CE_BLOCK = 1024  # columns per loop iteration (it fixes each row's summation order)
CE_WARPS = 2  # the fastest block x warps pair in bench/ops.py --sweep (docs/performance.md)


@triton.jit
def cross_entropy_rows(L_ptr, G_ptr, t_ptr, lse_ptr, tgt_ptr, max_ptr, min_ptr, stride_l,
                       stride_g, V, Vp, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    l_row = L_ptr + row * stride_l
    g_row = G_ptr + row * stride_g
    cols = tl.arange(0, BLOCK)
    # pass 1: running max m, sum of exp(x - m) s, min; every block holds a real column. A NaN
    # logit makes s, hence lse and the loss, NaN.
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    mn = tl.min(tl.full([BLOCK], float("inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    start = 0
    while start < V:  # a while loop: see sumsq_partials
        offs = start + cols
        real = offs < V
        x = tl.load(l_row + offs, mask=real, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
        mn = tl.minimum(mn, tl.min(tl.where(real, x, float("inf")), axis=0))
        start += BLOCK
    lse = m + tl.log(s)
    t = tl.load(t_ptr + row)
    keep = t != -1
    tl.store(lse_ptr + row, lse)
    tl.store(tgt_ptr + row, tl.load(l_row + tl.maximum(t, 0)).to(tl.float32))
    tl.store(max_ptr + row, m)
    tl.store(min_ptr + row, mn)
    # pass 2: G = keep * (exp(x - lse) - onehot), 0 in the padded columns
    start = 0
    while start < Vp:
        offs = start + cols
        x = tl.load(l_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(offs == t, 1.0, 0.0)
        g = tl.where(keep, g, 0.0)
        tl.store(g_row + offs, g.to(G_ptr.dtype.element_ty), mask=offs < Vp)
        start += BLOCK


def _seed_arg(seed: int) -> int:
    """The 32-bit seed as a signed int32 kernel argument (one compiled type for every seed)."""
    seed &= 0xFFFFFFFF
    return seed - (1 << 32) if seed >= (1 << 31) else seed


# ---------------------------------------------------------------------------------------------
# Launchers, shared by the custom ops (wrap = torch.library.wrap_triton, so torch.compile sees
# the kernels) and the interpreter path (wrap = identity, CPU tensors).

def _launch_global_norm_squared(grad, wrap) -> torch.Tensor:
    n = grad.numel()
    programs = max(1, min(triton.cdiv(n, NORM_BLOCK), NORM_PROGRAMS))
    partials = torch.empty(programs, dtype=torch.float32, device=grad.device)
    out = torch.empty((), dtype=torch.float32, device=grad.device)
    iters = triton.cdiv(triton.cdiv(n, NORM_BLOCK), programs)
    wrap(sumsq_partials)[(programs,)](grad, partials, n, iters, BLOCK=NORM_BLOCK,
                                       num_warps=NORM_WARPS)
    wrap(sum_partials)[(1,)](partials, out, programs, BLOCK=NORM_PROGRAMS, num_warps=4)
    return out


def _launch_adamw(wrap, param, grad, m, v, master, seg_table, block_table, block, max_pieces,
                  lr, beta1, beta2, one_minus_beta1, one_minus_beta2, bias_correction1,
                  bias_correction2, eps, weight_decay, grad_scale, seed) -> None:
    n_blocks = block_table.shape[1]
    if n_blocks == 0:
        return
    has_master = master is not None
    wrap(adamw)[(n_blocks,)](
        param, master if has_master else param, grad, m, v, seg_table, seg_table.shape[1],
        block_table, n_blocks, param.numel(), lr, beta1, beta2, one_minus_beta1,
        one_minus_beta2, bias_correction1, bias_correction2, eps, weight_decay, grad_scale,
        _seed_arg(seed), HAS_MASTER=has_master, BLOCK=block, MAX_PIECES=max_pieces,
        num_warps=_elementwise_warps(block))


def _launch_stochastic_round(wrap, x, out, seg_table, block_table, block, max_pieces,
                             seed) -> None:
    n_blocks = block_table.shape[1]
    if n_blocks == 0:
        return
    wrap(stochastic_round)[(n_blocks,)](
        x, out, seg_table, seg_table.shape[1], block_table, n_blocks, x.numel(),
        _seed_arg(seed), BLOCK=block, MAX_PIECES=max_pieces,
        num_warps=max(1, _elementwise_warps(block) // 2))


def _launch_cross_entropy_grad(wrap, L, t, vocab_size):
    L, t = L.contiguous(), t.contiguous()
    n, vp = L.shape
    G = torch.empty_like(L)
    # four tensors, not views of one: a custom op's outputs must not alias each other
    lse, target, row_max, row_min = (torch.empty(n, dtype=torch.float32, device=L.device)
                                     for _ in range(4))
    if n:
        wrap(cross_entropy_rows)[(n,)](L, G, t, lse, target, row_max, row_min, L.stride(0),
                                       G.stride(0), vocab_size, vp, BLOCK=CE_BLOCK,
                                       num_warps=CE_WARPS)
    return G, lse, target, row_max, row_min


# ---------------------------------------------------------------------------------------------
# torch custom ops: torch.ops.raygpt.{global_norm_squared, adamw_update, stochastic_round_bf16,
# cross_entropy_grad}.
# A Segments object cannot cross the op boundary, so its two tables travel as tensors and the
# per-step scalars as floats.

@triton_op("raygpt::global_norm_squared", mutates_args=())
def _global_norm_squared_op(grad: torch.Tensor) -> torch.Tensor:
    return _launch_global_norm_squared(grad, wrap_triton)


@triton_op("raygpt::adamw_update", mutates_args=("param", "m", "v", "master"))
def _adamw_update_op(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                     master: Optional[torch.Tensor], seg_table: torch.Tensor,
                     block_table: torch.Tensor, block: int, max_pieces: int, lr: float,
                     beta1: float, beta2: float, one_minus_beta1: float,
                     one_minus_beta2: float, bias_correction1: float, bias_correction2: float,
                     eps: float, weight_decay: float, grad_scale: float, seed: int) -> None:
    _launch_adamw(wrap_triton, param, grad, m, v, master, seg_table, block_table, block,
                  max_pieces, lr, beta1, beta2, one_minus_beta1, one_minus_beta2,
                  bias_correction1, bias_correction2, eps, weight_decay, grad_scale, seed)


@triton_op("raygpt::stochastic_round_bf16", mutates_args=("out",))
def _stochastic_round_op(x: torch.Tensor, out: torch.Tensor, seg_table: torch.Tensor,
                         block_table: torch.Tensor, block: int, max_pieces: int,
                         seed: int) -> None:
    _launch_stochastic_round(wrap_triton, x, out, seg_table, block_table, block, max_pieces,
                             seed)


@triton_op("raygpt::cross_entropy_grad", mutates_args=())
def _cross_entropy_grad_op(L: torch.Tensor, t: torch.Tensor, vocab_size: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor]:
    return _launch_cross_entropy_grad(wrap_triton, L, t, vocab_size)


# ---------------------------------------------------------------------------------------------
# Entry points. raygpt.ops dispatches CUDA tensors here, which go through the custom ops. CPU
# tensors are accepted only under TRITON_INTERPRET=1 and run the same launchers in Triton's
# interpreter (the parity tests on machines without a GPU do this in a subprocess).

def _identity(kernel):
    return kernel


def _interpreting(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return False
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"):
        raise ValueError(f"raygpt.ops.triton_kernels: got a {t.device} tensor; the Triton path "
                         "needs CUDA tensors, or TRITON_INTERPRET=1 set before Triton's import")
    return True


def global_norm_squared(grad: torch.Tensor) -> torch.Tensor:
    if _interpreting(grad):
        return _launch_global_norm_squared(grad, _identity)
    return _global_norm_squared_op(grad)


def adamw_update(param, grad, m, v, master, segments: Segments, *, lr, beta1, beta2, eps,
                 weight_decay, grad_scale, step, seed) -> None:
    check_adamw_args(param, grad, m, v, master, segments)
    s = AdamWScalars.make(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          grad_scale=grad_scale, step=step)
    args = (param, grad, m, v, master, segments.seg_table, segments.block_table, segments.block,
            segments.max_pieces, s.lr, s.beta1, s.beta2, s.one_minus_beta1, s.one_minus_beta2,
            s.bias_correction1, s.bias_correction2, s.eps, s.weight_decay, s.grad_scale,
            int(seed) & 0xFFFFFFFF)
    if _interpreting(param):
        _launch_adamw(_identity, *args)
    else:
        _adamw_update_op(*args)


def stochastic_round_bf16(x: torch.Tensor, segments: Segments, seed: int, *,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Round x into `out` (a new bf16 tensor if None; copy_master_to_params passes param)."""
    if x.dtype != torch.float32 or x.dim() != 1 or x.numel() != segments.numel:
        raise ValueError(f"stochastic_round_bf16: expected fp32 1-D tensor of {segments.numel} "
                         f"elements, found {x.dtype} of shape {tuple(x.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    elif out.dtype != torch.bfloat16 or out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"stochastic_round_bf16: out must be a contiguous bf16 tensor of shape "
                         f"{tuple(x.shape)}, found {out.dtype} {tuple(out.shape)}")
    args = (x, out, segments.seg_table, segments.block_table, segments.block,
            segments.max_pieces, int(seed) & 0xFFFFFFFF)
    if _interpreting(x):
        _launch_stochastic_round(_identity, *args)
    else:
        _stochastic_round_op(*args)
    return out


def cross_entropy_grad(L: torch.Tensor, t: torch.Tensor, vocab_size: int):
    if _interpreting(L):
        return _launch_cross_entropy_grad(_identity, L, t, vocab_size)
    return _cross_entropy_grad_op(L, t, vocab_size)
