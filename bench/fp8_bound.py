"""How much FP8 matmuls could buy GPT-2 124M at B=64, T=1024 on one GPU: an upper bound.

Issue 20's levers left are FP8 matmuls and fewer bytes per step. Before building FP8 training
(and proving its loss), this times what it would change in a step, per block linear (qkv,
attention projection, fc, fc projection; M = B*T rows):

* the three matmuls of a linear in bf16 (forward X W^T, input gradient dY W, weight gradient
  dY^T X), as the step runs them now;
* the same three as torch._scaled_mm in FP8 with one scale per tensor (e4m3 for X and W, e5m2
  for dY), the operands already cast and laid out as cuBLAS wants them;
* the casts FP8 training adds per linear: one pass over X and one over dY, each writing the FP8
  copy in both layouts (the weight gradient needs X^T and dY^T), plus the amax pass each needs
  with dynamic scaling (none with delayed scaling, which uses the previous step's amax); W's
  casts are counted too (small). Timed as Inductor compiles them here, and priced at the
  device's copy bandwidth (measured in the same run: bytes read + written over time), the best
  a separate pass can do; the last bound prices them at nothing, as if every cast were fused
  into the kernel that produces its input (LayerNorm, GELU, the attention and the backward's
  matmuls writing FP8 beside or instead of bf16).

Not counted, so the bound is optimistic: the accuracy cost (FP8 training has to show its loss
within the noise of bf16's before it could be a default) and the classifier's matmuls (kept in
bf16 by every FP8 recipe). Each time is the median of --iters calls between CUDA events, the
device idle otherwise, so nearer the top clock than a whole step at the power cap.
    python bench/fp8_bound.py [--iters 30] [--step-ms 119.4] [--llmc-ms 134.1]
"""

from __future__ import annotations

import argparse
import statistics

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LINEARS = {"qkv": (768, 2304), "attproj": (768, 768), "fc": (768, 3072), "fcproj": (3072, 768)}


def device_ms(fn, iters: int) -> float:
    """Median device time of fn() in ms."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def amax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax().float()


def cast_both_layouts(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """x * scale in `dtype`, row-major and transposed (one read of x when Inductor fuses it)."""
    top = torch.finfo(dtype).max
    q = (x.float() * scale).clamp(-top, top).to(dtype)
    return q, q.t().contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--step-ms", type=float, default=119.4,
                    help="raygpt's measured step (det, B=64 T=1024, one H200) to project onto")
    ap.add_argument("--llmc-ms", type=float, default=134.1,
                    help="llm.c train_gpt2.py's measured step in the same setup")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    M = args.batch * args.seq
    amax_c = torch.compile(amax)
    cast_c = torch.compile(cast_both_layouts)
    print(f"{torch.cuda.get_device_name()} | M={M} rows | torch {torch.__version__} | "
          f"median of {args.iters}, ms")
    print(f"{'linear':8} {'bf16 fwd  dgrad  wgrad':>23} {'fp8 fwd  dgrad  wgrad':>23} "
          f"{'casts':>6} {'amaxes':>7} {'fwd rel err':>12}")
    src = torch.empty(512 * 2**20, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / device_ms(lambda: dst.copy_(src), args.iters) / 1e6
    del src, dst
    print(f"device-to-device copy: {copy_gbs:,.0f} GB/s (bytes read + written)")
    sums = dict(bf16=0.0, fp8=0.0, casts=0.0, amax=0.0, cast_bytes=0.0, amax_bytes=0.0)
    for name, (K, N) in LINEARS.items():
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16) * 1e-3
        bf = [device_ms(lambda: x @ w.t(), args.iters), device_ms(lambda: dy @ w, args.iters),
              device_ms(lambda: dy.t() @ x, args.iters)]
        sx = torch.finfo(E4M3).max / amax_c(x)
        sw = torch.finfo(E4M3).max / amax_c(w)
        sdy = torch.finfo(E5M2).max / amax_c(dy)
        xq, xtq = cast_c(x, sx, E4M3)
        wq, wtq = cast_c(w, sw, E4M3)
        dyq, dytq = cast_c(dy, sdy, E5M2)
        ix, iw, idy = sx.reciprocal(), sw.reciprocal(), sdy.reciprocal()
        bf16 = torch.bfloat16
        # _scaled_mm wants A row-major and B column-major: B = (row-major copy of B^T).t()
        fwd = lambda: torch._scaled_mm(xq, wq.t(), scale_a=ix, scale_b=iw, out_dtype=bf16)
        dgrad = lambda: torch._scaled_mm(dyq, wtq.t(), scale_a=idy, scale_b=iw, out_dtype=bf16)
        wgrad = lambda: torch._scaled_mm(dytq, xtq.t(), scale_a=idy, scale_b=ix, out_dtype=bf16)
        f8 = [device_ms(fwd, args.iters), device_ms(dgrad, args.iters),
              device_ms(wgrad, args.iters)]
        casts = (device_ms(lambda: cast_c(x, sx, E4M3), args.iters)
                 + device_ms(lambda: cast_c(dy, sdy, E5M2), args.iters)
                 + device_ms(lambda: cast_c(w, sw, E4M3), args.iters))
        amaxes = (device_ms(lambda: amax_c(x), args.iters) + device_ms(lambda: amax_c(dy), args.iters)
                  + device_ms(lambda: amax_c(w), args.iters))
        ref = (x @ w.t()).float()
        rel = ((fwd().float() - ref).norm() / ref.norm()).item()
        print(f"{name:8} {bf[0]:7.3f} {bf[1]:6.3f} {bf[2]:6.3f}   {f8[0]:7.3f} {f8[1]:6.3f} "
              f"{f8[2]:6.3f}   {casts:6.3f} {amaxes:7.3f} {rel:12.3e}")
        sums["bf16"] += sum(bf)
        sums["fp8"] += sum(f8)
        sums["casts"] += casts
        sums["amax"] += amaxes
        elems = M * K + M * N + N * K  # X, dY, W
        sums["cast_bytes"] += 4 * elems  # 2 B read, 2 x 1 B written (both layouts)
        sums["amax_bytes"] += 2 * elems
    L = args.layers
    cast_bw = sums["cast_bytes"] / copy_gbs / 1e6
    amax_bw = sums["amax_bytes"] / copy_gbs / 1e6
    print(f"per block: bf16 {sums['bf16']:.3f} ms | fp8 {sums['fp8']:.3f} | casts {sums['casts']:.3f} "
          f"as compiled, {cast_bw:.3f} at copy bandwidth | amaxes {sums['amax']:.3f} as compiled, "
          f"{amax_bw:.3f} at copy bandwidth")
    llmc_tok = M / args.llmc_ms * 1e3
    print(f"projected onto raygpt's {args.step_ms} ms step (llm.c: {args.llmc_ms} ms, "
          f"{llmc_tok:,.0f} tok/s); 1.3x llm.c needs {args.llmc_ms / 1.3:.1f} ms:")
    for label, casts in (("casts as compiled here, delayed scaling", sums["casts"]),
                         ("casts as compiled here, dynamic scaling", sums["casts"] + sums["amax"]),
                         ("casts at copy bandwidth, dynamic scaling", cast_bw + amax_bw),
                         ("casts at copy bandwidth, delayed scaling", cast_bw),
                         ("casts free (all fused into their producers)", 0.0)):
        step = args.step_ms - L * (sums["bf16"] - sums["fp8"] - casts)
        print(f"  {label:46s} {step:6.1f} ms  {M / step * 1e3:9,.0f} tok/s  "
              f"{args.llmc_ms / step:.3f}x llm.c")


if __name__ == "__main__":
    main()
