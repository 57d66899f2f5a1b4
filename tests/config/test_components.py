"""TrainConfig is composed of the knobs each component declares in its own folder: every field
is declared where its section's owner lives, each component checks its own knobs without the
rest of the config, and the composition keeps the flat names, flags and field order."""

from __future__ import annotations

import dataclasses

import pytest

from raygpt.checkpointing.knobs import CheckpointConfig
from raygpt.config import ConfigError, TrainConfig
from raygpt.data.knobs import DataConfig
from raygpt.eval.knobs import EvalConfig
from raygpt.model.knobs import ModelConfig
from raygpt.ray.knobs import RayConfig
from raygpt.runlog.knobs import RunLogConfig
from raygpt.train.knobs import OptimizerConfig, PerformanceConfig, ScheduleConfig, SpikeConfig

# section -> the module that owns its knobs
OWNERS = {"data": "raygpt.data.knobs", "model": "raygpt.model.knobs",
          "optimizer": "raygpt.train.knobs", "schedule": "raygpt.train.knobs",
          "eval": "raygpt.eval.knobs", "checkpoint": "raygpt.checkpointing.knobs",
          "spike": "raygpt.train.knobs", "run": "raygpt.runlog.knobs", "ray": "raygpt.ray.knobs",
          "performance": "raygpt.train.knobs"}


def declaring_class(cls, name: str) -> type:
    """The class in `cls`'s MRO whose own body declares field `name`."""
    return next(k for k in cls.__mro__ if name in vars(k).get("__annotations__", {}))


def test_every_field_is_declared_by_the_component_that_owns_its_section():
    for f in dataclasses.fields(TrainConfig):
        owner = declaring_class(TrainConfig, f.name)
        assert owner.__module__ == OWNERS[f.metadata["section"]], (f.name, owner)
    assert TrainConfig.__dict__.get("__annotations__", {}) == {}  # the composition adds none


def test_the_fields_keep_their_order_from_data_to_performance():
    sections = [f.metadata["section"] for f in dataclasses.fields(TrainConfig)]
    firsts = list(dict.fromkeys(sections))
    assert firsts == list(OWNERS)
    assert sections == sorted(sections, key=firsts.index)  # each section's fields together


# (component, the other knobs its check reads, the knob, a bad value, a good one, the flag named)
BAD = [
    (DataConfig, dict(seq_len=64, total_batch_size=64), "batch_size", 0, 1, "-b/--batch-size"),
    (ModelConfig, dict(model="d4"), "precision", "fp16", "fp32", "--precision"),
    (OptimizerConfig, dict(zero_stage=0), "learning_rate", float("nan"), 1e-3, "-l/--learning-rate"),
    (ScheduleConfig, dict(warmup_steps=0, max_steps=10), "scheduler", "step", "wsd", "-k/--scheduler"),
    (EvalConfig, dict(val_batches=2, sample_every=0), "val_batch_size", 0, 1, "--val-batch-size"),
    (CheckpointConfig, dict(checkpoint_every=50), "checkpoints_keep", -1, 0, "-nk/--checkpoints-keep"),
    (RunLogConfig, {}, "output_dir", " ", "runs/x", "-o/--output-dir"),
    (RayConfig, dict(device="cpu", num_workers=2), "min_workers", 3, 2, "--min-workers"),
    (PerformanceConfig, dict(ce_chunk_rows=512), "sdpa_backend", "xformers", "raygpt", "--sdpa-backend"),
    (SpikeConfig, dict(hard_z=3.0), "soft_z", 9.0, 3.0, "--spike-soft-z/--spike-hard-z"),
]
VALIDATE = {DataConfig: lambda c: c.validate_data(workers=range(1, 2)),
            ModelConfig: lambda c: c.validate_model(device="cpu"),
            OptimizerConfig: lambda c: c.validate_optimizer(),
            ScheduleConfig: lambda c: c.validate_schedule(),
            EvalConfig: lambda c: c.validate_eval(validating=True),
            CheckpointConfig: lambda c: c.validate_checkpoint(),
            RunLogConfig: lambda c: c.validate_run_log(),
            RayConfig: lambda c: c.validate_ray(),
            PerformanceConfig: lambda c: c.validate_performance(),
            SpikeConfig: lambda c: c.validate()}


@pytest.mark.parametrize("cls,others,name,bad,good,flag", BAD, ids=[b[0].__name__ for b in BAD])
def test_each_component_checks_its_own_knobs_alone(cls, others, name, bad, good, flag):
    VALIDATE[cls](cls(**others, **{name: good}))  # the component alone, its knobs good: passes
    with pytest.raises(ConfigError) as e:
        VALIDATE[cls](cls(**others, **{name: bad}))
    assert str(e.value).startswith(f"{flag}: expected ")


@pytest.mark.parametrize("cls,others,name,bad,good,flag", BAD, ids=[b[0].__name__ for b in BAD])
def test_the_composition_runs_every_components_check(cls, others, name, bad, good, flag):
    base = TrainConfig(device="cpu").resolve(0, cpus_available=2)
    base.validate()
    if cls is SpikeConfig:
        cfg = dataclasses.replace(base, spike=SpikeConfig(**others, **{name: bad}))
    else:
        cfg = dataclasses.replace(base, **{name: bad})
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert str(e.value).startswith(f"{flag}: expected "), str(e.value)


def test_the_defaults_resolve_from_each_component_in_order():
    cfg = TrainConfig(device="cpu").resolve(0, cpus_available=2)
    # Ray's workers feed the data's batch, which feeds -d; the model's block size bounds T
    assert (cfg.num_workers, cfg.model, cfg.seq_len, cfg.batch_size) == (2, "d4", 64, 8)
    assert cfg.total_batch_size == 8 * 64 * 2
    assert (cfg.learning_rate, cfg.zero_stage, cfg.warmup_steps, cfg.max_steps) == (1e-3, 0, 10, 100)
    assert (cfg.checkpoint_every, cfg.compile, cfg.deterministic, cfg.ce_chunk_rows) == (50, False, False, 512)
    one = TrainConfig(device="cpu").resolve(0, cpus_available=1)
    assert (one.num_workers, one.total_batch_size) == (1, 8 * 64)
