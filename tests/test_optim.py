"""Flat buffers in llm.c order, llm.c's xorshift RNG, ZeRO-1 shard ranges, AdamW over the flat
buffers against torch.optim.AdamW."""

import pytest
import torch

from raygpt.model import GPT, GPTConfig, llmc_parameter_layout
from raygpt.optim import AdamW, FlatParameters, random_u32, shard_range


def tiny_model():
    return GPT(GPTConfig(block_size=16, vocab_size=60, padded_vocab_size=64, n_layer=2, n_head=2,
                         n_embd=16), init_seed=3)


def test_parameters_and_grads_are_views_in_llmc_order():
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
            offset += p.numel()
    x = torch.randint(0, 60, (2, 8))
    for _ in range(2):  # accumulation lands in the flat gradient buffer, in place
        loss, _ = model(x, x)
        loss.backward()
    assert flat.grads.abs().sum() > 0
    assert model.transformer.wte.weight.grad.data_ptr() == flat.grads.data_ptr()


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
