"""Every knob of a raygpt run, as typed dataclasses, and the command line that fills them.

The command line takes long options and llm.c's short flags with llm.c's meanings (`-i -j -o -e
-b -t -d -l -u -q -c -k -x -v -m -s -g -sl -sg -n -nk -nm -y -z -r`). It is generated from the
dataclasses: every field is a flag whose help is the field's docstring (`field_docs`, read with
`ast`) and whose default is the field's default, so `--help` and the code cannot drift.

`resolve()` fills the fields left unset from the hardware and the data (a micro-batch the
shards can feed on this many workers, validation batches that fit the validation set) and
validates every value: a bad one is a `ConfigError` naming the flag, what was expected and what
was found. What needs files or the run directory is checked next by `raygpt.config.preflight`, still
before Ray starts. A Ray Tune search space is an override of `TrainConfig` fields (see
`with_overrides`), not a second config system.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import math
import numbers
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from raygpt.config.errors import ConfigError  # noqa: F401 (raygpt.config.ConfigError)
from raygpt.model.shapes import CE_CHUNK_ROWS, MODEL_SHAPES
from raygpt.runlog import tracking

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # raygpt/
DATA_DIR = PACKAGE_DIR / "data_files"
DEFAULT_TRAIN = str(DATA_DIR / "tiny_shakespeare_train.bin")
DEFAULT_VAL = str(DATA_DIR / "tiny_shakespeare_val.bin")

SCHEDULERS = ("cosine", "linear", "constant", "wsd")

CONFIG_FILE_MAX_BYTES = 1 << 20


SECTION_TITLES = {
    "data": "data: the token shards and the batch", "model": "model",
    "optimizer": "optimizer: AdamW, clipping, ZeRO, llm.c's z-score skip",
    "schedule": "schedule: the learning rate over the steps",
    "eval": "evaluation, sampling and watch metrics", "checkpoint": "checkpoints and resuming",
    "spike": "the loss-spike monitor", "run": "the run directory, logging and fault injection",
    "ray": "Ray: workers and their restarts",
    "performance": "performance: speed switches (the function computed stays the same)"}


def knob(default=dataclasses.MISSING, *, section: str, factory=dataclasses.MISSING,
         short: str | None = None, long: str | None = None, choices: tuple | None = None,
         metavar: str | None = None, may_change_on_resume: bool = False,
         from_file: bool | None = None):
    """A config field and everything the rest of raygpt needs to know about it, in one place:
    its `section` (a SECTION_TITLES key: --help groups the flags by it), its llm.c `short` flag,
    a `long` flag that is not the name with dashes (a boolean whose default is on has a flag
    that turns it off), its closed set of `choices` (validate() checks the same tuples), the
    `metavar` --help shows, whether it `may_change_on_resume` (a checkpoint's identity,
    `TrainConfig.identity`, leaves those fields out: e.g. extending -x), and whether a file
    (a --config file, a sweep's sweep.json, a stored search space) may set it: `from_file`.
    Unsaid, a free text field may not (it can name a place on this machine, a server or a
    credential) and every other field may (a number, a switch or one of `choices` names none);
    a field that arms or deletes says False, a path read only as data says True."""
    assert section in SECTION_TITLES, section
    return field(default=default, default_factory=factory, metadata=dict(
        section=section, short=short, long=long, choices=choices, metavar=metavar,
        may_change_on_resume=may_change_on_resume, from_file=from_file))


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
                          from_file=True)  # read as data; a URI from a file carries no options
    """Glob of llm.c train token shards (-i): local files, or an s3:// or gs:// URI glob whose
    shards each node fetches into its cache (--shard-cache-dir)."""
    input_val_bin: str = knob(DEFAULT_VAL, section="data", short="-j", metavar="GLOB",
                              from_file=True)
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
    batch_size: int | None = knob(None, section="data", short="-b")
    """Micro-batch size per worker, B. Default: 16 on GPUs, 8 on CPUs, made smaller when the
    train shards cannot hold B*T*workers+1 tokens (llm.c's loader rule)."""
    seq_len: int | None = knob(None, section="data", short="-t")
    """Sequence length, T. Default: 1024 on GPUs, 64 on CPUs (at most a model file's
    max_seq_len)."""
    total_batch_size: int = knob(-1, section="data", short="-d")
    """Tokens per optimizer step across all workers (-d); -1 means B*T*world (no accumulation)."""
    seed: int = knob(1337, section="data")
    """Seeds init, the data shuffle and stochastic rounding."""

    # ==== model (-e)
    model: str | None = knob(None, section="model", short="-e", metavar="dN|FILE|DIR",
                             from_file=True)
    """d1..d6 (CPU sizes), d12/d24/d36/d48 (GPT-2 124M/350M/774M/1558M), an llm.c model_*.bin
    file, or a Hugging Face GPT-2 folder (config.json, model.safetensors: `raygpt export` writes
    one) to start from. Default: d12 on GPUs, d4 on CPUs."""
    precision: str | None = knob(None, section="model", choices=("bf16", "fp32"))
    """bf16 (working weights bf16, fp32 master) or fp32. Default: bf16 on GPUs, fp32 on CPUs."""
    z_loss: float = knob(0.0, section="model")
    """Coefficient of the z-loss on the output logits (about 1e-4 when on); 0 turns it off."""

    # ==== optimizer: AdamW, clipping, ZeRO, llm.c's z-score skip (-l -c -z -sl -sg)
    learning_rate: float | None = knob(None, section="optimizer", short="-l")
    """Peak learning rate. Default: 6e-4 on GPUs, 1e-3 on CPUs."""
    weight_decay: float = knob(0.1, section="optimizer", short="-c")
    """AdamW weight decay on 2-D tensors (-c)."""
    grad_clip: float = knob(1.0, section="optimizer")
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
    scheduler: str = knob("cosine", section="schedule", short="-k", choices=SCHEDULERS)
    """cosine | linear | constant | wsd (-k)."""
    warmup_steps: int | None = knob(None, section="schedule", short="-u")
    """Linear warmup steps, 1-based as llm.c. Default: 20 on GPUs, 10 on CPUs."""
    final_lr_frac: float = knob(0.1, section="schedule", short="-q")
    """Final LR as a fraction of the peak (-q)."""
    max_steps: int | None = knob(None, section="schedule", short="-x", may_change_on_resume=True)
    """Optimizer steps to train; -1 means one epoch of the train shards. Default: 200 on GPUs,
    100 on CPUs."""

    # ==== evaluation, sampling and watch metrics (-v -m -s -g)
    val_every: int = knob(20, section="eval", short="-v", may_change_on_resume=True)
    """Validation loss every N steps (-v); 0 turns it off."""
    val_batches: int | None = knob(None, section="eval", short="-m", may_change_on_resume=True)
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
                                        may_change_on_resume=True)
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
                           may_change_on_resume=True)
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
        c.input_bin, c.input_val_bin = (shards_with_endpoint(flag, p, c.storage_endpoint) for flag, p
                                        in (("-i/--input-bin", c.input_bin),
                                            ("-j/--input-val-bin", c.input_val_bin)))
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
                                                data=(c.input_bin, c.input_val_bin,
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
        need(_remote(self.input_bin) or bool(glob.glob(self.input_bin)), "-i/--input-bin",
             "a glob matching at least one llm.c token shard (local, s3:// or gs://)",
             self.input_bin)
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


def _is_list(f: dataclasses.Field) -> bool:
    """A field of repeatable values (`list[str]`: a flag given once per value)."""
    return str(f.type).startswith("list[")


def _value_type(f: dataclasses.Field) -> type:
    """bool, int, float or str from a field's annotation ('int | None' is int; 'list[str]'
    is str, its items' type)."""
    hint = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    parts = {p.strip() for p in str(hint).split("|")}
    return next((t for t in (bool, int, float) if t.__name__ in parts), str)


def _from_file(f: dataclasses.Field) -> bool:
    """Whether a file may set field `f` (its knob's `from_file`; unsaid: any but free text)."""
    allowed = f.metadata["from_file"]
    if allowed is None:
        allowed = bool(f.metadata["choices"]) or _value_type(f) is not str
    return allowed


def flag_of(name: str) -> str:
    """The command-line flag of a TrainConfig field ('spike.x' for SpikeConfig's)."""
    cls, key = (SpikeConfig, name[6:]) if name.startswith("spike.") else (TrainConfig, name)
    meta = next(f for f in dataclasses.fields(cls) if f.name == key).metadata
    return meta["long"] or "--" + name.replace(".", "-").replace("_", "-")


# The fields no file may set (each knob's `from_file`): where a run writes, whether it overwrites
# or resumes, fault injection, servers (storage endpoint, MLflow, W&B), the shard cache's directory.
FILE_REFUSED = tuple(f.name for f in dataclasses.fields(TrainConfig)
                     if f.name != "spike" and not _from_file(f))
assert all(_from_file(f) for f in dataclasses.fields(SpikeConfig))  # (numbers: none to refuse)
CONFIG_FILE_FORBIDDEN = FILE_REFUSED  # (the name launchers and sweeps know it by)
# ...of which the launcher of each run sets these three itself (a sweep's trials, a resume)
PLACEMENT = ("output_dir", "overwrite", "resume")
# ...and the rest only the command line gives: a stored config holds them at their defaults, and
# the command that reads it back hands on its own (`command_line_only`).
COMMAND_LINE_ONLY = {name: flag_of(name) for name in FILE_REFUSED if name not in PLACEMENT}


def check_file_fields(d: dict, where: str) -> None:
    """The fields of a config read from a file (`--config`, sweep.json, a stored search space)
    against each knob's declaration: ConfigError naming `where` and the fields a file may not
    set, or the field whose URI carries options (an endpoint, credentials: `storage.uri`)."""
    flat = dict(d)
    spike = flat.pop("spike", None)
    if isinstance(spike, dict):
        flat.update({f"spike.{k}": v for k, v in spike.items()})
    refused = sorted(k for k in flat if k in FILE_REFUSED)  # (spike.* are numbers: none refused)
    if refused:
        raise ConfigError(f"{where}: may not set {refused} (a file names no place this run "
                          f"writes or caches in, no server, and neither arms nor deletes; give "
                          f"them on the command line: {', '.join(flag_of(k) for k in refused)})")
    from raygpt.storage.uri import URIRefused, check_plain
    for key, value in flat.items():
        try:
            for item in (value if isinstance(value, list) else [value]):
                check_plain(_uri_of(item), f"{where}: {key}")
        except URIRefused as e:
            raise ConfigError(str(e)) from None


def _uri_of(item):
    """The URI (or path) an item of a field names: an --eval-set's NAME=GLOB names its GLOB."""
    if isinstance(item, str) and "=" in item.split("://", 1)[0]:
        return item.partition("=")[2]
    return item


def stored_fields(d: dict) -> dict:
    """A config dict as raygpt writes it into a file it will read back (`check_file_fields`):
    every URI without its options (the endpoint comes back from the reading command's
    --storage-endpoint or environment)."""
    from raygpt.storage.uri import without_options

    def plain(v):
        if isinstance(v, dict):
            return stored_fields(v)
        if isinstance(v, list):  # an --eval-set's NAME=GLOB: the name kept, the URI plain
            return [v_ if (u := _uri_of(v_)) is v_ else v_[:len(v_) - len(u)] + without_options(u)
                    for v_ in v]
        return without_options(v)
    return {k: plain(v) for k, v in d.items()}


def _typed(cls, d: dict, where: str) -> dict:
    """`d` with every value checked against `cls`'s annotation for it (and ints made floats
    where a float is expected); ConfigError naming the first field that does not fit."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)} - {"spike"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{where}unknown config field(s) {unknown}; expected some of {sorted(known)}")
    out = {}
    for key, value in d.items():
        hint = hints[key]
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        for t in allowed:
            ok, converted = _fits(value, t)
            if ok:
                out[key] = converted
                break
        else:
            names = " or ".join("null" if t is type(None) else str(t) if typing.get_origin(t)
                                else t.__name__ for t in allowed)
            raise ConfigError(f"{where}{key}: expected {names}, found {value!r} "
                              f"({type(value).__name__})")
    return out


def _fits(value, t) -> tuple[bool, object]:
    if t is type(None):
        return value is None, None
    if t is bool:
        return isinstance(value, bool), value
    if isinstance(value, bool):  # a bool is an int to Python, never to a config
        return False, value
    if t is int:
        return isinstance(value, numbers.Integral), int(value) if isinstance(value, numbers.Integral) else value
    if t is float:
        ok = isinstance(value, numbers.Real)
        return ok, float(value) if ok else value
    if typing.get_origin(t) is list:  # list[str]: a list of items of that type
        (item,) = typing.get_args(t)
        ok = isinstance(value, (list, tuple)) and all(_fits(v, item)[0] for v in value)
        return ok, list(value) if ok else value
    return isinstance(value, t), value


def as_command(cfg: "TrainConfig") -> tuple[dict, list[str]]:
    """`cfg` split as a launcher hands it to `raygpt train --config FILE FLAGS...`: the fields a
    --config file may hold, and flags for the rest (FILE_REFUSED, and a URI with options, which
    only a command line may give), those at their defaults left out. The writer beside
    read_config_file's reader."""
    from raygpt.storage.uri import uri_options
    fields, default = cfg.to_dict(), TrainConfig()
    flags = ["-o", fields.pop("output_dir"), "-y", str(fields.pop("resume"))]
    if fields.pop("overwrite"):
        flags.append("--overwrite")
    def has_options(v) -> bool:
        return any(uri_options(_uri_of(i)) for i in (v if isinstance(v, list) else [v]))

    for name in [*COMMAND_LINE_ONLY, *(k for k, v in fields.items() if has_options(v))]:
        value = fields.pop(name)
        if value != getattr(default, name):
            if isinstance(value, bool):
                flags += [flag_of(name)]
            elif isinstance(value, list):  # a repeatable flag, once per value
                flags += [a for item in value for a in (flag_of(name), str(item))]
            else:
                flags += [flag_of(name), str(value)]
    return fields, flags


def read_config_file(path: str) -> dict:
    """The fields of a --config JSON file: bounded in size, an object, each one a file may set
    (`check_file_fields`; the types are checked by TrainConfig.from_dict)."""
    try:
        with open(path, "rb") as f:
            data = f.read(CONFIG_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e})") from e
    if len(data) > CONFIG_FILE_MAX_BYTES:
        raise ConfigError(f"--config {path}: expected a JSON file of at most "
                          f"{CONFIG_FILE_MAX_BYTES:,} bytes, found a larger one")
    from raygpt.storage import JSONError, parse_json  # pyarrow: imported only when used
    try:
        d = parse_json(data, f"--config {path}")
    except JSONError as e:
        raise ConfigError(f"--config {path}: expected a JSON object of config fields "
                          f"({e.reason})") from e
    if not isinstance(d, dict):
        raise ConfigError(f"--config {path}: expected a JSON object of config fields, "
                          f"found {type(d).__name__}")
    check_file_fields(d, f"--config {path}")
    return d


def config_read_back(d, where: str) -> "TrainConfig":
    """A TrainConfig that raygpt wrote into a directory and reads back (a sweep's base config):
    typed like a --config file, and refused (ConfigError naming `where` and the field) when it
    sets a COMMAND_LINE_ONLY field to anything but its default, or names a URI with options,
    since whoever can write the directory could have. raygpt writes such configs with those
    fields at their defaults (`without_command_line_only`) and its URIs plain (`stored_fields`),
    and takes them from the reading command's own line."""
    cfg = TrainConfig.from_dict(d, where)
    default = TrainConfig()
    for name, flag in COMMAND_LINE_ONLY.items():
        value = getattr(cfg, name)
        if value != getattr(default, name):
            raise ConfigError(f"{where}: {name}: expected {getattr(default, name)!r} (only the "
                              f"command line sets it: {flag}), found {value!r}")
    check_file_fields({k: v for k, v in cfg.to_dict().items() if k not in FILE_REFUSED}, where)
    return cfg


def command_line_only(cfg: "TrainConfig") -> dict:
    """The COMMAND_LINE_ONLY fields of `cfg`: what a process hands on beside a stored config."""
    return {name: getattr(cfg, name) for name in COMMAND_LINE_ONLY}


def without_command_line_only(cfg: "TrainConfig") -> "TrainConfig":
    """`cfg` with every COMMAND_LINE_ONLY field at its default: what raygpt stores in a file."""
    default = TrainConfig()
    return cfg.with_overrides({name: getattr(default, name) for name in COMMAND_LINE_ONLY})


def _remote(pattern: str) -> bool:
    from raygpt.data.sources import is_remote
    return is_remote(pattern)


def shards_with_endpoint(flag: str, pattern: str, endpoint: str) -> str:
    """An s3:// shard glob carrying its endpoint as a run directory does (`storage.with_endpoint`);
    any other pattern unchanged. ConfigError naming `flag` for a URI of a scheme raygpt cannot
    read shards from."""
    if "://" not in pattern:
        return pattern
    from raygpt.data.sources import REMOTE_SCHEMES
    if not _remote(pattern):
        raise ConfigError(f"{flag}: expected a local glob or an {' / '.join(REMOTE_SCHEMES)} URI, "
                          f"found {pattern!r}")
    from raygpt.storage import with_endpoint  # pyarrow: only for shards in a bucket
    try:
        return with_endpoint(pattern, endpoint)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def output_dir_with_endpoint(output_dir: str, endpoint: str, data: tuple[str, ...] = ()) -> str:
    """An s3:// run (or sweep) directory carrying its endpoint (--storage-endpoint or the AWS
    variables), so that Ray's workers, elsewhere, open the same store (`storage.with_endpoint`).
    `data`: the run's shard globs, which may be what the endpoint is for."""
    if not output_dir.startswith("s3://"):
        if endpoint and not any(p.startswith("s3://") for p in data):
            raise ConfigError(f"--storage-endpoint: expected with an s3:// -o/--output-dir, -i "
                              f"or -j, found -o {output_dir!r}")
        return output_dir
    from raygpt.storage import with_endpoint  # pyarrow: only for object-store run directories
    try:
        return with_endpoint(output_dir, endpoint)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with every local path it names made absolute against this process's working
    directory (and ~ as the user's home): the run directory, the train and validation shard
    globs, the shard cache directory, an -e model file or folder, a HellaSwag file. The driver
    does it before anything reads them; Ray's workers run
    with another working directory, where a path given relative to the user's would name
    nothing (or something else). URIs, an empty -o (refused by validate(), never made the
    working directory), an empty -j (validation off) and a dN model spec are left as they are."""
    def absolute(path: str) -> str:  # ~ too: a quoted glob ('~/data/*.bin') reaches us as typed
        return path if not path or "://" in path else os.path.abspath(os.path.expanduser(path))

    paths = {"input_bin": absolute(cfg.input_bin), "input_val_bin": absolute(cfg.input_val_bin),
             "hellaswag": absolute(cfg.hellaswag),
             "eval_set": _eval_sets().with_patterns(cfg.eval_set, lambda _, p: absolute(p))}
    if cfg.output_dir.strip() and "://" not in cfg.output_dir:
        paths["output_dir"] = str(Path(cfg.output_dir).expanduser().resolve())
    if cfg.shard_cache_dir:
        paths["shard_cache_dir"] = absolute(cfg.shard_cache_dir)
    if cfg.depth is None and cfg.model:
        paths["model"] = absolute(cfg.model)
    return cfg.with_overrides(paths)


def local_gpus() -> int:
    """The GPUs this process can see (CUDA_VISIBLE_DEVICES applies), as a Ray started here
    counts them."""
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:  # torch missing or broken CUDA: treat as no GPU, the caller says so
        return 0


DEFAULT_VAL_BATCHES = 20  # llm.c's val_max_steps


def _model_file_block_size(model: str) -> int:
    """max_seq_len of an llm.c model file given as -e (1024 for dN names and for a file that
    cannot be read: `raygpt.config.preflight` names that file's problem)."""
    if not model or (model.startswith("d") and model[1:].isdigit()) or not os.path.isfile(model):
        return 1024
    import numpy as np
    try:
        header = np.fromfile(model, dtype="<i4", count=256)
    except OSError:
        return 1024
    return int(header[2]) if len(header) == 256 and header[2] >= 1 else 1024


def _shard_tokens(pattern: str, flag: str) -> list[int] | None:
    """Token counts of the shards matching `pattern` (headers only), None when nothing matches
    (validate() says so); a bad header is a ConfigError naming the flag and the file."""
    from raygpt.data.sources import shard_token_counts  # numpy: only when resolving
    from raygpt.llmc.shards import ShardError
    if not pattern or not (_remote(pattern) or glob.glob(pattern)):
        return None
    try:
        return [n for _, n in shard_token_counts(pattern)]
    except ShardError as e:
        raise ConfigError(f"{flag}: {e}") from None


def _fit_batch_size(c: "TrainConfig", default: int, notes: list[str]) -> int:
    """The default micro-batch, made smaller when the smallest train shard cannot hold one
    global micro-batch on c.num_workers workers (B*T*workers+1 tokens). A shard too small even
    for B=1 is left to `raygpt.config.preflight`, which names it."""
    tokens = _shard_tokens(c.input_bin, "-i/--input-bin")
    if tokens is None or c.seq_len < 1 or c.num_workers < 1:
        return default
    fits = (min(tokens) - 1) // (c.seq_len * c.num_workers)
    if 1 <= fits < default:
        notes.append(f"B={fits} (not {default}): the smallest train shard holds {min(tokens):,} "
                     f"tokens and one micro-batch on {c.num_workers} workers needs "
                     f"B*T*{c.num_workers}+1 (T={c.seq_len})")
        return fits
    return default


def _fit_validation(c: "TrainConfig", notes: list[str]) -> None:
    """Fill val_batch_size and val_batches (when unset) to the validation shards: every rank
    that validates reads val_batches micro-batches of val_batch_size samples of T+1 tokens;
    ranks beyond the data sit validation out (`data.ranks_with_data`). The defaults cover as much
    of the validation set as DEFAULT_VAL_BATCHES batches can without reading a sample twice,
    with the largest micro-batch (at most B) that does so."""
    from raygpt.data.loader import ranks_with_data
    if not c.input_val_bin or c.val_every <= 0:  # validation off: nothing to fit
        c.val_batch_size = c.batch_size if c.val_batch_size is None else c.val_batch_size
        c.val_batches = DEFAULT_VAL_BATCHES if c.val_batches is None else c.val_batches
        return
    tokens = _shard_tokens(c.input_val_bin, "-j/--input-val-bin")
    if (tokens is None or c.seq_len < 1 or c.batch_size < 1 or c.num_workers < 1
            or (c.val_batch_size is not None and c.val_batch_size < 1)):
        c.val_batch_size = c.batch_size if c.val_batch_size is None else c.val_batch_size  # validate()/preflight explain
        c.val_batches = DEFAULT_VAL_BATCHES if c.val_batches is None else c.val_batches
        return
    samples = sum((n - 1) // c.seq_len for n in tokens)  # the whole validation stream
    cap = min(c.batch_size, (min(tokens) - 1) // c.seq_len)  # one rank must fit in each shard

    def batches(b: int) -> int:
        if c.val_batches is not None:
            return c.val_batches
        ranks = ranks_with_data(tokens, b, c.seq_len, c.num_workers)
        if ranks < 1:  # an explicit micro-batch no shard can hold: preflight names it
            return DEFAULT_VAL_BATCHES
        return max(1, min(DEFAULT_VAL_BATCHES, samples // (b * ranks)))

    def covered(b: int) -> int:  # distinct samples one evaluation reads
        ranks = ranks_with_data(tokens, b, c.seq_len, c.num_workers)
        return min(samples, b * ranks * batches(b))

    if c.val_batch_size is None:
        if cap < 1:  # shards shorter than T+1 tokens: preflight names them
            c.val_batch_size = c.batch_size
        else:  # most samples covered; among equals, the largest micro-batch (fewest batches)
            c.val_batch_size = max(range(1, cap + 1), key=lambda b: (covered(b), b))
    if c.val_batches is None:
        c.val_batches = batches(c.val_batch_size) if cap >= 1 else DEFAULT_VAL_BATCHES
    ranks = ranks_with_data(tokens, c.val_batch_size, c.seq_len, c.num_workers)
    if ranks >= 1:
        if (c.val_batch_size, c.val_batches, ranks) != (c.batch_size, DEFAULT_VAL_BATCHES,
                                                         c.num_workers):
            notes.append(f"validation: {c.val_batches} batch(es) of {c.val_batch_size} x "
                         f"{c.seq_len} tokens on {ranks} of {c.num_workers} rank(s), "
                         f"{covered(c.val_batch_size):,} of the {samples:,} validation samples "
                         f"(the validation shards hold {sum(tokens):,} tokens)")


# ---------------------------------------------------------------------- command line

# The command line is generated from the dataclasses above: every field is a flag, its help is
# the field's docstring (read from this file's source with `ast`, so the two cannot drift), its
# default the field's default, its short flag, choices and metavar the field's `knob` metadata.
# llm.c's one- and two-letter flags keep llm.c's meanings.
EXIT_CODES = """exit status:
  0  finished (every step of -x trained)
  1  failed (Ray's retry budget spent, or an error raygpt cannot recover from)
  2  bad input: a flag, a file or the run directory refused before Ray started, or one a
     worker met (a corrupt shard, a checkpoint it cannot use), which is not retried
  3  stopped early by SIGTERM, Ctrl-C or a preemption, after a checkpoint: -y 1 resumes it
  130  aborted by a second Ctrl-C: -y 1 resumes from the last verified checkpoint"""


def field_docs(cls) -> dict[str, str]:
    """{field: docstring} of a dataclass, read from its source: the string literal right after
    each annotated field (what Sphinx and torchtitan treat as the field's documentation)."""
    import ast
    import inspect
    import textwrap
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _show(value) -> str:
    if isinstance(value, str) and value.startswith(str(DATA_DIR)):
        return f"the bundled {Path(value).name}"
    return "'' (off)" if value == "" else str(value)


def _flag_specs():
    """(section, dest, names, argparse kwargs) of every config field: TrainConfig's, then
    SpikeConfig's as spike_<name> (the --spike-* flags)."""
    import re
    for cls, prefix in ((TrainConfig, ""), (SpikeConfig, "spike.")):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name == "spike":
                continue
            meta = f.metadata
            key = prefix + f.name
            dest = key.replace(".", "_")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            # the flag is shown beside the help, so the docstring's own "(-x)" goes
            doc = re.sub(r"\s*\((-\w+ ?)+\)", "", docs.get(f.name, "")).replace("%", "%%")
            long = meta["long"] or "--" + key.replace(".", "-").replace("_", "-")
            names = [n for n in (meta["short"], long) if n]
            typ = _value_type(f)
            if _is_list(f):  # repeatable: each use adds a value
                yield meta["section"], dest, names, dict(
                    dest=dest, action="append", type=typ, default=None,
                    metavar=meta["metavar"] or typ.__name__.upper().replace("STR", "TEXT"),
                    help=doc + " (repeatable; default: none)")
                continue
            if typ is bool:
                if default is True:  # the flag turns a default-on feature off
                    yield meta["section"], dest, names, dict(
                        action="store_false", default=None,
                        help=f"{doc} (default: on; this flag turns it off)")
                else:
                    shown = "" if default is None else " (default: off)"
                    yield meta["section"], dest, names, dict(action="store_true", default=None,
                                                             help=doc + shown)
                    if default is None:
                        yield meta["section"], dest, ["--no-" + long[2:]], dict(
                            action="store_false", help=f"turn {long} off")
                continue
            kw = dict(dest=dest, type=typ, default=None,
                      metavar=meta["metavar"] or typ.__name__.upper().replace("STR", "TEXT"))
            if meta["choices"]:
                kw.update(choices=meta["choices"],
                          metavar="{" + ",".join(map(str, meta["choices"])) + "}")
            shown = "" if default is None else f" (default: {_show(default)})"
            kw["help"] = doc + shown
            yield meta["section"], dest, names, kw


class FlagParser(argparse.ArgumentParser):
    """argparse for raygpt's commands (train, and sweep's own flags): a usage mistake is a
    ConfigError like any other bad value, in raygpt's form (flag, expected, found)."""

    def error(self, message):
        raise ConfigError(_usage_error(message))


def _usage_error(message: str) -> str:
    """argparse's message in raygpt's form: the flag first, then what was expected and found."""
    import re
    m = re.match(r"argument (\S+): (.*)$", message)
    if not m:
        return message
    flag, what = m.groups()
    kinds = {"int": "an integer", "float": "a number"}
    if (c := re.match(r"invalid choice: (.*) \(choose from (.*)\)$", what)):
        return f"{flag}: expected one of {c.group(2)}, found {c.group(1)}"
    if (c := re.match(r"invalid (\w+) value: (.*)$", what)):
        return f"{flag}: expected {kinds.get(c.group(1), c.group(1))}, found {c.group(2)}"
    if what.startswith("expected one argument"):
        return f"{flag}: expected a value after the flag, found none"
    return f"{flag}: {what}"


def build_parser(prog: str = "raygpt train") -> argparse.ArgumentParser:
    p = FlagParser(prog=prog, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Pretrain GPT-2 on Ray Train. llm.c's flags keep llm.c's meanings;\n"
                            "every field of raygpt.config.TrainConfig is a flag (its docstring is "
                            "the help).",
                epilog=EXIT_CODES)
    groups = {name: p.add_argument_group(title) for name, title in SECTION_TITLES.items()}
    for section, dest, names, kw in _flag_specs():
        if "dest" not in kw:
            kw["dest"] = dest
        groups[section].add_argument(*names, **kw)
    p.add_argument("--cpu", dest="device", action="store_const", const="cpu", help="--device cpu")
    p.add_argument("--gpu", dest="device", action="store_const", const="gpu", help="--device gpu")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a JSON file of TrainConfig fields (e.g. a sweep's best_config.json); "
                        "flags given beside it win")
    return p


def parse_args(argv: list[str] | None = None, base: TrainConfig | None = None) -> TrainConfig:
    """Parse the command line into an unresolved TrainConfig (call `.resolve()` next)."""
    ns = build_parser().parse_args(argv)
    cfg = base or TrainConfig()
    if ns.config:
        fields = read_config_file(ns.config)
        spike = fields.pop("spike", None)
        if spike is not None:
            if not isinstance(spike, dict):
                raise ConfigError(f"--config {ns.config}: spike: expected an object, found {spike!r}")
            fields.update({f"spike.{k}": v for k, v in spike.items()})
        try:
            cfg = cfg.with_overrides(fields)
        except ConfigError as e:
            raise ConfigError(f"--config {ns.config}: {e}") from e
    overrides = {}
    for key, value in vars(ns).items():
        if value is None or key == "config":
            continue
        if key.startswith("spike_"):
            overrides["spike." + key[len("spike_"):]] = value
        else:
            overrides[key] = value
    return cfg.with_overrides(overrides)
