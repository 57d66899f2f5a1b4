"""Flat buffers in llm.c order, llm.c's xorshift RNG, ZeRO-1 shard ranges, AdamW over the flat
buffers against torch.optim.AdamW."""

import pytest
import torch

from raygpt.model.gpt import GPT, LLMC_DECAY, GPTConfig, llmc_parameter_layout
from raygpt.train.optim import AdamW, FlatParameters, random_u32, shard_range


def tiny_model():
    return GPT(GPTConfig(block_size=16, vocab_size=60, padded_vocab_size=64, n_layer=2, n_head=2,
                         n_embd=16), init_seed=3)


def test_parameters_and_grads_alias_the_flat_buffers_in_llmc_order():
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flat = FlatParameters(model, torch.device("cpu"), torch.float32)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])  # same values, now living in the flat buffer
    offset = 0
    for _, params in llmc_parameter_layout(model):
        for p in params:
            assert p.data_ptr() == flat.params[offset:].data_ptr()
            assert p.grad.data_ptr() == flat.grads[offset:].data_ptr()
            # the buffers' memory, not autograd views of them: torch.compile replays every
            # view among its inputs from the view's base, at every start (a second at GPT-2)
            assert not p._is_view() and not p.grad._is_view()
            offset += p.numel()
    x = torch.randint(0, 60, (2, 8))
    for _ in range(2):  # accumulation lands in the flat gradient buffer, in place
        loss, _ = model(x, x)
        loss.backward()
    assert flat.grads.abs().sum() > 0
    assert model.transformer.wte.weight.grad.data_ptr() == flat.grads.data_ptr()
    ref = tiny_model()
    for _ in range(2):
        ref(x, x)[0].backward()
    assert torch.equal(flat.grads[:flat.num_parameters], torch.cat(
        [p.grad.reshape(-1) for _, params in llmc_parameter_layout(ref) for p in params]))
    flat.params[0] = 7.0  # and writes through the buffer are the model's
    assert model.transformer.wte.weight[0, 0].item() == 7.0


def test_random_u32_is_llmc_xorshift_star():
    # llm.c: state ^= state >> 12; state ^= state << 25; state ^= state >> 27;
    #        return (state * 0x2545F4914F6CDD1D) >> 32   (64-bit arithmetic)
    s = 13371337
    mask = (1 << 64) - 1
    s2 = s ^ (s >> 12)
    s2 ^= (s2 << 25) & mask
    s2 ^= s2 >> 27
    value, state = random_u32(s)
    assert state == s2 and value == ((s2 * 0x2545F4914F6CDD1D) & mask) >> 32
    values = {random_u32(v)[0] for v in range(1, 200)}
    assert len(values) == 199 and all(0 <= v < 2**32 for v in values)


@pytest.mark.parametrize("n, world", [(10, 1), (10, 2), (11, 2), (7, 3), (1000003, 8)])
def test_zero_shards_cover_everything_once(n, world):
    ranges = [shard_range(n, r, world, 1) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert shard_range(n, 1 % world, world, 0) == (0, n)


def test_adamw_matches_torch_adamw_in_fp32():
    torch.manual_seed(0)
    model = tiny_model()
    ref = tiny_model()
    flat = FlatParameters(model, torch.device("cpu"), torch.float32)
    # eps well above the float noise: the key bias of attention has an exactly-zero true
    # gradient, and Adam turns two different 1e-10 noises into two different full-size steps
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-4, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-4,
                                weight_decay=0.0)
    x = torch.randint(0, 60, (2, 8))
    for t in range(1, 4):
        flat.zero_grad()
        model(x, x)[0].backward()
        opt.step(lr=1e-3, grad_scale=1.0, t=t, seed=t)
        ref_opt.zero_grad()
        ref(x, x)[0].backward()
        ref_opt.step()
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (n, (a - b).abs().max())


def test_adamw_defaults_to_one_process_that_needs_no_process_group():
    """AdamW's defaults are a single process (rank 0 of 1, no ZeRO): it owns every parameter,
    and its data-parallel collectives are no-ops that need no torch.distributed process group
    (found by bench/mutants.sh: a default of world=2 survived the other tests)."""
    import torch.distributed as dist
    flat = FlatParameters(tiny_model(), torch.device("cpu"), torch.float32)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    assert not dist.is_initialized()
    assert (opt.rank, opt.world, opt.zero_stage) == (0, 1, 0)
    assert (opt.lo, opt.hi) == (0, flat.num_parameters) and opt.master is None
    flat.grads.fill_(1.0)
    opt.reduce_gradients()  # would call into torch.distributed with world > 1
    opt.gather_params()
    assert torch.equal(flat.grads, torch.ones_like(flat.grads))


def test_a_zero1_rank_holds_optimizer_state_for_its_shard_only():
    """Rank 1 of 2 under ZeRO-1 owns the second half of the padded buffer (clipped to the real
    parameters): m, v are that long, and the optimizer reads that slice (no process group is
    needed to build it; shard-range argument mutants survived the single-process tests)."""
    flat = FlatParameters(tiny_model(), torch.device("cpu"), torch.float32, pad_multiple=2)
    n = flat.num_parameters
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, rank=1, world=2,
                zero_stage=1)
    half = -(-n // 2)
    assert (opt.lo, opt.hi) == (half, n) == shard_range(n, 1, 2, 1)
    assert opt.m.shape == opt.v.shape == (n - half,) and opt.m.dtype == torch.float32
    assert opt.shard_params.data_ptr() == flat.params[half:].data_ptr()


# ---------------------------------------------------------------------- bench/mutants.sh survivors

def test_flat_buffers_pad_to_the_multiple_with_a_tail_that_belongs_to_no_parameter():
    model = tiny_model()
    layout = llmc_parameter_layout(model)
    n = sum(p.numel() for p in model.parameters())
    assert n % 5 != 0  # so that padding to 5 adds a tail
    flat = FlatParameters(model, torch.device("cpu"), torch.float32, pad_multiple=5)
    assert flat.num_parameters == n and flat.padded_size == (n // 5 + 1) * 5
    assert flat.params.shape == flat.grads.shape == (flat.padded_size,)
    assert flat.params.dtype == flat.grads.dtype == torch.float32
    assert flat.names == [name for name, _ in layout]
    assert flat.tensor_sizes == [sum(p.numel() for p in ps) for _, ps in layout]
    assert flat.decay == [name in LLMC_DECAY for name, _ in layout] and any(flat.decay)
    assert not all(flat.decay)
    assert torch.count_nonzero(flat.params[n:]) == 0 and torch.count_nonzero(flat.params[:n]) > 0
    assert FlatParameters(tiny_model(), torch.device("cpu"), torch.float32).padded_size == n
    x = torch.randint(0, 60, (2, 8))
    model(x, x)[0].backward()
    assert flat.grads.abs().sum() > 0 and torch.count_nonzero(flat.grads[n:]) == 0
    flat.zero_grad()
    assert torch.count_nonzero(flat.grads) == 0
    assert model.transformer.wte.weight.grad.data_ptr() == flat.grads.data_ptr()  # still a view


@pytest.mark.parametrize("n, world, expected", [
    (11, 2, [(0, 6), (6, 11)]), (7, 3, [(0, 3), (3, 6), (6, 7)]),
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)])])
def test_zero1_shard_ranges_are_exact(n, world, expected):
    assert [shard_range(n, r, world, 1) for r in range(world)] == expected
    assert [shard_range(n, r, world, 0) for r in range(world)] == [(0, n)] * world
    assert shard_range(n, 0, 1, 1) == (0, n)


def test_one_adamw_step_is_llmcs_formula_with_the_scaled_gradient():
    """m, v and the weights after the first step (t=1: bias corrections 1 - beta), with
    grad_scale 0.25 and weight decay on llm.c's decay tensors only."""
    model = tiny_model()
    flat = FlatParameters(model, torch.device("cpu"), torch.float32)
    b1, b2, eps, wd, lr, scale = 0.8, 0.9, 1e-3, 0.5, 1e-2, 0.25
    opt = AdamW(flat, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
    x = torch.randint(0, 60, (2, 8))
    model(x, x)[0].backward()
    w0, g = flat.params.double().clone(), flat.grads.double().clone() * scale
    opt.step(lr=lr, grad_scale=scale, t=1, seed=5)
    assert torch.allclose(opt.m.double(), (1 - b1) * g, rtol=1e-5, atol=1e-12)
    assert torch.allclose(opt.v.double(), (1 - b2) * g * g, rtol=1e-5, atol=1e-16)
    decay = torch.cat([torch.full((s,), wd if d else 0.0, dtype=torch.float64)
                       for s, d in zip(flat.tensor_sizes, flat.decay)])
    m_hat, v_hat = (1 - b1) * g / (1 - b1), (1 - b2) * g * g / (1 - b2)
    expected = w0 - lr * (m_hat / (v_hat.sqrt() + eps) + decay * w0)
    assert torch.allclose(flat.params.double(), expected, rtol=1e-5, atol=1e-7)
    # t is the bias-correction step: the same moments at t=2 give a different update
    w1 = flat.params.clone()
    m1 = opt.m.clone()
    flat.grads.zero_()
    opt.step(lr=lr, grad_scale=scale, t=2, seed=5)
    m_hat2 = b1 * m1.double() / (1 - b1 ** 2)
    v_hat2 = b2 * ((1 - b2) * g * g) / (1 - b2 ** 2)
    expected2 = w1.double() - lr * (m_hat2 / (v_hat2.sqrt() + eps) + decay * w1.double())
    assert torch.allclose(flat.params.double(), expected2, rtol=1e-5, atol=1e-7)


def test_bf16_working_weights_round_with_the_seed_and_rederive_from_the_master():
    model = tiny_model()
    flat = FlatParameters(model, torch.device("cpu"), torch.bfloat16)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    assert opt.use_master_weights and opt.master.dtype == torch.float32
    assert torch.equal(opt.master, flat.params.float())
    x = torch.randint(0, 60, (2, 8))
    model(x, x)[0].backward()
    start = (flat.params.clone(), opt.master.clone(), opt.m.clone(), opt.v.clone())
    opt.step(lr=1e-3, grad_scale=1.0, t=1, seed=11)
    after11, master11 = flat.params.clone(), opt.master.clone()
    for buf, saved in zip((flat.params, opt.master, opt.m, opt.v), start):
        buf.copy_(saved)
    opt.step(lr=1e-3, grad_scale=1.0, t=1, seed=12)
    assert torch.equal(opt.master, master11)  # the master update does not depend on the seed
    assert not torch.equal(flat.params, after11)  # the rounding does
    flat.params.zero_()
    opt.rederive_working_weights(12)
    assert not torch.equal(flat.params, after11)
    opt.rederive_working_weights(11)
    assert torch.equal(flat.params, after11)  # bit for bit, from the master and the seed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seed", [0, 11, 2 ** 32 - 1])
def test_rederiving_fresh_bf16_weights_returns_them_unchanged(seed, device):
    """The loop re-derives a fresh GPU run's working weights once (so the restore's kernel is in
    the node's cache before any restart needs it): master holds bf16 values exactly, and their
    stochastic rounding, whatever the seed, gives back the same bits (on CUDA: the Triton kernel
    the loop runs)."""
    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():  # values with every exponent, signs, and zeros
            p.copy_(torch.randn(p.shape) * 10.0 ** torch.randint(-30, 30, p.shape))
            p.view(-1)[:3] = torch.tensor([0.0, -0.0, float("inf")])
    flat = FlatParameters(model, torch.device(device), torch.bfloat16)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    before = flat.params.clone()
    opt.rederive_working_weights(seed)
    assert torch.equal(flat.params.view(torch.int16), before.view(torch.int16))


def test_rederive_without_master_weights_leaves_fp32_weights_alone():
    flat = FlatParameters(tiny_model(), torch.device("cpu"), torch.float32)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    assert opt.master is None and not opt.use_master_weights
    flat.params[:5] = 7.0
    before = flat.params.clone()
    opt.rederive_working_weights(3)
    assert torch.equal(flat.params, before)


def test_grad_norm_squared_is_this_ranks_shard_only():
    model = tiny_model()
    flat = FlatParameters(model, torch.device("cpu"), torch.float32, pad_multiple=2)
    x = torch.randint(0, 60, (2, 8))
    model(x, x)[0].backward()
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, rank=1, world=2,
                zero_stage=1)
    got = opt.grad_norm_squared()
    assert got.dtype == torch.float32 and got.dim() == 0
    assert torch.allclose(got, (flat.grads[opt.lo:opt.hi] ** 2).sum())
    assert not torch.allclose(got, (flat.grads ** 2).sum())


class FakeWorld:
    """torch.distributed for rank `rank` of `world` in one process: the other ranks' buffers are
    given (`others[r]`), collectives combine them with this rank's real tensors; calls are
    recorded. Stands in for a process group in the pure tests of AdamW's collectives."""

    class ReduceOp:
        SUM = "sum"

    def __init__(self, backend, rank, others):
        self.backend, self.rank, self.others, self.calls = backend, rank, others, []

    def get_backend(self):
        return self.backend

    def _everyone(self, mine):
        return [mine if r == self.rank else self.others[r] for r in range(len(self.others))]

    def all_reduce(self, t, op):
        assert op == "sum"
        self.calls.append("all_reduce")
        t.copy_(sum(b.clone() for b in self._everyone(t)))

    def reduce_scatter_tensor(self, out, inp, op):
        assert op == "sum"
        self.calls.append("reduce_scatter_tensor")
        shard = inp.numel() // len(self.others)
        total = sum(b.clone() for b in self._everyone(inp))
        out.copy_(total[self.rank * shard:(self.rank + 1) * shard])

    def all_gather_into_tensor(self, out, inp):
        self.calls.append("all_gather_into_tensor")
        shard = inp.numel()
        assert out.numel() == shard * len(self.others)
        pieces = [inp if r == self.rank else self.others[r][r * shard:(r + 1) * shard]
                  for r in range(len(self.others))]
        out.copy_(torch.cat(pieces))


def fake_world_optimizer(monkeypatch, backend, zero_stage, which):
    """Rank 1 of 3 with padded buffers; the other ranks' `which` buffers are 10 and 100."""
    import raygpt.train.optim as optim
    flat = FlatParameters(tiny_model(), torch.device("cpu"), torch.float32, pad_multiple=3)
    mine = getattr(flat, which)
    mine.copy_(torch.arange(mine.numel(), dtype=torch.float32))
    others = [torch.full_like(mine, 10.0), None, torch.full_like(mine, 100.0)]
    world = FakeWorld(backend, 1, others)
    monkeypatch.setattr(optim, "dist", world)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, rank=1, world=3,
                zero_stage=zero_stage)
    return flat, mine.clone(), world, opt


@pytest.mark.parametrize("backend, zero_stage", [("gloo", 0), ("nccl", 0), ("gloo", 1)])
def test_gradients_are_summed_over_every_rank(monkeypatch, backend, zero_stage):
    flat, before, world, opt = fake_world_optimizer(monkeypatch, backend, zero_stage, "grads")
    opt.reduce_gradients()
    assert world.calls == ["all_reduce"]
    assert torch.equal(flat.grads, before + 110.0)


def test_zero1_on_nccl_reduce_scatters_this_ranks_shard(monkeypatch):
    flat, before, world, opt = fake_world_optimizer(monkeypatch, "nccl", 1, "grads")
    opt.reduce_gradients()
    assert world.calls == ["reduce_scatter_tensor"]
    shard = flat.padded_size // 3
    assert torch.equal(flat.grads[shard:2 * shard], before[shard:2 * shard] + 110.0)
    assert torch.equal(flat.grads[:shard], before[:shard])  # not this rank's: left as it was
    assert torch.equal(flat.grads[2 * shard:], before[2 * shard:])


def test_zero1_gathers_every_ranks_updated_shard(monkeypatch):
    flat, before, world, opt = fake_world_optimizer(monkeypatch, "gloo", 1, "params")
    opt.gather_params()
    assert world.calls == ["all_gather_into_tensor"]
    shard = flat.padded_size // 3
    assert torch.equal(flat.params[:shard], torch.full((shard,), 10.0))
    assert torch.equal(flat.params[shard:2 * shard], before[shard:2 * shard])
    assert torch.equal(flat.params[2 * shard:], torch.full((flat.padded_size - 2 * shard,), 100.0))


def test_without_zero_there_is_nothing_to_gather(monkeypatch):
    flat, before, world, opt = fake_world_optimizer(monkeypatch, "nccl", 0, "params")
    opt.gather_params()
    assert world.calls == [] and torch.equal(flat.params, before)


def test_by_default_the_buffers_are_not_padded():
    """An odd parameter count (n_embd 3) stays unpadded without pad_multiple."""
    model = GPT(GPTConfig(block_size=8, vocab_size=60, padded_vocab_size=64, n_layer=1, n_head=1,
                          n_embd=3), init_seed=3)
    flat = FlatParameters(model, torch.device("cpu"), torch.float32)
    assert flat.num_parameters % 2 == 1 and flat.padded_size == flat.num_parameters
    assert flat.params.numel() == flat.grads.numel() == flat.num_parameters


@pytest.mark.parametrize("world, zero_stage", [(2, 0), (1, 1)])
def test_without_zero_or_with_one_rank_the_optimizer_owns_everything_alone(world, zero_stage):
    """ZeRO off on 2 ranks, or ZeRO-1 on 1 rank: every parameter is this rank's, and
    gathering the weights needs no process group (none exists here)."""
    flat = FlatParameters(tiny_model(), torch.device("cpu"), torch.float32, pad_multiple=world)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, rank=world - 1,
                world=world, zero_stage=zero_stage)
    assert (opt.lo, opt.hi) == (0, flat.num_parameters)
    assert opt.m.numel() == opt.v.numel() == flat.num_parameters
    if world == 1:
        before = flat.params.clone()
        opt.gather_params()
        opt.reduce_gradients()
        assert torch.equal(flat.params, before)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_zero1_shards_update_is_the_unsharded_update_of_its_slice(monkeypatch, rank):
    """Each ZeRO-1 rank's AdamW step over its shard equals, bit for bit, the single-process step
    on that slice (the shard's segments must cover exactly [lo, hi) of the right tensors)."""
    import raygpt.train.optim as optim
    models = [tiny_model(), tiny_model()]
    x = torch.randint(0, 60, (2, 8))
    flats = [FlatParameters(m, torch.device("cpu"), torch.float32, pad_multiple=2) for m in models]
    for m in models:
        m(x, x)[0].backward()
    kw = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    whole = AdamW(flats[0], **kw)
    monkeypatch.setattr(optim, "dist", FakeWorld("gloo", rank, [None, None]))
    shard = AdamW(flats[1], **kw, rank=rank, world=2, zero_stage=1)
    monkeypatch.setattr(AdamW, "gather_params", lambda self: None)  # no other rank here
    for t in (1, 2):
        whole.step(lr=1e-2, grad_scale=0.5, t=t, seed=t)
        shard.step(lr=1e-2, grad_scale=0.5, t=t, seed=t)
    lo, hi = shard.lo, shard.hi
    assert 0 < hi - lo < flats[0].num_parameters
    assert torch.equal(flats[1].params[lo:hi], flats[0].params[lo:hi])
    assert torch.equal(shard.m, whole.m[lo:hi]) and torch.equal(shard.v, whole.v[lo:hi])
