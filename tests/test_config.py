"""The config and its command line: llm.c's flags, long options, resolution from the hardware,
and a clear error naming the flag for every bad value, before anything starts."""

import json

import pytest

from raygpt.config import ConfigError, TrainConfig, parse_args


def test_llmc_short_flags_keep_llmc_meanings():
    cfg = parse_args(["-i", "a*.bin", "-j", "", "-o", "out", "-e", "d2", "-b", "4", "-t", "32",
                      "-d", "256", "-l", "3e-4", "-u", "5", "-q", "0.0", "-c", "0.1", "-k", "wsd",
                      "-x", "100", "-v", "10", "-m", "3", "-s", "7", "-g", "16", "-sl", "5",
                      "-sg", "6", "-n", "20", "-nk", "2", "-nm", "40", "-y", "1", "-z", "1"])
    assert (cfg.input_bin, cfg.input_val_bin, cfg.output_dir, cfg.model) == ("a*.bin", "", "out", "d2")
    assert (cfg.batch_size, cfg.seq_len, cfg.total_batch_size) == (4, 32, 256)
    assert (cfg.learning_rate, cfg.warmup_steps, cfg.final_lr_frac, cfg.weight_decay) == (3e-4, 5, 0.0, 0.1)
    assert (cfg.scheduler, cfg.max_steps, cfg.val_every, cfg.val_batches) == ("wsd", 100, 10, 3)
    assert (cfg.sample_every, cfg.gen_tokens, cfg.skip_update_lossz, cfg.skip_update_gradz) == (7, 16, 5, 6)
    assert (cfg.checkpoint_every, cfg.checkpoints_keep, cfg.major_checkpoint_every) == (20, 2, 40)
    assert (cfg.resume, cfg.zero_stage) == (1, 1)


def test_long_options_and_spike_knobs():
    cfg = parse_args(["--cpu", "--num-workers", "3", "--seed", "7", "--spike", "--spike-soft-z",
                      "4.5", "--no-shuffle", "--overwrite"])
    assert cfg.device == "cpu" and cfg.num_workers == 3 and cfg.seed == 7
    assert cfg.spike.enabled and cfg.spike.soft_z == 4.5 and not cfg.shuffle and cfg.overwrite


def test_resolve_fills_cpu_and_gpu_defaults():
    cpu = TrainConfig().resolve(gpus_available=0)
    assert (cpu.device, cpu.model, cpu.precision, cpu.num_workers) == ("cpu", "d4", "fp32", 2)
    assert cpu.total_batch_size == cpu.batch_size * cpu.seq_len * 2
    gpu = TrainConfig().resolve(gpus_available=8)
    assert (gpu.device, gpu.model, gpu.precision, gpu.num_workers, gpu.compile) == ("gpu", "d12", "bf16", 8, True)


@pytest.mark.parametrize("argv, flag", [
    (["-k", "cosine_with_restarts"], "-k/--scheduler"),
    (["-d", "1000"], "-d/--total-batch-size"),
    (["-t", "2048"], "-t/--seq-len"),
    (["-l", "-1"], "-l/--learning-rate"),
    (["-q", "1.5"], "-q/--final-lr-frac"),
    (["-e", "d7"], "-e/--model"),
    (["-e", "missing_model.bin"], "-e/--model"),
    (["-i", "/nonexistent/*.bin"], "-i/--input-bin"),
    (["-y", "2"], "-y/--resume"),
    (["--precision", "bf16", "--cpu"], "--precision"),
    (["--spike-soft-z", "30"], "--spike-soft-z/--spike-hard-z"),
    (["--min-workers", "3"], "--min-workers"),
])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(ConfigError) as e:
        parse_args(argv).resolve(gpus_available=0)
    assert str(e.value).startswith(flag), str(e.value)
    assert "expected" in str(e.value)


def test_unknown_flag_is_a_config_error():
    with pytest.raises(ConfigError, match="unrecognized arguments"):
        parse_args(["--no-such-flag"])


def test_gpu_requested_without_one():
    with pytest.raises(ConfigError, match="no GPU is visible"):
        parse_args(["--gpu"]).resolve(gpus_available=0)


def test_overrides_reach_nested_fields_and_reject_unknown_ones(tmp_path):
    cfg = TrainConfig().with_overrides({"scheduler": "wsd", "spike.hard_z": 30.0})
    assert cfg.scheduler == "wsd" and cfg.spike.hard_z == 30.0
    with pytest.raises(ConfigError, match="unknown config field 'lr'"):
        TrainConfig().with_overrides({"lr": 1.0})
    best = tmp_path / "best.json"
    best.write_text(json.dumps({"learning_rate": 2e-3, "scheduler": "linear"}))
    cfg = parse_args(["--config", str(best), "-x", "5"])
    assert (cfg.learning_rate, cfg.scheduler, cfg.max_steps) == (2e-3, "linear", 5)


def test_identity_leaves_out_what_may_change_on_resume():
    a = TrainConfig().resolve(0)
    b = a.with_overrides({"max_steps": 999, "val_every": 3, "num_workers": 1, "output_dir": "x"})
    c = a.with_overrides({"learning_rate": 1.0})
    assert a.hash() == b.hash() and a.hash() != c.hash()
