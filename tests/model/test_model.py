"""raygpt.model.gpt: the GPT-2 network, its loss (the fused one: test_classifier_loss.py), sampling,
llm.c's parameter layout (the model file that holds the weights: tests/llmc/test_model_file.py)."""

import math

import pytest
import torch
from torch.nn import functional as F

import raygpt.model.gpt

from raygpt.model.gpt import (
    GPT, LLMC_DECAY, LLMC_TENSOR_NAMES, GPTConfig, llmc_parameter_layout,
    llmc_tensor_shapes, num_parameters, saved_activation_bytes,
)

# Tiny: 2 layers, C=64, 2 heads, block 32, vocab 100 padded to 128.
CFG = GPTConfig(block_size=32, vocab_size=100, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=64)


@pytest.fixture
def model():
    return GPT(CFG, init_seed=7)


def batch(B=3, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    return idx, targets


def all_logits(model, idx):
    """Logits for every padded column (B, T, Vp), bypassing forward's slicing."""
    t = model.transformer
    x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
    for block in t.h:
        x = block(x)
    return model.lm_head(t.ln_f(x))


def reference_forward(model, idx):
    """GPT-2 written out by hand from the parameters (explicit mask, GELU formula)."""
    t, C, nh = model.transformer, CFG.n_embd, CFG.n_head
    B, T = idx.shape
    ln = lambda x, m: F.layer_norm(x, (C,), m.weight, m.bias, 1e-5)
    x = t.wte.weight[idx] + t.wpe.weight[:T]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for blk in t.h:
        qkv = ln(x, blk.ln_1) @ blk.attn.c_attn.weight.T + blk.attn.c_attn.bias
        q, k, v = (z.view(B, T, nh, C // nh).transpose(1, 2) for z in qkv.split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // nh)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ blk.attn.c_proj.weight.T + blk.attn.c_proj.bias
        h = ln(x, blk.ln_2) @ blk.mlp.c_fc.weight.T + blk.mlp.c_fc.bias
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
        x = x + h @ blk.mlp.c_proj.weight.T + blk.mlp.c_proj.bias
    return (ln(x, t.ln_f) @ t.wte.weight.T)[..., :CFG.vocab_size]


# ---------------------------------------------------------------------- config and init

def test_from_depth_uses_model_shapes():
    cfg = GPTConfig.from_depth(12)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size) == (12, 768, 12, 1024)
    assert (cfg.vocab_size, cfg.padded_vocab_size) == (50257, 50304)
    assert GPTConfig.from_depth(4, block_size=64) == GPTConfig(
        block_size=64, n_layer=4, n_head=4, n_embd=256)
    with pytest.raises(ValueError, match="depth"):
        GPTConfig.from_depth(7)
    with pytest.raises(ValueError, match="n_embd"):
        GPTConfig(n_embd=100, n_head=3)


def test_gpt2_init(model):
    t = model.transformer
    wte = t.wte.weight
    assert torch.all(wte[CFG.vocab_size:] == 0), "padded vocab rows start at zero"
    assert abs(wte[:CFG.vocab_size].std().item() - 0.02) < 0.002
    resid_std = 0.02 / math.sqrt(2 * CFG.n_layer)
    c_proj = torch.cat([b.attn.c_proj.weight.flatten() for b in t.h] +
                       [b.mlp.c_proj.weight.flatten() for b in t.h])
    assert abs(c_proj.std().item() - resid_std) < 0.1 * resid_std
    assert abs(t.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif ".ln_" in name:
            assert torch.all(p == 1), name
    # The same seed gives the same weights; another seed does not.
    assert torch.equal(GPT(CFG, init_seed=7).transformer.wpe.weight, t.wpe.weight)
    assert not torch.equal(GPT(CFG, init_seed=8).transformer.wpe.weight, t.wpe.weight)


def test_gpt2_init_draws_no_pytorch_init_and_empty_draws_none(monkeypatch):
    """GPT(config, init_seed) builds its modules on the meta device, so PyTorch's own init
    (which GPT-2's overwrites) is never drawn, and its weights equal PyTorch's init overwritten
    by init_gpt2; GPT.empty draws no init at all and keeps lm_head tied to wte."""
    old = GPT(CFG, init_seed=None)
    old.init_gpt2(7)
    drawn = []
    for name in ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_"):
        real = getattr(torch.nn.init, name)
        def spy(*a, _n=name, _r=real, **k):
            drawn.append((_n, (a[0] if a else k["tensor"]).device.type))
            return _r(*a, **k)
        monkeypatch.setattr(torch.nn.init, name, spy)
    new, empty = GPT(CFG, init_seed=7), GPT.empty(CFG)
    assert all(device == "meta" for _, device in drawn) and drawn  # built, never drawn on CPU
    assert old.state_dict().keys() == new.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(),
                                                  new.state_dict().values()))
    for m in (new, empty):
        assert m.lm_head.weight is m.transformer.wte.weight
        assert {p.device.type for p in m.parameters()} == {"cpu"}
        assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in old.parameters())


def test_building_a_model_imports_no_compiler():
    """A fresh process builds GPT(config, init_seed) and GPT.empty without importing
    torch._dynamo: PyTorch's normal_ on a meta tensor (nn.Embedding's own init) imports it,
    which put seconds of the compiler's imports inside every restarted worker's model build
    (they belong on the warm-up thread, beside the build)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from raygpt.model.gpt import GPT, GPTConfig\n"
            "GPT(GPTConfig.from_depth(2), init_seed=1); GPT.empty(GPTConfig.from_depth(2))\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------- forward and loss

def test_forward_shapes_and_reference(model):
    idx, _ = batch()
    logits = model(idx)
    assert logits.shape == (3, 16, CFG.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference_forward(model, idx), rtol=1e-4, atol=1e-5)
    last = model(idx, last_only=True)
    assert last.shape == (3, 1, CFG.vocab_size)
    torch.testing.assert_close(last[:, 0], logits[:, -1])
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, CFG.block_size + 1, dtype=torch.long))


def test_loss_sum_is_cross_entropy_sum_over_real_vocab(model):
    idx, targets = batch()
    loss_sum, z_sum = model(idx, targets)
    assert loss_sum.shape == () and loss_sum.dtype == torch.float32
    manual = F.cross_entropy(model(idx).reshape(-1, CFG.vocab_size), targets.reshape(-1), reduction="sum")
    torch.testing.assert_close(loss_sum, manual)
    assert z_sum.item() == 0.0
    # an untrained model is near uniform over the real V, not Vp
    assert abs(loss_sum.item() / targets.numel() - math.log(CFG.vocab_size)) < 0.2
    # last_max_logit is the largest |logit| over the real vocab, a detached 0-dim tensor
    assert model.last_max_logit.shape == () and not model.last_max_logit.requires_grad
    torch.testing.assert_close(model.last_max_logit, model(idx).abs().max())


def test_ignored_targets(model):
    idx, targets = batch()
    masked = targets.clone()
    masked[:, :5] = -1
    masked[1] = -1
    loss_sum, _ = model(idx, masked)
    keep = masked != -1
    logits = model(idx)
    manual = F.cross_entropy(logits[keep], targets[keep], reduction="sum")
    torch.testing.assert_close(loss_sum, manual)
    all_ignored, z = model(idx, torch.full_like(targets, -1), z_loss=1e-2)
    assert all_ignored.item() == 0.0 and z.item() == 0.0


def test_padded_columns_never_affect_the_loss(model):
    idx, targets = batch()
    before = model(idx, targets, z_loss=1e-3)
    with torch.no_grad():
        pad = model.transformer.wte.weight[CFG.vocab_size:]
        pad.copy_(1e3 * torch.randn(pad.shape, generator=torch.Generator().manual_seed(0)))
    assert all_logits(model, idx)[..., CFG.vocab_size:].abs().amax(-1).min() > 1e3  # huge padded logits
    after = model(idx, targets, z_loss=1e-3)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_z_loss_matches_manual(model):
    idx, targets = batch()
    targets[0, :4] = -1
    coef = 1e-3
    loss_sum, z_sum = model(idx, targets, z_loss=coef)
    logits = model(idx)
    lse = torch.logsumexp(logits, dim=-1)
    manual = coef * (lse[targets != -1] ** 2).sum()
    torch.testing.assert_close(z_sum, manual)
    assert z_sum.item() > 0
    torch.testing.assert_close(loss_sum, model(idx, targets)[0])  # z-loss leaves the CE alone


def test_weight_tie_and_gradient_flows_once(model):
    assert model.lm_head.weight is model.transformer.wte.weight
    idx, targets = batch()
    loss_sum, _ = model(idx, targets)
    loss_sum.backward()
    tied_grad = model.transformer.wte.weight.grad.clone()
    # Untie by hand: the tied gradient must be exactly the sum of the two uses' gradients.
    params = {k: v.detach() for k, v in model.named_parameters()}
    emb = params["transformer.wte.weight"].clone().requires_grad_()
    head = params["transformer.wte.weight"].clone().requires_grad_()
    params["transformer.wte.weight"], params["lm_head.weight"] = emb, head
    loss2, _ = torch.func.functional_call(model, params, (idx, targets), tie_weights=False)
    loss2.backward()
    torch.testing.assert_close(tied_grad, emb.grad + head.grad)
    assert head.grad.abs().sum() > 0 and emb.grad.abs().sum() > 0
    assert torch.all(tied_grad[CFG.vocab_size:] == 0), "padded rows get no gradient"
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names


def test_num_parameters_counts_padded_wte_once(model):
    C, L, Vp, T = CFG.n_embd, CFG.n_layer, CFG.padded_vocab_size, CFG.block_size
    per_layer = 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C + 4 * C * C + C
    assert num_parameters(model) == Vp * C + T * C + L * per_layer + 2 * C
    # GPT-2 124M as llm.c counts it (padded vocab)
    with torch.device("meta"):  # shapes only, no memory, no init cost
        gpt2 = GPT(GPTConfig(), init_seed=None)
    assert num_parameters(gpt2) == 124475904


def test_causal(model):
    idx, _ = batch(B=2, T=20)
    logits = model(idx)
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % CFG.vocab_size
    logits2 = model(changed)
    assert torch.equal(logits[:, :12], logits2[:, :12])
    assert not torch.allclose(logits[:, 12:], logits2[:, 12:])


# ---------------------------------------------------------------------- the fused classifier loss


def test_gpt_fused_and_reference_losses_agree(model):
    """The whole network: same loss, z-loss, max |logit| and every parameter gradient."""
    idx, targets = batch()          # B*T = 48 rows, in chunks of 20: 20 + 20 + 8
    targets[0, :5] = -1
    results = []
    for impl in ("reference", "fused"):
        m = GPT(CFG, init_seed=7, loss_impl=impl, ce_chunk_rows=20)
        assert m.loss_impl == impl
        loss_sum, z_sum = m(idx, targets, z_loss=1e-3)
        ((loss_sum + z_sum) / targets.numel()).backward()
        results.append((loss_sum.detach(), z_sum.detach(), m.last_max_logit,
                        {n: p.grad for n, p in m.named_parameters()}))
    (ref_loss, ref_z, ref_max, ref_grads), (loss, z, mx, grads) = results
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(z, ref_z)
    torch.testing.assert_close(mx, ref_max)
    assert mx.shape == () and not mx.requires_grad
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_gpt_implementation_options(model, monkeypatch):
    assert model.loss_impl == raygpt.model.gpt.DEFAULT_LOSS_IMPL
    assert model.ce_chunk_rows == raygpt.model.gpt.DEFAULT_CE_CHUNK_ROWS
    monkeypatch.setattr(raygpt.model.gpt, "DEFAULT_LOSS_IMPL", "reference")
    monkeypatch.setattr(raygpt.model.gpt, "DEFAULT_SDPA_BACKEND", "cudnn")
    m = GPT(CFG, init_seed=7)  # module defaults are read at construction
    assert m.loss_impl == "reference" and m.transformer.h[0].attn.sdpa_backend == "cudnn"
    assert GPT(CFG, init_seed=7, loss_impl="fused").loss_impl == "fused"
    assert GPT(CFG, init_seed=7, sdpa_backend="default").transformer.h[1].attn.sdpa_backend == "default"
    # cuDNN-first attention is a preference: on the CPU the same function is computed
    idx, _ = batch()
    torch.testing.assert_close(m(idx), model(idx))
    for bad in (dict(loss_impl="chunked"), dict(ce_chunk_rows=0), dict(sdpa_backend="xformers")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GPT(CFG, init_seed=None, **bad)


# ---------------------------------------------------------------------- activation recomputation

def sgd_steps(recompute, backend=None, steps=3, z_loss=1e-3, config=CFG):
    """`steps` SGD steps of a fresh GPT at this recompute level, compiled whole with `backend`
    (None: eager): each step's loss as a float, the last step's gradients, and the activation
    bytes the first step held for backward."""
    model = GPT(config, init_seed=7, recompute=recompute)
    forward = model if backend is None else torch.compile(model, dynamic=False, backend=backend)
    losses, held = [], None
    for step in range(steps):
        idx, targets = batch(seed=step)
        model.zero_grad(set_to_none=True)
        (loss_sum, z_sum), nbytes = saved_activation_bytes(
            model, lambda: forward(idx, targets, z_loss=z_loss))
        held = nbytes if held is None else held
        ((loss_sum + z_sum) / targets.numel()).backward()
        losses.append(loss_sum.item())
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return losses, {n: p.grad for n, p in model.named_parameters()}, held


def assert_recompute_exact(runs):
    """Every level's losses equal level 0's as floats, gradients equal bit for bit, and each
    level holds fewer activation bytes than the one below it."""
    losses0, grads0, _ = runs[0]
    for level, (losses, grads, _) in runs.items():
        assert losses == losses0, (level, losses, losses0)
        for name, g in grads0.items():
            assert torch.equal(grads[name], g), (level, name)
    held = [runs[level][2] for level in sorted(runs)]
    assert all(a > b for a, b in zip(held, held[1:])), held


def test_recompute_levels_are_bit_exact_and_hold_less():
    """Eager: the checkpointed regions free what they recompute (level 1 the MLP's
    activations, level 2 all but each block's input) and give the same values."""
    runs = {level: sgd_steps(level) for level in raygpt.model.gpt.RECOMPUTE_LEVELS}
    assert_recompute_exact(runs)
    # level 2 holds one (B, T, C) fp32 input per block plus the embedding and loss's own
    B, T = batch()[0].shape
    assert runs[2][2] < runs[0][2] / 3, [r[2] for r in runs.values()]
    assert runs[2][2] >= CFG.n_layer * B * T * CFG.n_embd * 4


def test_recompute_is_bit_exact_and_holds_less_under_compile():
    """Compiled whole, as the loop does: AOTAutograd's min-cut partitioner decides what the
    compiled forward saves (it may recompute on its own), and it honours the checkpointed
    regions: fewer saved bytes at each level, the same losses and gradients bit for bit.
    aot_eager_decomp_partition is Inductor's decompositions and partitioner (the same saved
    bytes as Inductor) run with eager kernels: Inductor's C++ compile would cost a minute of
    CPU per level. Inductor's own kernels are checked on the GPU (test_gpu_training)."""
    import torch._dynamo

    runs = {}
    for level in raygpt.model.gpt.RECOMPUTE_LEVELS:
        torch._dynamo.reset()
        runs[level] = sgd_steps(level, backend="aot_eager_decomp_partition", steps=2)
    assert_recompute_exact(runs)


def test_recompute_level_is_checked_and_needs_grad():
    with pytest.raises(ValueError, match="GPT recompute: expected one of"):
        GPT(CFG, init_seed=None, recompute=3)
    model = GPT(CFG, init_seed=7, recompute=2)
    idx, targets = batch()
    with torch.no_grad():  # evaluation holds nothing, so nothing is recomputed
        _, nbytes = saved_activation_bytes(model, lambda: model(idx, targets))
    assert nbytes == 0


# ---------------------------------------------------------------------- sampling

def test_generate_shape_determinism_and_crop(model):
    prompt = torch.randint(0, CFG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    n = CFG.block_size + 3  # runs past block_size: the context must be cropped
    a = model.generate(prompt, n, top_k=10, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, n, top_k=10, generator=torch.Generator().manual_seed(3))
    c = model.generate(prompt, n, top_k=10, generator=torch.Generator().manual_seed(4))
    assert a.shape == (2, 5 + n)
    assert torch.equal(a[:, :5], prompt)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.max() < CFG.vocab_size, "never samples a padded column"
    greedy = model.generate(prompt, 4, temperature=0.0)
    assert torch.equal(greedy[:, 5], model(prompt, last_only=True)[:, -1].argmax(-1))


def test_generate_top_k_1_is_greedy(model):
    prompt = torch.randint(0, CFG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    top1 = model.generate(prompt, 6, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(top1, model.generate(prompt, 6, temperature=0.0))


# ---------------------------------------------------------------------- llm.c layout

def test_llmc_layout_covers_every_parameter_once(model):
    layout = llmc_parameter_layout(model)
    shapes = llmc_tensor_shapes(CFG)
    assert [n for n, _ in layout] == list(LLMC_TENSOR_NAMES) == [n for n, _ in shapes]
    ids = [id(p) for _, params in layout for p in params]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    for (name, params), (_, shape) in zip(layout, shapes):
        assert sum(p.numel() for p in params) == math.prod(shape), name
        if len(params) > 1:  # per-layer tensors: one (L, ...) slice per layer
            assert len(params) == CFG.n_layer and all(p.shape == shape[1:] for p in params), name
        else:
            assert params[0].shape == shape, name
    C = CFG.n_embd
    assert dict(shapes)["qkvw"] == (CFG.n_layer, 3 * C, C)
    assert dict(shapes)["fcprojw"] == (CFG.n_layer, C, 4 * C)
    assert dict(layout)["qkvw"][1] is model.transformer.h[1].attn.c_attn.weight
    assert dict(layout)["wte"][0] is model.lm_head.weight
    assert LLMC_DECAY == {n for n, s in shapes if len(s) >= 2 and n not in
                          ("ln1w", "ln1b", "qkvb", "attprojb", "ln2w", "ln2b", "fcb", "fcprojb")}
    assert sum(math.prod(s) for _, s in shapes) == num_parameters(model)


def repoint_to_flat(model):
    """What raygpt/train/optim.py does: one flat buffer in llm.c order, every param a view into it."""
    layout = llmc_parameter_layout(model)
    flat = torch.empty(sum(p.numel() for _, ps in layout for p in ps))
    offset = 0
    for _, params in layout:
        for p in params:
            view = flat[offset:offset + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            offset += p.numel()
    return flat


def test_repointed_parameters_keep_forward_identical(model):
    idx, targets = batch()
    before_logits = model(idx)
    before_loss = model(idx, targets, z_loss=1e-3)
    flat = repoint_to_flat(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.wte.weight.data_ptr() == flat.data_ptr()
    assert torch.equal(model(idx), before_logits)
    after_loss = model(idx, targets, z_loss=1e-3)
    assert torch.equal(after_loss[0], before_loss[0]) and torch.equal(after_loss[1], before_loss[1])
    # Writing the flat buffer changes the model (the params are views, not copies).
    with torch.no_grad():
        flat.mul_(0.5)
    assert not torch.equal(model(idx), before_logits)
    # and the flat buffer is exactly llm.c's order: its last C values are ln_f.bias
    assert model.transformer.ln_f.bias.data_ptr() == flat[-CFG.n_embd:].data_ptr()


@pytest.mark.gpu
def test_cuda_move_keeps_tie_and_matches_cpu(model):
    idx, targets = batch()
    cpu_loss, _ = model(idx, targets)
    gpu = GPT(CFG, init_seed=7).cuda()
    assert gpu.lm_head.weight is gpu.transformer.wte.weight
    gpu_loss, _ = gpu(idx.cuda(), targets.cuda())
    torch.testing.assert_close(gpu_loss.cpu(), cpu_loss, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
def test_cuda_bf16_working_weights(model):
    """The GPU path: bf16 parameters (the working buffer), fp32 loss close to the fp32 model's."""
    idx, targets = batch()
    cpu_loss, _ = model(idx, targets)
    gpu = GPT(CFG, init_seed=7).cuda().to(torch.bfloat16)
    assert gpu.lm_head.weight is gpu.transformer.wte.weight
    loss, z = gpu(idx.cuda(), targets.cuda(), z_loss=1e-4)
    assert loss.dtype == torch.float32 and z.dtype == torch.float32
    assert gpu.last_max_logit.dtype == torch.float32 and gpu.last_max_logit.is_cuda
    torch.testing.assert_close(loss.cpu(), cpu_loss, rtol=2e-2, atol=0.0)
    loss.backward()
    assert torch.all(gpu.transformer.wte.weight.grad[CFG.vocab_size:] == 0)
    out = gpu.generate(idx[:, :4].cuda(), 5, generator=torch.Generator("cuda").manual_seed(0))
    assert out.shape == (3, 9)
