"""Throughput of raygpt's training step against llm.c's own train_gpt2.py and a plain PyTorch
baseline, side by side on one GPU.

    python bench/throughput.py [--depth 12] [--batch 64] [--seq 1024] [--steps 30] [--ray]
                               [--variants default,cudnn,det,ckpt@100] [--split-only]
                               [--no-rebaseline] [--no-baseline] [--no-llmc] [--no-split]
                               [--anchors DIR]

The baseline of record is llm.c's PyTorch trainer, unchanged (`../shared/anchors`, run by
bench/anchor.py in a child process with the same model, batch and constant learning rate): its
row comes first and, unless --no-rebaseline, again after the raygpt rows; every raygpt row's
ratio is against the mean of the two, and the loss comparison is against its first run.
Then, in this process, the same GPT-2 (raygpt.model.gpt.GPT, same init, same data) on two sides:
- baseline: fp32 weights, torch.compile, autocast bf16, SDPA attention, the textbook loss
  (loss_impl="reference": full logits, fp32 cross-entropy), torch.optim.AdamW(fused=True),
  torch.nn.utils.clip_grad_norm_ (what llm.c's train_gpt2.py does). It is pinned: raygpt's
  model options never change it, so the ratio measures them;
- raygpt: the real training loop (`raygpt.train.loop.train` under a LocalSession): bf16 working
  weights over fp32 master weights, raygpt's global-norm and AdamW kernels, data loading,
  logging (loss_history.jsonl, main.log, TensorBoard) and the console line included; and, with
  --ray, the same run under Ray Train's TorchTrainer with 1 worker (TrainConfig's defaults,
  whatever the variants).
Per side: tokens/s and ms/step (median over the steps after warm-up, no syncs between phases),
the mean ms/step over the same steps (what a checkpoint's stall moves), the first step's time
(compilation included), then a separate pass with syncs that splits a step into
forward+backward, norm, optimizer; "other" is ms/step minus those three (what the step spends
outside the GPU's work: host gaps, logging, data). Two MFUs: raygpt's own
(raygpt.runlog.mfu.estimate_mfu, llm.c's 6N + 6LCT per token, what the loop prints) and the
bench's own count: FLOPs of one forward+backward counted by torch.utils.flop_counter, with the
attention term halved (causal: half the score matrix is masked; FlopCounterMode counts it
dense), over the datasheet peak. Peak memory. Numbers, not a test.

The baseline runs first and, unless --no-rebaseline, again after the raygpt rows; the ratios are
against the mean of its two runs, and the two are printed side by side: a GPU whose speed drifts
during the bench shows it there. Under each row: the GPU's median SM clock, power and
temperature over its timed steps (nvidia-smi, sampled every 200 ms); an H200 at its 700 W cap
lowers its clock. With 100 steps or more, each row's mean loss over the last half is compared
with the first baseline's step by step; the two baseline runs' difference is the noise.

--variants runs the raygpt side once per variant, one row each. A variant is tokens joined by
"+" (see VARIANT_TOKENS): `ref` / `fused` / `fused@ROWS` pick the loss, `cudnn` prefers cuDNN
attention, `torchce` computes the fused loss's softmax gradient with PyTorch ops (fused by
Inductor) instead of raygpt.ops.cross_entropy_grad, `autotune` / `coord` turn on Inductor's
GEMM autotuning (what mode="max-autotune-no-cudagraphs" does) / coordinate-descent tuning of
its own kernels, `det` is the loop's deterministic mode (the GPU default: raygpt's deterministic
attention and embedding backward), `det+torchdet` the same with PyTorch's deterministic kernels
instead (sdpa_backend="default", embedding_impl="torch": the "before"), `raygpt` picks
raygpt's kernels explicitly (`det+raygpt`), `ckpt@N` checkpoints every N steps
(async, as in a real run), `noprefetch` builds each batch after the step's sync, `cgraph`
compiles the model with mode="reduce-overhead" (CUDA graphs), `regional` compiles each
transformer block on its own instead of the whole model, `pieces` the final norm and the fused
loss on their own too, `mb@N` trains each step's --batch
sequences as micro-batches of N accumulated into one update, `seed@N` draws the loop's
initialization from seed N (rows with several seeds give the loss's spread across
initializations, against which llm.c's one seed is compared); `default` is TrainConfig's
defaults with deterministic off. A variant sets the loop's performance fields of TrainConfig (loss_impl, ce_kernel,
ce_chunk_rows, sdpa_backend, embedding_impl, prefetch_batches, compile_mode, deterministic),
and Inductor's config for its run, restored after.
--no-baseline skips the PyTorch baseline (each raygpt row is then compared with the first one,
e.g. `--variants default,det+torchdet,det+raygpt`: non-deterministic, strict with PyTorch's
kernels, strict with raygpt's). `default` is TrainConfig's defaults with deterministic off,
which are the non-deterministic kernels: a run's own default (deterministic on GPUs) is the `det` row. --split-only skips the loop (one compile per variant instead of two): forward+backward, norm
and optimizer times only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import torch

from raygpt.config import TrainConfig
from raygpt.data.loader import DistributedDataLoader
from raygpt.model.gpt import GPT, GPTConfig, kernels_for, num_parameters
from raygpt.runlog.mfu import estimate_mfu, flops_per_token, promised_flops
from raygpt.train.optim import AdamW, FlatParameters, random_u32

import anchor  # bench/anchor.py (bench/ is this script's directory): llm.c's trainer


def cuda_time(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


VARIANT_TOKENS = {
    "default": "TrainConfig's defaults (deterministic off)",
    "ref": 'loss_impl="reference" (full logits, fp32 cross-entropy)',
    "fused": 'loss_impl="fused" (chunked, gradients in forward); fused@ROWS sets ce_chunk_rows',
    "cudnn": 'sdpa_backend="cudnn" (cuDNN attention first)',
    "flash": 'sdpa_backend="flash" (FlashAttention-2 first)',
    "autotune": "Inductor max_autotune (GEMM templates autotuned against cuBLAS)",
    "coord": "Inductor coordinate_descent_tuning (its reduction / pointwise kernels)",
    "torchce": "the fused loss's softmax gradient as PyTorch ops (Inductor's kernel), not raygpt.ops",
    "det": "the loop's --deterministic (torch.use_deterministic_algorithms, fixed cuBLAS workspace; "
           "on CUDA with raygpt's deterministic attention and embedding backward)",
    "torchdet": "with det: PyTorch's deterministic kernels instead of raygpt's (the before)",
    "raygpt": 'sdpa_backend="raygpt" and embedding_impl="raygpt" (raygpt\'s deterministic kernels)',
    "ckpt": "ckpt@N: the loop checkpoints every N steps (async)",
    "noprefetch": "the loop builds each batch after the step's sync (--no-prefetch)",
    "cgraph": 'torch.compile(mode="reduce-overhead"): forward and backward replayed as CUDA graphs',
    "regional": "each transformer block compiled on its own (loop.compile_model replaced for the row)",
    "pieces": "regional, plus the final norm and the fused loss each compiled on their own",
    "mb": "mb@N: micro-batches of N sequences, accumulated to the bench's --batch per step",
    "seed": "seed@N: the loop's --seed N (another initialization: the loss's noise across seeds)",
}
WITH_ARG = {"fused", "ckpt", "mb", "seed"}


def parse_variant(spec: str) -> tuple[dict, dict]:
    """'fused@8192+cudnn+det' -> (Inductor config, TrainConfig overrides for the loop: its
    performance fields) for that run."""
    inductor, loop = {}, {}
    for token in spec.split("+"):
        name, _, arg = token.partition("@")
        if (name not in VARIANT_TOKENS or (arg and name not in WITH_ARG)
                or (name in ("ckpt", "mb", "seed") and not arg.isdigit())
                or (arg and not arg.isdigit())):
            raise SystemExit(f"--variants: unknown token {token!r} in {spec!r}; expected "
                             f"{', '.join(VARIANT_TOKENS)} (fused@ROWS, ckpt@N, mb@N, seed@N), "
                             f"joined by '+'")
        if name == "ref":
            loop["loss_impl"] = "reference"
        elif name == "fused":
            loop["loss_impl"] = "fused"
            if arg:
                loop["ce_chunk_rows"] = int(arg)
        elif name in ("cudnn", "flash"):
            loop["sdpa_backend"] = name
        elif name == "autotune":
            inductor.update(max_autotune=True, max_autotune_gemm=True)
        elif name == "coord":
            inductor["coordinate_descent_tuning"] = True
        elif name == "torchce":
            loop["ce_kernel"] = False
        elif name == "det":
            loop["deterministic"] = True
        elif name == "torchdet":
            loop.update(sdpa_backend="default", embedding_impl="torch")
        elif name == "raygpt":
            loop.update(sdpa_backend="raygpt", embedding_impl="raygpt")
        elif name == "ckpt":
            loop.update(checkpoint_every=int(arg), async_checkpoint=True)
        elif name == "noprefetch":
            loop["prefetch_batches"] = False
        elif name == "cgraph":
            loop["compile_mode"] = "reduce-overhead"
        elif name == "regional":
            inductor["_regional"] = True  # not Inductor's: variant_settings takes it out
        elif name == "pieces":
            inductor["_regional"] = "pieces"
        elif name == "mb":
            loop["micro_batch"] = int(arg)  # loop_config turns it into batch_size + accumulation
        elif name == "seed":
            loop["seed"] = int(arg)
    return inductor, loop


@contextlib.contextmanager
def variant_settings(spec: str):
    """Inductor's config as the variant says, restored after; yields the TrainConfig overrides
    (the loop's performance fields). Dynamo's caches are reset so each variant compiles afresh
    (and never hits the recompile limit, past which Dynamo silently runs eager)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    import raygpt.model.gpt
    import raygpt.train.loop

    inductor, loop = parse_variant(spec)
    regional = inductor.pop("_regional", False)
    deterministic = torch.are_deterministic_algorithms_enabled()
    whole = raygpt.train.loop.compile_model
    loss = raygpt.model.gpt.fused_classifier_loss
    torch._dynamo.reset()
    try:
        if loop.get("deterministic"):  # the split pass too (the loop turns it on for itself)
            torch.use_deterministic_algorithms(True)
        if regional:
            raygpt.train.loop.compile_model = compile_blocks
        if regional == "pieces":
            raygpt.train.loop.compile_model = compile_pieces
            raygpt.model.gpt.fused_classifier_loss = torch.compile(loss, dynamic=False)
        with inductor_config.patch(inductor):
            yield loop
    finally:
        raygpt.train.loop.compile_model = whole
        raygpt.model.gpt.fused_classifier_loss = loss
        torch.use_deterministic_algorithms(deterministic)  # the loop leaves it on
        torch._dynamo.reset()


def compile_blocks(model, mode, scope="model"):
    """The regional variant's compile: each transformer block on its own (the blocks share
    their code, so Dynamo traces one), the embeddings, final norm and loss eager."""
    for block in model.transformer.h:
        block.compile(mode=mode, dynamic=False)
    return model


def compile_pieces(model, mode, scope="model"):
    """The pieces variant's compile: the blocks as regional's, the final norm on its own (the
    fused loss is compiled by variant_settings), only the embeddings eager."""
    compile_blocks(model, mode)
    model.transformer.ln_f.compile(mode=mode, dynamic=False)
    return model


class GpuClocks:
    """SM clock (MHz), power (W) and temperature (C) of this process's GPU, sampled every
    200 ms by `nvidia-smi` in the background; `mark(label, window)` names the wall-clock
    window of one row's timed steps and `summary(label)` gives the medians over it. A GPU that
    slows down under heat or a power cap moves every row it runs, so a ratio is only as good
    as the clocks were steady. Samples carry nvidia-smi's own timestamps: its output reaches
    this process in bursts where stdbuf cannot make it line-buffered."""

    def __init__(self):
        self.samples, self.marks = [], []
        index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        try:
            line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
            self.proc = subprocess.Popen(
                line_buffered + ["nvidia-smi", "-i", index,
                 "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                 "--format=csv,noheader,nounits", "-lms", "200"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                stamp, *values = line.split(",")
                when = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((when, *map(float, values)))
            except ValueError:
                pass  # "[N/A]" and the like

    def mark(self, label: str, window) -> None:
        """The phase `label` is the wall-clock window (start, end) of its timed steps."""
        if window[0] is not None and window[1] is not None:
            self.marks.append((label, *window))

    def summary(self, label: str) -> str:
        for name, t0, t1 in self.marks:
            if name == label:
                inside = [s for s in list(self.samples) if t0 <= s[0] <= t1]
                if not inside:
                    return "clocks: no samples (yet: nvidia-smi's output comes in bursts)"
                med = lambda i: statistics.median(s[i] for s in inside)  # noqa: E731
                return (f"SM clock {med(1):.0f} MHz (min {min(s[1] for s in inside):.0f}), "
                        f"{med(2):.0f} W, {med(3):.0f} C over {len(inside)} samples")
        return "clocks: not measured"

    def close(self):
        if self.proc is not None:
            time.sleep(0.5)  # the last samples
            self.proc.terminate()
            self.proc.wait()


def describe(model: GPT) -> str:
    return (f"loss={model.loss_impl}" + (f"@{model.ce_chunk_rows}" if model.loss_impl == "fused" else "")
            + f" attn={model.transformer.h[0].attn.sdpa_backend} emb={model.embedding_impl}")


def baseline(args, loader):
    torch.manual_seed(0)
    # pinned to the textbook loss and PyTorch's attention choice, whatever raygpt's defaults
    model = GPT(GPTConfig.from_depth(args.depth), init_seed=1337, loss_impl="reference",
                sdpa_backend="default").cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=True)
    fwd = torch.compile(model)
    tokens = args.batch * args.seq
    losses, times, split = [], [], {"fwd_bwd": [], "norm": [], "opt": []}

    def fwd_bwd():
        x, y = loader.next_batch()
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_sum, _ = fwd(x, y)
        (loss_sum / tokens).backward()
        return loss_sum

    window = [None, None]  # wall-clock start and end of the timed steps (for GpuClocks)
    for step in range(args.steps):
        if step == args.warmup:
            window[0] = time.time()
        t0 = time.perf_counter()
        loss_sum = fwd_bwd()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((loss_sum / tokens).item())  # the one host sync per step
        norm.item()
        times.append(time.perf_counter() - t0)
    window[1] = time.time()
    for _ in range(5):
        split["fwd_bwd"].append(cuda_time(fwd_bwd))
        split["norm"].append(cuda_time(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        split["opt"].append(cuda_time(lambda: (opt.step(), opt.zero_grad(set_to_none=True))))
    return losses, times, split, window


def add_loop_args(p: argparse.ArgumentParser) -> None:
    """The flags `loop_config` reads (bench/profile_step.py too)."""
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)


def loop_config(args, run_dir: str, overrides: dict | None = None) -> TrainConfig:
    """The loop's config for a bench run: the bench's model and batch, a constant LR, no
    validation, samples or checkpoints unless `overrides` say so (bench/profile_step.py too)."""
    fields = dict(model=f"d{args.depth}", batch_size=args.batch, seq_len=args.seq,
                  max_steps=args.steps, val_every=0, sample_every=0, checkpoint_every=0,
                  output_dir=run_dir, device="gpu", num_workers=1, shuffle=False,
                  warmup_steps=0, learning_rate=3e-4, final_lr_frac=1.0, scheduler="constant",
                  compile=True, deterministic=False)  # the `det` variant turns it on
    overrides = dict(overrides or {})
    if "micro_batch" in overrides:  # the same tokens per step, in smaller forward passes
        micro = overrides.pop("micro_batch")
        if micro <= 0 or args.batch % micro:
            raise SystemExit(f"--variants: mb@{micro} does not divide --batch {args.batch}")
        overrides.update(batch_size=micro, total_batch_size=args.batch * args.seq)
    return TrainConfig(**{**fields, **overrides}).resolve(1)


def raygpt_loop(args, cfg_overrides=None):
    """The real loop: returns per-step (loss, dt) from its loss history."""
    from raygpt.storage import open_run_dir
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession

    run_dir = tempfile.mkdtemp(prefix="raygpt-bench-")
    cfg = loop_config(args, run_dir, cfg_overrides)
    summary = train(cfg, LocalSession(open_run_dir(run_dir), torch.device("cuda")))
    recs = [json.loads(l) for l in Path(run_dir, "loss_history.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["kind"] == "train"]
    # wall-clock window of the timed steps: from the end of the last warm-up step
    window = ((train_recs[args.warmup - 1]["time"], train_recs[-1]["time"])
              if 0 < args.warmup < len(train_recs) else (None, None))
    return [r["loss"] for r in train_recs], [r["dt"] for r in train_recs], summary, window


def counted_flops_per_step(depth: int, batch: int, seq: int, probe_batch: int = 4) -> float:
    """The bench's own FLOP count for one training step (forward + backward) of GPT-2 at
    (batch, seq): torch.utils.flop_counter counts every matmul and attention op of an eager
    step at probe_batch (FLOPs are linear in the batch), scaled to `batch`. The attention ops
    are counted dense; a causal mask leaves half the score matrix unused, so that term is
    halved (llm.c's formula makes the same choice)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(GPTConfig.from_depth(depth), init_seed=1337, loss_impl="reference",
                sdpa_backend="default").cuda()
    x = torch.randint(0, model.config.vocab_size, (probe_batch, seq), device="cuda")
    counter = FlopCounterMode(display=False)
    with counter, torch.autocast("cuda", dtype=torch.bfloat16):
        loss_sum, _ = model(x, x)
        loss_sum.backward()
    per_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = sum(n for op, n in per_op.items() if "attention" in op)
    if attention == 0:
        raise SystemExit(f"counted FLOPs: no attention op among {sorted(per_op)}; SDPA ran a "
                         f"kernel torch.utils.flop_counter does not count")
    del model
    torch.cuda.empty_cache()
    return (counter.get_total_flops() - attention / 2) * batch / probe_batch


def build_step(depth: int, perf: TrainConfig, device=torch.device("cuda"),
               dtype=torch.bfloat16, compile_fn=None):
    """raygpt's training step without Ray or the loop: GPT-2 at `depth` with `perf`'s
    performance fields and the kernels the loop's build_model would pick (deterministic mode
    as the process has it), its parameters in FlatParameters' working buffer (bf16 over fp32
    masters on GPUs), raygpt's AdamW, and the forward `compile_fn(model)` returns (default
    torch.compile with perf's mode; `lambda m: m` runs eagerly). Returns (model, flat, opt,
    fwd, update): update() is one AdamW step at a constant LR with a fresh stochastic-rounding
    seed each time."""
    model = GPT(GPTConfig.from_depth(depth), init_seed=1337, loss_impl=perf.loss_impl,
                ce_kernel=perf.ce_kernel, ce_chunk_rows=perf.ce_chunk_rows,
                recompute=perf.recompute).to(device)
    model.use_kernels(**kernels_for(torch.are_deterministic_algorithms_enabled(), device.type,
                                    sdpa_backend=perf.sdpa_backend,
                                    embedding_impl=perf.embedding_impl))
    flat = FlatParameters(model, device, dtype)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    fwd = (compile_fn or (lambda m: torch.compile(m, mode=perf.compile_mode)))(model)
    rng = 13371337

    def update():
        nonlocal rng
        seed, rng = random_u32(rng)
        opt.step(lr=3e-4, grad_scale=1.0, t=1, seed=seed)

    return model, flat, opt, fwd, update


def raygpt_split(args, loader, loop_overrides: dict):
    # the variant's performance fields, as the loop reads them; the split runs the whole --batch
    # in one pass whatever mb@N says (the loop's row is the micro-batched one); det turned
    # strict mode on for build_step's choice of kernels
    perf = TrainConfig(**{k: v for k, v in loop_overrides.items() if k != "micro_batch"})
    model, flat, opt, fwd, step = build_step(args.depth, perf)
    tokens = args.batch * args.seq

    def fwd_bwd():
        flat.zero_grad()
        x, y = loader.next_batch()
        loss_sum, _ = fwd(x.cuda(non_blocking=True), y.cuda(non_blocking=True))
        (loss_sum / tokens).backward()

    split = {"fwd_bwd": [], "norm": [], "opt": []}
    t0 = time.perf_counter()
    for _ in range(8):
        split["fwd_bwd"].append(cuda_time(fwd_bwd))
        split["norm"].append(cuda_time(lambda: opt.grad_norm_squared().sqrt()))
        split["opt"].append(cuda_time(step))
        if len(split["fwd_bwd"]) == 1:
            first = time.perf_counter() - t0  # compilation included
    return {k: v[3:] for k, v in split.items()}, first, describe(model)


def main():
    p = argparse.ArgumentParser()
    add_loop_args(p)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--ray", action="store_true", help="also run the loop under TorchTrainer")
    p.add_argument("--variants", default="default",
                   help="comma-separated raygpt variants, one row each; tokens joined by '+': "
                        + "; ".join(f"{k}: {v}" for k, v in VARIANT_TOKENS.items()))
    p.add_argument("--no-rebaseline", action="store_true",
                   help="run the baseline only once, before the raygpt rows (by default it runs "
                        "again after them, and each ratio is against the mean of both runs)")
    p.add_argument("--no-llmc", action="store_true",
                   help="skip llm.c's train_gpt2.py (the baseline of record, before and after)")
    p.add_argument("--anchors", default=None,
                   help="folder holding llm.c's train_gpt2.py and its offline runner "
                        "(default: $RAYGPT_ANCHORS or ../shared/anchors)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the PyTorch baseline (raygpt rows only, compared with the first)")
    p.add_argument("--no-split", action="store_true",
                   help="raygpt variants: the loop only, no separate forward+backward / norm / "
                        "optimizer pass (one compile per variant: the big models' bench)")
    p.add_argument("--split-only", action="store_true",
                   help="raygpt variants: only the forward+backward / norm / optimizer split")
    args = p.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:  # fail on a typo before minutes of compiling
        loop_config(args, "unused", parse_variant(v)[1])
    if any(parse_variant(v)[1].get("deterministic") for v in variants):
        # cuBLAS reads it when its first handle is made (the baseline's first matmul), so
        # deterministic mode's fixed workspace holds for every row of this run; the table says so
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = TrainConfig()
    dev = torch.cuda.get_device_name()
    n_params = num_parameters(GPT(GPTConfig.from_depth(args.depth), init_seed=None))
    L, C = GPTConfig.from_depth(args.depth).n_layer, GPTConfig.from_depth(args.depth).n_embd
    tokens = args.batch * args.seq
    rows = []

    counted = counted_flops_per_step(args.depth, args.batch, args.seq)
    peak_flops = promised_flops(dev, "bf16")

    pct = lambda f: f"{100 * f:5.1f}%" if f else "   n/a"  # noqa: E731

    def header():
        print(f"\n{dev} | GPT-2 d{args.depth} ({n_params / 1e6:.1f}M) | B={args.batch} "
              f"T={args.seq} | {tokens} tokens/step | median (and mean) of steps "
              f"{args.warmup}..{args.steps - 1}"
              + (" | --split-only: ms/step = fwd+bwd + norm + opt" if args.split_only else ""))
        print(f"FLOPs per step: raygpt's formula "
              f"{flops_per_token(n_params, L, C, args.seq) * tokens:.4g}, counted {counted:.4g}"
              + (f" | CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']} for every "
                 f"row" if os.environ.get("CUBLAS_WORKSPACE_CONFIG") else ""))
        print(f"{'':28s} {'tok/s':>8s} {'ms/step':>7s} {'mean':>6s} {'fwd+bwd':>7s} {'norm':>5s} "
              f"{'opt':>5s} {'other':>5s} {'MFU':>6s} {'counted':>7s} {'GiB':>6s} {'1st s':>5s}",
              flush=True)

    def show(r):
        name, tps, ms, mean, s, mfu, mfu_c, peak, _, first, note = r
        print(f"{name:28s} {tps:8.0f} {ms:7.1f} {mean:6.1f} {s.get('fwd_bwd', float('nan')):7.1f} "
              f"{s.get('norm', float('nan')):5.2f} {s.get('opt', float('nan')):5.2f} "
              f"{s.get('other', float('nan')):5.1f} {pct(mfu)} {pct(mfu_c):>7s} {peak:6.2f} "
              f"{first:5.1f}" + (f"\n{'':28s} {note}" if note else ""), flush=True)

    def row(name, times, split, peak, losses, first_s=float("nan"), summary=None):
        """One row, printed at once (a run cut short keeps what it measured) and kept for the
        table at the end. A loop's checkpoint stall happens between steps, outside their dt:
        it is added to the mean, and said."""
        timed = times[args.warmup:]
        if times and not timed:
            print(f"{name}: only {len(times)} steps recorded, none after --warmup {args.warmup}",
                  flush=True)
        dt = statistics.median(timed) if timed else float("nan")
        note = ""
        # a checkpoint at step s is taken before step s trains: between timed steps s-1 and s
        # when warmup < s < len(times); the loop's save after its last step is outside them
        stalls = [sec for step, sec in (summary or {}).get("checkpoint_stalls", [])
                  if args.warmup < step < len(times)]
        stall = sum(stalls)
        mean = (sum(timed) + stall) / len(timed) if timed else float("nan")
        if stalls:
            note = (f"{len(stalls)} checkpoints within the timed steps, "
                    f"{', '.join(f'{1000 * s:.1f}' for s in stalls)} ms stall, in the mean")
        s = {k: statistics.median(v) * 1000 for k, v in split.items() if v} if split else {}
        if args.split_only and s:  # like for like: every row's step is the sum of its parts
            dt = sum(s.values()) / 1000
        if s and dt == dt:
            s["other"] = dt * 1000 - sum(s.values())
        mfu = estimate_mfu(n_params, L, C, args.seq, tokens, dt, dev, "bf16") if dt == dt else None
        mfu_counted = counted / dt / peak_flops if peak_flops and dt == dt else None
        first = times[0] if times else first_s
        rows.append((name, tokens / dt, dt * 1000, mean * 1000, s, mfu, mfu_counted, peak,
                     losses, first, note))
        show(rows[-1])

    header()
    clocks = GpuClocks()
    loader = DistributedDataLoader(cfg.input_bin, args.batch, args.seq, 0, 1)

    def run_baseline(name):
        import torch._dynamo
        torch._dynamo.reset()  # compiled afresh, as the first time
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        loader.reset()
        b_losses, b_times, b_split, window = baseline(args, loader)
        clocks.mark(name, window)
        row(name, b_times, b_split, torch.cuda.max_memory_allocated() / 2**30, b_losses)
        print(f"{'':28s} {clocks.summary(name)}", flush=True)

    def run_llmc(name):
        """llm.c's own trainer in a child process on this GPU (bench/anchor.py): its step times
        and losses as printed; the clock window is its last timed steps, counted back from its
        exit (its shutdown is short against them)."""
        r = anchor.run(anchor.command(depth=args.depth, batch=args.batch, seq=args.seq,
                                      steps=args.steps, anchors=args.anchors))
        end = time.time()
        clocks.mark(name, (end - sum(r.times[args.warmup:]), end))
        row(name, r.times, None, r.peak_gib, r.losses)
        print(f"{'':28s} {clocks.summary(name)}", flush=True)

    if not args.no_llmc:
        anchor.runner_path(args.anchors)  # missing: say so before minutes of compiling
        run_llmc("llm.c train_gpt2.py")
    if not args.no_baseline:
        run_baseline("pytorch baseline")
    for i, spec in enumerate(variants):
        # a variant named twice (to see the run-to-run spread) gets a second label
        repeat = variants[:i].count(spec)
        label = f"raygpt {spec}" + (f" #{repeat + 1}" if repeat else "")
        with variant_settings(spec) as loop_overrides:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            r_losses, r_times, summary, window = [], [], None, (None, None)
            if not args.split_only:
                r_losses, r_times, summary, window = raygpt_loop(args, loop_overrides)
            peak = torch.cuda.max_memory_allocated() / 2**30  # the loop's own peak
            split, first_s, what = {}, float("nan"), "the loop only (--no-split)"
            if not args.no_split:
                loader.reset()
                split, first_s, what = raygpt_split(args, loader, loop_overrides)
                peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"variant {spec}: {what}", flush=True)
            clocks.mark(label, window)
            row(label, r_times, split, peak, r_losses, first_s, summary)
            print(f"{'':28s} {clocks.summary(label)}", flush=True)
    if not (args.no_rebaseline or args.no_baseline):
        # the same baseline again: if the GPU drifted (clocks, heat) over the raygpt rows, the
        # two baseline rows differ, and the ratio is against their mean
        run_baseline("pytorch baseline again")
    if not (args.no_rebaseline or args.no_llmc):
        run_llmc("llm.c train_gpt2.py again")
    if args.ray:
        import ray
        from raygpt.ray.driver import run
        run_dir = tempfile.mkdtemp(prefix="raygpt-bench-ray-") + "/run"
        ray.init(num_gpus=1, include_dashboard=False)
        c = TrainConfig(model=f"d{args.depth}", batch_size=args.batch, seq_len=args.seq,
                        max_steps=args.steps, val_every=0, sample_every=0, checkpoint_every=0,
                        output_dir=run_dir, device="gpu", num_workers=1, shuffle=False,
                        warmup_steps=0, scheduler="constant", learning_rate=3e-4,
                        final_lr_frac=1.0, deterministic=False).resolve(1)  # as the default row
        run(c)
        recs = [json.loads(l) for l in Path(run_dir, "loss_history.jsonl").read_text().splitlines()]
        t = [r["dt"] for r in recs if r["kind"] == "train"]
        row("raygpt under TorchTrainer", t, None, float("nan"),
            [r["loss"] for r in recs if r["kind"] == "train"])

    clocks.close()
    header()
    for r in rows:
        show(r)
        print(f"{'':28s} {clocks.summary(r[0])}")
    bases = [r[1] for r in rows if r[0].startswith("pytorch baseline")]
    base = statistics.mean(bases) if bases else float("nan")
    if len(bases) > 1:
        print(f"baseline before / after the raygpt rows: {bases[0]:.0f} / {bases[1]:.0f} tok/s "
              f"({bases[1] / bases[0] - 1:+.1%}); ratios against their mean, {base:.0f}")
    for name, tps, _, mean, *_ in rows:
        if name.startswith("raygpt") and bases:
            print(f"ratio {name} / baseline: {tps / base:.3f} (median step); mean step "
                  f"{mean:.1f} ms")
    anchors = [r[1] for r in rows if r[0].startswith("llm.c")]
    if anchors:
        mean_anchor = statistics.mean(anchors)
        print("llm.c train_gpt2.py before / after the raygpt rows: "
              + " / ".join(f"{a:.0f}" for a in anchors) + f" tok/s; ratios against {mean_anchor:.0f}")
        for name, tps, *_ in rows:
            if name.startswith("raygpt"):
                print(f"ratio {name} / llm.c train_gpt2.py: {tps / mean_anchor:.3f}")
    ours = [r for r in rows if r[0].startswith("raygpt")]
    for name, tps, *_ in ours[1:]:  # e.g. det (after) and det+torchdet (before) vs default
        print(f"ratio {name} / {ours[0][0]}: {tps / ours[0][1]:.3f} ({tps / ours[0][1] - 1:+.1%})")
    # same data, same init: the losses agree within noise. The noise: the two baseline runs
    # differ too (non-deterministic kernels), so their difference is the yardstick
    ref = rows[0][8]
    for name, *_, losses, _first, _note in rows:
        if losses:
            line = (f"{name:28s} first losses {[round(l, 4) for l in losses[:5]]} | mean of the "
                    f"last 10 {statistics.mean(losses[-10:]):.4f}")
            if len(losses) >= 100:
                n = len(losses)
                half = losses[n - 50:] if n < 200 else losses[n // 2:]
                line += f" | mean of steps {n - len(half)}..{n - 1} {statistics.mean(half):.4f}"
                if name != rows[0][0] and len(ref) == n:
                    d = [a - b for a, b in zip(half, ref[n - len(half):])]
                    line += (f" | minus the baseline's: mean {statistics.mean(d):+.4f}, "
                             f"mean |d| {statistics.mean(abs(x) for x in d):.4f}")
            print(line)

if __name__ == "__main__":
    main()
