"""The training loop's knobs, each group with its defaults from the hardware and its checks:
the optimizer (AdamW, clipping, ZeRO, llm.c's z-score skip), the learning-rate schedule, the
loss-spike monitor (raygpt.train.outlier) and the performance switches (which change speed,
never the function computed)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from raygpt.config.knobs import knob, need
from raygpt.model.shapes import CE_CHUNK_ROWS
from raygpt.train.schedule import KINDS as SCHEDULERS


@dataclass
class OptimizerConfig:
    """AdamW and what may skip its update."""

    learning_rate: float | None = knob(None, section="optimizer", short="-l",
                                       hints=("--lr", "--max-lr", "--peak-lr"))
    """Peak learning rate. Default: 6e-4 on GPUs, 1e-3 on CPUs."""
    weight_decay: float = knob(0.1, section="optimizer", short="-c")
    """AdamW weight decay on 2-D tensors (-c)."""
    grad_clip: float = knob(1.0, section="optimizer",
                            hints=("--max-grad-norm", "--clip-grad", "--gradient-clipping"))
    """Clip the global grad norm to this (as a scalar inside AdamW; gradients stay untouched)."""
    beta1: float = knob(0.9, section="optimizer")
    """AdamW's beta1 (decay of the first-moment average)."""
    beta2: float = knob(0.95, section="optimizer")
    """AdamW's beta2 (decay of the second-moment average)."""
    eps: float = knob(1e-8, section="optimizer")
    """AdamW's epsilon, added to the root of the second moment."""
    zero_stage: int | None = knob(None, section="optimizer", short="-z", choices=(0, 1),
                                  may_change_on_resume=True)
    """0: every rank holds the whole optimizer state; 1: ZeRO-1 sharding, each rank holds and
    checkpoints 1/N of it (-z). Default: 1 with more than one GPU worker (a rank's state file is
    then 1/N of the optimizer, so checkpoint bytes per rank shrink as the world grows), else 0
    (CPU runs keep the replicated state and its simple all-reduce)."""
    skip_update_lossz: float = knob(0.0, section="optimizer", short="-sl")
    """Skip the update when the loss z-score exceeds this (-sl); 0 turns it off."""
    skip_update_gradz: float = knob(0.0, section="optimizer", short="-sg")
    """Skip the update when the grad-norm z-score exceeds this (-sg); 0 turns it off."""


    def resolve_optimizer(self, *, on_gpu: bool, workers: int) -> None:
        if self.learning_rate is None:
            self.learning_rate = 6e-4 if on_gpu else 1e-3
        if self.zero_stage is None:  # CPU runs keep the replicated state and its plain all-reduce
            self.zero_stage = 1 if on_gpu and workers > 1 else 0

    def validate_optimizer(self) -> None:
        need(self.learning_rate > 0 and math.isfinite(self.learning_rate), "-l/--learning-rate",
             "a finite value > 0", self.learning_rate)
        need(self.weight_decay >= 0, "-c/--weight-decay", "a value >= 0", self.weight_decay)
        need(self.grad_clip > 0, "--grad-clip", "a value > 0", self.grad_clip)
        need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "--beta1/--beta2", "values in [0, 1)",
             (self.beta1, self.beta2))
        need(self.skip_update_lossz >= 0 and self.skip_update_gradz >= 0, "-sl/-sg",
             "z thresholds >= 0 (0 is off)", (self.skip_update_lossz, self.skip_update_gradz))
        need(self.zero_stage in (0, 1), "-z/--zero-stage", "0 or 1", self.zero_stage)


@dataclass
class ScheduleConfig:
    """The learning rate over the steps (raygpt.train.schedule)."""

    scheduler: str = knob("cosine", section="schedule", short="-k", choices=SCHEDULERS,
                          hints=("--lr-scheduler", "--lr-schedule", "--lr-scheduler-type"))
    """cosine | linear | constant | wsd (-k)."""
    warmup_steps: int | None = knob(None, section="schedule", short="-u",
                                    hints=("--warmup", "--warmup-iters", "--num-warmup-steps"))
    """Linear warmup steps, 1-based as llm.c. Default: 20 on GPUs, 10 on CPUs."""
    final_lr_frac: float = knob(0.1, section="schedule", short="-q")
    """Final LR as a fraction of the peak (-q)."""
    max_steps: int | None = knob(None, section="schedule", short="-x", may_change_on_resume=True,
                                 hints=("--steps", "--max-iters", "--num-iterations", "--iters"))
    """Optimizer steps to train; -1 means one epoch of the train shards. Default: 200 on GPUs,
    100 on CPUs."""


    def resolve_schedule(self, *, on_gpu: bool) -> None:
        if self.warmup_steps is None:
            self.warmup_steps = 20 if on_gpu else 10
        if self.max_steps is None:
            self.max_steps = 200 if on_gpu else 100

    def validate_schedule(self) -> None:
        need(self.scheduler in SCHEDULERS, "-k/--scheduler", " | ".join(SCHEDULERS),
             self.scheduler)
        need(self.warmup_steps >= 0, "-u/--warmup-steps", "an integer >= 0", self.warmup_steps)
        need(0.0 <= self.final_lr_frac <= 1.0, "-q/--final-lr-frac", "a value in [0, 1]",
             self.final_lr_frac)
        need(self.max_steps == -1 or self.max_steps >= 1, "-x/--max-steps",
             "-1 (one epoch) or an integer >= 1", self.max_steps)


@dataclass
class SpikeConfig:
    """The loss-spike policy (raygpt.train.outlier.SpikeMonitor) on top of llm.c's z-score skip."""

    enabled: bool = knob(False, section="spike", long="--spike")
    """Turn the spike monitor on (skip isolated outliers, rewind sustained spikes)."""
    window: int = knob(64, section="spike")
    """Clean steps in the robust baseline (median and MAD of the loss)."""
    min_history: int = knob(16, section="spike")
    """Clean steps needed before the monitor judges anything."""
    soft_z: float = knob(6.0, section="spike")
    """Robust z of the loss above which a step is an outlier (skipped)."""
    hard_z: float = knob(20.0, section="spike")
    """Robust z of the loss above which the run rewinds at once."""
    gnorm_mult: float = knob(10.0, section="spike")
    """A grad norm this many times the median clean norm is an outlier too (0 turns it off)."""
    max_consecutive: int = knob(3, section="spike")
    """More consecutive outliers than this turn skipping into a rewind."""
    safety_steps: int = knob(1, section="spike")
    """Rewind to a checkpoint at least this many steps before the spike began."""
    max_rewinds: int = knob(5, section="spike")
    """After this many rewinds the run stops with an error (escalates to a human)."""
    lr_scale_decay: float = knob(0.7, section="spike", long="--spike-lr-decay")
    """lr_scale is multiplied by this when a region spikes again after its data was skipped."""
    min_lr_scale: float = knob(0.1, section="spike")
    """lr_scale below this stops the run with an error."""

    def validate(self) -> None:
        need(self.window >= 4 and 1 <= self.min_history <= self.window,
             "--spike-window/--spike-min-history",
             "window >= 4 and 1 <= min_history <= window", (self.window, self.min_history))
        need(0 < self.soft_z <= self.hard_z, "--spike-soft-z/--spike-hard-z",
             "0 < soft_z <= hard_z", (self.soft_z, self.hard_z))
        need(0 < self.lr_scale_decay < 1, "--spike-lr-decay", "a value in (0, 1)",
             self.lr_scale_decay)
        need(self.max_rewinds >= 0 and self.max_consecutive >= 0 and self.safety_steps >= 0,
             "--spike-max-rewinds/--spike-max-consecutive/--spike-safety-steps", "integers >= 0",
             (self.max_rewinds, self.max_consecutive, self.safety_steps))



@dataclass
class SpikePolicy:
    """The spike monitor's knobs as one field of a run's config (their flags are --spike-*)."""

    spike: SpikeConfig = knob(factory=SpikeConfig, section="spike")
    """The loss-spike monitor (raygpt.train.outlier): --spike turns it on, --spike-* set its knobs."""



@dataclass
class PerformanceConfig:
    """Speed switches: each changes how fast a step runs, never what it computes."""

    compile: bool | None = knob(None, section="performance", may_change_on_resume=True)
    """torch.compile the model. Default: on for GPUs, off for CPUs."""
    deterministic: bool | None = knob(None, section="performance", may_change_on_resume=True)
    """Bitwise-exact runs and resumes: deterministic kernels only (torch.use_deterministic_algorithms,
    strict; on GPUs raygpt's own attention and embedding backward), a fixed cuBLAS workspace. An
    op with no deterministic implementation stops the run with its name (exit 2). Default: on for
    GPUs (it costs under 1% of a step there), off for CPUs (whose kernels are deterministic)."""
    compile_mode: str = knob("default", section="performance",
                             choices=("default", "reduce-overhead", "max-autotune"),
                             may_change_on_resume=True)
    """torch.compile's mode for the model: reduce-overhead replays the forward and backward
    graphs as CUDA graphs (bench/throughput.py's cgraph variant measures it)."""
    compile_scope: str = knob("model", section="performance", choices=("model", "blocks"),
                              may_change_on_resume=True)
    """What --compile compiles: model = the whole model as one graph (the fastest step on one
    GPU); blocks = each transformer block on its own, the rest eager (a slower step, but
    backward lands each block's gradients as it finishes, which --overlap-comm needs)."""
    overlap_comm: bool | None = knob(None, section="performance", may_change_on_resume=True)
    """Reduce the gradients over the workers in buckets of layers during the backward pass, each
    bucket as soon as its layers' backward is done (under ZeRO-1 with NCCL, reduce-scatter or
    a reduce to each shard's owner), rather than in one collective after it. Default: on for
    GPUs without --compile or with --compile-scope blocks. The whole-model compile runs
    backward as one graph whose gradients all land at its end: there it overlaps nothing. On
    CPUs the small models are mostly wte, whose bucket comes last, and the buckets' staging
    copies cost more than the overlap saves. Under ZeRO-1 the update's gather of the weights
    overlaps the next forward too, each block waiting for its own (the whole-model compile
    waits for all of them first). Losses are the same either way (exactly, on 2 workers)."""
    prefetch_batches: bool = knob(True, section="performance", long="--no-prefetch",
                                  may_change_on_resume=True)
    """Gather the next micro-batch on the host and copy it to the device during the backward
    pass (DistributedDataLoader.prefetch), not after the step's sync."""
    gc_freeze: bool = knob(True, section="performance", long="--no-gc-freeze",
                           may_change_on_resume=True)
    """After the first step move the live objects out of the garbage collector's reach
    (gc.freeze): a full collection otherwise walks Dynamo's and Inductor's caches and stalls a
    step for tens of milliseconds now and then (bench/profile_step.py prints the pauses)."""
    loss_impl: str = knob("fused", section="performance", choices=("fused", "reference"),
                          may_change_on_resume=True)
    """The training loss: fused (chunked classifier, gradient computed in the forward pass,
    the (B*T, V) logits never held) or reference (the textbook cross-entropy)."""
    ce_kernel: bool = knob(True, section="performance", long="--no-ce-kernel",
                           may_change_on_resume=True)
    """The fused loss's softmax gradient as raygpt.ops.cross_entropy_grad (one Triton kernel on
    CUDA), not as PyTorch ops (Inductor's kernel, which reads each row three times)."""
    ce_chunk_rows: int | None = knob(None, section="performance", may_change_on_resume=True)
    """Rows of the (B*T, Vp) logits the fused loss holds at once. Default: 16384 on GPUs (1.6 GB
    of GPT-2's logits in bf16), 512 on CPUs (whose eager loss holds about four fp32 copies of a
    chunk: 103 MB each). Fewer, larger chunks mean fewer read-modify-writes of the weight
    gradient's fp32 accumulator, smaller ones less memory."""
    sdpa_backend: str = knob("auto", section="performance",
                             choices=("auto", "default", "cudnn", "flash", "raygpt"),
                             may_change_on_resume=True)
    """Attention kernel: auto = raygpt's under --deterministic on CUDA, else PyTorch's choice;
    default = PyTorch's choice (flash attention on Hopper); cudnn / flash = cuDNN's fused
    attention / FlashAttention-2 first; raygpt = raygpt.ops.causal_attention (Triton on CUDA,
    deterministic forward and backward, no atomics). An explicit choice is taken as given."""
    embedding_impl: str = knob("auto", section="performance", choices=("auto", "torch", "raygpt"),
                               may_change_on_resume=True)
    """Token embedding: auto = raygpt's under --deterministic on CUDA, else torch; torch =
    nn.Embedding (its deterministic CUDA backward is a sort-based kernel, ~3.6 ms a step at d12
    B=64 on an H200); raygpt = raygpt.ops.embedding (a Triton backward over sorted ids, no
    atomics). An explicit choice is taken as given."""
    recompute: int = knob(0, section="performance", short="-r", choices=(0, 1, 2),
                          may_change_on_resume=True)
    """Activation recomputation (llm.c's -r): 0 none; 1 each block's MLP half (ln_2, c_fc,
    GELU) recomputed in backward, its (B, T, 4C) activations not held; 2 the whole block
    recomputed from its input, one (B, T, C) tensor held per layer. Less memory for a larger
    -b, more compute per step (1: one c_fc matmul, 2: a second forward pass of every block).
    The same losses bit for bit on CPUs and eagerly; compiled on a GPU, within bf16 rounding
    (Inductor rounds a recomputed region's values its own way)."""
    preemption_poll_steps: int = knob(10, section="performance", may_change_on_resume=True)
    """Steps between polls of Ray's preemption notice (ray.train.get_preemption_info, a barrier
    of every worker)."""


    def resolve_performance(self, *, on_gpu: bool, device: str) -> None:
        if self.compile is None:
            self.compile = on_gpu
        if self.overlap_comm is None:
            # a whole-model compiled backward lands every gradient at its end: nothing to overlap;
            # CPU models are mostly wte, whose bucket lands last: the staging copies cost more
            self.overlap_comm = on_gpu and (not self.compile or self.compile_scope == "blocks")
        if self.deterministic is None:
            self.deterministic = on_gpu
        if self.ce_chunk_rows is None:
            self.ce_chunk_rows = CE_CHUNK_ROWS[device]

    def validate_performance(self) -> None:
        for f in dataclasses.fields(PerformanceConfig):  # (a config file is not argparse-checked)
            choices = f.metadata["choices"]
            if choices:
                need(getattr(self, f.name) in choices, "--" + f.name.replace("_", "-"),
                     " | ".join(map(str, choices)), getattr(self, f.name))
        need(isinstance(self.ce_chunk_rows, int) and self.ce_chunk_rows >= 1, "--ce-chunk-rows",
             "an integer >= 1", self.ce_chunk_rows)
        need(self.preemption_poll_steps >= 1, "--preemption-poll-steps", "an integer >= 1",
             self.preemption_poll_steps)
