"""raygpt.ops.global_norm_squared: against float64, determinism, odd sizes, NaN/Inf.

Every behavioural test runs on the CPU reference and, marked gpu, on the Triton kernel. The
interpreter test runs the Triton kernel on CPU tensors in a subprocess (TRITON_INTERPRET=1 must
be set before Triton is imported) when Triton is installed.
"""


import pytest
import torch

from tests.ops.interpreter import needs_triton, run_in_interpreter
from raygpt.ops import global_norm_squared, reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NORM_BLOCK = 4096  # triton_kernels.NORM_BLOCK (not imported: that module needs Triton)
ODD_SIZES = [1, 7, NORM_BLOCK - 1, NORM_BLOCK, NORM_BLOCK + 1, 3 * NORM_BLOCK + 5, 100_003]


def _randn(n, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype).to(device)


def _float64_sumsq(x):
    return float((x.double().cpu() ** 2).sum())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", ODD_SIZES)
def test_matches_float64(device, dtype, n):
    x = _randn(n, seed=n, dtype=dtype, device=device)
    out = global_norm_squared(x)
    assert out.dtype == torch.float32 and out.dim() == 0 and out.device == x.device
    want = _float64_sumsq(x)
    assert abs(out.item() - want) / want < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_large_buffer_matches_float64(device):
    # more blocks than the persistent grid has programs, so each program loops
    n = 5_000_011 if device == "cuda" else 300_007
    x = _randn(n, seed=1, device=device) * 3.0
    want = _float64_sumsq(x)
    assert abs(global_norm_squared(x).item() - want) / want < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_is_zero(device, dtype):
    out = global_norm_squared(torch.empty(0, dtype=dtype, device=device))
    assert out.item() == 0.0 and out.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_calls_bitwise_identical(device, dtype):
    x = _randn(1_000_003, seed=2, dtype=dtype, device=device)
    first = global_norm_squared(x)
    for _ in range(3):
        assert torch.equal(global_norm_squared(x).view(torch.int32), first.view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_propagates(device, dtype):
    n = 3 * NORM_BLOCK + 5
    x = _randn(n, seed=3, dtype=dtype, device=device)
    for pos in (0, NORM_BLOCK + 1, n - 1):  # first element, inside, the masked tail block
        y = x.clone()
        y[pos] = float("nan")
        assert torch.isnan(global_norm_squared(y)), f"NaN at {pos} was hidden"
        y[pos] = float("inf")
        assert torch.isinf(global_norm_squared(y)), f"Inf at {pos} was hidden"
        y[pos] = -float("inf")
        assert torch.isinf(global_norm_squared(y)), f"-Inf at {pos} was hidden"


def test_exact_for_small_integers():
    # small integers square and sum exactly in fp32: the result must be the exact integer
    x = torch.arange(-50, 51, dtype=torch.float32)
    assert global_norm_squared(x).item() == 2 * sum(i * i for i in range(51))


@pytest.mark.parametrize("bad", [torch.zeros(3, 4), torch.zeros(8, dtype=torch.int32),
                                 torch.zeros(8, dtype=torch.float64), torch.zeros(16)[::2]])
def test_rejects_bad_buffers(bad):
    with pytest.raises(ValueError, match="global_norm_squared"):
        global_norm_squared(bad)


@pytest.mark.gpu
def test_gpu_matches_reference_and_custom_op_registered():
    x = _randn(2_000_003, seed=4, dtype=torch.bfloat16, device="cuda")
    gpu = global_norm_squared(x).item()
    cpu = reference.global_norm_squared(x.cpu()).item()
    assert abs(gpu - cpu) / cpu < 1e-5
    assert hasattr(torch.ops.raygpt, "global_norm_squared")


@pytest.mark.gpu
def test_gpu_composes_with_torch_compile():
    x = _randn(100_003, seed=5, device="cuda")

    @torch.compile(fullgraph=True)
    def clip_scale(g):
        norm = global_norm_squared(g).sqrt()
        return torch.clamp(1.0 / norm, max=1.0)

    want = min(1.0, 1.0 / _float64_sumsq(x) ** 0.5)
    assert abs(clip_scale(x).item() - want) / want < 1e-5


# ---------------------------------------------------------------------------------------------
# The Triton kernel on CPU tensors, through Triton's interpreter (no GPU needed).

def _interpreter_checks():
    """Run in a subprocess with TRITON_INTERPRET=1: the kernel against float64 and itself."""
    from raygpt.ops import triton_kernels

    for dtype in (torch.float32, torch.bfloat16):
        for n in [0] + ODD_SIZES[:-1]:
            x = _randn(n, seed=n, dtype=dtype)
            out = triton_kernels.global_norm_squared(x)
            want = _float64_sumsq(x)
            assert (out.item() == 0.0) if n == 0 else abs(out.item() - want) / want < 1e-5, \
                (dtype, n, out.item(), want)
            assert torch.equal(out, triton_kernels.global_norm_squared(x))
    y = _randn(NORM_BLOCK + 3, seed=9)
    y[NORM_BLOCK + 2] = float("nan")
    assert torch.isnan(triton_kernels.global_norm_squared(y))
    print("interpreter checks passed")


@needs_triton
def test_triton_kernel_in_interpreter():
    run_in_interpreter(__file__)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _interpreter_checks()
