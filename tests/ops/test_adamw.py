"""raygpt.ops AdamW and stochastic rounding: math vs float64, weight decay, grad_scale, bias
correction, NaN/Inf, sharding, rounding statistics and reproducibility, Segments tables.

Behavioural tests run on the CPU reference and, marked gpu, on the Triton kernels; gpu-only tests
check Triton against the reference. The interpreter test runs the Triton kernels on CPU tensors
in a subprocess (TRITON_INTERPRET=1 must be set before Triton is imported) when Triton is
installed.
"""


import pytest
import torch

from tests.ops.interpreter import needs_triton, run_in_interpreter
from raygpt.ops import (Segments, adamw_update, copy_master_to_params, reference,
                        stochastic_round_bf16)
from raygpt.ops.reference import ELEMENTWISE_BLOCK as BLOCK

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# odd sizes around the kernel block, an empty tensor, decay on some
SIZES = [1, 7, 0, BLOCK - 1, BLOCK + 1, 3001, 5, BLOCK]
DECAY = [True, False, True, True, False, True, False, False]
HYPER = dict(lr=0.05, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.7)


def _segments(device, lo=0, hi=None, sizes=SIZES, decay=DECAY):
    return Segments.build(sizes, decay, lo, hi, device=device)


def _state(n, mode, device, seed=0):
    """(param, grad, m, v, master) with random contents; mode 'fp32' or 'bf16'."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 0.1
    m = torch.randn(n, generator=g) * 0.01
    v = torch.rand(n, generator=g) * 1e-3
    if mode == "fp32":
        tensors = (w, grad, m, v, None)
    else:
        tensors = (w.to(torch.bfloat16), grad.to(torch.bfloat16), m, v, w)
    return tuple(None if t is None else t.to(device) for t in tensors)


def _clone(state):
    return tuple(None if t is None else t.clone() for t in state)


def _float64_adamw(w, grad, m, v, decay_mask, *, lr, beta1, beta2, eps, weight_decay,
                   grad_scale, step):
    g = grad.double().cpu() * grad_scale
    m = beta1 * m.double().cpu() + (1 - beta1) * g
    v = beta2 * v.double().cpu() + (1 - beta2) * g * g
    m_hat = m / (1 - beta1 ** step)
    v_hat = v / (1 - beta2 ** step)
    w = w.double().cpu()
    w = w - lr * (m_hat / (v_hat.sqrt() + eps) + weight_decay * decay_mask.double().cpu() * w)
    return w, m, v


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).cpu()


def _equal_bits(a, b):
    return torch.equal(_bits(a), _bits(b))


# ---------------------------------------------------------------------------------------------
# AdamW math

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("step", [1, 10, 1000])
def test_matches_float64(device, mode, step):
    seg = _segments(device)
    param, grad, m, v, master = _state(seg.numel, mode, device)
    w0 = (master if master is not None else param).clone()
    want_w, want_m, want_v = _float64_adamw(w0, grad, m, v, seg.decay_mask(), step=step, **HYPER)
    adamw_update(param, grad, m, v, master, seg, step=step, seed=1, **HYPER)
    w = master if master is not None else param
    assert _rel(m, want_m) < 1e-5
    assert _rel(v, want_v) < 1e-5
    assert _rel(w, want_w) < 1e-5
    # the update itself (w - w0), not just w, to 1e-5: lr is large enough that the update
    # dwarfs fp32 rounding of w
    assert _rel(w.double().cpu() - w0.double().cpu(), want_w - w0.double().cpu()) < 1e-5
    if mode == "bf16":
        assert _equal_bits(param, reference.stochastic_round_bf16(master.cpu(), _segments("cpu"),
                                                                  1))


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_reference_is_the_textbook_formula_bit_for_bit(mode):
    """The CPU reference computes in two scratch tensors in place (speed); each element must
    still get the bits of the formula written one op per line, and the gradient stays as given.
    Special values ride along: inf and nan weights on decay and non-decay tensors, -0.0."""
    seg = _segments("cpu")
    param, grad, m, v, master = _state(seg.numel, mode, "cpu", seed=5)
    w = master if master is not None else param
    w[0], w[2], w[3], w[BLOCK + 9] = float("inf"), -0.0, float("nan"), float("-inf")
    if master is not None:
        param.copy_(master.to(torch.bfloat16))
    want_m, want_v, want_w = m.clone(), v.clone(), w.clone()
    grad_before = grad.clone()
    for step in (1, 2, 7):
        adamw_update(param, grad, m, v, master, seg, step=step, seed=step, **HYPER)
        s = reference.AdamWScalars.make(step=step, **HYPER)
        g = grad.to(torch.float32) * s.grad_scale
        want_m = want_m * s.beta1 + s.one_minus_beta1 * g
        want_v = want_v * s.beta2 + s.one_minus_beta2 * (g * g)
        wd = s.weight_decay * seg.decay_mask()
        update = (want_m / s.bias_correction1) / (torch.sqrt(want_v / s.bias_correction2) + s.eps)
        want_w = want_w - s.lr * (update + wd * want_w)
        assert _equal_bits(m, want_m) and _equal_bits(v, want_v), step
        assert _equal_bits(w, want_w), step
        if master is not None:
            assert _equal_bits(param, reference.stochastic_round_bf16(want_w, seg, step))
    assert _equal_bits(grad, grad_before), "the reference wrote into the gradient"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_repeated_updates_bitwise_identical(device, mode):
    seg = _segments(device)
    state = _state(seg.numel, mode, device)
    a, b = _clone(state), _clone(state)
    for step in (1, 2, 3):
        adamw_update(*a, seg, step=step, seed=step, **HYPER)
        adamw_update(*b, seg, step=step, seed=step, **HYPER)
    for x, y in zip(a, b):
        if x is not None:
            assert _equal_bits(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_weight_decay_only_on_decay_segments(device, mode):
    seg = _segments(device)
    param, grad, m, v, master = _state(seg.numel, mode, device)
    grad.zero_(), m.zero_(), v.zero_()
    w = master if master is not None else param
    w0 = w.clone()
    hyper = dict(HYPER, grad_scale=1.0)
    adamw_update(param, grad, m, v, master, seg, step=5, seed=3, **hyper)
    decay = seg.decay_mask().bool()
    # zero grad and moments: the Adam term is 0/(0+eps) = 0, so only decay moves weights
    assert _equal_bits(w[~decay], w0[~decay])
    shrunk = w0[decay].double() * (1 - hyper["lr"] * hyper["weight_decay"])
    assert _rel(w[decay], shrunk) < 1e-6
    assert not torch.equal(w[decay], w0[decay])
    if mode == "bf16":
        # non-decay master unchanged, so its bf16 is a stochastic rounding of the same value
        assert _equal_bits(param, stochastic_round_bf16(master, seg, 3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_grad_scale_is_applied_to_grad(device, mode):
    seg = _segments(device)
    a = _state(seg.numel, mode, device)
    b = _clone(a)
    b[1].mul_(2)  # grad * 2 (exact in fp32 and bf16)
    adamw_update(*a, seg, step=4, seed=9, **dict(HYPER, grad_scale=1.0))
    adamw_update(*b, seg, step=4, seed=9, **dict(HYPER, grad_scale=0.5))
    for i in (0, 2, 3, 4):  # param, m, v, master (grad differs by construction)
        if a[i] is not None:
            assert _equal_bits(a[i], b[i])
    c = _clone(_state(seg.numel, mode, device))
    adamw_update(*c, seg, step=4, seed=9, **dict(HYPER, grad_scale=0.5))
    assert not torch.equal(c[2], a[2]), "grad_scale had no effect on m"


@pytest.mark.parametrize("device", DEVICES)
def test_bias_correction_uses_step(device):
    seg = _segments(device)
    n = seg.numel
    param, grad, m, v, master = _state(n, "fp32", device)
    m.zero_(), v.zero_()
    grad.copy_(torch.linspace(-1, 1, n).to(device) + 0.01)  # |g| >> eps, no zeros
    w0 = param.clone()
    hyper = dict(HYPER, weight_decay=0.0, grad_scale=1.0)
    adamw_update(param, grad, m, v, None, seg, step=1, seed=0, **hyper)
    # step 1 from zero moments: m_hat = g, v_hat = g*g, so the step is lr * sign(g)
    update = (w0 - param).double().cpu()
    want = hyper["lr"] * torch.sign(grad.double().cpu()) * (
        grad.abs().double().cpu() / (grad.abs().double().cpu() + hyper["eps"]))
    assert _rel(update, want) < 1e-5
    # at a large step the correction is ~1, and the same zero moments give a first step of
    # (1-b1)/sqrt(1-b2) = 0.447 of that
    later = _state(n, "fp32", device)
    later[2].zero_(), later[3].zero_(), later[1].copy_(grad)
    w_later = later[0].clone()
    adamw_update(*later, seg, step=10_000, seed=0, **hyper)
    update_later = (w_later - later[0]).double().cpu()
    want_w, _, _ = _float64_adamw(w_later, grad, later[2] * 0, later[3] * 0, seg.decay_mask(),
                                  step=10_000, **hyper)
    assert _rel(update_later, w_later.double().cpu() - want_w) < 1e-5
    ratio = (update_later / update).median().item()
    assert abs(ratio - 0.1 / 0.05 ** 0.5) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_nonfinite_grad_gives_nan_weights(device, mode, bad):
    seg = _segments(device)
    param, grad, m, v, master = _state(seg.numel, mode, device)
    poisoned = [0, BLOCK + 3, seg.numel - 1]
    grad[poisoned] = float(bad)
    adamw_update(param, grad, m, v, master, seg, step=2, seed=4, **HYPER)
    w = master if master is not None else param
    assert torch.isnan(w[poisoned]).all(), "a non-finite gradient was hidden"
    assert torch.isnan(param[poisoned]).all()
    others = torch.ones(seg.numel, dtype=torch.bool, device=device)
    others[poisoned] = False
    assert torch.isfinite(w[others]).all() and torch.isfinite(param[others]).all()
    if mode == "bf16":
        assert (_bits(param[poisoned]) == reference.BF16_NAN_BITS).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("bounds", [[0, 3, BLOCK * 2 + 5, -9], [0, 1, 8, BLOCK + 7],
                                    [BLOCK - 3, BLOCK - 2, -1]])
def test_sharded_update_equals_unsharded(device, mode, bounds):
    full = _segments(device)
    n = full.numel
    bounds = [b % n for b in bounds] + [n]  # negative: from the end
    ref = _state(n, mode, device)
    sharded = _clone(ref)
    for step in (1, 2):
        adamw_update(*ref, full, step=step, seed=77 + step, **HYPER)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            seg = _segments(device, lo, hi)
            views = tuple(None if t is None else t[lo:hi] for t in sharded)
            adamw_update(*views, seg, step=step, seed=77 + step, **HYPER)
    lo0 = bounds[0]
    for x, y in zip(ref, sharded):
        if x is not None:
            assert _equal_bits(x[lo0:], y[lo0:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_empty_shard_and_empty_tensors(device, mode):
    seg = _segments(device, lo=9, hi=9)
    assert seg.numel == 0 and seg.block_table.shape[1] == 0
    state = _state(0, mode, device)
    adamw_update(*state, seg, step=1, seed=0, **HYPER)
    copy_master_to_params(state[0], state[4] if mode == "bf16" else state[0], seg, 0)
    only_empty = Segments.build([0, 0], [True, False], device=device)
    assert only_empty.numel == 0 and only_empty.pieces == ()


@pytest.mark.parametrize("device", DEVICES)
def test_copy_master_to_params_reproduces_update(device):
    seg = _segments(device)
    param, grad, m, v, master = _state(seg.numel, "bf16", device)
    adamw_update(param, grad, m, v, master, seg, step=3, seed=0xDEADBEEF, **HYPER)
    resumed = torch.zeros_like(param)
    copy_master_to_params(resumed, master, seg, seed=0xDEADBEEF)
    assert _equal_bits(resumed, param)
    copy_master_to_params(resumed, master, seg, seed=0xDEADBEEE)
    assert not _equal_bits(resumed, param)


def test_argument_errors():
    seg = _segments("cpu")
    param, grad, m, v, master = _state(seg.numel, "bf16", "cpu")
    with pytest.raises(ValueError, match="master"):
        adamw_update(param, grad, m, v, None, seg, step=1, seed=0, **HYPER)
    with pytest.raises(ValueError, match="grad"):
        adamw_update(param, grad.float(), m, v, master, seg, step=1, seed=0, **HYPER)
    with pytest.raises(ValueError, match="m must"):
        adamw_update(param, grad, m[:-1], v, master, seg, step=1, seed=0, **HYPER)
    with pytest.raises(ValueError, match="step counts from 1"):
        adamw_update(param, grad, m, v, master, seg, step=0, seed=0, **HYPER)


# ---------------------------------------------------------------------------------------------
# Stochastic rounding

def _bf16_neighbours(x):
    """The bf16 values just below and above |x| in magnitude (truncation and truncation + 1)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    down = bits >> 16
    return [((b ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16)
            for b in (down, (down + 1) & 0xFFFF)]


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_unbiased(device):
    n = 1 << 21
    seg = Segments.build([n // 2, n - n // 2], [True, False], device=device)
    g = torch.Generator().manual_seed(11)
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    base = (1 + torch.randint(0, 128, (n,), generator=g) * ulp)
    frac = torch.rand(n, generator=g) * 0.5  # always in the lower half: RTN always rounds down
    x = (base + frac * ulp).to(device)
    sr = stochastic_round_bf16(x, seg, seed=12345)
    err_sr = ((sr.double() - x.double()) / ulp).mean().item()
    err_rtn = ((x.to(torch.bfloat16).double() - x.double()) / ulp).mean().item()
    assert abs(err_rtn) > 0.2  # round-to-nearest: about -0.25 ulp on this data
    assert abs(err_sr) < 5e-3  # SR: 0 within ~14 standard errors (sd of the mean ~3.5e-4)
    up = (sr.double() > x.double()).double().mean().item()
    assert abs(up - frac.double().mean().item()) < 5e-3


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_picks_a_neighbour_and_keeps_exact_values(device):
    seg = _segments(device)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(seg.numel, generator=g) * torch.logspace(-30, 30, seg.numel)).to(device)
    sr = stochastic_round_bf16(x, seg, seed=2)
    down, up = _bf16_neighbours(x.cpu())
    sr_bits = _bits(sr)
    assert ((sr_bits == _bits(down)) | (sr_bits == _bits(up))).all()
    assert (sr_bits != _bits(down)).any() and (sr_bits != _bits(up)).any()
    exact = x.to(torch.bfloat16).float()  # representable values round to themselves
    assert _equal_bits(stochastic_round_bf16(exact, seg, seed=2), exact.to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_special_values(device):
    seg = Segments.build([8], [True], device=device)
    fmax = torch.finfo(torch.float32).max
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, fmax, 1e-45,
                      -1e-45]).to(device)
    x_bits = x.view(torch.int32).clone()
    x_bits[0] = 0x7FFFFFFF  # a NaN whose payload would carry into the sign bit
    x = x_bits.view(torch.float32)
    for seed in range(20):
        sr = stochastic_round_bf16(x, seg, seed)
        bits = _bits(sr).tolist()
        assert bits[0] == reference.BF16_NAN_BITS
        assert sr[1].item() == float("inf") and sr[2].item() == -float("inf")
        assert bits[3] == 0 and bits[4] == -0x8000  # signed zeros kept
        assert sr[5].item() in (float("inf"), 3.3895313892515355e38)  # overflow by distance
        assert bits[6] in (0, 1) and bits[7] in (-0x8000, -0x8000 + 1)  # subnormals


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_reproducible_and_seeded(device):
    seg = _segments(device)
    x = torch.randn(seg.numel, generator=torch.Generator().manual_seed(8)).to(device)
    a = stochastic_round_bf16(x, seg, seed=1)
    assert _equal_bits(a, stochastic_round_bf16(x.clone(), seg, seed=1))
    b = stochastic_round_bf16(x, seg, seed=2)
    differ = (_bits(a) != _bits(b)).double().mean().item()
    assert differ > 0.3  # about half the elements round the other way
    # a seed beyond 32 bits is taken modulo 2**32
    assert _equal_bits(a, stochastic_round_bf16(x, seg, seed=1 + 2 ** 32))


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_keyed_by_tensor_and_index(device):
    # two equal tensors of equal values: rounded differently (tensor id enters the seed), and a
    # shard sees the same rounding as the whole buffer (index is within the tensor)
    n = 4000
    seg = Segments.build([n, n], [True, True], device=device)
    x = (1 + torch.rand(n, generator=torch.Generator().manual_seed(1)) * 0.01).repeat(2)
    x = x.to(device)
    sr = stochastic_round_bf16(x, seg, seed=3)
    assert not _equal_bits(sr[:n], sr[n:])
    for lo, hi in [(1, 2), (n - 5, n + 2051), (n + 17, 2 * n)]:
        shard = Segments.build([n, n], [True, True], lo, hi, device=device)
        assert _equal_bits(stochastic_round_bf16(x[lo:hi].contiguous(), shard, seed=3),
                           sr[lo:hi])


def test_hash_matches_plain_uint32_arithmetic():
    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    keys = [0, 1, 2 ** 31, 2 ** 32 - 1, 123456789]
    counters = torch.tensor([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 987654321])
    for key in keys:
        want = [mix(mix((c + 0x9E3779B9) & 0xFFFFFFFF) ^ key) for c in counters.tolist()]
        assert reference.hash2(key, counters).tolist() == want
        assert [reference.hash2(key, c) for c in counters.tolist()] == want
    # a bijection in the counter for a fixed key: no two elements of a tensor share bits
    assert reference.hash2(7, torch.arange(1 << 16)).unique().numel() == 1 << 16


# ---------------------------------------------------------------------------------------------
# Segments

def test_segments_tables():
    seg = Segments.build([3, 0, 5, 4], [True, False, False, True], lo=2, hi=10)
    assert [(p.start, p.length, p.tensor_id, p.offset, p.decay) for p in seg.pieces] == [
        (0, 1, 0, 2, True), (1, 5, 2, 0, False), (6, 2, 3, 0, True)]
    assert seg.seg_table.tolist() == [[0, 1, 6], [1, 6, 8], [0, 2, 3], [2, 0, 0], [1, 0, 1]]
    assert seg.block_table.tolist() == [[0], [2]]
    assert seg.max_pieces == 3
    assert seg.decay_mask().tolist() == [1, 0, 0, 0, 0, 0, 1, 1]
    big = Segments.build([BLOCK - 1, 2, BLOCK * 2], [True] * 3)
    assert big.block_table.tolist() == [[0, 1, 2, 2], [1, 2, 2, 2]]
    assert big.max_pieces == 2
    with pytest.raises(ValueError, match="one decay flag per tensor"):
        Segments.build([1, 2], [True])
    with pytest.raises(ValueError, match="0 <= lo <= hi <= total"):
        Segments.build([1, 2], [True, True], lo=2, hi=4)


# ---------------------------------------------------------------------------------------------
# GPU: Triton against the reference

@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 0x5EED])
def test_gpu_stochastic_rounding_bitwise_equals_reference(seed):
    seg_cpu, seg_gpu = _segments("cpu"), _segments("cuda")
    g = torch.Generator().manual_seed(seed % 1000)
    x = torch.randn(seg_cpu.numel, generator=g) * torch.logspace(-40, 38, seg_cpu.numel)
    x[[0, 5, 100, 3000]] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    gpu = stochastic_round_bf16(x.cuda(), seg_gpu, seed)
    cpu = reference.stochastic_round_bf16(x, seg_cpu, seed)
    assert _equal_bits(gpu, cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("lo_hi", [(0, None), (5, 6000)])
def test_gpu_adamw_matches_reference(mode, lo_hi):
    lo, hi = lo_hi
    seg_cpu, seg_gpu = _segments("cpu", lo, hi), _segments("cuda", lo, hi)
    cpu = _state(seg_cpu.numel, mode, "cpu", seed=21)
    gpu = tuple(None if t is None else t.cuda() for t in cpu)
    for step in (1, 2, 3):
        reference.adamw_update(*cpu, seg_cpu, step=step, seed=step, **HYPER)
        adamw_update(*gpu, seg_gpu, step=step, seed=step, **HYPER)
    for name, c, gp in zip(("param", "grad", "m", "v", "master"), cpu, gpu):
        if c is not None and c.dtype == torch.float32:
            assert _rel(gp, c) < 1e-6, name
    if mode == "bf16":
        # the same master rounds to the same bf16 on both paths
        assert _equal_bits(gpu[0], reference.stochastic_round_bf16(gpu[4].cpu(), seg_cpu, 3))


@pytest.mark.gpu
def test_gpu_custom_ops_registered_and_compile():
    assert hasattr(torch.ops.raygpt, "adamw_update")
    assert hasattr(torch.ops.raygpt, "stochastic_round_bf16")
    seg = _segments("cuda")
    eager = _state(seg.numel, "bf16", "cuda", seed=5)
    compiled = _clone(eager)

    def step_fn(p, g, m, v, w):
        adamw_update(p, g, m, v, w, seg, step=2, seed=6, **HYPER)

    step_fn(*eager)
    torch.compile(step_fn)(*compiled)
    for x, y in zip(eager, compiled):
        assert _equal_bits(x, y)


# ---------------------------------------------------------------------------------------------
# The Triton kernels on CPU tensors, through Triton's interpreter (no GPU needed).

def _interpreter_checks():
    """Run in a subprocess with TRITON_INTERPRET=1: kernels against the reference."""
    from raygpt.ops import triton_kernels

    for lo, hi in [(0, None), (5, 6000), (2047, 2049)]:
        seg = _segments("cpu", lo, hi)
        x = torch.randn(seg.numel) * torch.logspace(-40, 38, seg.numel)
        x[0] = float("nan")
        for seed in (0, 2 ** 31 + 5):
            assert _equal_bits(triton_kernels.stochastic_round_bf16(x, seg, seed),
                               reference.stochastic_round_bf16(x, seg, seed)), (lo, hi, seed)
        for mode in ("fp32", "bf16"):
            ref = _state(seg.numel, mode, "cpu", seed=lo)
            ker = _clone(ref)
            for step in (1, 2):
                reference.adamw_update(*ref, seg, step=step, seed=step, **HYPER)
                triton_kernels.adamw_update(*ker, seg, step=step, seed=step, **HYPER)
            for name, r, k in zip(("param", "grad", "m", "v", "master"), ref, ker):
                if r is not None and r.dtype == torch.float32:
                    assert _rel(k, r) < 1e-6, (lo, hi, mode, name)
            if mode == "bf16":
                assert _equal_bits(ker[0], reference.stochastic_round_bf16(ker[4], seg, 2))
    print("interpreter checks passed")


@needs_triton
def test_triton_kernels_in_interpreter():
    run_in_interpreter(__file__)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _interpreter_checks()
