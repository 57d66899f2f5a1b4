"""The fused classifier loss: GPT-2's tied lm_head and cross-entropy (plus z-loss and the max
|logit|) over row chunks, its input gradients computed in the forward pass, so the (B*T, Vp)
logits are never held whole. `GPT.forward` calls it for loss_impl "fused"; its reference is the
full-logits path in raygpt.model.gpt (tests/model/test_classifier_loss.py holds them equal)."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from raygpt import ops
from raygpt.model.shapes import CE_CHUNK_ROWS
from raygpt.ops.reference import logit_statistics

def ce_chunk_rows_for(device_type: str) -> int:
    """The fused loss's default rows of the (B*T, Vp) logits held at once on a torch device type
    ("cuda", "cpu", ...): model.shapes.CE_CHUNK_ROWS. Fewer, larger chunks mean fewer fp32
    read-modify-writes of the (Vp, C) weight-gradient accumulator, smaller ones less memory
    (a CPU's eager loss holds fp32 temporaries per chunk). B*T need not be a multiple."""
    return CE_CHUNK_ROWS["gpu" if device_type == "cuda" else "cpu"]


# ---------------------------------------------------------------------- the fused classifier loss
#
# Notation for one chunk of n rows: X (n, C) final hidden states, W (Vp, C) the tied lm_head,
# t (n,) targets with -1 = ignore, keep = t != -1, logits L = X W^T (n, Vp) in the working
# dtype, Lf = L in fp32 with the padded columns j >= V set to -inf. Per row:
#   lse = logsumexp(Lf)                 loss_row = lse - Lf[t]        z_row = z lse^2
#   p = softmax(Lf) = exp(Lf - lse)     (exactly 0 in the padded columns)
#   d loss_sum / d L = keep (p - onehot(t))     =: G
#   d z_sum    / d L = keep 2 z lse p           =  s p,  s = keep 2 z lse (a per-row scalar)
# and for either, d/dX = (d/dL) W, d/dW = (d/dL)^T X. Both losses are sums, so their upstream
# gradients g_loss, g_z are scalars: the gradients can be computed in the forward pass, where
# L is at hand, and merely scaled in backward. That is the whole trick: the (B*T, Vp) logits
# are never stored and never recomputed; under torch.compile Inductor turns each chunk into one
# matmul for L, one kernel (online max / sum-exp / min, target gather, then G written in bf16
# over L's buffer) and the two gradient matmuls the textbook backward does anyway, so no fp32
# (n, Vp) tensor reaches memory (eagerly, the fp32 temporaries exist per chunk only). z > 0
# costs two more matmuls per chunk, P @ W and P^T (s X) (P = keep p in bf16), because g_z is
# only known in backward. Padded columns have p = 0, so W's padded rows get exactly zero
# gradient. The textbook path, compiled, writes an fp32 (B*T, V) softmax in forward for its
# backward to read (13 GB at GPT-2 d12, B*T = 65536), which is what this avoids.
# Gradients are first-order only (once_differentiable): a double backward raises.


def _chunks(n_rows: int, chunk_rows: int):
    return [(lo, min(lo + chunk_rows, n_rows)) for lo in range(0, n_rows, chunk_rows)]


class _FusedClassifierLoss(torch.autograd.Function):
    """(x (N, C), weight (Vp, C), targets (N,)) -> (loss_sum, z_sum, max |logit|), fp32 scalars,
    with the input gradients computed in forward (see the notes above)."""

    @staticmethod
    def forward(ctx, x, weight, targets, vocab_size: int, z_loss: float, chunk_rows: int,
                ce_kernel: bool):
        N, with_z = x.shape[0], z_loss > 0.0
        loss_sum = torch.zeros((), dtype=torch.float32, device=x.device)
        z_sum = torch.zeros((), dtype=torch.float32, device=x.device)
        max_abs = torch.full((), float("-inf"), dtype=torch.float32, device=x.device)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)    # (Vp, C)
        dw_z = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if with_z else None
        dx_parts, dx_z_parts = [], []
        for lo, hi in _chunks(N, chunk_rows):
            X, t = x[lo:hi], targets[lo:hi]                                    # (n, C), (n,)
            L = X @ weight.t()                                                 # (n, Vp)
            keep = t != -1
            if with_z or not ce_kernel:
                Lf, lse, target_logit, row_max, row_min = logit_statistics(L, t, vocab_size)
                p = torch.exp(Lf - lse[:, None])                               # (n, Vp), 0 in pads
                onehot = torch.arange(L.shape[1], device=L.device)[None, :] == t[:, None]
                G = torch.where(keep[:, None], p - onehot.float(), 0.0).to(L.dtype)  # (n, Vp)
            else:  # the same G and statistics, one kernel (raygpt.ops)
                G, lse, target_logit, row_max, row_min = ops.cross_entropy_grad(L, t, vocab_size)
            loss_sum = loss_sum + torch.where(keep, lse - target_logit, 0.0).sum()
            max_abs = torch.maximum(max_abs, torch.maximum(row_max.amax(), -row_min.amin()))
            dx_parts.append((G @ weight).float())                              # (n, C)
            dw = dw + (G.t() @ X).float()                                      # (Vp, C)
            if with_z:
                s = torch.where(keep, 2.0 * z_loss * lse, 0.0)                 # (n,)
                z_sum = z_sum + z_loss * torch.where(keep, lse.square(), 0.0).sum()
                P = torch.where(keep[:, None], p, 0.0).to(L.dtype)             # (n, Vp)
                dx_z_parts.append(s[:, None] * (P @ weight).float())           # (n, C)
                dw_z = dw_z + (P.t() @ (s[:, None] * X.float()).to(X.dtype)).float()
        dx = torch.cat(dx_parts)                                               # (N, C) fp32
        ctx.with_z = with_z
        ctx.dtypes = (x.dtype, weight.dtype)
        if with_z:
            ctx.save_for_backward(dx, dw, torch.cat(dx_z_parts), dw_z)
        else:
            ctx.save_for_backward(dx, dw)
        # one call: each call replaces the previous set
        ctx.mark_non_differentiable(*((max_abs,) if with_z else (z_sum, max_abs)))
        return loss_sum, z_sum, max_abs

    @staticmethod
    @once_differentiable
    def backward(ctx, g_loss, g_z, g_max_abs):
        x_dtype, w_dtype = ctx.dtypes
        if ctx.with_z:
            dx, dw, dx_z, dw_z = ctx.saved_tensors
            grad_x = dx * g_loss + dx_z * g_z
            grad_w = dw * g_loss + dw_z * g_z
        else:
            dx, dw = ctx.saved_tensors
            grad_x, grad_w = dx * g_loss, dw * g_loss
        return grad_x.to(x_dtype), grad_w.to(w_dtype), None, None, None, None, None


def fused_classifier_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          vocab_size: int, *, z_loss: float = 0.0,
                          chunk_rows: int | None = None, ce_kernel: bool = True):
    """Cross-entropy of the classifier x @ weight^T over the first vocab_size columns, in row
    chunks, without the full logits. x (N, C) final hidden states, weight (Vp, C), targets (N,)
    with -1 = ignore. Returns fp32 scalars (loss_sum, z_sum, max_abs_logit):
    loss_sum = sum over kept rows of CE, z_sum = z_loss * sum over kept rows of lse^2 (a 0 that
    carries no gradient when z_loss is 0), max_abs_logit = max |logit| over every row and the
    real columns (no gradient). With grad enabled the input gradients are computed here and
    backward only scales them; without (evaluation), only the statistics are computed.
    ce_kernel: the softmax gradient without z-loss as raygpt.ops.cross_entropy_grad (one Triton
    kernel on CUDA, one read of the logits), else as PyTorch ops (which Inductor fuses into a
    kernel that reads each row three times); z-loss keeps the PyTorch ops, as it also needs
    the softmax itself. chunk_rows None: ce_chunk_rows_for(x's device)."""
    if chunk_rows is None:
        chunk_rows = ce_chunk_rows_for(x.device.type)
    if chunk_rows < 1:
        raise ValueError(f"fused_classifier_loss: expected chunk_rows >= 1, found {chunk_rows}")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _FusedClassifierLoss.apply(x, weight, targets, vocab_size, float(z_loss), chunk_rows,
                                          ce_kernel)
    loss_sum = torch.zeros((), dtype=torch.float32, device=x.device)
    z_sum = torch.zeros((), dtype=torch.float32, device=x.device)
    max_abs = torch.full((), float("-inf"), dtype=torch.float32, device=x.device)
    for lo, hi in _chunks(x.shape[0], chunk_rows):
        t = targets[lo:hi]
        _, lse, target_logit, row_max, row_min = logit_statistics(x[lo:hi] @ weight.t(), t,
                                                                   vocab_size)
        keep = t != -1
        loss_sum = loss_sum + torch.where(keep, lse - target_logit, 0.0).sum()
        if z_loss > 0.0:
            z_sum = z_sum + z_loss * torch.where(keep, lse.square(), 0.0).sum()
        max_abs = torch.maximum(max_abs, torch.maximum(row_max.amax(), -row_min.amin()))
    return loss_sum, z_sum, max_abs
