"""The plain-PyTorch twin of raygpt's optimizer kernels, and the `Segments` table both paths share.

This module is the specification of record for the math the Triton kernels implement:

* `global_norm_squared`: sum of squares of a flat gradient buffer, accumulated in fp32.
* `adamw_update`: llm.c's AdamW (decoupled weight decay, bias correction), one pass over a flat
  shard, with the fp32 master weights written first and the bf16 working weights derived from
  them by `stochastic_round_bf16`.
* `attention_forward` / `attention_backward`: causal self-attention split as FlashAttention
  splits it (the forward keeps the row log-sum-exp, the backward recomputes the probabilities).
* `embedding_backward`: the token embedding's weight gradient.
* the counter-based hash behind stochastic rounding, written with int64 torch ops masked to 32
  bits, so a CPU reference and the GPU kernel round the same fp32 value to the same bf16 bits.

Everything is vectorised over the whole shard; the only Python loop is over the (at most ~16 in
llm.c's layout) tensor pieces of a shard, to build per-element counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# ---------------------------------------------------------------------------------------------
# The hash. mix32 is a 32-bit integer finaliser (xorshift-multiply, constants from the public
# "lowbias32" search of Wellons' hash-prospector); every step is a bijection on 32-bit words, so
# for a fixed key, distinct counters never collide. hash2(key, counter) feeds the counter through
# one mix, folds in the key, and mixes again:
#
#     hash2(key, counter) = mix32(mix32(counter + GOLDEN) ^ key)        (all mod 2**32)
#
# tensor_seed(seed, t)    = hash2(seed, t)             t: tensor id in the full model's order
# random_bits(seed, t, i) = hash2(tensor_seed, i) >> 16   i: element index inside tensor t
#
# The functions accept Python ints or int64 torch tensors holding values in [0, 2**32); the
# Triton kernel computes the same thing in uint32 arithmetic.

MASK32 = 0xFFFFFFFF
MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B
GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: keeps counter 0 away from mix32's fixed point 0

BF16_NAN_BITS = 0x7FC0  # the quiet NaN torch and CUDA produce for bf16


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) without leaving int64: split c into 16-bit halves.

    x * c = x * c_lo + (x * c_hi) << 16; each product is < 2**48, and only the low 16 bits of
    x * c_hi survive the shift modulo 2**32.
    """
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (x * c_lo + (((x * c_hi) & 0xFFFF) << 16)) & MASK32


def mix32(x):
    """32-bit integer finaliser: a bijection on [0, 2**32) with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL2)
    x = x ^ (x >> 16)
    return x


def hash2(key, counter):
    """Counter-based hash of (key, counter), both in [0, 2**32) -> [0, 2**32)."""
    return mix32(mix32((counter + GOLDEN) & MASK32) ^ key)


def tensor_seed(seed: int, tensor_id: int) -> int:
    """Per-tensor rounding seed from the step seed and the tensor's index in the model."""
    return hash2(seed & MASK32, tensor_id & MASK32)


# ---------------------------------------------------------------------------------------------
# Segments: which tensors a flat shard [lo, hi) holds.

# Elements per program of the elementwise Triton kernels (AdamW, stochastic rounding): the default
# block of the Segments block table, which the kernels then use.
ELEMENTWISE_BLOCK = 1024


@dataclass(frozen=True)
class Piece:
    """The part of one model tensor that lies in the shard."""

    start: int  # first element, relative to the shard
    length: int
    tensor_id: int  # index in Segments.sizes
    offset: int  # index inside the tensor of the piece's first element
    decay: bool


@dataclass(frozen=True, eq=False)
class Segments:
    """The tensors inside a flat buffer, seen from the shard [lo, hi) that one rank updates.

    Built once per run by `Segments.build`. Holds, on the target device:

    * `seg_table`  int64 (5, P): per piece: start (shard-relative), end, tensor id, offset of the
      start inside its tensor, decay flag. Pieces are the non-empty intersections of tensors with
      the shard, in buffer order, so they tile [0, numel).
    * `block_table` int64 (2, B): for each `block`-sized block of the shard (ELEMENTWISE_BLOCK
      unless tuning), the first and last piece it touches. Blocks are aligned to the shard, not
      to tensors, so loads and stores stay vectorised; a kernel program visits the pieces of its
      block (`max_pieces` at most: 2 or 3 for GPT-2) to find each element's tensor id, index
      and decay flag.

    The Python-side `pieces` drive the reference path. Tensor ids and element indices are those
    of the whole model, so every shard rounds an element exactly as the unsharded buffer does.
    """

    sizes: tuple[int, ...]
    decay: tuple[bool, ...]
    lo: int
    hi: int
    pieces: tuple[Piece, ...]
    seg_table: torch.Tensor
    block_table: torch.Tensor
    block: int  # elements per block of block_table (the elementwise kernels' BLOCK)
    max_pieces: int  # the most pieces any one block touches (>= 1)
    device: torch.device
    # the reference AdamW's decay mask, per device, built on its first step (never handed out)
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        """Elements in the whole (unsharded) flat buffer."""
        return sum(self.sizes)

    @property
    def numel(self) -> int:
        """Elements in the shard."""
        return self.hi - self.lo

    @staticmethod
    def build(sizes: list[int], decay: list[bool], lo: int = 0, hi: int | None = None,
              device: torch.device | str = "cpu", *, block: int = ELEMENTWISE_BLOCK
              ) -> "Segments":
        sizes = tuple(int(s) for s in sizes)
        decay = tuple(bool(d) for d in decay)
        if len(sizes) != len(decay):
            raise ValueError(f"Segments.build: sizes has {len(sizes)} entries but decay has "
                             f"{len(decay)}; expected one decay flag per tensor")
        if any(s < 0 for s in sizes):
            raise ValueError(f"Segments.build: sizes must be >= 0, found {sizes}")
        if any(s > MASK32 + 1 for s in sizes):
            # the hash counter is the 32-bit element index inside a tensor
            raise ValueError("Segments.build: a tensor has more than 2**32 elements; the "
                             "stochastic-rounding counter is 32-bit")
        total = sum(sizes)
        hi = total if hi is None else int(hi)
        lo = int(lo)
        if not 0 <= lo <= hi <= total:
            raise ValueError(f"Segments.build: shard [lo, hi) = [{lo}, {hi}) must satisfy "
                             f"0 <= lo <= hi <= total = {total}")
        device = torch.device(device)

        pieces = []
        tensor_start = 0
        for tid, (size, dec) in enumerate(zip(sizes, decay)):
            a, b = max(lo, tensor_start), min(hi, tensor_start + size)
            if a < b:
                pieces.append(Piece(a - lo, b - a, tid, a - tensor_start, dec))
            tensor_start += size

        seg = torch.tensor([[p.start, p.start + p.length, p.tensor_id, p.offset, int(p.decay)]
                            for p in pieces], dtype=torch.int64).reshape(-1, 5)
        seg_table = seg.t().contiguous()

        # block k covers [k*block, min((k+1)*block, n)); its first/last piece by binary search on
        # the piece ends (pieces tile the shard, so the search never falls off the table).
        if block < 16 or block & (block - 1):
            raise ValueError(f"Segments.build: block must be a power of two >= 16, found {block}")
        n = hi - lo
        n_blocks = -(-n // block)
        first_elem = torch.arange(n_blocks, dtype=torch.int64) * block
        last_elem = torch.clamp(first_elem + block, max=n) - 1
        ends = seg_table[1]
        block_table = torch.stack([torch.searchsorted(ends, first_elem, right=True),
                                   torch.searchsorted(ends, last_elem, right=True)])

        max_pieces = int((block_table[1] - block_table[0]).max()) + 1 if n_blocks else 1
        return Segments(sizes, decay, lo, hi, tuple(pieces), seg_table.to(device),
                        block_table.contiguous().to(device), block, max_pieces, device)

    def decay_mask(self, device: torch.device | None = None) -> torch.Tensor:
        """fp32 (numel,): 1.0 where the element's tensor takes weight decay, else 0.0."""
        device = self.device if device is None else device
        flags = torch.tensor([float(p.decay) for p in self.pieces], dtype=torch.float32)
        lengths = torch.tensor([p.length for p in self.pieces], dtype=torch.int64)
        return torch.repeat_interleave(flags, lengths).to(device)

    def _decay_mask_kept(self, device: torch.device) -> torch.Tensor:
        """decay_mask(device), built once per device: the reference AdamW reads it every step."""
        if device not in self._masks:
            self._masks[device] = self.decay_mask(device)
        return self._masks[device]

    def random_bits(self, seed: int, device: torch.device | None = None) -> torch.Tensor:
        """int64 (numel,): the 16 rounding bits of every element of the shard for this seed."""
        device = self.device if device is None else device
        parts = []
        for p in self.pieces:
            counter = torch.arange(p.offset, p.offset + p.length, dtype=torch.int64,
                                   device=device)
            parts.append(hash2(tensor_seed(seed, p.tensor_id), counter) >> 16)
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=device)
        return torch.cat(parts)


# ---------------------------------------------------------------------------------------------
# The reference ops.

def global_norm_squared(grad: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a flat grad buffer (fp32 or bf16), accumulated in fp32; 0-dim fp32."""
    x = grad.to(torch.float32)
    return (x * x).sum()


def stochastic_round_bf16(x: torch.Tensor, segments: Segments, seed: int) -> torch.Tensor:
    """Round fp32 x (the shard's values) to bf16, up or down with probability by distance.

    bf16 is the upper half of an fp32 word. Adding a uniform 16-bit r to the fp32 bits carries
    into the upper half with probability (low 16 bits) / 2**16, which is exactly the value's
    fractional distance to the next bf16 away from zero, so E[round(x)] = x (sign-magnitude
    format: the same holds for negatives, and for subnormals, whose spacing is also linear).

    Special values: +-Inf stays +-Inf (its low bits are zero, so nothing carries). NaN becomes
    the canonical bf16 quiet NaN 0x7FC0 (adding r could otherwise carry a NaN into -0.0 or turn
    it into Inf). A finite value above the largest bf16 (3.3895e38) rounds up to Inf with
    probability by distance, as rounding to the next bf16 value would.
    """
    if x.dtype != torch.float32 or x.dim() != 1 or x.numel() != segments.numel:
        raise ValueError(f"stochastic_round_bf16: expected fp32 1-D tensor of {segments.numel} "
                         f"elements, found {x.dtype} of shape {tuple(x.shape)}")
    r = segments.random_bits(seed, device=x.device)
    return round_with_bits(x, r)


def round_with_bits(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """bf16 whose bits are the upper 16 bits of (fp32 bits of x + r), NaN -> 0x7FC0."""
    bits = x.view(torch.int32).to(torch.int64) & MASK32
    upper = ((bits + r) >> 16) & 0xFFFF
    upper = torch.where(torch.isnan(x), BF16_NAN_BITS, upper)
    # [0, 65536) -> the int16 with the same 16 bits
    return ((upper ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16)


@dataclass(frozen=True)
class AdamWScalars:
    """The per-step scalars, computed once in double precision and handed to fp32 math."""

    lr: float
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    bias_correction1: float  # 1 - beta1**step
    bias_correction2: float  # 1 - beta2**step
    eps: float
    weight_decay: float
    grad_scale: float

    @staticmethod
    def make(*, lr, beta1, beta2, eps, weight_decay, grad_scale, step) -> "AdamWScalars":
        if step < 1:
            raise ValueError(f"adamw_update: step counts from 1 (llm.c's t), found {step}")
        return AdamWScalars(float(lr), float(beta1), float(beta2), 1.0 - beta1, 1.0 - beta2,
                            1.0 - beta1 ** step, 1.0 - beta2 ** step, float(eps),
                            float(weight_decay), float(grad_scale))


def check_adamw_args(param, grad, m, v, master, segments: Segments) -> None:
    """Shapes, dtypes and devices of an AdamW call; raises ValueError naming the argument."""
    n = segments.numel
    named = {"param": param, "grad": grad, "m": m, "v": v}
    if master is not None:
        named["master"] = master
    for name, t in named.items():
        if t.dim() != 1 or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"adamw_update: {name} must be a contiguous 1-D tensor of the "
                             f"shard's {n} elements, found shape {tuple(t.shape)}")
        if t.device != param.device:
            raise ValueError(f"adamw_update: {name} is on {t.device}, param on {param.device}")
    for name in ("m", "v") + (("master",) if master is not None else ()):
        if named[name].dtype != torch.float32:
            raise ValueError(f"adamw_update: {name} must be fp32, found {named[name].dtype}")
    if master is None and param.dtype != torch.float32:
        raise ValueError(f"adamw_update: param is {param.dtype} and master is None; "
                         "a bf16 param needs fp32 master weights")
    if master is not None and param.dtype != torch.bfloat16:
        raise ValueError(f"adamw_update: with master weights param must be bf16, "
                         f"found {param.dtype}")
    if grad.dtype != param.dtype:
        raise ValueError(f"adamw_update: grad is {grad.dtype}, expected the working dtype "
                         f"{param.dtype}")


def adamw_update(param, grad, m, v, master, segments: Segments, *, lr, beta1, beta2, eps,
                 weight_decay, grad_scale, step, seed) -> None:
    """llm.c's AdamW over one flat shard, in place. See raygpt.ops.adamw_update."""
    check_adamw_args(param, grad, m, v, master, segments)
    s = AdamWScalars.make(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          grad_scale=grad_scale, step=step)
    # Only correctly rounded elementwise ops (no fused alpha/addcdiv, which may use FMA in the
    # vectorised loop and not in its tail): each element's result then does not depend on its
    # position, and a sharded update equals the unsharded one bit for bit. The math is
    #   g = grad * grad_scale;  m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
    #   w -= lr (m / bc1 / (sqrt(v / bc2) + eps) + (weight_decay * decay) w)
    # each op as written there (so the same bits), computed in two scratch tensors (g, t) in
    # place: a new tensor per op would spend most of a CPU step's optimizer time in page faults.
    w = master if master is not None else param
    g = grad.to(torch.float32, copy=True).mul_(s.grad_scale)  # never grad itself (fp32 too)
    t = torch.mul(g, s.one_minus_beta1)
    m.mul_(s.beta1).add_(t)
    torch.mul(g, g, out=t).mul_(s.one_minus_beta2)
    v.mul_(s.beta2).add_(t)
    torch.div(m, s.bias_correction1, out=g)                          # m_hat
    torch.div(v, s.bias_correction2, out=t).sqrt_().add_(s.eps)      # sqrt(v_hat) + eps
    g.div_(t)
    torch.mul(segments._decay_mask_kept(w.device), s.weight_decay, out=t).mul_(w)  # wd * w
    w.sub_(g.add_(t).mul_(s.lr))
    if master is not None:
        param.copy_(stochastic_round_bf16(master, segments, seed))


def copy_master_to_params(param, master, segments: Segments, seed: int) -> None:
    """Re-derive the working weights from the fp32 master weights, as adamw_update does."""
    if param.dtype == torch.float32:
        param.copy_(master)
    else:
        param.copy_(stochastic_round_bf16(master, segments, seed))


# ---------------------------------------------------------------------------------------------
# The classifier's softmax: one chunk of logits L (n, Vp) in the working dtype, targets t (n,)
# with -1 = ignore, columns j >= V (the padded vocabulary) excluded. All statistics in fp32.

def logit_statistics(L: torch.Tensor, t: torch.Tensor, vocab_size: int):
    """Lf (n, Vp) fp32 with padded columns -inf, and per row (n,): lse = logsumexp(Lf), the
    target logit Lf[t] (t = -1 reads column 0), the max and the min over the real columns."""
    Lf, lse, target_logit, row_max, row_min, _ = _statistics_and_scratch(L, t, vocab_size)
    return Lf, lse, target_logit, row_max, row_min


def _statistics_and_scratch(L: torch.Tensor, t: torch.Tensor, vocab_size: int):
    """logit_statistics and the (n, Vp) fp32 tensor it used for exp(Lf - max), free to reuse.
    In place where it can be (a (n, Vp) fp32 tensor per op would be most of a CPU step's loss)."""
    Lf = L.to(torch.float32, copy=True)                                    # (n, Vp), own copy
    row_min = Lf[:, :vocab_size].amin(dim=1)       # (n,); a min is exact in any order
    Lf[:, vocab_size:] = float("-inf")
    row_max = Lf.amax(dim=1)                                               # (n,)
    scratch = torch.sub(Lf, row_max[:, None]).exp_()
    lse = row_max + torch.log(scratch.sum(dim=1))                          # (n,)
    target_logit = Lf.gather(1, t.clamp(min=0)[:, None])[:, 0]            # (n,)
    return Lf, lse, target_logit, row_max, row_min, scratch


def cross_entropy_grad(L: torch.Tensor, t: torch.Tensor, vocab_size: int):
    """(G, lse, target_logit, row_max, row_min): G (n, Vp) in L's dtype is the gradient of the
    summed cross-entropy of the kept rows with respect to L, keep (softmax(Lf) - onehot(t)),
    exactly 0 in the padded columns and in ignored rows; the rest as `logit_statistics`."""
    Lf, lse, target_logit, row_max, row_min, p = _statistics_and_scratch(L, t, vocab_size)
    torch.sub(Lf, lse[:, None], out=p).exp_()                              # (n, Vp), 0 in pads
    onehot = torch.arange(L.shape[1], device=L.device)[None, :] == t[:, None]
    p.sub_(onehot.float())          # no index by data (a graph break under torch.compile)
    p.masked_fill_((t == -1)[:, None], 0.0)                                # ignored rows
    return p.to(L.dtype), lse, target_logit, row_max, row_min


# ---------------------------------------------------------------------------------------------
# Causal self-attention, FlashAttention's split: the forward returns the output and the row
# log-sum-exp of the scaled scores, the backward recomputes the probabilities from them. q, k, v
# (B, H, T, D) in any layout; statistics and sums in fp32, outputs in q's dtype.
#
#   S = q k^T / sqrt(D) with S[i, j] = -inf for j > i      lse = logsumexp(S, -1)   (B, H, T)
#   P = exp(S - lse)      o = P v
#   delta = rowsum(do * o)      dP = do v^T      dS = P (dP - delta)
#   dq = dS k / sqrt(D)     dk = dS^T q / sqrt(D)     dv = P^T do

ATTENTION_HEAD_DIMS = (16, 32, 64, 128)  # the kernel's tl.arange needs a power of two, tl.dot 16+


def check_attention_args(q, k, v) -> None:
    """A clear error for what the kernels cannot take (checked on every path)."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"causal attention: expected q, k, v of one shape (B, H, T, D), found "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"causal attention: head dim must be one of {ATTENTION_HEAD_DIMS}, "
                         f"found {q.shape[-1]}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.bfloat16, torch.float16,
                                                            torch.float32):
        raise ValueError(f"causal attention: expected q, k, v of one float dtype, found "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")


def _causal_probabilities(q, k, lse=None):
    T, D = q.shape[-2], q.shape[-1]
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D)          # (B, H, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    s = s.masked_fill(future, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)                                  # (B, H, T)
    return torch.exp(s - lse[..., None]), lse


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(o, lse): o (B, H, T, D) in q's dtype, lse (B, H, T) fp32."""
    p, lse = _causal_probabilities(q, k)
    return (p @ v.float()).to(q.dtype), lse


def attention_backward(do, q, k, v, o, lse):
    """(dq, dk, dv) for the upstream gradient do of attention_forward's o, in q's dtype."""
    D = q.shape[-1]
    p, _ = _causal_probabilities(q, k, lse)
    do_f = do.float()
    delta = (do_f * o.float()).sum(-1)                                    # (B, H, T)
    dv = p.transpose(-1, -2) @ do_f
    ds = p * (do_f @ v.float().transpose(-1, -2) - delta[..., None])
    dq = (ds @ k.float()) / math.sqrt(D)
    dk = (ds.transpose(-1, -2) @ q.float()) / math.sqrt(D)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# The token embedding's weight gradient: dW[r] = sum of grad[i] over the positions i whose id
# is r, in fp32, in the order of the positions (the kernel sums the same rows, sorted by id with
# a stable sort, so in the same order, but in blocks). Rows no id names get 0.

def embedding_backward(grad: torch.Tensor, ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """grad (N, C), ids (N,) int -> dW (num_rows, C) in grad's dtype."""
    out = torch.zeros(num_rows, grad.shape[1], dtype=torch.float32, device=grad.device)
    out.index_put_((ids.long(),), grad.float(), accumulate=True)
    return out.to(grad.dtype)
