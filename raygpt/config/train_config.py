"""TrainConfig: one raygpt run, composed of the knobs each component declares where it lives
(data, model, optimizer, schedule, evaluation, checkpoints, the spike monitor, the run log, the
Ray seam, performance), each with its own resolve and validate; here only what crosses them:
`resolve()` runs the components' defaults in the order they depend on each other, `validate()`
their checks, and a checkpoint's identity (which fields may change on resume).

The fields stay one flat namespace (`cfg.batch_size`, `--batch-size`, a config file's keys), so
flags, files and stored configs are the same as before the components owned them."""


from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from raygpt.checkpointing.knobs import CheckpointConfig
from raygpt.config import eval_sets, mixture
from raygpt.config.errors import ConfigError
from raygpt.config.knobs import _typed
from raygpt.config.paths import output_dir_with_endpoint
from raygpt.data import fit
from raygpt.data.knobs import DataConfig
from raygpt.eval.knobs import EvalConfig
from raygpt.model.knobs import ModelConfig
from raygpt.ray.knobs import RayConfig
from raygpt.runlog.knobs import RunLogConfig
from raygpt.train.knobs import (OptimizerConfig, PerformanceConfig, ScheduleConfig, SpikeConfig,
                                SpikePolicy)


# Bases in reverse: a dataclass lists its bases' fields from the last base to the first, so the
# fields (--help, to_dict, a stored config.json) keep the order data, model, ..., performance.
@dataclass
class TrainConfig(PerformanceConfig, RayConfig, RunLogConfig, SpikePolicy, CheckpointConfig,
                  EvalConfig, ScheduleConfig, OptimizerConfig, ModelConfig, DataConfig):
    """One raygpt run. Defaults are the embedded Shakespeare job; `resolve()` fills the `None`s
    from the hardware (GPT-2 124M in bf16 on GPUs, a small fp32 model on 2 CPU workers)."""

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
        on_gpu = c.resolve_ray(gpus_available=gpus_available, cpus_available=cpus_available,
                               notes=notes)
        c.resolve_model(on_gpu=on_gpu)
        c.resolve_data(on_gpu=on_gpu, workers=c.num_workers, block_size=c.block_size(),
                       endpoint=c.storage_endpoint, notes=notes)
        c.resolve_optimizer(on_gpu=on_gpu, workers=c.num_workers)
        c.resolve_schedule(on_gpu=on_gpu)
        c.resolve_eval(endpoint=c.storage_endpoint)
        fit.fit_validation(c, notes)  # -m and --val-batch-size from -j's shards, B, T, workers
        c.resolve_checkpoint(on_gpu=on_gpu)
        c.resolve_performance(on_gpu=on_gpu, device=c.device)
        c.resolve_run_log()
        c.output_dir = output_dir_with_endpoint(c.output_dir, c.storage_endpoint,
                                                data=(*mixture.patterns(c.input_bin), c.input_val_bin,
                                                      *eval_sets.patterns(c.eval_set)))
        c.validate()
        return c

    def validate(self) -> None:
        """Raise ConfigError naming the first field whose value cannot be used: each component's
        checks, the run directory's first."""
        self.validate_run_log()
        self.validate_schedule()
        self.validate_ray()
        self.validate_model(device=self.device)
        self.validate_data(workers=self.world_sizes())
        self.validate_optimizer()
        self.validate_eval(validating=bool(self.input_val_bin))
        self.validate_checkpoint()
        self.validate_performance()
        self.spike.validate()

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
