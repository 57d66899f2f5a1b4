"""TrainConfig: every knob of a raygpt run as one typed dataclass (SpikeConfig for the spike
monitor), `resolve()` filling what was left unset from the hardware and the data (raygpt.config.fit)
and `validate()` checking every value; a checkpoint's identity (which fields may change on resume)."""


from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from raygpt.config import mixture  # -i's syntax: one glob, or sources mixed by weight
from raygpt.config.errors import ConfigError
from raygpt.config.knobs import _typed, knob
from raygpt.config.fit import _fit_batch_size, _fit_validation, _model_file_block_size, local_gpus
from raygpt.config.paths import _remote, output_dir_with_endpoint, shards_with_endpoint
from raygpt.model.shapes import CE_CHUNK_ROWS, MODEL_SHAPES
from raygpt.runlog import tracking

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # raygpt/
DATA_DIR = PACKAGE_DIR / "data_files"
DEFAULT_TRAIN = str(DATA_DIR / "tiny_shakespeare_train.bin")
DEFAULT_VAL = str(DATA_DIR / "tiny_shakespeare_val.bin")

SCHEDULERS = ("cosine", "linear", "constant", "wsd")


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


@dataclass
class TrainConfig:
    """One raygpt run. Defaults are the embedded Shakespeare job; `resolve()` fills the `None`s
    from the hardware (GPT-2 124M in bf16 on GPUs, a small fp32 model on 2 CPU workers)."""

    # ==== data: the token shards and the batch (-i -j -b -t -d)
    input_bin: str = knob(DEFAULT_TRAIN, section="data", short="-i", metavar="GLOB",
                          from_file=True,  # read as data; a URI from a file carries no options
                          action=mixture.AddSource,
                          hints=("--train-data", "--train-bin", "--data"))
    """Glob of llm.c train token shards (-i): local files, or an s3:// or gs:// URI glob whose
    shards each node fetches into its cache (--shard-cache-dir). Or corpora mixed by weight,
    NAME=WEIGHT:GLOB once per -i (each global batch draws from them in proportion)."""
    input_val_bin: str = knob(DEFAULT_VAL, section="data", short="-j", metavar="GLOB",
                              from_file=True, hints=("--val-data", "--val-bin"))
    """Glob of llm.c validation token shards (-j), local or s3:// / gs://; empty turns
    validation off."""
    shard_cache_gb: float = knob(50.0, section="data", metavar="GB", may_change_on_resume=True)
    """Disk each node may fill with the shards of an s3:// or gs:// -i/-j, least recently used
    evicted first (the shards workers are reading stay); must hold a few of the largest."""
    shard_cache_dir: str = knob("", section="data", metavar="DIR", may_change_on_resume=True)
    """Where each node caches the shards of an s3:// or gs:// -i/-j: a directory private to the
    user (made 0700; refused if another user owns it or it is a symlink). Default:
    raygpt_shards_<uid> in the temp directory. Local shards are read in place."""
    shuffle: bool = knob(True, section="data", long="--no-shuffle")
    """Deterministic shuffling of shard order and of samples within a shard (train only)."""
    batch_size: int | None = knob(None, section="data", short="-b",
                                  hints=("--micro-batch-size", "--bs"))
    """Micro-batch size per worker, B. Default: 16 on GPUs, 8 on CPUs, made smaller when the
    train shards cannot hold B*T*workers+1 tokens (llm.c's loader rule)."""
    seq_len: int | None = knob(None, section="data", short="-t",
                               hints=("--block-size", "--seq-length", "--context-length"))
    """Sequence length, T. Default: 1024 on GPUs, 64 on CPUs (at most a model file's
    max_seq_len)."""
    total_batch_size: int = knob(-1, section="data", short="-d",
                                 hints=("--global-batch-size", "--tokens-per-step"))
    """Tokens per optimizer step across all workers (-d); -1 means B*T*world (no accumulation)."""
    seed: int = knob(1337, section="data")
    """Seeds init, the data shuffle and stochastic rounding."""

    # ==== model (-e)
    model: str | None = knob(None, section="model", short="-e", metavar="dN|FILE|DIR",
                             from_file=True,
                             hints=("--init-from", "--model-name-or-path"))
    """d1..d6 (CPU sizes), d12/d24/d36/d48 (GPT-2 124M/350M/774M/1558M), an llm.c model_*.bin
    file, or a Hugging Face GPT-2 folder (config.json, model.safetensors: `raygpt export` writes
    one) to start from. Default: d12 on GPUs, d4 on CPUs."""
    precision: str | None = knob(None, section="model", choices=("bf16", "fp32"))
    """bf16 (working weights bf16, fp32 master) or fp32. Default: bf16 on GPUs, fp32 on CPUs."""
    z_loss: float = knob(0.0, section="model")
    """Coefficient of the z-loss on the output logits (about 1e-4 when on); 0 turns it off."""

    # ==== optimizer: AdamW, clipping, ZeRO, llm.c's z-score skip (-l -c -z -sl -sg)
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

    # ==== schedule: the learning rate over the steps (-k -u -q -x)
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

    # ==== evaluation, sampling and watch metrics (-v -m -s -g)
    val_every: int = knob(20, section="eval", short="-v", may_change_on_resume=True,
                          hints=("--eval-interval", "--val-loss-every", "--eval-steps"))
    """Validation loss every N steps (-v); 0 turns it off."""
    val_batches: int | None = knob(None, section="eval", short="-m", may_change_on_resume=True,
                                   hints=("--eval-iters", "--val-max-steps"))
    """Validation micro-batches per rank per evaluation. Default: up to 20, as many as the
    validation shards hold without reading a sample twice (at least 1)."""
    val_batch_size: int | None = knob(None, section="eval", may_change_on_resume=True)
    """Validation micro-batch per rank. Default: the one up to B that covers the most of the
    validation shards in -m batches. Ranks beyond the validation data sit validation out."""
    eval_set: list[str] = knob(section="eval", factory=list, long="--eval-set",
                               metavar="NAME=GLOB", may_change_on_resume=True, from_file=True)
    """Another validation set, repeatable: NAME (letters, digits, _ . -; not 'loss', -j's)
    and a glob of llm.c token shards like -j's (local, s3:// or gs://). Each is evaluated with
    -j's policy: every -v steps and at the last step, -m batches of --val-batch-size per rank
    (the values resolved for -j's shards), ranks beyond the set's data sitting out, the mean
    over every rank's tokens; its loss is reported as val/NAME (history, TensorBoard, trackers,
    raygpt status and plot), not in main.log."""
    sample_every: int | None = knob(None, section="eval", short="-s", may_change_on_resume=True)
    """Generate a text sample every N steps; 0 turns it off. Default: 50."""
    gen_tokens: int = knob(64, section="eval", short="-g", may_change_on_resume=True)
    """Tokens per generated sample (-g)."""
    watch_every: int = knob(50, section="eval", may_change_on_resume=True)
    """Every N steps log watch metrics: clipped fraction, max logit, update/param ratios."""
    hellaswag: str = knob("", section="eval", metavar="FILE", may_change_on_resume=True,
                          from_file=True)
    """HellaSwag's hellaswag_val.jsonl (a path or URI), scored as llm.c scores it (acc_norm,
    llm.c's -h 1) every --hellaswag-every steps, the examples spread over the ranks; '' is off."""
    hellaswag_every: int | None = knob(None, section="eval", may_change_on_resume=True)
    """Score HellaSwag every N steps and at the last. Default: -v (its validation steps)."""

    # ==== checkpoints and resuming (-n -nk -nm -y)
    checkpoint_every: int | None = knob(None, section="checkpoint", short="-n",
                                        may_change_on_resume=True,
                                        hints=("--save-every", "--save-steps"))
    """Write a checkpoint every N steps (-n); 0 writes only at the end and on signals. Default:
    100 on GPU, 50 on CPU (the 100-step CPU job checkpoints once before its end)."""
    checkpoint_minutes: float = knob(0.0, section="checkpoint", may_change_on_resume=True)
    """Also write a checkpoint once this many minutes have passed since the last one
    (--checkpoint-minutes), for long runs; rank 0's clock decides and every rank saves at the
    same step. 0 turns it off."""
    checkpoints_keep: int = knob(3, section="checkpoint", short="-nk", may_change_on_resume=True)
    """Keep the last K checkpoints (-nk) besides the -nm ones, the newest verified one and the
    last before a WSD decay; 0 keeps all. Default: 3."""
    major_checkpoint_every: int | None = knob(None, section="checkpoint", short="-nm",
                                              may_change_on_resume=True)
    """Keep every checkpoint whose step is a multiple of M forever (-nm); 0 turns it off.
    Default: the smallest multiple of -n at or above a quarter of -x, so about 4 are kept."""
    resume: int = knob(0, section="checkpoint", short="-y", choices=(0, 1),
                       may_change_on_resume=True, from_file=False)
    """1: resume from the newest verified checkpoint in the run directory (-y)."""
    overwrite: bool = knob(False, section="checkpoint", may_change_on_resume=True,
                           from_file=False)
    """Allow a fresh start over a run directory that already holds a run."""
    async_checkpoint: bool = knob(True, section="checkpoint", long="--sync-checkpoint",
                                  may_change_on_resume=True)
    """Write checkpoint files on a background thread after a host copy."""
    checkpoint_snapshot: str = knob("host", section="checkpoint", choices=("host", "device"),
                                    may_change_on_resume=True)
    """How a GPU checkpoint copies the state at its step: host (straight to pinned host memory
    on a side stream; no GPU memory, the update after a checkpoint waits for the copy's end)
    or device (a copy on the GPU first, the state's size in GPU memory for the whole run; the
    host copy then runs behind training)."""

    # ==== the loss-spike monitor (--spike, --spike-*)
    spike: SpikeConfig = knob(factory=SpikeConfig, section="spike")
    """The loss-spike monitor (raygpt.train.outlier): --spike turns it on, --spike-* set its knobs."""

    # ==== the run directory, logging and fault injection (-o)
    output_dir: str = knob("runs/shakespeare", section="run", short="-o", metavar="DIR|URI",
                           may_change_on_resume=True,
                           hints=("--out-dir", "--save-dir", "--run-dir"))
    """Run directory: main.log, loss_history.jsonl, checkpoints; a local path or a URI."""
    storage_endpoint: str = knob("", section="run", metavar="URL", may_change_on_resume=True)
    """S3-compatible endpoint of an s3:// run directory and s3:// -i/-j shards (MinIO, Ceph...),
    e.g. http://minio:9000; default: AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, else AWS's own.
    An endpoint in the URI itself (?endpoint_override=host:port&scheme=http) wins."""
    log_every: int = knob(1, section="run", may_change_on_resume=True)
    """Console line every N steps."""
    log_segment_s: float = knob(30.0, section="run", metavar="SECONDS", may_change_on_resume=True)
    """On an object store (s3://, gs://), how long rank 0 keeps the lines of loss_history,
    main.log and samples before storing them as a new segment (a part object); a killed rank 0
    loses at most this much (plus one upload). Local and NFS run directories append each line."""
    log_segment_lines: int = knob(10000, section="run", metavar="N", may_change_on_resume=True)
    """... or this many lines, whichever comes first (a segment never holds more)."""
    record_samples: bool = knob(False, section="run", may_change_on_resume=True)
    """Record each step's global sample ranges in loss_history.jsonl (audits data coverage)."""
    wandb: str = knob("", section="run", may_change_on_resume=True)
    """W&B project for train/val metrics and the config (needs 'raygpt[wandb]');
    WANDB_MODE=offline keeps the files in <run dir>/wandb; empty: off."""
    mlflow: str = knob("", section="run", may_change_on_resume=True)
    """MLflow tracking URI for the same metrics: a server URL, sqlite:///FILE.db or a local
    directory (needs 'raygpt[mlflow]'); empty: off."""
    fault: str = knob("", section="run", metavar="SPEC", may_change_on_resume=True)
    """Fault injection for tests, e.g. 'kill:rank=1,step=7' (see raygpt.train.faults); off when empty."""
    allow_fault_injection: bool = knob(False, section="run", may_change_on_resume=True,
                                       from_file=False)
    """Let RAYGPT_FAULT from the environment arm faults (refused without it: an inherited
    variable must not inject kills into a real run)."""

    # ==== Ray: workers and their restarts
    device: str = knob("auto", section="ray", choices=("auto", "cpu", "gpu"))
    """Where the workers train: auto picks gpu when the machine (or, under ray job submit, the
    cluster) has a GPU, else cpu. --cpu and --gpu are short for it."""
    num_workers: int | None = knob(None, section="ray", may_change_on_resume=True)
    """Ray Train workers. Default: every visible GPU, or 2 CPU workers (1 where the Ray has a
    single CPU)."""
    min_workers: int | None = knob(None, section="ray", may_change_on_resume=True)
    """Elastic: continue on as few as this many workers after losing nodes. The global batch
    (-d) stays the same; grad accumulation absorbs the change. Default: none (a fixed size)."""
    max_failures: int = knob(3, section="ray", may_change_on_resume=True)
    """Worker-group restarts Ray Train may make after failures (FailureConfig.max_failures)."""
    max_preemption_failures: int = knob(10, section="ray", may_change_on_resume=True)
    """Restarts after preemptions, counted apart from max_failures."""

    # ==== performance: speed switches (the function computed stays the same)
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

    # ==== derived values
    @property
    def depth(self) -> int | None:
        if self.model and self.model.startswith("d") and self.model[1:].isdigit():
            return int(self.model[1:])
        return None

    def grad_accum_steps(self, world: int) -> int:
        tokens_per_micro = self.batch_size * self.seq_len * world
        return self.total_batch_size // tokens_per_micro

    def effective_total_batch(self, world: int) -> int:
        if self.total_batch_size > 0:
            return self.total_batch_size
        return self.batch_size * self.seq_len * world

    # ==== resolution and checks
    def resolve(self, gpus_available: int | None = None,
                notes: list[str] | None = None, cpus_available: int | None = None) -> "TrainConfig":
        """Return a copy with hardware- and data-dependent defaults filled in, then validated.

        Only fields left unset (None, or -1 for total_batch_size) are filled, so resolving an
        already resolved config changes nothing and a value the user gave is never replaced
        (an impossible one is an error, here or in `raygpt.config.preflight`). Where the data forces a
        default to adapt (a micro-batch the train shards cannot feed on this many workers, a
        validation set smaller than the default validation batches), a line saying what was
        chosen and why is appended to `notes`. `gpus_available` / `cpus_available`: what the
        Ray the run uses holds (GPUs: None counts this machine's; CPUs: None is not known, and
        a CPU run gets its default of 2 workers)."""
        c = dataclasses.replace(self, spike=dataclasses.replace(self.spike))
        notes = notes if notes is not None else []
        # shards in a bucket carry their endpoint, as the run directory does (every process
        # opens them from the same string); resolve reads their headers below
        c.input_bin = mixture.with_patterns(
            c.input_bin, lambda flag, p: shards_with_endpoint(flag, p, c.storage_endpoint))
        c.input_val_bin = shards_with_endpoint("-j/--input-val-bin", c.input_val_bin,
                                               c.storage_endpoint)
        c.eval_set = _eval_sets().with_patterns(
            c.eval_set, lambda name, p: shards_with_endpoint(f"--eval-set {name}", p,
                                                             c.storage_endpoint))
        if gpus_available is None:  # (counting GPUs imports torch: not for --cpu)
            gpus_available = 0 if c.device == "cpu" else local_gpus()
        if c.device == "auto":
            c.device = "gpu" if gpus_available > 0 else "cpu"
        if c.device == "gpu" and gpus_available == 0 and c.num_workers is None:
            raise ConfigError("--gpu: no GPU is visible on this machine (expected at least 1, found 0)")
        on_gpu = c.device == "gpu"
        if c.num_workers is None and on_gpu:
            c.num_workers = gpus_available
        elif c.num_workers is None:  # two CPU workers, where the Ray has two CPUs to hold them
            c.num_workers = 2 if cpus_available is None else max(1, min(2, cpus_available))
            if c.num_workers < 2:
                notes.append(f"workers=1 (not 2): the Ray this run uses has {cpus_available} CPU, "
                             f"and a second CPU worker would wait for one forever")
        if c.model is None:
            c.model = "d12" if on_gpu else "d4"
        if c.seq_len is None:
            c.seq_len = min(1024 if on_gpu else 64, _model_file_block_size(c.model))
        if c.batch_size is None:
            c.batch_size = _fit_batch_size(c, 16 if on_gpu else 8, notes)
        if c.total_batch_size == -1:
            c.total_batch_size = c.batch_size * c.seq_len * c.num_workers
        if c.learning_rate is None:
            c.learning_rate = 6e-4 if on_gpu else 1e-3
        if c.warmup_steps is None:
            c.warmup_steps = 20 if on_gpu else 10
        if c.max_steps is None:
            c.max_steps = 200 if on_gpu else 100
        if c.sample_every is None:
            c.sample_every = 50
        if c.hellaswag_every is None:
            c.hellaswag_every = c.val_every if c.hellaswag else 0
        if c.checkpoint_every is None:
            # measured cost: docs/performance.md, "Checkpoint cost" (under 1% of step time on CPU)
            c.checkpoint_every = 100 if on_gpu else 50
        if c.precision is None:
            c.precision = "bf16" if on_gpu else "fp32"
        if c.compile is None:
            c.compile = on_gpu
        if c.overlap_comm is None:
            # a whole-model compiled backward lands every gradient at its end: nothing to overlap;
            # CPU models are mostly wte, whose bucket lands last: the staging copies cost more
            c.overlap_comm = on_gpu and (not c.compile or c.compile_scope == "blocks")
        if c.deterministic is None:
            c.deterministic = on_gpu
        if c.zero_stage is None:
            c.zero_stage = 1 if on_gpu and c.num_workers > 1 else 0
        if c.ce_chunk_rows is None:
            c.ce_chunk_rows = CE_CHUNK_ROWS[c.device]
        _fit_validation(c, notes)
        c.mlflow = tracking.normalize_mlflow_uri(c.mlflow)  # workers run in other directories
        c.output_dir = output_dir_with_endpoint(c.output_dir, c.storage_endpoint,
                                                data=(*mixture.patterns(c.input_bin), c.input_val_bin,
                                                      *_eval_sets().patterns(c.eval_set)))
        c.validate()
        return c

    def validate(self) -> None:
        """Raise ConfigError naming the first field whose value cannot be used."""
        def need(ok: bool, flag: str, expected: str, found) -> None:
            if not ok:
                raise ConfigError(f"{flag}: expected {expected}, found {found!r}")

        need(bool(self.output_dir.strip()), "-o/--output-dir",
             "a run directory (a path or URI; empty is the current directory: an unset variable?)",
             self.output_dir)
        need(self.scheduler in SCHEDULERS, "-k/--scheduler", " | ".join(SCHEDULERS),
             self.scheduler)
        need(self.device in ("cpu", "gpu"), "--device", "cpu or gpu", self.device)
        need(self.precision in ("fp32", "bf16"), "--precision", "fp32 or bf16", self.precision)
        need(not (self.device == "cpu" and self.precision == "bf16"), "--precision",
             "fp32 on CPU (bf16 master-weight training needs a GPU)", self.precision)
        need(self.num_workers >= 1, "--num-workers", "an integer >= 1", self.num_workers)
        need(self.batch_size >= 1, "-b/--batch-size", "an integer >= 1", self.batch_size)
        need(1 <= self.seq_len <= 1024, "-t/--seq-len", "an integer in [1, 1024]", self.seq_len)
        need(self.learning_rate > 0 and math.isfinite(self.learning_rate), "-l/--learning-rate",
             "a finite value > 0", self.learning_rate)
        need(self.warmup_steps >= 0, "-u/--warmup-steps", "an integer >= 0", self.warmup_steps)
        need(0.0 <= self.final_lr_frac <= 1.0, "-q/--final-lr-frac", "a value in [0, 1]",
             self.final_lr_frac)
        need(self.weight_decay >= 0, "-c/--weight-decay", "a value >= 0", self.weight_decay)
        need(self.max_steps == -1 or self.max_steps >= 1, "-x/--max-steps",
             "-1 (one epoch) or an integer >= 1", self.max_steps)
        need(self.grad_clip > 0, "--grad-clip", "a value > 0", self.grad_clip)
        need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "--beta1/--beta2", "values in [0, 1)",
             (self.beta1, self.beta2))
        for flag, value in (("-v/--val-every", self.val_every), ("-m/--val-batches", self.val_batches),
                            ("-s/--sample-every", self.sample_every), ("-g/--gen-tokens", self.gen_tokens),
                            ("-n/--checkpoint-every", self.checkpoint_every),
                            ("-nk/--checkpoints-keep", self.checkpoints_keep),
                            ("-nm/--major-checkpoint-every",
                             0 if self.major_checkpoint_every is None else self.major_checkpoint_every),
                            ("--max-failures", self.max_failures), ("--watch-every", self.watch_every)):
            need(value >= 0, flag, "an integer >= 0", value)
        need(self.log_every >= 1, "--log-every", "an integer >= 1", self.log_every)
        need(isinstance(self.log_segment_s, (int, float)) and math.isfinite(self.log_segment_s)
             and self.log_segment_s > 0, "--log-segment-s", "a number of seconds > 0",
             self.log_segment_s)
        need(isinstance(self.log_segment_lines, int) and self.log_segment_lines >= 1,
             "--log-segment-lines", "an integer >= 1", self.log_segment_lines)
        need(isinstance(self.checkpoint_minutes, (int, float)) and math.isfinite(self.checkpoint_minutes)
             and self.checkpoint_minutes >= 0, "--checkpoint-minutes",
             "a number of minutes >= 0 (0 is off)", self.checkpoint_minutes)
        need(self.val_batch_size is not None and self.val_batch_size >= 1, "--val-batch-size",
             "an integer >= 1", self.val_batch_size)
        need(self.val_batches >= 1 or not self.input_val_bin or self.val_every == 0,
             "-m/--val-batches", "an integer >= 1 while validation is on (-v > 0)", self.val_batches)
        need(self.skip_update_lossz >= 0 and self.skip_update_gradz >= 0, "-sl/-sg",
             "z thresholds >= 0 (0 is off)", (self.skip_update_lossz, self.skip_update_gradz))
        need(self.resume in (0, 1), "-y/--resume", "0 or 1", self.resume)
        need(self.checkpoint_snapshot in ("host", "device"), "--checkpoint-snapshot",
             "host or device", self.checkpoint_snapshot)
        need(self.zero_stage in (0, 1), "-z/--zero-stage", "0 or 1", self.zero_stage)
        need(self.z_loss >= 0, "--z-loss", "a coefficient >= 0", self.z_loss)
        for f in dataclasses.fields(self):  # (a config file is not argparse-checked)
            choices = f.metadata["choices"]
            if f.metadata["section"] == "performance" and choices:
                need(getattr(self, f.name) in choices, "--" + f.name.replace("_", "-"),
                     " | ".join(map(str, choices)), getattr(self, f.name))
        need(isinstance(self.ce_chunk_rows, int) and self.ce_chunk_rows >= 1, "--ce-chunk-rows",
             "an integer >= 1", self.ce_chunk_rows)
        need(self.preemption_poll_steps >= 1, "--preemption-poll-steps", "an integer >= 1",
             self.preemption_poll_steps)
        s = self.spike
        need(s.window >= 4 and 1 <= s.min_history <= s.window, "--spike-window/--spike-min-history",
             "window >= 4 and 1 <= min_history <= window", (s.window, s.min_history))
        need(0 < s.soft_z <= s.hard_z, "--spike-soft-z/--spike-hard-z", "0 < soft_z <= hard_z",
             (s.soft_z, s.hard_z))
        need(0 < s.lr_scale_decay < 1, "--spike-lr-decay", "a value in (0, 1)", s.lr_scale_decay)
        need(s.max_rewinds >= 0 and s.max_consecutive >= 0 and s.safety_steps >= 0,
             "--spike-max-rewinds/--spike-max-consecutive/--spike-safety-steps", "integers >= 0",
             (s.max_rewinds, s.max_consecutive, s.safety_steps))
        depth = self.depth
        if depth is not None:
            need(depth in MODEL_SHAPES, "-e/--model",
                 f"d{{{','.join(str(d) for d in sorted(MODEL_SHAPES))}}} or a model_*.bin file", self.model)
        else:
            need(os.path.isfile(self.model) or os.path.isfile(os.path.join(self.model, "config.json")),
                 "-e/--model", "dN (N in 1-6, 12, 24, 36, 48), an existing llm.c model_*.bin file "
                 "or a Hugging Face GPT-2 folder (config.json, model.safetensors)", self.model)
        need(self.min_workers is None or 1 <= self.min_workers <= self.num_workers,
             "--min-workers", f"an integer in [1, --num-workers={self.num_workers}]", self.min_workers)
        for world in range(self.min_workers or self.num_workers, self.num_workers + 1):
            micro = self.batch_size * self.seq_len * world
            need(self.total_batch_size > 0 and self.total_batch_size % micro == 0,
                 "-d/--total-batch-size",
                 f"a positive multiple of B*T*world = {self.batch_size}*{self.seq_len}*{world}"
                 f" = {micro}", self.total_batch_size)
        # a local glob must match here; a bucket's is listed by raygpt.config.preflight (one line
        # naming the URI when it matches nothing or the store does not answer)
        for flag, pattern in mixture.flags_and_patterns(self.input_bin):  # (its syntax too)
            need(_remote(pattern) or bool(glob.glob(pattern)), flag, "a glob matching at least "
                 "one llm.c token shard (local, s3:// or gs://)", pattern)
        if self.input_val_bin:
            need(_remote(self.input_val_bin) or bool(glob.glob(self.input_val_bin)),
                 "-j/--input-val-bin", "a glob matching at least one llm.c token shard (local, "
                 "s3:// or gs://; or '' to turn validation off)", self.input_val_bin)
        for name, pattern in _eval_sets().parse(self.eval_set):
            need(_remote(pattern) or bool(glob.glob(pattern)), f"--eval-set {name}",
                 "a glob matching at least one llm.c token shard (local, s3:// or gs://)",
                 pattern)
        need(isinstance(self.shard_cache_gb, (int, float)) and math.isfinite(self.shard_cache_gb)
             and self.shard_cache_gb > 0, "--shard-cache-gb", "a number of GB > 0",
             self.shard_cache_gb)
        missing = tracking.check_installed(self)  # here, not in a worker after Ray has started
        if missing:
            raise ConfigError(missing)

    # ==== identity and overrides
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "TrainConfig":
        """A TrainConfig from {field: value}, every value checked against its field's annotation
        (ConfigError naming the field: the string "false" is not a bool). An int is taken for
        a float field (as a float)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected an object of config fields, found {type(d).__name__}")
        d = dict(d)
        spike = d.pop("spike", {})
        if isinstance(spike, SpikeConfig):
            spike = dataclasses.asdict(spike)
        if not isinstance(spike, dict):
            raise ConfigError(f"{where}: spike: expected an object of spike fields, found {spike!r}")
        return cls(spike=SpikeConfig(**_typed(SpikeConfig, spike, f"{where}: spike.")),
                   **_typed(cls, d, f"{where}: "))

    def with_overrides(self, overrides: dict) -> "TrainConfig":
        """Apply {field: value} overrides; 'spike.soft_z' style keys reach SpikeConfig.
        This is how a Ray Tune trial config becomes a run config."""
        d = self.to_dict()
        for key, value in overrides.items():
            if key.startswith("spike."):
                sub = key.split(".", 1)[1]
                if sub not in d["spike"]:
                    raise ConfigError(f"unknown spike field {sub!r} in override {key!r}")
                d["spike"][sub] = value
            elif key in d:
                d[key] = value
            else:
                raise ConfigError(f"unknown config field {key!r} in overrides")
        return TrainConfig.from_dict(d)

    @classmethod
    def section_fields(cls, section: str) -> list[str]:
        """The names of the fields in `section`, in declaration order."""
        return [f.name for f in dataclasses.fields(cls) if f.metadata["section"] == section]

    def identity(self) -> dict:
        """The fields a checkpoint must agree on to be resumed (everything not in the allowlist)."""
        d = self.to_dict()
        return {k: v for k, v in d.items() if k not in RESUME_MUTABLE_FIELDS}

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()


# The fields that name files, each with the manifest's fingerprint of what it names (the shard
# globs: data.data_fingerprint, names, sizes, first and last MiB; -e: checkpointing.fingerprints.model_source, a dN
# spec as written or a model file's bytes). A checkpoint compares those, not the paths, which a
# moved checkout (the bundled data's default path moves with it), another mount point or Ray's
# working_dir changes: a run resumes wherever the same files are.
FILE_FIELDS = {"input_bin": "data_hash", "input_val_bin": "val_data_hash",
               "model": "model_source"}

# Fields that may differ between a checkpoint and the run resuming it (e.g. extending -x): each
# field's own `knob(may_change_on_resume=...)`.
RESUME_MUTABLE_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig)
                                  if f.metadata["may_change_on_resume"])


def _eval_sets():
    from raygpt.config import eval_sets  # --eval-set's syntax (the task is raygpt.eval.sets)
    return eval_sets
