"""GPT-2 on one device: the network, its initialisation, the loss, sampling, and the map between
PyTorch parameters and llm.c's 16 parameter tensors (its file: raygpt.llmc.model_file). It knows
nothing of Ray or torch.distributed. Module names are GPT-2's (`transformer.wte`,
`h[i].attn.c_attn`, `ln_f`, `lm_head`), so a nanoGPT or llm.c reader finds them where expected.

Dimension letters: B batch, T time, C channels (n_embd), nh heads, hs head size = C / nh,
L layers, V vocab (50257), Vp padded vocab (50304, a multiple of 128 for fast matmuls).

Padded vocabulary (as llm.c): wte and the tied lm_head have Vp rows. Rows >= V start at zero and
get no gradient (no token >= V, the softmax covers V columns): they stay zero the whole run.

The loss (`loss_impl`): "reference" holds the full (B*T, Vp) logits and takes an fp32
cross-entropy; "fused" (the default, `fused_classifier_loss`) walks the rows in chunks and writes
the logits' gradient in the forward pass (raygpt.ops.cross_entropy_grad). Both give the same loss,
z-loss, max |logit| and gradients.

`llmc_parameter_layout` lists the Parameters behind each llm.c tensor, in llm.c's order;
raygpt/train/optim.py re-points them at slices of one flat buffer, so nothing here caches a parameter
tensor (the weight tie is one Parameter shared by wte and lm_head, which survives that).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from raygpt import ops
from raygpt.model.shapes import MODEL_SHAPES
from raygpt.model.classifier_loss import fused_classifier_loss
from raygpt.ops.reference import ATTENTION_HEAD_DIMS


# ---------------------------------------------------------------------- configuration

@dataclass
class GPTConfig:
    """Shape of a GPT-2 network; the same fields as llm.c's model file header."""

    block_size: int = 1024
    """Longest sequence (llm.c's max_seq_len); wpe has this many rows."""
    vocab_size: int = 50257
    """Real vocabulary, V: the softmax and the loss run over these columns only."""
    padded_vocab_size: int = 50304
    """Rows of wte / lm_head, Vp >= V (llm.c pads to a multiple of 128)."""
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "padded_vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}: expected an integer >= 1, found {value!r}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"GPTConfig.padded_vocab_size: expected >= vocab_size "
                             f"{self.vocab_size}, found {self.padded_vocab_size}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd: expected a multiple of n_head {self.n_head}, "
                             f"found {self.n_embd}")

    @classmethod
    def from_depth(cls, depth: int, block_size: int = 1024) -> "GPTConfig":
        """llm.c's `-e dN`: depth -> (channels, heads) from raygpt.model.shapes."""
        if depth not in MODEL_SHAPES:
            raise ValueError(f"GPTConfig.from_depth: expected a depth in {sorted(MODEL_SHAPES)}, "
                             f"found {depth!r}")
        channels, heads = MODEL_SHAPES[depth]
        return cls(block_size=block_size, n_layer=depth, n_head=heads, n_embd=channels)


# ---------------------------------------------------------------------- implementation choices

# How GPT computes its loss and which kernels it runs. A GPT built without a choice takes these
# defaults; a run's choices are TrainConfig's performance fields (--loss-impl, --ce-chunk-rows,
# --sdpa-backend, --embedding-impl), which raygpt.train.loop.build_model hands to the GPT, and the
# benches set those same fields.
LOSS_IMPLS = ("reference", "fused")
DEFAULT_LOSS_IMPL = "fused"
# Rows of the logits the fused loss holds at once; None = by the device (classifier_loss.ce_chunk_rows_for)
DEFAULT_CE_CHUNK_ROWS = None


# Attention kernel preference: "default" = PyTorch's own choice (flash attention on Hopper),
# "cudnn" = cuDNN's fused attention first, then flash / memory-efficient / math (a preference:
# where cuDNN cannot run, e.g. on the CPU, the usual kernels do), "flash" = FlashAttention-2 first
# (its backward has a deterministic variant PyTorch picks in --deterministic mode), "raygpt" =
# raygpt.ops.causal_attention (Triton on CUDA: forward and backward deterministic, no atomics;
# the plain-PyTorch reference elsewhere), which --deterministic is to pick on GPUs (kernels_for).
SDPA_BACKENDS = ("default", "cudnn", "flash", "raygpt")
DEFAULT_SDPA_BACKEND = "default"
# Token embedding: "torch" = nn.Embedding (its CUDA backward is a scatter-add, deterministic
# under torch.use_deterministic_algorithms only through a slow sort-based kernel),
# "raygpt" = raygpt.ops.embedding (a Triton backward over sorted ids, no atomics) for wte,
# and wpe read as a slice, whose gradient is a plain sum over the batch.
EMBEDDING_IMPLS = ("torch", "raygpt")
DEFAULT_EMBEDDING_IMPL = "torch"
# Activation recomputation (llm.c's -r): what a block holds from its forward pass for backward.
# 0 = everything backward reads; 1 = the MLP half (ln_2, c_fc, GELU, c_proj) recomputed in
# backward from the residual stream it reads, so ln_2's output and the (B, T, 4C) pre- and
# post-GELU activations are not held (llm.c's -r 1 recomputes the GELU alone), for one more
# c_fc matmul; 2 = the whole block recomputed from its input, one (B, T, C) tensor held per
# layer, for a second forward pass of every block. torch.compile's partitioner honours the
# regions (test_model's saved-bytes test measures it). The values are the same either way:
# recomputation runs the same ops on the same inputs.
RECOMPUTE_LEVELS = (0, 1, 2)
DEFAULT_RECOMPUTE = 0


def kernels_for(deterministic: bool, device_type: str, *, sdpa_backend: str = "auto",
                embedding_impl: str = "auto") -> dict:
    """The GPT kernel choices (`GPT.use_kernels`' arguments) for a run. "auto" is raygpt's
    deterministic attention and embedding backward under --deterministic on CUDA, else the
    defaults above; any other value is taken as given.

    raygpt's kernels under --deterministic because they keep nearly all of the non-deterministic
    speed where PyTorch's deterministic ones do not (docs/performance.md, "Deterministic by
    default"; bench/throughput.py's `torchdet` variant runs PyTorch's)."""
    ours = deterministic and device_type == "cuda"
    return dict(
        sdpa_backend=("raygpt" if ours else DEFAULT_SDPA_BACKEND) if sdpa_backend == "auto"
        else sdpa_backend,
        embedding_impl=("raygpt" if ours else DEFAULT_EMBEDDING_IMPL) if embedding_impl == "auto"
        else embedding_impl)


_SDPA_PRIORITY = {
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
              SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
              SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


# ---------------------------------------------------------------------- the network

class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.n_head = config.n_head
        self.c_attn = nn.Linear(C, 3 * C)  # weight (3C, C): rows are [q; k; v], llm.c's qkvw
        self.c_proj = nn.Linear(C, C)      # residual projection, attprojw
        self.sdpa_backend = "default"      # see SDPA_BACKENDS; GPT sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)    # 3 x (B, T, C)
        q = q.view(B, T, nh, hs).transpose(1, 2)    # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)    # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)    # (B, nh, T, hs)
        # softmax(q k^T / sqrt(hs) + causal mask) v; flash / memory-efficient kernel when available
        if self.sdpa_backend == "raygpt":
            y = ops.causal_attention(q, k, v)                        # (B, nh, T, hs)
        elif self.sdpa_backend in _SDPA_PRIORITY:
            with sdpa_kernel(_SDPA_PRIORITY[self.sdpa_backend], set_priority=True):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)              # heads side by side
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.c_fc = nn.Linear(C, 4 * C)    # weight (4C, C), fcw
        self.c_proj = nn.Linear(4 * C, C)  # weight (C, 4C), fcprojw, residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's GELU is the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)  # with bias, eps 1e-5 as GPT-2 / llm.c
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, recompute: int = 0) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); `recompute` a RECOMPUTE_LEVELS level."""
        if recompute == 2:
            return _recomputed(self.forward, x)
        x = x + self.attn(self.ln_1(x))  # pre-norm residual blocks, (B, T, C) throughout
        if recompute == 1:
            return x + _recomputed(self._mlp_branch, x)
        return x + self._mlp_branch(x)

    def _mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_2(x))


def _recomputed(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x), its intermediate activations recomputed in backward instead of held.
    torch.utils.checkpoint's non-reentrant form (torch.compile traces it and its partitioner
    recomputes the region); no RNG state is kept since GPT has no randomness in its forward."""
    return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False)


def _embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num, dim); on the meta device built around an empty weight instead of
    drawing its init there: PyTorch's normal_ on a meta tensor imports torch._dynamo, which would
    put the compiler's imports inside the model build of every (re)started worker, and the init
    would be overwritten anyway."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class GPT(nn.Module):
    """GPT-2. `GPT(config, init_seed=42)`: GPT-2's init drawn from a private CPU generator, so
    every rank and every device starts from the same weights (the modules are built on the meta
    device first: PyTorch's own init, which GPT-2's overwrites, is never drawn). `init_seed=None`
    leaves PyTorch's default init; `GPT.empty(config)` draws no init at all (for weights about
    to be loaded, or set later by `init_gpt2`).

    Implementation choices, each None = its default above (a run passes TrainConfig's): loss_impl
    ("reference" | "fused"), ce_chunk_rows (rows per chunk of the fused loss; None stays None,
    chosen by the device at each forward: ce_chunk_rows_for), sdpa_backend
    (SDPA_BACKENDS), embedding_impl (EMBEDDING_IMPLS); ce_kernel (the fused loss's softmax
    gradient as raygpt's kernel, see fused_classifier_loss); recompute (RECOMPUTE_LEVELS, the
    activations recomputed in backward). They change speed, memory and determinism, not the
    function computed (`use_kernels` changes sdpa_backend and embedding_impl later)."""

    def __init__(self, config: GPTConfig, *, init_seed: int | None = 42,
                 loss_impl: str | None = None, ce_chunk_rows: int | None = None,
                 sdpa_backend: str | None = None, embedding_impl: str | None = None,
                 ce_kernel: bool = True, recompute: int | None = None):
        super().__init__()
        self.config = config
        self.loss_impl = DEFAULT_LOSS_IMPL if loss_impl is None else loss_impl
        self.ce_kernel = ce_kernel  # see fused_classifier_loss
        self.ce_chunk_rows = DEFAULT_CE_CHUNK_ROWS if ce_chunk_rows is None else ce_chunk_rows
        sdpa_backend = DEFAULT_SDPA_BACKEND if sdpa_backend is None else sdpa_backend
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(f"GPT loss_impl: expected one of {LOSS_IMPLS}, found {self.loss_impl!r}")
        if self.ce_chunk_rows is not None and (not isinstance(self.ce_chunk_rows, int)
                                               or self.ce_chunk_rows < 1):
            raise ValueError(f"GPT ce_chunk_rows: expected None or an integer >= 1, "
                             f"found {self.ce_chunk_rows!r}")
        self.recompute = DEFAULT_RECOMPUTE if recompute is None else recompute
        if self.recompute not in RECOMPUTE_LEVELS:
            raise ValueError(f"GPT recompute: expected one of {RECOMPUTE_LEVELS}, found {self.recompute!r}")
        with torch.device("meta") if init_seed is not None else contextlib.nullcontext():
            self.transformer = nn.ModuleDict(dict(
                wte=_embedding(config.padded_vocab_size, config.n_embd),  # (Vp, C)
                wpe=_embedding(config.block_size, config.n_embd),         # (maxT, C)
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            ))
            self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        if init_seed is not None:
            self.to_empty(device="cpu")  # uninitialised: init_gpt2 below sets every element
        # Weight tying (after to_empty, which gives each module its own storage): one Parameter, counted once, its gradient the sum of both uses.
        self.lm_head.weight = self.transformer.wte.weight
        self.use_kernels(sdpa_backend=sdpa_backend, embedding_impl=embedding_impl)
        # Largest |logit| over the real vocab in the last forward with targets (watch metric).
        # A detached device tensor, so reading it is the caller's choice of when to sync.
        self.last_max_logit: torch.Tensor | None = None
        if init_seed is not None:
            self.init_gpt2(init_seed)

    @classmethod
    def empty(cls, config: GPTConfig, **kw) -> "GPT":
        """A GPT on the CPU whose weights are uninitialised memory, no init drawn (built on the
        meta device): for weights about to be loaded, or set by `init_gpt2`. A restarted worker
        skips GPT-2's init, seconds of one CPU thread, this way."""
        with torch.device("meta"):
            model = cls(config, init_seed=None, **kw)
        model.to_empty(device="cpu")
        model.lm_head.weight = model.transformer.wte.weight  # to_empty untied them
        return model

    def use_kernels(self, *, sdpa_backend: str | None = None,
                    embedding_impl: str | None = None) -> "GPT":
        """Set the attention and embedding kernels (None = the default above)."""
        sdpa_backend = DEFAULT_SDPA_BACKEND if sdpa_backend is None else sdpa_backend
        embedding_impl = DEFAULT_EMBEDDING_IMPL if embedding_impl is None else embedding_impl
        if sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"GPT sdpa_backend: expected one of {SDPA_BACKENDS}, found {sdpa_backend!r}")
        if embedding_impl not in EMBEDDING_IMPLS:
            raise ValueError(f"GPT embedding_impl: expected one of {EMBEDDING_IMPLS}, found "
                             f"{embedding_impl!r}")
        head_dim = self.config.n_embd // self.config.n_head
        if sdpa_backend == "raygpt" and head_dim not in ATTENTION_HEAD_DIMS:
            raise ValueError(f"GPT sdpa_backend 'raygpt': head dim (n_embd / n_head) must be one "
                             f"of {ATTENTION_HEAD_DIMS}, found {head_dim}")
        for block in self.transformer.h:
            block.attn.sdpa_backend = sdpa_backend
        self.embedding_impl = embedding_impl
        return self

    @torch.no_grad()
    def init_gpt2(self, seed: int) -> None:
        """GPT-2's init (llm.c's train_gpt2.py): Linear and Embedding weights N(0, 0.02), the two
        residual projections (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 L)), biases 0,
        LayerNorm weight 1 / bias 0, padded wte rows 0. Values are drawn in module order
        (wte, wpe, then per block c_attn, attn.c_proj, c_fc, mlp.c_proj) on a CPU generator and
        copied in, so the result does not depend on the device. Every element of every parameter
        is set, so it may follow `GPT.empty`, also once the parameters alias the
        optimizer's flat buffers on the device."""
        g = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)

        def normal_(p: nn.Parameter, std: float, rows: int | None = None) -> None:
            n = p.shape[0] if rows is None else rows
            values = torch.empty((n,) + tuple(p.shape[1:])).normal_(0.0, std, generator=g)
            p.zero_()
            p[:n].copy_(values)

        normal_(self.transformer.wte.weight, 0.02, rows=self.config.vocab_size)
        normal_(self.transformer.wpe.weight, 0.02)
        for block in self.transformer.h:
            for ln in (block.ln_1, block.ln_2):
                ln.weight.fill_(1.0)
                ln.bias.zero_()
            for linear, std in ((block.attn.c_attn, 0.02), (block.attn.c_proj, residual_std),
                                (block.mlp.c_fc, 0.02), (block.mlp.c_proj, residual_std)):
                normal_(linear.weight, std)
                linear.bias.zero_()
        self.transformer.ln_f.weight.fill_(1.0)
        self.transformer.ln_f.bias.zero_()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                z_loss: float = 0.0, last_only: bool = False):
        """idx (B, T) token ids.

        With targets (B, T), -1 = ignore: returns (loss_sum, z_sum), fp32 scalars, where
        loss_sum = sum over kept tokens of cross-entropy over the real V columns and
        z_sum = z_loss * sum over kept tokens of logsumexp(logits)^2 (a 0 tensor when z_loss
        is 0). The caller divides both by its token count (a token-weighted mean over the
        accumulation window) and backpropagates their sum.

        Without targets: logits (B, T, V) in fp32, or (B, 1, V) for the last position only
        when last_only (sampling)."""
        B, T = idx.shape
        V = self.config.vocab_size
        if T > self.config.block_size:
            raise ValueError(f"GPT.forward: expected a sequence of at most block_size "
                             f"{self.config.block_size} tokens, found {T}")
        if self.embedding_impl == "raygpt":
            # the same values; wpe's gradient is then a sum over the batch, no scatter
            x = ops.embedding(idx, self.transformer.wte.weight) + self.transformer.wpe.weight[:T]
        else:
            pos = torch.arange(T, dtype=torch.long, device=idx.device)    # (T,)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)      # (B, T, C)
        recompute = self.recompute if torch.is_grad_enabled() else 0  # nothing held without grad
        for block in self.transformer.h:
            x = block(x, recompute)
        x = self.transformer.ln_f(x)                                       # (B, T, C)

        if targets is None:
            if last_only:
                x = x[:, -1:, :]                                           # (B, 1, C)
            return self.lm_head(x)[..., :V].float()                        # (B, T|1, V)

        if self.loss_impl == "fused":
            loss_sum, z_sum, max_abs = fused_classifier_loss(
                x.reshape(B * T, -1), self.lm_head.weight, targets.reshape(B * T).long(), V,
                z_loss=z_loss, chunk_rows=self.ce_chunk_rows, ce_kernel=self.ce_kernel)
            self.last_max_logit = max_abs.detach()
            return loss_sum, z_sum

        logits = self.lm_head(x)[..., :V]        # (B, T, V): padded columns sliced off
        with torch.no_grad():                    # max |logit| without an abs() copy
            self.last_max_logit = torch.maximum(logits.amax(), -logits.amin()).float()
        logits = logits.float().reshape(B * T, V)                          # (B*T, V) fp32
        targets = targets.reshape(B * T).long()
        loss_sum = F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum")
        if z_loss > 0.0:
            # z-loss (PaLM): pushes log Z = logsumexp(logits) towards 0, over kept tokens only
            keep = targets != -1
            lse = torch.logsumexp(logits, dim=-1)                          # (B*T,)
            z_sum = z_loss * (lse.square() * keep).sum()
        else:
            z_sum = torch.zeros((), dtype=torch.float32, device=logits.device)
        return loss_sum, z_sum

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample max_new_tokens tokens after idx (B, T0); returns (B, T0 + max_new_tokens).
        The context is cropped to the last block_size tokens. temperature 0 is greedy; pass a
        seeded generator (on idx's device) for a reproducible sample."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size:]                     # (B, <= maxT)
            logits = self(idx_cond, last_only=True)[:, -1, :]                # (B, V) fp32
            if temperature == 0.0:
                idx_next = logits.argmax(dim=-1, keepdim=True)              # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next.to(idx.dtype)), dim=1)
        return idx


def saved_activation_bytes(model: nn.Module, fn):
    """(fn()'s result, the bytes of the distinct storages autograd saves for backward while fn
    runs, the model's parameters left out): what --recompute trades for compute. Compiled or
    not, autograd packs every tensor a backward will read, so the hook sees them all."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(held.values())


def num_parameters(model: GPT) -> int:
    """Parameter count as llm.c counts it (the padded wte once): the N of MFU's 6N."""
    return sum(p.numel() for p in model.parameters())  # parameters() yields the tied one once


# ---------------------------------------------------------------------- llm.c parameter layout

# llm.c's ParameterTensors, in memory order (train_gpt2.cu).
LLMC_TENSOR_NAMES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
                     "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")
# The 2-D (matmul / embedding) tensors: the ones AdamW decays.
LLMC_DECAY = frozenset({"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"})

# Per-layer llm.c tensor -> (submodule path within a Block, attribute).
_PER_LAYER = {
    "ln1w": ("ln_1", "weight"), "ln1b": ("ln_1", "bias"),
    "qkvw": ("attn.c_attn", "weight"), "qkvb": ("attn.c_attn", "bias"),
    "attprojw": ("attn.c_proj", "weight"), "attprojb": ("attn.c_proj", "bias"),
    "ln2w": ("ln_2", "weight"), "ln2b": ("ln_2", "bias"),
    "fcw": ("mlp.c_fc", "weight"), "fcb": ("mlp.c_fc", "bias"),
    "fcprojw": ("mlp.c_proj", "weight"), "fcprojb": ("mlp.c_proj", "bias"),
}


def llmc_tensor_shapes(cfg: GPTConfig) -> list[tuple[str, tuple[int, ...]]]:
    """llm.c's 16 parameter tensors and their shapes (fill_in_parameter_sizes), layer-stacked.
    PyTorch's Linear weight is (out, in), which is llm.c's row layout, so no transposes."""
    Vp, C, maxT, L = cfg.padded_vocab_size, cfg.n_embd, cfg.block_size, cfg.n_layer
    shapes = {
        "wte": (Vp, C), "wpe": (maxT, C),
        "ln1w": (L, C), "ln1b": (L, C),
        "qkvw": (L, 3 * C, C), "qkvb": (L, 3 * C),
        "attprojw": (L, C, C), "attprojb": (L, C),
        "ln2w": (L, C), "ln2b": (L, C),
        "fcw": (L, 4 * C, C), "fcb": (L, 4 * C),
        "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
        "lnfw": (C,), "lnfb": (C,),
    }
    return [(name, shapes[name]) for name in LLMC_TENSOR_NAMES]


def llmc_num_elements(cfg: GPTConfig) -> int:
    """Elements in llm.c's flat parameter buffer (= num_parameters of a GPT with this config)."""
    return sum(math.prod(shape) for _, shape in llmc_tensor_shapes(cfg))


def llmc_parameter_layout(model: GPT) -> list[tuple[str, list[nn.Parameter]]]:
    """For each llm.c tensor, in llm.c order, the model's Parameters that make it up, in order:
    one for wte / wpe / lnfw / lnfb, one per layer (layer 0 first) for the others. Laying these
    out back to back gives llm.c's flat parameter buffer."""
    t = model.transformer
    layout = []
    for name in LLMC_TENSOR_NAMES:
        if name == "wte":
            params = [t.wte.weight]  # == model.lm_head.weight
        elif name == "wpe":
            params = [t.wpe.weight]
        elif name == "lnfw":
            params = [t.ln_f.weight]
        elif name == "lnfb":
            params = [t.ln_f.bias]
        else:
            sub, attr = _PER_LAYER[name]
            params = [getattr(block.get_submodule(sub), attr) for block in t.h]
        layout.append((name, params))
    return layout
