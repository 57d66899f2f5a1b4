"""raygpt.ops embedding backward: the reference against autograd of F.embedding in float64, the
Triton kernel against the reference (marked gpu, and in Triton's interpreter on CPU), frequent
ids (longer runs than a loop iteration takes), unused rows, bitwise repeatability, and
torch.compile."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.ops.interpreter import needs_triton, run_in_interpreter
from raygpt import ops
from raygpt.ops import reference

EMB_ROWS = 16  # triton_attention.EMB_ROWS (not imported: that module needs Triton)
# (positions, columns, rows): runs longer than EMB_ROWS, several column blocks with a ragged
# last one, rows no id names
SHAPES = [(7, 5, 4), (100, 300, 12), (64, 256, 20)]


def _case(n, c, rows, seed, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max(1, rows // 3), (n,), generator=g)  # ids from the first third
    ids[: n // 2] = rows // 3 // 2  # one frequent id: a run of n/2 positions, > EMB_ROWS
    ids = ids[torch.randperm(n, generator=g)]
    grad = torch.randn(n, c, generator=g).to(dtype)
    return grad.to(device), ids.to(device)


def _autograd_float64(grad, ids, rows):
    w = torch.zeros(rows, grad.shape[1], dtype=torch.float64, requires_grad=True)
    F.embedding(ids.cpu(), w).backward(grad.double().cpu())
    return w.grad


@pytest.mark.parametrize("n,c,rows", SHAPES)
def test_reference_matches_autograd_in_float64(n, c, rows):
    grad, ids = _case(n, c, rows, seed=n, dtype=torch.float32)
    got = reference.embedding_backward(grad, ids, rows)
    assert got.dtype == grad.dtype and got.shape == (rows, c)
    torch.testing.assert_close(got.double(), _autograd_float64(grad, ids, rows), rtol=1e-5,
                               atol=1e-5)


def test_embedding_autograd_gives_the_reference_gradient_on_cpu():
    grad, ids = _case(40, 24, 30, seed=1, dtype=torch.float32)
    w = torch.randn(30, 24, requires_grad=True)
    out = ops.embedding(ids.view(5, 8), w)
    assert torch.equal(out, F.embedding(ids.view(5, 8), w.detach()))
    out.backward(grad.view(5, 8, 24))
    assert torch.equal(w.grad, reference.embedding_backward(grad, ids, 30))


def test_bad_shapes_are_refused():
    grad, ids = _case(10, 8, 6, seed=0)
    with pytest.raises(ValueError, match=r"expected grad \(N, C\) and ids \(N,\)"):
        ops.embedding_backward(grad, ids[:9], 6)


def _check_kernel_against_reference(kernel, shapes, device):
    for i, (n, c, rows) in enumerate(shapes):
        for dtype in (torch.bfloat16, torch.float32):
            grad, ids = _case(n, c, rows, seed=10 + i, dtype=dtype, device=device)
            got = kernel(grad, ids, rows)
            assert got.dtype == dtype and got.shape == (rows, c)
            want = _autograd_float64(grad, ids, rows)
            # fp32 sums of the same rows in blocks: fp32 rounding; bf16: one final rounding
            tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5,
                                                                                 atol=1e-5)
            torch.testing.assert_close(got.double().cpu(), want, **tol)
            unused = torch.ones(rows, dtype=torch.bool)
            unused[ids.cpu()] = False
            assert torch.all(got.cpu()[unused] == 0), "rows no id names get 0"
            assert torch.equal(got, kernel(grad, ids, rows)), "bitwise repeatable"


@pytest.mark.gpu
def test_gpu_kernel_matches_reference():
    _check_kernel_against_reference(ops.embedding_backward, SHAPES, "cuda")


@pytest.mark.gpu
def test_gpu_gpt2_sized_embedding_backward_matches_and_repeats():
    """GPT-2 d12 at B=64: 65536 positions over 50304 rows of 768, Zipf-like ids (log-uniform:
    id 0 holds ~6% of the positions, thousands of rows in one run)."""
    g = torch.Generator().manual_seed(0)
    ids = (torch.exp(torch.rand(65536, generator=g) * math.log(50257)).long() - 1).cuda()
    grad = torch.randn(65536, 768, generator=g).bfloat16().cuda()
    got = ops.embedding_backward(grad, ids, 50304)
    want = reference.embedding_backward(grad.float(), ids, 50304)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(got, ops.embedding_backward(grad, ids, 50304))


@pytest.mark.gpu
def test_gpu_embedding_composes_with_torch_compile():
    grad, ids = _case(512, 128, 1000, seed=2, device="cuda")
    w = torch.randn(1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(ids, w):
        return (ops.embedding(ids, w).float() * grad.float()).sum()

    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        w.grad = None
        fn(ids, w).backward()
        results.append(w.grad.clone())
    assert torch.equal(*results)


# ---------------------------------------------------------------------------------------------
# The Triton kernel on CPU tensors, through Triton's interpreter (no GPU needed).

def _interpreter_checks():
    from raygpt.ops import triton_attention

    assert triton_attention.EMB_ROWS == EMB_ROWS
    _check_kernel_against_reference(triton_attention.embedding_backward, SHAPES, "cpu")
    print("interpreter checks passed")


@needs_triton
def test_triton_kernel_in_interpreter():
    run_in_interpreter(__file__)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _interpreter_checks()
