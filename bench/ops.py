"""Benchmark of raygpt.ops on one CUDA GPU, against PyTorch and a device-to-device copy.

A GPT-2 124M parameter set (llm.c's 16 tensors for L=12, C=768, Vp=50304, maxT=1024) as one
flat buffer:

* global_norm_squared over bf16 grads vs torch.nn.utils.get_total_norm over the 148 per-layer
  PyTorch gradient views (foreach);
* adamw_update (bf16 params + fp32 master, m, v) vs torch.optim.AdamW(fused=True) on fp32
  params: both move 28 bytes per parameter;
* adamw_update in fp32 mode, and copy_master_to_params (stochastic rounding);
* cross_entropy_grad on one chunk of the fused loss (16384 rows of GPT-2's bf16 logits) vs the
  same math as PyTorch ops under torch.compile (reference.py compiled: Inductor's kernel);
* a device-to-device copy of the same bytes, measured in the same run, as the bandwidth
  reference (bytes read + bytes written over time).

CUDA events around each call, warm-up first, median of --iters. Not a test: prints a table.
    python bench/ops.py [--iters 50] [--sweep]
    python bench/ops.py --layouts   # only the classifier's three matmuls, two layouts
    python bench/ops.py --det-kernels [--sweep]  # deterministic attention / embedding backward

Measured on one H200 (torch 2.11, triton 3.6), device ms (% of copy bandwidth, vs torch):
norm bf16 0.064 (96%, 2.2x get_total_norm), norm fp32 0.122 (98%, 1.5x), AdamW bf16+master
0.852 (96%, 1.20x AdamW fused fp32 at 1.023), AdamW fp32 0.828 (99%, 1.24x),
copy_master_to_params 0.234 (78%). The --sweep over block sizes found nothing faster, except
for cross_entropy_grad: 1,024 columns x 2 warps (now the default, 1.55 ms per chunk against 1.59
for 2,048 x 4, 1.46x the compiled reference).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raygpt import ops  # noqa: E402


def gpt2_tensor_shapes(L=12, C=768, Vp=50304, maxT=1024):
    """llm.c's parameter tensors in order: (name, shape, weight decay, per-layer)."""
    return [
        ("wte", (Vp, C), True, False), ("wpe", (maxT, C), True, False),
        ("ln1w", (L, C), False, True), ("ln1b", (L, C), False, True),
        ("qkvw", (L, 3 * C, C), True, True), ("qkvb", (L, 3 * C), False, True),
        ("attprojw", (L, C, C), True, True), ("attprojb", (L, C), False, True),
        ("ln2w", (L, C), False, True), ("ln2b", (L, C), False, True),
        ("fcw", (L, 4 * C, C), True, True), ("fcb", (L, 4 * C), False, True),
        ("fcprojw", (L, C, 4 * C), True, True), ("fcprojb", (L, C), False, True),
        ("lnfw", (C,), False, False), ("lnfb", (C,), False, False),
    ]


def per_layer_views(flat, shapes):
    """The PyTorch model's parameters as views of the flat buffer: a stacked llm.c tensor of
    shape (L, ...) becomes L tensors of shape (...)."""
    views, offset = [], 0
    for _, shape, _, per_layer in shapes:
        numel = 1
        for d in shape:
            numel *= d
        t = flat[offset:offset + numel].view(shape)
        views.extend(list(t.unbind(0)) if per_layer else [t])
        offset += numel
    return views


def measure(fn, iters, warmup=5):
    """(median device ms, host us per call) of fn(), by CUDA events.

    The GPU is kept busy (torch.cuda._sleep) while the host enqueues every timed call, so the
    events time the kernels, not the host's launch path (Python, custom-op dispatch, Triton's
    launcher), which for the 0.1 ms norm is of the same order as the kernel itself. The host
    time is that enqueueing, per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz: longer than enqueueing all the calls
    t0 = time.perf_counter()
    for start, end in events:
        start.record()
        fn()
        end.record()
    host_us = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events), host_us


def copy_reference(src_bytes, iters):
    """(ms, host us, GB/s) of a device-to-device copy of src_bytes (reads and writes them)."""
    src = torch.empty(src_bytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms, host_us = measure(lambda: dst.copy_(src), iters)
    return ms, host_us, 2 * src.numel() * 4 / ms / 1e6


class Table:
    """Rows of op, device ms, bytes moved, reference copy GB/s, torch's device ms."""

    def __init__(self):
        self.rows = []

    def add(self, op, timing, nbytes, copy_gbs, torch_ms=None):
        ms, host_us = timing
        self.rows.append((op, ms, host_us, nbytes, copy_gbs, torch_ms))

    def print(self):
        print()
        print(f"{'op':<40} {'ms':>7} {'host us':>8} {'GB/s':>6} {'% copy':>7} {'vs torch':>9}")
        for op, ms, host_us, nbytes, copy_gbs, torch_ms in self.rows:
            gbs = nbytes / ms / 1e6
            speed = f"{torch_ms / ms:8.2f}x" if torch_ms else ""
            print(f"{op:<40} {ms:7.3f} {host_us:8.0f} {gbs:6.0f} {100 * gbs / copy_gbs:6.0f}% "
                  f"{speed:>9}")
        print("ms: median device time; host us: enqueue cost per call; GB/s: bytes read + "
              "written once over ms;\n% copy: of a device-to-device copy of the same bytes; "
              "vs torch: torch's device ms over ours (get_total_norm foreach / AdamW fused / "
              "compiled reference)")


def classifier_layouts(iters: int) -> None:
    """The three matmuls of one chunk of the fused loss (raygpt.model.gpt._FusedClassifierLoss):
    L = X W^T, dX = G W, dW = G^T X, against the same products with the logits stored
    transposed (L^T = W X^T, dX = (G^T)^T W, dW = G^T X from G^T): which layout cuBLAS runs
    faster decides how a chunk's logits should be laid out."""
    n, C, Vp = 16384, 768, 50304
    X = torch.randn(n, C, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(Vp, C, device="cuda", dtype=torch.bfloat16) * 0.02
    G = torch.randn(n, Vp, device="cuda", dtype=torch.bfloat16)
    GT = G.t().contiguous()
    flops = 2 * n * C * Vp
    cases = [("L = X W^T", lambda: X @ W.t()), ("dX = G W", lambda: G @ W),
             ("dW = G^T X", lambda: G.t() @ X), ("L^T = W X^T", lambda: W @ X.t()),
             ("dX = (G^T)^T W", lambda: GT.t() @ W), ("dW = G^T X (G^T stored)", lambda: GT @ X)]
    print(f"classifier matmuls of one chunk: n={n}, C={C}, Vp={Vp}, bf16; device ms (TFLOP/s)")
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        row = []
        for name, fn in cases:
            ms = measure(fn, iters)[0]
            row.append(ms)
            print(f"  {lib:9s} {name:26s} {ms:7.3f} ms ({flops / ms / 1e9:5.0f})")
        print(f"  {lib:9s} as written {sum(row[:3]):.3f} ms, transposed {sum(row[3:]):.3f} ms")
    torch.backends.cuda.preferred_blas_library("cublas")


def det_kernels(iters: int, sweep: bool) -> None:
    """raygpt's deterministic causal attention (forward, forward+backward) and token-embedding
    backward at GPT-2 d12's shapes for one layer at B=64 (H=12, T=1024, D=64; 65536 ids over
    50304 rows of 768), against PyTorch: flash and cuDNN attention (non-deterministic
    backward), flash under torch.use_deterministic_algorithms (its deterministic backward, what
    --deterministic ran before raygpt's kernels), and the embedding backward in both modes."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from raygpt.ops import triton_attention as ta

    B, H, T, D = 64, 12, 1024, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, T, 3, H, D, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = (x[:, :, i].transpose(1, 2).requires_grad_(True) for i in range(3))
    do = torch.randn(B, H, T, D, device="cuda", generator=g).to(torch.bfloat16)
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    torch.utils.deterministic.fill_uninitialized_memory = False

    def sdpa(backend):
        def attn(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attn

    impls = [("raygpt (deterministic)", ops.causal_attention, False),
             ("torch flash", sdpa(SDPBackend.FLASH_ATTENTION), False),
             ("torch cuDNN", sdpa(SDPBackend.CUDNN_ATTENTION), False),
             ("torch flash, deterministic", sdpa(SDPBackend.FLASH_ATTENTION), True)]
    ref = sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    print(f"\nattention, one layer: B={B} H={H} T={T} D={D} bf16, causal; device ms (median of "
          f"{iters}); 'vs raygpt' = theirs / ours")
    print(f"{'impl':<30} {'fwd':>7} {'fwd+bwd':>8} {'bwd':>7} {'vs raygpt':>10} {'repeatable':>10}")
    ours_fb = None
    for name, attn, det in impls:
        torch.use_deterministic_algorithms(det)
        try:
            out = attn(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), do)
            again = torch.autograd.grad(attn(q, k, v), (q, k, v), do)
            err = max((a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
                      for a, b in zip((out,) + grads, (ref,) + ref_grads))
            fwd = measure(lambda: attn(q, k, v), iters)[0]
            fb = measure(lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), do), iters)[0]
        except RuntimeError as e:  # e.g. cuDNN attention not available here
            print(f"{name:<30} failed: {str(e).splitlines()[0][:80]}")
            continue
        finally:
            torch.use_deterministic_algorithms(saved[0])
        ours_fb = ours_fb or fb
        same = all(torch.equal(a, b) for a, b in zip(grads, again))
        print(f"{name:<30} {fwd:7.3f} {fb:8.3f} {fb - fwd:7.3f} {fb / ours_fb:9.2f}x "
              f"{str(same):>10}   (max error vs flash {err:.1e} of max)")
    if sweep:
        for cfg in [ta.AttnConfig(128, 64, 4, 3, 64, 128, 128, 64, 4, 3),
                    ta.AttnConfig(128, 128, 8, 3, 32, 128, 128, 32, 4, 4),
                    ta.AttnConfig(64, 64, 4, 4, 64, 64, 64, 64, 4, 3),
                    ta.AttnConfig(128, 64, 4, 4, 32, 128, 128, 32, 8, 3),
                    ta.AttnConfig(128, 64, 8, 3, 64, 128, 128, 64, 8, 2)]:
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            try:
                fwd = measure(lambda: ta.attention_forward(qd, kd, vd, cfg), iters)[0]
                o, lse = ta.attention_forward(qd, kd, vd, cfg)
                bwd = measure(lambda: ta.attention_backward(do, qd, kd, vd, o, lse, cfg),
                              iters)[0]
            except Exception as e:  # noqa: BLE001 (out of shared memory and the like)
                print(f"  sweep {cfg}: failed: {str(e).splitlines()[0][:80]}")
                continue
            print(f"  sweep fwd {cfg.fwd_m}x{cfg.fwd_n} w{cfg.fwd_warps} s{cfg.fwd_stages}: "
                  f"{fwd:.3f} ms | bwd dkdv {cfg.dkdv_m}x{cfg.dkdv_n} dq {cfg.dq_m}x{cfg.dq_n} "
                  f"w{cfg.bwd_warps} s{cfg.bwd_stages}: {bwd:.3f} ms")
    del x, q, k, v, do, ref, ref_grads

    # --- embedding backward ------------------------------------------------------------------
    N, Vp, C = 65536, 50304, 768
    # log-uniform ids: a Zipf-like law where id 0 holds ln 2 / ln V ~ 6% of the positions
    ids = torch.exp(torch.rand(N, device="cuda", generator=g) * math.log(50257)).long() - 1
    grad = torch.randn(N, C, device="cuda", generator=g).to(torch.bfloat16)
    print(f"\nembedding backward: {N} ids (Zipf-like; the most frequent holds "
          f"{torch.bincount(ids).max().item()}) over {Vp} rows of {C}, bf16")
    ours = ops.embedding_backward(grad, ids, Vp)
    impls = [("raygpt (deterministic)", lambda: ops.embedding_backward(grad, ids, Vp), False),
             ("torch embedding_dense_backward", lambda: torch.ops.aten.embedding_dense_backward(
                 grad, ids, Vp, -1, False), False),
             ("torch, deterministic", lambda: torch.ops.aten.embedding_dense_backward(
                 grad, ids, Vp, -1, False), True)]
    ours_ms = None
    for name, fn, det in impls:
        torch.use_deterministic_algorithms(det)
        try:
            out = fn()
            same = torch.equal(out, fn())
            ms = measure(fn, iters)[0]
        finally:
            torch.use_deterministic_algorithms(saved[0])
        ours_ms = ours_ms or ms
        err = (out.float() - ours.float()).abs().max().item()
        print(f"{name:<32} {ms:7.3f} ms {ms / ours_ms:6.2f}x  repeatable {same}  "
              f"(max diff vs raygpt {err:.2g})")
    if sweep:
        saved_emb = (ta.EMB_ROWS, ta.EMB_BLOCK_C, ta.EMB_WARPS)
        for rows, block_c, warps in [(16, 256, 4), (32, 256, 8), (64, 128, 4), (16, 128, 2),
                                     (32, 768 // 3, 4)]:
            ta.EMB_ROWS, ta.EMB_BLOCK_C, ta.EMB_WARPS = rows, block_c, warps
            ms = measure(lambda: ops.embedding_backward(grad, ids, Vp), iters)[0]
            print(f"  sweep embedding rows={rows} cols={block_c} warps={warps}: {ms:.3f} ms")
        ta.EMB_ROWS, ta.EMB_BLOCK_C, ta.EMB_WARPS = saved_emb
    torch.utils.deterministic.fill_uninitialized_memory = saved[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--layouts", action="store_true",
                        help="only time the fused loss's three classifier matmuls per chunk, as "
                             "raygpt.model.gpt writes them and transposed, under cuBLAS and cuBLASLt")
    parser.add_argument("--sweep", action="store_true",
                        help="also time other block sizes / warps of the Triton kernels")
    parser.add_argument("--det-kernels", action="store_true",
                        help="only the deterministic attention and embedding backward against "
                             "PyTorch's (with --sweep: other attention block sizes too)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/ops.py needs a CUDA GPU")
    if args.det_kernels:
        det_kernels(args.iters, args.sweep)
        return
    if args.layouts:
        classifier_layouts(args.iters)
        return
    from raygpt.ops import triton_kernels as tk

    torch.manual_seed(0)
    shapes = gpt2_tensor_shapes()
    sizes = [torch.Size(s).numel() for _, s, _, _ in shapes]
    decay = [d for _, _, d, _ in shapes]
    n = sum(sizes)
    seg = ops.Segments.build(sizes, decay, device="cuda")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"GPT-2 124M: {n:,} parameters in {len(sizes)} llm.c tensors")
    table = Table()
    it = args.iters

    # --- global norm -------------------------------------------------------------------------
    grad_bf16 = (torch.randn(n, device="cuda") * 1e-2).to(torch.bfloat16)
    grad_fp32 = grad_bf16.float()
    views = per_layer_views(grad_bf16, shapes)
    views32 = per_layer_views(grad_fp32, shapes)
    ours = ops.global_norm_squared(grad_bf16).sqrt().item()
    theirs = torch.nn.utils.get_total_norm(views, foreach=True).item()
    print(f"grad norm: ours {ours:.6f}  torch {theirs:.6f} (over {len(views)} views)")
    assert abs(ours - theirs) / theirs < 1e-2, (ours, theirs)

    copy_ms, copy_host, copy2 = copy_reference(2 * n, it)  # the bf16 grad buffer's bytes
    table.add("copy (bf16 grad bytes)", (copy_ms, copy_host), 4 * n, copy2)
    copy_ms, copy_host, copy4 = copy_reference(4 * n, it)
    table.add("copy (fp32 grad bytes)", (copy_ms, copy_host), 8 * n, copy4)
    torch_ms = measure(lambda: torch.nn.utils.get_total_norm(views, foreach=True), it)[0]
    table.add("global_norm_squared bf16", measure(lambda: ops.global_norm_squared(grad_bf16),
                                                  it), 2 * n, copy2, torch_ms)
    torch_ms = measure(lambda: torch.nn.utils.get_total_norm(views32, foreach=True), it)[0]
    table.add("global_norm_squared fp32", measure(lambda: ops.global_norm_squared(grad_fp32),
                                                  it), 4 * n, copy4, torch_ms)
    if args.sweep:
        saved = (tk.NORM_BLOCK, tk.NORM_WARPS, tk.NORM_PROGRAMS)
        for block, warps, programs in [(2048, 4, 2048), (8192, 8, 1024), (8192, 16, 512),
                                       (16384, 16, 512), (8192, 8, 2048)]:
            tk.NORM_BLOCK, tk.NORM_WARPS, tk.NORM_PROGRAMS = block, warps, programs
            table.add(f"  sweep norm bf16 B={block} w={warps} P={programs}",
                      measure(lambda: ops.global_norm_squared(grad_bf16), it), 2 * n, copy2)
        tk.NORM_BLOCK, tk.NORM_WARPS, tk.NORM_PROGRAMS = saved
    del grad_fp32, views32

    # --- AdamW -------------------------------------------------------------------------------
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    master = torch.randn(n, device="cuda") * 0.02
    param = master.to(torch.bfloat16)
    m = torch.zeros(n, device="cuda")
    v = torch.zeros(n, device="cuda")
    adam_bytes = 28 * n  # read grad 2, m 4, v 4, master 4; write m, v, master 12, param 2
    copy_ms, copy_host, copy_adam = copy_reference(adam_bytes // 2, it)
    table.add("copy (AdamW bytes)", (copy_ms, copy_host), adam_bytes, copy_adam)

    step = [0]

    def ours_bf16(segments=seg):
        step[0] += 1
        ops.adamw_update(param, grad_bf16, m, v, master, segments, grad_scale=1.0, step=step[0],
                         seed=step[0], **hyper)

    # torch: the 148 per-layer fp32 parameters with fp32 grads, decay / no-decay groups; also
    # 28 bytes per parameter (read p, g, m, v; write p, m, v)
    decay_flags = [d for _, shape, d, per_layer in shapes for _ in range(shape[0] if per_layer
                                                                            else 1)]
    tparams = [torch.nn.Parameter(t.clone()) for t in per_layer_views(master, shapes)]
    for p, g in zip(tparams, per_layer_views(grad_bf16.float(), shapes)):
        p.grad = g.clone()
    groups = [{"params": [p for p, d in zip(tparams, decay_flags) if d]},
              {"params": [p for p, d in zip(tparams, decay_flags) if not d],
               "weight_decay": 0.0}]
    topt = torch.optim.AdamW(groups, lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                             eps=hyper["eps"], weight_decay=hyper["weight_decay"], fused=True)
    torch_timing = measure(topt.step, it)
    table.add("torch AdamW(fused) fp32", torch_timing, adam_bytes, copy_adam, torch_timing[0])
    table.add("adamw_update bf16+master", measure(ours_bf16, it), adam_bytes, copy_adam,
              torch_timing[0])
    del tparams, groups, topt

    w32, g32 = master.clone(), grad_bf16.float()
    m32, v32 = torch.zeros_like(w32), torch.zeros_like(w32)

    def ours_fp32():
        step[0] += 1
        ops.adamw_update(w32, g32, m32, v32, None, seg, grad_scale=1.0, step=step[0],
                         seed=step[0], **hyper)

    table.add("adamw_update fp32", measure(ours_fp32, it), adam_bytes, copy_adam,
              torch_timing[0])
    del w32, g32, m32, v32

    if args.sweep:
        for block in (512, 2048, 4096):
            seg_b = ops.Segments.build(sizes, decay, device="cuda", block=block)
            table.add(f"  sweep adamw bf16 block={block}", measure(lambda: ours_bf16(seg_b), it),
                      adam_bytes, copy_adam, torch_timing[0])

    sr_bytes = 6 * n  # read master 4, write param 2
    copy_ms, copy_host, copy_sr = copy_reference(sr_bytes // 2, it)
    table.add("copy_master_to_params", measure(
        lambda: ops.copy_master_to_params(param, master, seg, 7), it), sr_bytes, copy_sr)

    del master, param, m, v, grad_bf16

    # --- the classifier's cross-entropy gradient (one chunk of the fused loss) ----------------
    rows, Vp, V = 16384, 50304, 50257  # CE_CHUNK_ROWS["gpu"] rows of GPT-2's logits
    logits = (torch.randn(rows, Vp, device="cuda") * 3).to(torch.bfloat16)
    targets = torch.randint(0, V, (rows,), device="cuda")
    ce_bytes = 2 * 2 * rows * Vp  # read the bf16 logits once, write the bf16 gradient once
    copy_ms, copy_host, copy_ce = copy_reference(ce_bytes // 2, it)
    table.add("copy (logits chunk bytes)", (copy_ms, copy_host), ce_bytes, copy_ce)
    # torch: the same math as PyTorch ops (reference.py), compiled: what Inductor makes of it
    compiled = torch.compile(ops.reference.cross_entropy_grad)
    got, want = ops.cross_entropy_grad(logits, targets, V), compiled(logits, targets, V)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-5)
    torch_ms = measure(lambda: compiled(logits, targets, V), it)[0]
    table.add("torch.compile(reference) cross-entropy", (torch_ms, float("nan")), ce_bytes,
              copy_ce, torch_ms)
    table.add("cross_entropy_grad bf16", measure(
        lambda: ops.cross_entropy_grad(logits, targets, V), it), ce_bytes, copy_ce, torch_ms)
    if args.sweep:
        saved = (tk.CE_BLOCK, tk.CE_WARPS)
        for block, warps in [(2048, 4), (2048, 8), (4096, 4), (1024, 4), (512, 2)]:
            tk.CE_BLOCK, tk.CE_WARPS = block, warps
            table.add(f"  sweep cross-entropy B={block} w={warps}", measure(
                lambda: ops.cross_entropy_grad(logits, targets, V), it), ce_bytes, copy_ce,
                torch_ms)
        tk.CE_BLOCK, tk.CE_WARPS = saved

    table.print()


if __name__ == "__main__":
    main()
