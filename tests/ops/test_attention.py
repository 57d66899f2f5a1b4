"""raygpt.ops causal attention: the reference against PyTorch's SDPA in float64, the Triton
kernels against the reference (marked gpu, and in Triton's interpreter on CPU) forward and
backward, bitwise repeatability, torch.compile, and GPT with sdpa_backend="raygpt"."""

import pytest
import torch
import torch.nn.functional as F

from tests.ops.interpreter import needs_triton, run_in_interpreter
from raygpt import ops
from raygpt.ops import reference

# (B, H, T, D): whole blocks, a ragged last block, several of each kernel's block sizes
SHAPES = [(1, 2, 32, 16), (2, 1, 40, 16), (1, 2, 64, 32)]
GPU_SHAPES = [(2, 3, 256, 64), (1, 2, 200, 64), (2, 2, 130, 32), (1, 1, 96, 128)]


def _qkv(B, H, T, D, seed, dtype=torch.bfloat16, device="cpu", interleaved=True):
    """q, k, v as the model makes them: views of one (B, T, 3, H, D) buffer, heads transposed."""
    g = torch.Generator().manual_seed(seed)
    if interleaved:
        x = torch.randn(B, T, 3, H, D, generator=g).to(dtype).to(device)
        return [x[:, :, i].transpose(1, 2) for i in range(3)]
    return [torch.randn(B, H, T, D, generator=g).to(dtype).to(device) for _ in range(3)]


def _sdpa_float64(q, k, v, do):
    """o, lse and the gradients by autograd through PyTorch's math SDPA in float64."""
    q, k, v = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.backward(do.double().cpu())
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return o.detach(), torch.logsumexp(s.detach(), -1), q.grad, k.grad, v.grad


def _close(got, want, rel):
    """Max abs error within rel of the largest magnitude (bf16 rounds p before p @ v)."""
    got, want = got.double().cpu(), want.double().cpu()
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= rel * scale + 1e-6, f"max error {err} vs scale {scale}"


@pytest.mark.parametrize("B,H,T,D", SHAPES)
def test_reference_matches_sdpa_in_float64(B, H, T, D):
    q, k, v = _qkv(B, H, T, D, seed=T + D, dtype=torch.float64)
    do = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    o, lse = reference.attention_forward(q, k, v)
    grads = reference.attention_backward(do, q, k, v, o, lse)
    want = _sdpa_float64(q, k, v, do)
    for got, w in zip((o, lse) + grads, want):
        torch.testing.assert_close(got.double(), w, rtol=1e-5, atol=1e-5)


def test_causal_attention_autograd_matches_sdpa_on_cpu():
    """ops.causal_attention (the reference path on CPU) through autograd, as the model uses it."""
    q, k, v = (t.float().requires_grad_(True) for t in _qkv(2, 2, 24, 16, seed=5))
    do = torch.randn(2, 2, 24, 16, generator=torch.Generator().manual_seed(2))
    ops.causal_attention(q, k, v).backward(do)
    want = _sdpa_float64(q, k, v, do)
    for got, w in zip((q.grad, k.grad, v.grad), want[2:]):
        torch.testing.assert_close(got.double(), w, rtol=1e-4, atol=1e-5)


def test_bad_attention_arguments_are_refused():
    q, k, v = _qkv(1, 1, 8, 16, seed=0)
    with pytest.raises(ValueError, match=r"expected q, k, v of one shape"):
        ops.attention_forward(q, k[:, :, :4], v)
    q24, k24, v24 = _qkv(1, 1, 8, 24, seed=0)
    with pytest.raises(ValueError, match="head dim must be one of"):
        ops.attention_forward(q24, k24, v24)
    with pytest.raises(ValueError, match="one float dtype"):
        ops.attention_forward(q, k.float(), v)


TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 2e-3}  # of the largest value; fp32: TF32 on GPUs


def _check_kernels_against_reference(fwd, bwd, shapes, device,
                                     dtypes=(torch.bfloat16, torch.float32)):
    for i, (B, H, T, D) in enumerate(shapes):
        for dtype in dtypes:
            rel = TOLERANCE[dtype]
            q, k, v = _qkv(B, H, T, D, seed=20 + i, dtype=dtype, device=device,
                           interleaved=i % 2 == 0)
            do = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(i)).to(dtype)
            do = do.to(device)
            o, lse = fwd(q, k, v)
            assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32
            want = _sdpa_float64(q, k, v, do)
            _close(o, want[0], rel)
            # bf16 scores are exact products summed in fp32; fp32 ones go through TF32 on GPUs
            _close(lse, want[1], 1e-5 if dtype == torch.bfloat16 else 1e-3)
            grads = bwd(do, q, k, v, o, lse)
            for g, w, name in zip(grads, want[2:], "qkv"):
                assert g.dtype == dtype and g.shape == q.shape, name
                _close(g, w, 2 * rel)
            # bitwise repeatable: no atomics, a fixed order of every sum
            o2, lse2 = fwd(q, k, v)
            assert torch.equal(o, o2) and torch.equal(lse, lse2)
            assert all(torch.equal(a, b) for a, b in zip(grads, bwd(do, q, k, v, o, lse)))


@pytest.mark.gpu
def test_gpu_kernels_match_reference():
    _check_kernels_against_reference(ops.attention_forward, ops.attention_backward,
                                     GPU_SHAPES, "cuda")


@pytest.mark.gpu
def test_gpu_gpt2_sized_attention_matches_pytorch_and_repeats():
    """GPT-2 d12's shape (T 1024, 12 heads of 64) against PyTorch's SDPA in fp32."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(4, 12, 1024, 64, seed=9, device="cuda"))
    do = torch.randn(4, 12, 1024, 64, device="cuda").bfloat16()
    o = ops.causal_attention(q, k, v)
    o.backward(do)
    got = (o.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    of = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    of.backward(do.float())
    for g, w in zip(got, (of, qf.grad, kf.grad, vf.grad)):
        _close(g, w.detach(), 3e-2)
    q.grad = k.grad = v.grad = None
    ops.causal_attention(q, k, v).backward(do)
    assert all(torch.equal(a, b) for a, b in zip(got[1:], (q.grad, k.grad, v.grad)))


@pytest.mark.gpu
def test_gpu_causal_attention_composes_with_torch_compile():
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, 4, 128, 64, seed=3, device="cuda"))

    def f(q, k, v):
        return (ops.causal_attention(q, k, v).float() ** 2).sum()

    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward()
        results.append((q.grad.clone(), k.grad.clone(), v.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results)), "compiled = eager, bitwise"


@pytest.mark.gpu
def test_gpu_gpt_with_raygpt_kernels_matches_pytorch_kernels_and_repeats():
    """GPT with sdpa_backend / embedding_impl "raygpt" against PyTorch's kernels (loss and
    gradients close), and two backward passes with raygpt's kernels bitwise equal."""
    from raygpt.model.gpt import GPT, GPTConfig

    cfg = GPTConfig(block_size=128, vocab_size=1000, n_layer=2, n_head=4, n_embd=256)
    idx = torch.randint(0, 1000, (4, 129), generator=torch.Generator().manual_seed(0)).cuda()
    runs = []
    for kw in ({}, dict(sdpa_backend="raygpt", embedding_impl="raygpt"),
               dict(sdpa_backend="raygpt", embedding_impl="raygpt")):
        model = GPT(cfg, init_seed=3, **kw).cuda().to(torch.bfloat16)
        with torch.enable_grad():
            loss, _ = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1), (l2, g2) = runs
    assert abs(l0.item() - l1.item()) / l0.item() < 1e-2
    for a, b in zip(g0, g1):  # bf16 gradients through other kernels: bf16 noise, not O(1)
        _close(b, a, 1e-1)
    assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_gpt_raygpt_kernels_on_cpu_compute_the_same_function(monkeypatch):
    """On CPU the "raygpt" choices run the references (each layer's attention forward and
    backward, the embedding backward once): the same loss and gradients as PyTorch's path up
    to fp32 rounding (and a head dim the kernel cannot take is refused up front)."""
    from raygpt.model.gpt import GPT, GPTConfig

    calls = []
    for name in ("attention_forward", "attention_backward", "embedding_backward"):
        def counted(*a, _f=getattr(reference, name), _n=name):
            calls.append(_n)
            return _f(*a)
        monkeypatch.setattr(reference, name, counted)
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)
    idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    runs = []
    for kw in ({}, dict(sdpa_backend="raygpt", embedding_impl="raygpt")):
        model = GPT(cfg, init_seed=3, **kw)
        loss, _ = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        runs.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert sorted(calls) == ["attention_backward"] * 2 + ["attention_forward"] * 2 + [
        "embedding_backward"], calls
    assert abs(runs[0][0] - runs[1][0]) < 1e-5 * runs[0][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="head dim"):
        GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=4, n_embd=40),
            sdpa_backend="raygpt")
    with pytest.raises(ValueError, match="embedding_impl"):
        GPT(cfg, embedding_impl="sparse")


def test_deterministic_runs_pick_raygpt_kernels_on_cuda_only():
    from raygpt.model.gpt import kernels_for

    ours, torchs = (dict(sdpa_backend="raygpt", embedding_impl="raygpt"),
                    dict(sdpa_backend="default", embedding_impl="torch"))
    assert kernels_for(True, "cuda") == ours
    assert kernels_for(False, "cuda") == torchs and kernels_for(True, "cpu") == torchs
    # an explicit choice (TrainConfig's --sdpa-backend / --embedding-impl) is taken as given:
    # PyTorch's deterministic kernels, the bench's "before"; raygpt's on the CPU
    assert kernels_for(True, "cuda", sdpa_backend="default", embedding_impl="torch") == torchs
    assert kernels_for(False, "cpu", sdpa_backend="raygpt", embedding_impl="raygpt") == ours
    assert kernels_for(True, "cuda", sdpa_backend="cudnn") == dict(sdpa_backend="cudnn",
                                                                   embedding_impl="raygpt")


def test_a_runs_kernel_fields_reach_the_model_and_name_the_models_choices():
    """TrainConfig's performance fields are what build_model hands the GPT, and their choices
    are the model's own (plus "auto")."""
    import dataclasses

    from raygpt.config import TrainConfig
    from raygpt.model.gpt import EMBEDDING_IMPLS, SDPA_BACKENDS
    from raygpt.train.loop import build_model

    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(TrainConfig)}
    assert choices["sdpa_backend"] == ("auto",) + SDPA_BACKENDS
    assert choices["embedding_impl"] == ("auto",) + EMBEDDING_IMPLS
    cfg = TrainConfig(device="cpu", model="d1", sdpa_backend="cudnn", embedding_impl="raygpt",
                      ce_chunk_rows=96, loss_impl="reference", ce_kernel=False).resolve(0)
    model = build_model(cfg, torch.device("cpu"))
    assert {b.attn.sdpa_backend for b in model.transformer.h} == {"cudnn"}
    assert (model.embedding_impl, model.ce_chunk_rows) == ("raygpt", 96)
    assert (model.loss_impl, model.ce_kernel) == ("reference", False)
    auto = build_model(TrainConfig(device="cpu", model="d1").resolve(0), torch.device("cpu"))
    assert (auto.transformer.h[0].attn.sdpa_backend, auto.embedding_impl) == ("default", "torch")


# ---------------------------------------------------------------------------------------------
# The Triton kernels on CPU tensors, through Triton's interpreter (no GPU needed).

def _interpreter_checks():
    from raygpt.ops import triton_attention as ta

    # bf16 (the model's dtype) at every shape, fp32 at one (the GPU tests take both everywhere)
    _check_kernels_against_reference(ta.attention_forward, ta.attention_backward, SHAPES, "cpu",
                                     dtypes=(torch.bfloat16,))
    # a second block layout: equal query and key blocks everywhere
    cfg = ta.AttnConfig(16, 16, 4, 1, 16, 16, 16, 16, 4, 1)
    _check_kernels_against_reference(lambda q, k, v: ta.attention_forward(q, k, v, cfg),
                                     lambda *a: ta.attention_backward(*a, config=cfg),
                                     SHAPES[1:2], "cpu", dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="must nest"):
        ta.attention_forward(*_qkv(1, 1, 16, 16, seed=0), ta.AttnConfig(
            16, 32, 4, 1, 16, 16, 16, 16, 4, 1))
    print("interpreter checks passed")


@needs_triton
def test_triton_kernels_in_interpreter():
    run_in_interpreter(__file__)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _interpreter_checks()
