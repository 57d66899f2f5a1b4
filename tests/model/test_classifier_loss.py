"""raygpt.model.classifier_loss: the fused loss against the textbook full-logits loss (values and
gradients, fp32 and bf16, padded columns, ignored rows, compiled)."""

import pytest
import torch
from torch.nn import functional as F

from raygpt.model.classifier_loss import fused_classifier_loss


def textbook_loss(x, weight, targets, vocab_size, z_loss):
    """The reference: full logits, padded columns sliced off, fp32 cross-entropy and z-loss."""
    logits = (x @ weight.t())[:, :vocab_size].float()                   # (N, V)
    keep = targets != -1
    loss_sum = F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum")
    z_sum = z_loss * torch.where(keep, torch.logsumexp(logits, -1).square(), 0.0).sum()
    return loss_sum, z_sum, logits.abs().max()



def classifier_inputs(N=37, C=16, V=100, Vp=128, dtype=torch.float32, seed=0):
    """x (N, C), weight (Vp, C) with zero padded rows, targets (N,) with some -1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g).to(dtype).requires_grad_()
    weight = 0.5 * torch.randn(Vp, C, generator=g)
    weight[V:] = 0.0
    weight = weight.to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::5] = -1
    return x, weight, targets



def loss_and_grads(fn, x, weight, g_loss=0.3, g_z=0.7):
    """Values and input gradients of g_loss * loss_sum + g_z * z_sum: distinct upstream
    gradients, so the two outputs' gradients are checked separately, not just their sum."""
    x.grad = weight.grad = None
    loss_sum, z_sum, max_abs = fn()
    objective = g_loss * loss_sum + (g_z * z_sum if z_sum.requires_grad else 0.0)
    objective.backward()
    return loss_sum.detach(), z_sum.detach(), max_abs.detach(), x.grad.clone(), weight.grad.clone()



def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()



def check_bf16_gradients(got, want, truth):
    """bf16 gradients: within 1% of the fp32 truth (relative norm) and no further from it than
    the textbook bf16 path. Elementwise tolerances do not fit: a sum that cancels to ~0 is off
    by a bf16 ulp of its terms in either path."""
    for i, name in ((3, "dx"), (4, "dweight")):
        err, ref_err = relative_error(got[i], truth[i]), relative_error(want[i], truth[i])
        assert err < 1e-2 and err <= 1.5 * ref_err + 1e-4, (name, err, ref_err)



@pytest.mark.parametrize("chunk_rows", [1, 8, 36, 37, 64])  # 37 rows: odd chunks, one, more
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_fused_loss_matches_textbook_fp32(chunk_rows, z_loss):
    x, weight, targets = classifier_inputs()
    want = loss_and_grads(lambda: textbook_loss(x, weight, targets, 100, z_loss), x, weight)
    got = loss_and_grads(lambda: fused_classifier_loss(x, weight, targets, 100, z_loss=z_loss,
                                                       chunk_rows=chunk_rows), x, weight)
    for name, a, b in zip(("loss_sum", "z_sum", "max_abs", "dx", "dweight"), got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert got[0] > 0 and got[3].abs().sum() > 0
    assert (got[1] > 0) == (z_loss > 0)
    assert torch.all(got[4][100:] == 0), "padded rows get exactly zero gradient"



@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_fused_loss_matches_textbook_bf16(z_loss):
    """bf16 inputs (the GPU working dtype): fp32 outputs, bf16 gradients within bf16 rounding."""
    x, weight, targets = classifier_inputs(dtype=torch.bfloat16)
    want = loss_and_grads(lambda: textbook_loss(x, weight, targets, 100, z_loss), x, weight)
    got = loss_and_grads(lambda: fused_classifier_loss(x, weight, targets, 100, z_loss=z_loss,
                                                       chunk_rows=8), x, weight)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float32
    assert got[3].dtype == got[4].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)  # fp32 math on equal logits
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2].float())
    xf, wf = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    truth = loss_and_grads(lambda: textbook_loss(xf, wf, targets, 100, z_loss), xf, wf)
    check_bf16_gradients(got, want, truth)



def test_fused_loss_padded_columns_never_matter():
    x, weight, targets = classifier_inputs()
    before = loss_and_grads(lambda: fused_classifier_loss(x, weight, targets, 100, z_loss=1e-2,
                                                          chunk_rows=8), x, weight)
    with torch.no_grad():  # huge padded rows: their logits would dominate an unmasked softmax
        weight[100:] = 1e3 * torch.randn(28, 16, generator=torch.Generator().manual_seed(1))
    after = loss_and_grads(lambda: fused_classifier_loss(x, weight, targets, 100, z_loss=1e-2,
                                                         chunk_rows=8), x, weight)
    for name, a, b in zip(("loss_sum", "z_sum", "max_abs", "dx"), before, after):
        assert torch.equal(a, b), name
    assert torch.equal(before[4][:100], after[4][:100])
    assert torch.all(after[4][100:] == 0)



def test_fused_loss_ignores_minus_one():
    x, weight, targets = classifier_inputs()
    keep = targets != -1
    loss_sum, z_sum, _ = fused_classifier_loss(x, weight, targets, 100, z_loss=1e-2, chunk_rows=8)
    kept = textbook_loss(x[keep], weight, targets[keep], 100, 1e-2)
    torch.testing.assert_close(loss_sum, kept[0])
    torch.testing.assert_close(z_sum, kept[1])
    # every target ignored: zero loss, zero z-loss, zero gradients, still a finite max logit
    none = torch.full_like(targets, -1)
    got = loss_and_grads(lambda: fused_classifier_loss(x, weight, none, 100, z_loss=1e-2,
                                                       chunk_rows=8), x, weight)
    assert got[0].item() == 0.0 and got[1].item() == 0.0 and got[2].item() > 0
    assert torch.all(got[3] == 0) and torch.all(got[4] == 0)



def test_fused_loss_outputs_and_no_grad_path():
    x, weight, targets = classifier_inputs()
    loss_sum, z_sum, max_abs = fused_classifier_loss(x, weight, targets, 100, chunk_rows=8)
    assert loss_sum.requires_grad and not z_sum.requires_grad and not max_abs.requires_grad
    assert z_sum.item() == 0.0
    _, z_on, _ = fused_classifier_loss(x, weight, targets, 100, z_loss=1e-2, chunk_rows=8)
    assert z_on.requires_grad
    with torch.no_grad():  # evaluation: statistics only, the same values
        ev = fused_classifier_loss(x, weight, targets, 100, z_loss=1e-2, chunk_rows=8)
    want = textbook_loss(x, weight, targets, 100, 1e-2)
    assert not any(t.requires_grad for t in ev)
    for a, b in zip(ev, want):
        torch.testing.assert_close(a, b.detach())
    with pytest.raises(ValueError, match="chunk_rows"):
        fused_classifier_loss(x, weight, targets, 100, chunk_rows=0)
    # first-order only: a double backward raises instead of silently missing terms
    (gx,) = torch.autograd.grad(loss_sum, x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()



def test_fused_loss_compiles_without_graph_breaks():
    """torch.compile is how the GPU runs it: Dynamo traces the autograd.Function into one graph
    (fullgraph) and AOTAutograd partitions it (aot_eager: the same tracing without the slow CPU
    codegen); same values and gradients."""
    x, weight, targets = classifier_inputs()
    compiled = torch.compile(fused_classifier_loss, fullgraph=True, backend="aot_eager")
    got = loss_and_grads(lambda: compiled(x, weight, targets, 100, z_loss=1e-2, chunk_rows=16),
                         x, weight)
    want = loss_and_grads(lambda: textbook_loss(x, weight, targets, 100, 1e-2), x, weight)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)



@pytest.mark.gpu
def test_fused_loss_compiled_on_cuda_matches_textbook():
    """The GPU path as the loop runs it: Inductor (Triton) compiles the fused loss; GPT-2's real
    V / Vp, bf16 inputs, an odd row count over several chunks; textbook loss on the same
    inputs. One compile (z = 0, the default), so the GPU suite stays quick."""
    g = torch.Generator().manual_seed(0)
    N, C, V, Vp = 1000, 64, 50257, 50304
    x = torch.randn(N, C, generator=g).cuda().bfloat16().requires_grad_()
    w = 0.1 * torch.randn(Vp, C, generator=g)
    w[V:] = 0.0
    w = w.cuda().bfloat16().requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g).cuda()
    targets[::7] = -1
    compiled = torch.compile(fused_classifier_loss, fullgraph=True)
    got = loss_and_grads(lambda: compiled(x, w, targets, V, chunk_rows=384), x, w)
    want = loss_and_grads(lambda: textbook_loss(x, w, targets, V, 0.0), x, w)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-2)
    torch.testing.assert_close(got[2], want[2].float())
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    truth = loss_and_grads(lambda: textbook_loss(xf, wf, targets, V, 0.0), xf, wf)
    check_bf16_gradients(got, want, truth)
    assert torch.all(got[4][V:] == 0)
