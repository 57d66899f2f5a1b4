"""Every knob of a raygpt run, as typed dataclasses, and the command line that fills them.

The command line takes long options and llm.c's short flags with llm.c's meanings (`-i -j -o -e
-b -t -d -l -u -q -c -k -x -v -m -s -g -sl -sg -n -nk -nm -y -z`). Everything is validated here,
before Ray starts: a bad value is a `ConfigError` naming the flag, what was expected and what was
found. A Ray Tune search space is an override of `TrainConfig` fields (see `with_overrides`), not
a second config system.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from raygpt import tracking

PACKAGE_DIR = Path(__file__).resolve().parent
DATA_DIR = PACKAGE_DIR / "data_files"
DEFAULT_TRAIN = str(DATA_DIR / "tiny_shakespeare_train.bin")
DEFAULT_VAL = str(DATA_DIR / "tiny_shakespeare_val.bin")

SCHEDULERS = ("cosine", "linear", "constant", "wsd")

# GPT-2 shapes by depth, as llm.c's `-e dN` (depth -> channels, heads). Depths of 6 and below are
# CPU-sized models with 64-wide heads (llm.c's own d6 is 384 channels, 6 heads).
MODEL_SHAPES = {12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25)}
for _depth in range(1, 7):
    MODEL_SHAPES[_depth] = (64 * _depth, _depth)

# Fields that may differ between a checkpoint and the run resuming it (e.g. extending -x).
RESUME_MUTABLE_FIELDS = frozenset({
    "max_steps", "val_every", "val_batches", "sample_every", "gen_tokens", "checkpoint_every",
    "checkpoints_keep", "major_checkpoint_every", "resume", "overwrite", "output_dir",
    "num_workers", "max_failures", "max_preemption_failures", "fault", "log_every",
    "watch_every", "async_checkpoint", "max_rewinds", "deterministic", "zero_stage",
    "min_workers", "compile", "record_samples", "wandb", "mlflow",
})


class ConfigError(ValueError):
    """A flag or config field has a value that cannot be used; the message names it."""


@dataclass
class SpikeConfig:
    """Seed 001's loss-spike policy on top of llm.c's z-score skip."""

    enabled: bool = False
    """Turn the spike monitor on (skip isolated outliers, rewind sustained spikes)."""
    window: int = 64
    """Clean steps in the robust baseline (median and MAD of the loss)."""
    min_history: int = 16
    """Clean steps needed before the monitor judges anything."""
    soft_z: float = 6.0
    """Robust z of the loss above which a step is an outlier (skipped)."""
    hard_z: float = 20.0
    """Robust z of the loss above which the run rewinds at once."""
    gnorm_mult: float = 10.0
    """A grad norm this many times the median clean norm is an outlier too (0 turns it off)."""
    max_consecutive: int = 3
    """More consecutive outliers than this turn skipping into a rewind."""
    safety_steps: int = 1
    """Rewind to a checkpoint at least this many steps before the spike began."""
    max_rewinds: int = 5
    """After this many rewinds the run stops with an error (escalates to a human)."""
    lr_scale_decay: float = 0.7
    """lr_scale is multiplied by this when a region spikes again after its data was skipped."""
    min_lr_scale: float = 0.1
    """lr_scale below this stops the run with an error."""


@dataclass
class TrainConfig:
    """One raygpt run. Defaults are the embedded Shakespeare job; `resolve()` fills the `None`s
    from the hardware (GPT-2 124M in bf16 on GPUs, a small fp32 model on 2 CPU workers)."""

    # data (-i -j)
    input_bin: str = DEFAULT_TRAIN
    """Glob of llm.c train token shards (-i)."""
    input_val_bin: str = DEFAULT_VAL
    """Glob of llm.c validation token shards (-j); empty turns validation off."""
    shuffle: bool = True
    """Deterministic shuffling of shard order and of samples within a shard (train only)."""
    # run directory (-o)
    output_dir: str = "runs/shakespeare"
    """Run directory: main.log, loss_history.jsonl, checkpoints; a local path or a URI."""
    # model (-e)
    model: str | None = None
    """d2..d6 (CPU sizes), d12/d24/d36/d48 (GPT-2 124M/350M/774M/1558M) or a model_*.bin file."""
    # batch (-b -t -d)
    batch_size: int | None = None
    """Micro-batch size per worker, B (-b)."""
    seq_len: int | None = None
    """Sequence length, T (-t)."""
    total_batch_size: int = -1
    """Tokens per optimizer step across all workers (-d); -1 means B*T*world (no accumulation)."""
    # optimizer and schedule (-l -u -q -c -k -x)
    learning_rate: float | None = None
    """Peak learning rate (-l)."""
    warmup_steps: int | None = None
    """Linear warmup steps, 1-based as llm.c (-u)."""
    final_lr_frac: float = 0.1
    """Final LR as a fraction of the peak (-q)."""
    weight_decay: float = 0.1
    """AdamW weight decay on 2-D tensors (-c)."""
    scheduler: str = "cosine"
    """cosine | linear | constant | wsd (-k)."""
    max_steps: int | None = None
    """Optimizer steps to train (-x); -1 means one epoch of the train shards."""
    grad_clip: float = 1.0
    """Clip the global grad norm to this (as a scalar inside AdamW; gradients stay untouched)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # evaluation and sampling (-v -m -s -g)
    val_every: int = 20
    """Validation loss every N steps (-v); 0 turns it off."""
    val_batches: int = 20
    """Validation micro-batches per evaluation (-m)."""
    sample_every: int | None = None
    """Generate a text sample every N steps (-s); 0 turns it off."""
    gen_tokens: int = 64
    """Tokens per generated sample (-g)."""
    # outlier detector (-sl -sg)
    skip_update_lossz: float = 0.0
    """Skip the update when the loss z-score exceeds this (-sl); 0 turns it off."""
    skip_update_gradz: float = 0.0
    """Skip the update when the grad-norm z-score exceeds this (-sg); 0 turns it off."""
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    z_loss: float = 0.0
    """Coefficient of the z-loss on the output logits (about 1e-4 when on); 0 turns it off."""
    watch_every: int = 50
    """Every N steps log watch metrics: clipped fraction, max logit, update/param ratios."""
    # checkpoints (-n -nk -nm -y)
    checkpoint_every: int = 0
    """Write a checkpoint every N steps (-n); 0 writes only at the end and on signals."""
    checkpoints_keep: int = 0
    """Keep the last K checkpoints (-nk); 0 keeps all."""
    major_checkpoint_every: int = 0
    """Keep every checkpoint whose step is a multiple of M forever (-nm); 0 turns it off."""
    resume: int = 0
    """1: resume from the newest verified checkpoint in the run directory (-y)."""
    overwrite: bool = False
    """Allow a fresh start over a run directory that already holds a run."""
    async_checkpoint: bool = True
    """Write checkpoint files on a background thread after a host copy."""
    # hardware and parallelism
    device: str = "auto"
    """auto | cpu | gpu."""
    num_workers: int | None = None
    """Ray Train workers; default: every visible GPU, or 2 CPU workers."""
    min_workers: int | None = None
    """Elastic: continue on as few as this many workers after losing nodes (None: fixed size).
    The global batch (-d) stays the same; grad accumulation absorbs the change."""
    precision: str | None = None
    """bf16 (working weights bf16, fp32 master) or fp32; default bf16 on GPU, fp32 on CPU."""
    zero_stage: int = 0
    """0: every rank holds the whole optimizer state; 1: ZeRO-1 sharding (-z)."""
    compile: bool | None = None
    """torch.compile the model; default on GPU."""
    deterministic: bool = False
    """PyTorch's deterministic kernels (torch.use_deterministic_algorithms, warn_only) and a
    fixed cuBLAS workspace, for bitwise-exact resume on GPU. With warn_only, an op that has no
    deterministic version keeps its default one and PyTorch warns once (on an H200 the cuDNN
    attention backward does); raygpt's own kernels are deterministic in every mode."""
    seed: int = 1337
    """Seeds init, the data shuffle and stochastic rounding."""
    # fault tolerance
    max_failures: int = 3
    """Worker-group restarts Ray Train may make after failures (FailureConfig.max_failures)."""
    max_preemption_failures: int = 10
    """Restarts after preemptions, counted apart from max_failures."""
    fault: str = ""
    """Fault injection for tests, e.g. 'kill:rank=1,step=7' (see raygpt.faults); off when empty."""
    log_every: int = 1
    """Console line every N steps."""
    record_samples: bool = False
    """Record each step's global sample ranges in loss_history.jsonl (audits data coverage)."""
    # experiment tracking (rank 0, at the log interval and every validation; see raygpt.tracking)
    wandb: str = ""
    """W&B project for train/val metrics and the config (needs 'raygpt[wandb]');
    WANDB_MODE=offline keeps the files in <run dir>/wandb; empty: off."""
    mlflow: str = ""
    """MLflow tracking URI for the same metrics: a server URL, sqlite:///FILE.db or a local
    directory (needs 'raygpt[mlflow]'); empty: off."""

    # ------------------------------------------------------------------ derived values
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

    # ------------------------------------------------------------------ resolution and checks
    def resolve(self, gpus_available: int | None = None) -> "TrainConfig":
        """Return a copy with hardware-dependent defaults filled in, then validated."""
        c = dataclasses.replace(self, spike=dataclasses.replace(self.spike))
        if gpus_available is None:
            gpus_available = _visible_gpus()
        if c.device == "auto":
            c.device = "gpu" if gpus_available > 0 else "cpu"
        if c.device == "gpu" and gpus_available == 0 and c.num_workers is None:
            raise ConfigError("--gpu: no GPU is visible on this machine (expected at least 1, found 0)")
        on_gpu = c.device == "gpu"
        if c.num_workers is None:
            c.num_workers = gpus_available if on_gpu else 2
        if c.model is None:
            c.model = "d12" if on_gpu else "d4"
        if c.batch_size is None:
            c.batch_size = 16 if on_gpu else 8
        if c.seq_len is None:
            c.seq_len = 1024 if on_gpu else 64
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
        if c.precision is None:
            c.precision = "bf16" if on_gpu else "fp32"
        if c.compile is None:
            c.compile = on_gpu
        c.mlflow = tracking.normalize_mlflow_uri(c.mlflow)  # workers run in other directories
        c.validate()
        return c

    def validate(self) -> None:
        """Raise ConfigError naming the first field whose value cannot be used."""
        def need(ok: bool, flag: str, expected: str, found) -> None:
            if not ok:
                raise ConfigError(f"{flag}: expected {expected}, found {found!r}")

        need(self.scheduler in SCHEDULERS, "-k/--scheduler", " | ".join(SCHEDULERS), self.scheduler)
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
                            ("-nm/--major-checkpoint-every", self.major_checkpoint_every),
                            ("--max-failures", self.max_failures), ("--watch-every", self.watch_every)):
            need(value >= 0, flag, "an integer >= 0", value)
        need(self.log_every >= 1, "--log-every", "an integer >= 1", self.log_every)
        need(self.skip_update_lossz >= 0 and self.skip_update_gradz >= 0, "-sl/-sg",
             "z thresholds >= 0 (0 is off)", (self.skip_update_lossz, self.skip_update_gradz))
        need(self.resume in (0, 1), "-y/--resume", "0 or 1", self.resume)
        need(self.zero_stage in (0, 1), "-z/--zero-stage", "0 or 1", self.zero_stage)
        need(self.z_loss >= 0, "--z-loss", "a coefficient >= 0", self.z_loss)
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
            need(os.path.isfile(self.model), "-e/--model",
                 "dN (N in 1-6, 12, 24, 36, 48) or an existing llm.c model_*.bin file", self.model)
        need(self.min_workers is None or 1 <= self.min_workers <= self.num_workers,
             "--min-workers", f"an integer in [1, --num-workers={self.num_workers}]", self.min_workers)
        for world in range(self.min_workers or self.num_workers, self.num_workers + 1):
            micro = self.batch_size * self.seq_len * world
            need(self.total_batch_size > 0 and self.total_batch_size % micro == 0,
                 "-d/--total-batch-size",
                 f"a positive multiple of B*T*world = {self.batch_size}*{self.seq_len}*{world}"
                 f" = {micro}", self.total_batch_size)
        need(bool(glob.glob(self.input_bin)), "-i/--input-bin",
             "a glob matching at least one llm.c token shard", self.input_bin)
        if self.input_val_bin:
            need(bool(glob.glob(self.input_val_bin)), "-j/--input-val-bin",
                 "a glob matching at least one llm.c token shard (or '' to turn validation off)",
                 self.input_val_bin)
        missing = tracking.check_installed(self)  # here, not in a worker after Ray has started
        if missing:
            raise ConfigError(missing)

    # ------------------------------------------------------------------ identity and overrides
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        d = dict(d)
        spike = SpikeConfig(**d.pop("spike", {}))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; expected some of {sorted(known)}")
        return cls(spike=spike, **d)

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

    def identity(self) -> dict:
        """The fields a checkpoint must agree on to be resumed (everything not in the allowlist)."""
        d = self.to_dict()
        return {k: v for k, v in d.items() if k not in RESUME_MUTABLE_FIELDS}

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()


def _visible_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:  # torch missing or broken CUDA: treat as no GPU, the caller says so
        return 0


# ---------------------------------------------------------------------- command line

# (short flag, long flag, field, type). llm.c's one- and two-letter flags keep llm.c's meaning.
_FLAGS = [
    ("-i", "--input-bin", "input_bin", str),
    ("-j", "--input-val-bin", "input_val_bin", str),
    ("-o", "--output-dir", "output_dir", str),
    ("-e", "--model", "model", str),
    ("-b", "--batch-size", "batch_size", int),
    ("-t", "--seq-len", "seq_len", int),
    ("-d", "--total-batch-size", "total_batch_size", int),
    ("-l", "--learning-rate", "learning_rate", float),
    ("-u", "--warmup-steps", "warmup_steps", int),
    ("-q", "--final-lr-frac", "final_lr_frac", float),
    ("-c", "--weight-decay", "weight_decay", float),
    ("-k", "--scheduler", "scheduler", str),
    ("-x", "--max-steps", "max_steps", int),
    ("-v", "--val-every", "val_every", int),
    ("-m", "--val-batches", "val_batches", int),
    ("-s", "--sample-every", "sample_every", int),
    ("-g", "--gen-tokens", "gen_tokens", int),
    ("-sl", "--skip-update-lossz", "skip_update_lossz", float),
    ("-sg", "--skip-update-gradz", "skip_update_gradz", float),
    ("-n", "--checkpoint-every", "checkpoint_every", int),
    ("-nk", "--checkpoints-keep", "checkpoints_keep", int),
    ("-nm", "--major-checkpoint-every", "major_checkpoint_every", int),
    ("-y", "--resume", "resume", int),
    ("-z", "--zero-stage", "zero_stage", int),
    (None, "--num-workers", "num_workers", int),
    (None, "--min-workers", "min_workers", int),
    (None, "--precision", "precision", str),
    (None, "--seed", "seed", int),
    (None, "--grad-clip", "grad_clip", float),
    (None, "--z-loss", "z_loss", float),
    (None, "--watch-every", "watch_every", int),
    (None, "--max-failures", "max_failures", int),
    (None, "--max-preemption-failures", "max_preemption_failures", int),
    (None, "--fault", "fault", str),
    (None, "--log-every", "log_every", int),
    (None, "--wandb", "wandb", str),
    (None, "--mlflow", "mlflow", str),
]
_SPIKE_FLAGS = [
    ("--spike-window", "window", int), ("--spike-min-history", "min_history", int),
    ("--spike-soft-z", "soft_z", float), ("--spike-hard-z", "hard_z", float),
    ("--spike-gnorm-mult", "gnorm_mult", float), ("--spike-max-consecutive", "max_consecutive", int),
    ("--spike-safety-steps", "safety_steps", int), ("--spike-max-rewinds", "max_rewinds", int),
    ("--spike-lr-decay", "lr_scale_decay", float), ("--spike-min-lr-scale", "min_lr_scale", float),
]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # a usage mistake is a ConfigError like any other bad value
        raise ConfigError(message)


def build_parser(prog: str = "raygpt") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Pretrain GPT-2 on Ray (llm.c's flags work too).",
                allow_abbrev=False)
    for short, long, dest, typ in _FLAGS:
        names = [n for n in (short, long) if n]
        p.add_argument(*names, dest=dest, type=typ, default=None, metavar=dest.upper())
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--cpu", dest="device", action="store_const", const="cpu")
    dev.add_argument("--gpu", dest="device", action="store_const", const="gpu")
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false", default=None)
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="start fresh over a run directory that already holds a run")
    p.add_argument("--compile", dest="compile", action="store_true", default=None)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--sync-checkpoint", dest="async_checkpoint", action="store_false", default=None)
    p.add_argument("--deterministic", action="store_true", default=None)
    p.add_argument("--record-samples", action="store_true", default=None,
                   help="record every step's sample ranges in loss_history.jsonl")
    p.add_argument("--spike", dest="spike_enabled", action="store_true", default=None,
                   help="turn the loss-spike monitor on")
    for long, dest, typ in _SPIKE_FLAGS:
        p.add_argument(long, dest="spike_" + dest, type=typ, default=None)
    p.add_argument("--config", default=None, help="a JSON file of TrainConfig fields (e.g. a sweep's best)")
    return p


def parse_args(argv: list[str] | None = None, base: TrainConfig | None = None) -> TrainConfig:
    """Parse the command line into an unresolved TrainConfig (call `.resolve()` next)."""
    ns = build_parser().parse_args(argv)
    cfg = base or TrainConfig()
    if ns.config:
        try:
            cfg = cfg.with_overrides(json.loads(Path(ns.config).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--config {ns.config}: expected a JSON object of config fields ({e})")
    overrides = {}
    for key, value in vars(ns).items():
        if value is None or key == "config":
            continue
        if key.startswith("spike_"):
            overrides["spike." + key[len("spike_"):]] = value
        else:
            overrides[key] = value
    return cfg.with_overrides(overrides)
