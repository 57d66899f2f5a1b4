"""raygpt.ops.cross_entropy_grad: the reference against autograd in float64, the Triton kernel
against the reference (marked gpu, and in Triton's interpreter on CPU), determinism, padding,
ignored rows, odd widths, torch.compile, and the fused loss end to end on the GPU."""

import pytest
import torch
import torch.nn.functional as F

from tests.ops.interpreter import needs_triton, run_in_interpreter
from raygpt.ops import cross_entropy_grad, reference

CE_BLOCK = 1024  # triton_kernels.CE_BLOCK (not imported: that module needs Triton)
# (rows, padded width, real vocabulary): one block, several, a ragged last block, padding
SHAPES = [(1, 7, 5), (5, 256, 250), (9, CE_BLOCK, CE_BLOCK), (4, CE_BLOCK + 64, CE_BLOCK + 1),
          (3, 2 * CE_BLOCK + 128, 2 * CE_BLOCK + 100)]


def _case(n, vp, v, seed, dtype=torch.bfloat16, device="cpu", scale=4.0):
    g = torch.Generator().manual_seed(seed)
    L = (torch.randn(n, vp, generator=g) * scale).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    if n > 2:
        t[1] = -1  # an ignored row
    return L.to(device), t.to(device)


def _autograd_float64(L, t, v):
    """What the op computes, by autograd on a float64 copy of the real columns."""
    Lr = L[:, :v].double().cpu().requires_grad_(True)
    tc = t.cpu()
    loss = F.cross_entropy(Lr, tc, ignore_index=-1, reduction="sum")
    loss.backward()
    lse = torch.logsumexp(Lr.detach(), dim=1)
    return Lr.grad, lse, Lr.detach().amax(1), Lr.detach().amin(1)


@pytest.mark.parametrize("n,vp,v", SHAPES)
def test_reference_matches_autograd_in_float64(n, vp, v):
    L, t = _case(n, vp, v, seed=n + vp)
    G, lse, tgt, mx, mn = reference.cross_entropy_grad(L, t, v)
    want_g, want_lse, want_max, want_min = _autograd_float64(L, t, v)
    assert G.dtype == L.dtype and G.shape == L.shape
    assert torch.all(G[:, v:] == 0), "padded columns get no gradient"
    torch.testing.assert_close(G[:, :v].double(), want_g, rtol=1.6e-2, atol=2e-3)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(mx.double(), want_max)
    torch.testing.assert_close(mn.double(), want_min)
    keep = t != -1
    assert torch.equal(tgt[keep], L.float()[keep, t[keep]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_textbook_formula_bit_for_bit(dtype):
    """The CPU reference reuses its buffers in place (speed); its results must keep the bits of
    the formula written one op per line, and the logits (its fp32 copy would alias fp32 ones)
    stay as given. An inf logit and a -0.0 ride along; row 1 is ignored."""
    n, vp, v = 6, 2 * CE_BLOCK + 128, 2 * CE_BLOCK + 100
    L, t = _case(n, vp, v, seed=3, dtype=dtype)
    L[0, 5], L[2, 7] = float("inf"), -0.0
    before = L.clone()
    G, lse, tgt, mx, mn = reference.cross_entropy_grad(L, t, v)
    real = torch.arange(vp) < v
    Lf = L.float()
    want_mn = torch.where(real, Lf, float("inf")).amin(dim=1)
    Lf = torch.where(real, Lf, float("-inf"))
    want_mx = Lf.amax(dim=1)
    want_lse = want_mx + torch.log(torch.exp(Lf - want_mx[:, None]).sum(dim=1))
    onehot = torch.arange(vp)[None, :] == t[:, None]
    p = torch.exp(Lf - want_lse[:, None])
    want_G = torch.where((t != -1)[:, None], p - onehot.float(), 0.0).to(dtype)
    want_tgt = Lf.gather(1, t.clamp(min=0)[:, None])[:, 0]
    def bits(x):
        return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)

    for got, want in ((G, want_G), (lse, want_lse), (tgt, want_tgt), (mx, want_mx), (mn, want_mn)):
        assert got.dtype == want.dtype and torch.equal(bits(got), bits(want))
    assert torch.equal(bits(L), bits(before)), "the reference wrote into the logits"


def test_bad_shapes_are_refused_with_what_was_expected():
    L, t = _case(4, 16, 10, seed=0)
    with pytest.raises(ValueError, match=r"expected logits \(n, Vp\)"):
        cross_entropy_grad(L, t[:3], 10)
    with pytest.raises(ValueError, match="vocab_size <= Vp"):
        cross_entropy_grad(L, t, 17)


def _check_kernel_against_reference(kernel, device):
    for i, (n, vp, v) in enumerate(SHAPES):
        for dtype in (torch.bfloat16, torch.float32):
            L, t = _case(n, vp, v, seed=10 + i, dtype=dtype, device=device)
            got = kernel(L, t, v)
            want = reference.cross_entropy_grad(L, t, v)
            assert got[0].dtype == dtype and got[0].shape == L.shape
            assert torch.all(got[0][:, v:] == 0), (n, vp, v)
            # G: the same fp32 value rounded to L's dtype, from an lse that differs in the last
            # fp32 bits (another summation order), so one unit in the last place at most
            torch.testing.assert_close(got[0].float(), want[0].float(), rtol=1e-2 if dtype ==
                                       torch.bfloat16 else 1e-5, atol=1e-6)
            for a, b in zip(got[1:], want[1:]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
            again = kernel(L, t, v)
            assert all(torch.equal(a, b) for a, b in zip(got, again)), "deterministic"


@pytest.mark.gpu
def test_gpu_kernel_matches_reference():
    _check_kernel_against_reference(cross_entropy_grad, "cuda")


@pytest.mark.gpu
def test_gpu_gpt2_sized_chunk_matches_reference():
    """A chunk of GPT-2's real shape (Vp 50304, V 50257): the kernel's loop over 50 blocks."""
    L, t = _case(64, 50304, 50257, seed=3, device="cuda", scale=3.0)
    got = cross_entropy_grad(L, t, 50257)
    want = reference.cross_entropy_grad(L, t, 50257)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=1e-2, atol=1e-6)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
def test_gpu_kernel_composes_with_torch_compile():
    L, t = _case(8, 1000, 990, seed=4, device="cuda")

    @torch.compile(fullgraph=True)
    def loss_and_grad(L, t):
        G, lse, tgt, _, _ = cross_entropy_grad(L, t, 990)
        return torch.where(t != -1, lse - tgt, 0.0).sum(), G

    loss, G = loss_and_grad(L, t)
    want_g, want_lse, _, _ = _autograd_float64(L, t, 990)
    keep = (t != -1).cpu()
    want_loss = (want_lse[keep] - L.double().cpu()[keep, t.cpu()[keep]]).sum()
    assert abs(loss.item() - want_loss.item()) / want_loss.item() < 1e-5
    torch.testing.assert_close(G[:, :990].double().cpu(), want_g, rtol=1.6e-2, atol=2e-3)


@pytest.mark.gpu
def test_gpu_fused_loss_with_the_kernel_matches_the_textbook_loss():
    """GPT's fused loss (the kernel inside) against loss_impl="reference": loss and gradients."""
    from raygpt.model.gpt import GPT, GPTConfig

    cfg = GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_head=4, n_embd=128)
    idx = torch.randint(0, 50257, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()
    results = []
    for impl in ("fused", "reference"):
        model = GPT(cfg, init_seed=3, loss_impl=impl).cuda()
        loss, _ = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append((loss.item(), model.transformer.wte.weight.grad.clone(),
                        model.transformer.h[0].mlp.c_fc.weight.grad.clone()))
    (fl, fw, fm), (rl, rw, rm) = results
    assert abs(fl - rl) / rl < 1e-5
    torch.testing.assert_close(fw, rw, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(fm, rm, rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The Triton kernel on CPU tensors, through Triton's interpreter (no GPU needed).

def _interpreter_checks():
    from raygpt.ops import triton_kernels

    _check_kernel_against_reference(triton_kernels.cross_entropy_grad, "cpu")
    L, t = _case(3, 300, 290, seed=7)
    L[2, 5] = float("nan")
    G, lse, *_ = triton_kernels.cross_entropy_grad(L, t, 290)
    assert torch.isnan(lse[2]) and not torch.isnan(lse[0])
    print("interpreter checks passed")


@needs_triton
def test_triton_kernel_in_interpreter():
    run_in_interpreter(__file__)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _interpreter_checks()
