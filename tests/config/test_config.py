"""The config and its command line: llm.c's flags, long options, resolution from the hardware,
and a clear error naming the flag for every bad value, before anything starts."""

import json

import pytest

from raygpt import config
from raygpt.config import ConfigError, TrainConfig, absolute_paths, parse_args


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


def test_gpu_runs_are_deterministic_unless_turned_off():
    """Bit-exact resumes are the GPU default (raygpt's deterministic kernels cost under 1%);
    CPU kernels are deterministic without strict mode; either way the flags win."""
    assert TrainConfig().resolve(gpus_available=2).deterministic is True
    assert TrainConfig().resolve(gpus_available=0).deterministic is False
    assert parse_args(["--no-deterministic"]).resolve(gpus_available=2).deterministic is False
    assert parse_args(["--deterministic"]).resolve(gpus_available=0).deterministic is True


def test_zero1_is_the_default_with_more_than_one_gpu_worker_and_z0_still_wins():
    assert TrainConfig().resolve(gpus_available=8).zero_stage == 1
    assert TrainConfig().resolve(gpus_available=1).zero_stage == 0
    assert TrainConfig(num_workers=1).resolve(gpus_available=8).zero_stage == 0
    assert TrainConfig().resolve(gpus_available=0).zero_stage == 0  # CPU workers: replicated
    assert parse_args(["-z", "0"]).resolve(gpus_available=2).zero_stage == 0
    assert parse_args(["-z", "1", "--cpu"]).resolve(gpus_available=0).zero_stage == 1


@pytest.mark.parametrize("argv, gpus, overlap", [
    (["--no-compile"], 2, True),  # backward lands each layer's gradients as it goes
    ([], 2, False),  # the whole-model compile lands them all at its end: nothing to overlap
    (["--compile-scope", "blocks"], 2, True),
    ([], 0, False),  # CPU: mostly wte, which lands last; the staging copies cost more
    (["--overlap-comm"], 0, True), (["--no-overlap-comm", "--no-compile"], 2, False)])
def test_overlap_comm_is_on_by_default_where_backward_lands_gradients_layer_by_layer(
        argv, gpus, overlap):
    assert parse_args(argv).resolve(gpus_available=gpus).overlap_comm is overlap


def test_compile_scope_is_model_or_blocks():
    with pytest.raises(ConfigError, match="--compile-scope"):
        parse_args(["--compile-scope", "layers"])


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
    (["-m", "0"], "-m/--val-batches"),
    (["--val-batch-size", "0"], "--val-batch-size"),
])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(ConfigError) as e:
        parse_args(argv).resolve(gpus_available=0)
    assert str(e.value).startswith(flag), str(e.value)
    assert "expected" in str(e.value)


def test_unknown_flag_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^--no-such-flag: expected a flag of raygpt train, "
                                          r"found an unknown one \(raygpt train --help lists"):
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
    b = a.with_overrides({"max_steps": 999, "val_every": 3, "num_workers": 1, "output_dir": "x",
                          "val_batches": 1, "val_batch_size": 2})
    c = a.with_overrides({"learning_rate": 1.0})
    assert a.hash() == b.hash() and a.hash() != c.hash()


# ---------------------------------------------------------------------- --help from the docstrings

def test_every_field_has_a_flag_whose_help_shows_its_default():
    import dataclasses

    from raygpt.config import SpikeConfig, build_parser, field_docs

    parser = build_parser()
    by_dest = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, []).append(action)
    fields = [(f, f.name) for f in dataclasses.fields(TrainConfig) if f.name != "spike"]
    fields += [(f, "spike_" + f.name) for f in dataclasses.fields(SpikeConfig)]
    for f, dest in fields:
        actions = by_dest.get(dest)
        assert actions, f"field {f.name}: no flag"
        help_text = " ".join(a.help or "" for a in actions)
        assert help_text.strip(), f"field {f.name}: empty help"
        assert "default" in help_text.lower(), f"field {f.name}: help shows no default: {help_text!r}"
    docs = field_docs(TrainConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(TrainConfig)}, "a field has no docstring"
    text = parser.format_help()
    # llm.c's short flag beside the long one, choices listed, exit codes documented
    for pair in ("-i GLOB, --input-bin GLOB", "-x INT, --max-steps INT", "-sl FLOAT, --skip-update-lossz",
                 "-nk INT, --checkpoints-keep", "-k {cosine,linear,constant,wsd}, --scheduler"):
        assert pair in text, pair
    assert "(default: 20)" in text and "(default: 1337)" in text  # -v and --seed
    for code in ("0  finished", "1  failed", "2  bad input", "3  stopped early"):
        assert code in text


def test_help_follows_the_docstring(monkeypatch):
    """The help is the docstring: change a docstring, the help changes with it."""
    import raygpt.config as config

    real = config.field_docs

    def edited(cls):
        docs = real(cls)
        if cls is TrainConfig:
            docs["seed"] = "A seed for everything random."
        return docs

    monkeypatch.setattr(config.command_line, "field_docs", edited)
    assert "A seed for everything random. (default: 1337)" in " ".join(
        config.build_parser().format_help().split())


def test_usage_errors_name_the_flag_and_what_was_expected():
    for argv, start in ((["-k", "cos"], "-k/--scheduler: expected one of"),
                        (["-b", "two"], "-b/--batch-size: expected an integer, found 'two'"),
                        (["-y", "3"], "-y/--resume: expected one of 0, 1, found 3")):
        with pytest.raises(ConfigError) as e:
            parse_args(argv)
        assert str(e.value).startswith(start), str(e.value)


# ---------------------------------------------------------------------- defaults fit the data

def _loaders_build(cfg, world):
    """Every rank's train and validation loader for `world` workers, as the loop builds them;
    returns (distinct validation samples one evaluation reads, samples it reads)."""
    from raygpt.data.loader import DistributedDataLoader
    from raygpt.train.loop import build_val_loader

    seen, val_ranks, reads = set(), 0, 0
    for rank in range(world):
        DistributedDataLoader(cfg.input_bin, cfg.batch_size, cfg.seq_len, rank, world,
                              shuffle=cfg.shuffle, seed=cfg.seed)
        val = build_val_loader(cfg, rank, world)
        if val is None:
            continue
        val_ranks += 1
        for _ in range(cfg.val_batches):
            val.next_batch()
            rows = val.last_global_samples[rank * val.B:(rank + 1) * val.B]
            seen.update(map(tuple, rows.tolist()))
            reads += len(rows)
    assert val_ranks >= 1
    return seen, reads


def test_default_job_resolves_and_its_loaders_build_on_1_to_64_gpus_and_on_cpus():
    """The bundled Shakespeare job on every GPU count from 1 to 64 and on CPUs: B, the global
    batch and the validation batches adapt, and every rank's loaders can be built (headers only;
    nothing trains). Each evaluation reads distinct samples, as many as its batches hold."""
    from raygpt.data.sources import shard_token_counts

    val_samples = sum((n - 1) // 1024 for _, n in shard_token_counts(TrainConfig().input_val_bin))
    for gpus in [0, *range(1, 65)]:
        notes = []
        cfg = TrainConfig().resolve(gpus_available=gpus, notes=notes)
        world = cfg.num_workers
        assert world == (gpus or 2)
        assert cfg.total_batch_size == cfg.batch_size * cfg.seq_len * world
        assert cfg.resolve(gpus_available=gpus) == cfg  # resolving again changes nothing
        seen, reads = _loaders_build(cfg, world)
        assert len(seen) == reads  # no sample twice
        if gpus:
            assert cfg.batch_size == min(16, (305260 - 1) // (1024 * world))
            assert (cfg.batch_size < 16) == any(n.startswith("B=") for n in notes)
            assert reads >= val_samples - 1, (gpus, reads)  # 30 or 31 of the 31 samples
        else:
            assert (cfg.batch_size, cfg.val_batch_size, cfg.val_batches, notes) == (8, 8, 20, [])


def test_explicit_values_are_kept_and_only_the_validation_batch_adapts():
    """-b 64 -t 1024 on one GPU: B stays 64 (the train shard holds it), validation reads the
    31 samples the validation shard has in one batch of 31 instead of failing."""
    cfg = parse_args(["-b", "64", "-t", "1024"]).resolve(gpus_available=1)
    assert (cfg.batch_size, cfg.seq_len, cfg.val_batch_size, cfg.val_batches) == (64, 1024, 31, 1)
    assert _loaders_build(cfg, 1) == ({(0, i) for i in range(31)}, 31)
    cfg = parse_args(["-m", "5", "--val-batch-size", "4"]).resolve(gpus_available=2)
    assert (cfg.val_batches, cfg.val_batch_size) == (5, 4)


# ---------------------------------------------------------------------- sections and resumes

def test_every_field_is_in_a_section_and_help_groups_the_flags_by_it():
    import dataclasses

    from raygpt.config import SECTION_TITLES, SpikeConfig, build_parser

    for cls in (TrainConfig, SpikeConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("section") in SECTION_TITLES, f"{cls.__name__}.{f.name}"
    groups = {g.title: {a.dest for a in g._group_actions} for g in build_parser()._action_groups}
    perf = groups[SECTION_TITLES["performance"]]
    assert {"prefetch_batches", "gc_freeze", "compile_mode", "loss_impl", "ce_kernel",
            "ce_chunk_rows", "sdpa_backend", "embedding_impl", "preemption_poll_steps", "compile",
            "deterministic"} <= perf
    assert "spike_soft_z" in groups[SECTION_TITLES["spike"]]
    assert TrainConfig.section_fields("schedule") == ["scheduler", "warmup_steps", "final_lr_frac",
                                                      "max_steps"]


def test_performance_switches_are_flags_and_may_change_on_resume():
    from raygpt.config import RESUME_MUTABLE_FIELDS

    cfg = parse_args(["--no-prefetch", "--no-gc-freeze", "--compile-mode", "reduce-overhead",
                      "--loss-impl", "reference", "--no-ce-kernel", "--preemption-poll-steps", "1",
                      "--ce-chunk-rows", "4096", "--sdpa-backend", "cudnn",
                      "--embedding-impl", "raygpt", "-r", "2"])
    assert (cfg.prefetch_batches, cfg.gc_freeze, cfg.ce_kernel) == (False, False, False)
    assert (cfg.compile_mode, cfg.loss_impl, cfg.preemption_poll_steps) == (
        "reduce-overhead", "reference", 1)
    assert (cfg.ce_chunk_rows, cfg.sdpa_backend, cfg.embedding_impl) == (4096, "cudnn", "raygpt")
    assert cfg.recompute == 2 and TrainConfig().recompute == 0
    assert set(TrainConfig.section_fields("performance")) <= RESUME_MUTABLE_FIELDS
    assert TrainConfig().identity() == cfg.identity()  # a checkpoint resumes with any of them
    resolved = TrainConfig(device="cpu").resolve(0)
    with pytest.raises(ConfigError, match=r"--loss-impl: expected fused \| reference, found 'fast'"):
        resolved.with_overrides({"loss_impl": "fast"}).validate()
    # every performance field with choices is checked (a config file is not argparse-checked)
    with pytest.raises(ConfigError, match=r"--sdpa-backend: expected auto \| default \| cudnn"):
        resolved.with_overrides({"sdpa_backend": "xformers"}).validate()
    with pytest.raises(ConfigError, match=r"--embedding-impl: expected auto \| torch \| raygpt"):
        resolved.with_overrides({"embedding_impl": "sparse"}).validate()
    with pytest.raises(ConfigError, match=r"--recompute: expected 0 \| 1 \| 2, found 3"):
        resolved.with_overrides({"recompute": 3}).validate()
    with pytest.raises(ConfigError, match=r"--ce-chunk-rows: expected an integer >= 1, found 0"):
        resolved.with_overrides({"ce_chunk_rows": 0}).validate()


def test_a_config_written_before_the_sections_still_resumes():
    """tests/assets/config_before_sections.json: what raygpt wrote before TrainConfig had
    sections and performance fields (config.json's config, and a checkpoint MANIFEST's identity
    and hash). The same run configured today must be the same identity, or -y 1 would refuse
    every checkpoint written before (checkpoint.check_compatible compares exactly these); and
    `raygpt status` must not list the new fields as changed between the two launches."""
    from pathlib import Path

    from raygpt.runlog.run_config import config_changes, with_defaults

    asset = json.loads((Path(__file__).parent / "assets" / "config_before_sections.json").read_text())
    old = asset["config_json_config"]
    assert "prefetch_batches" not in old  # really the old layout
    cfg = TrainConfig.from_dict(old)
    assert cfg.identity() == asset["manifest_config_identity"]
    assert cfg.hash() == asset["manifest_config_hash"]
    today = cfg.with_overrides({"resume": 1}).to_dict()
    assert config_changes(with_defaults(old), with_defaults(today)) == ["resume: 0 -> 1"]


def test_absolute_paths_makes_every_local_path_the_users_and_leaves_the_rest(tmp_path, monkeypatch):
    """The driver's working directory is the user's; a Ray worker's is not (see
    tests/ray_seam/test_driver.py for the run)."""
    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(parse_args(["-i", "d/train_*.bin", "-j", "d/val.bin", "-o", "runs/a",
                                     "-e", "models/gpt2.bin"]))
    assert (cfg.input_bin, cfg.input_val_bin, cfg.output_dir, cfg.model) == (
        f"{tmp_path}/d/train_*.bin", f"{tmp_path}/d/val.bin", f"{tmp_path}/runs/a",
        f"{tmp_path}/models/gpt2.bin")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = absolute_paths(parse_args(["-i", "~/d/*.bin", "-o", "~/runs/b"]))
    assert (home.input_bin, home.output_dir) == (f"{tmp_path}/home/d/*.bin", f"{tmp_path}/home/runs/b")
    kept = absolute_paths(parse_args(["-j", "", "-o", "s3://bucket/run", "-e", "d4"]))
    assert (kept.input_val_bin, kept.output_dir, kept.model) == ("", "s3://bucket/run", "d4")
    assert kept.input_bin == TrainConfig().input_bin  # the bundled shards: absolute already


def test_cpu_default_workers_fit_the_machine():
    """Two CPU workers by default, one where the Ray has a single CPU (with a note saying so)."""
    notes = []
    one = TrainConfig(device="cpu").resolve(notes=notes, cpus_available=1)
    assert one.num_workers == 1 and one.total_batch_size == one.batch_size * one.seq_len
    assert notes[0].startswith("workers=1 (not 2): the Ray this run uses has 1 CPU"), notes
    assert TrainConfig(device="cpu").resolve(cpus_available=16).num_workers == 2
    assert TrainConfig(device="cpu").resolve().num_workers == 2  # the Ray's CPUs not known
    assert TrainConfig(device="cpu", num_workers=3).resolve(cpus_available=1).num_workers == 3


def test_as_command_puts_what_a_config_file_may_not_hold_on_the_command_line(tmp_path):
    """A launcher's split of a config (bench/fault_campaign.py, the Ctrl-C tests): the file
    passes read_config_file's rule, and file + flags parse back to the same config."""
    from raygpt.config import CONFIG_FILE_FORBIDDEN, as_command, parse_args
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), resume=1, overwrite=True,
                      fault="kill:rank=0,step=3", allow_fault_injection=True,
                      storage_endpoint="http://127.0.0.1:9000", mlflow="sqlite:///m.db",
                      learning_rate=3e-4)
    fields, flags = as_command(cfg)
    assert not set(fields) & set(CONFIG_FILE_FORBIDDEN)
    f = tmp_path / "c.json"
    f.write_text(json.dumps(fields))
    assert parse_args(["--config", str(f), *flags]) == cfg
    fields, flags = as_command(TrainConfig(output_dir="r"))
    assert flags == ["-o", "r", "-y", "0"]


# ---------------------------------------------------------------- what a file may set (knob)

# Every field that names a place this run writes or caches in, a server, or that arms or deletes:
# a --config file, a sweep's sweep.json or a stored search space may set none of them.
REFUSED_FROM_FILES = {"output_dir": "runs/x", "overwrite": True, "resume": 1, "fault": "kill:step=1",
                      "allow_fault_injection": True, "storage_endpoint": "http://evil:9000",
                      "mlflow": "http://evil:5000", "wandb": "project", "shard_cache_dir": "/home/u"}


@pytest.mark.parametrize("field", sorted(REFUSED_FROM_FILES))
def test_a_config_file_may_not_set_a_place_a_server_or_a_switch_that_arms(tmp_path, field):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"seed": 7, field: REFUSED_FROM_FILES[field]}))
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(path)])
    flag = config.flag_of(field)
    assert str(e.value).startswith(f"--config {path}: may not set ['{field}']")
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_what_a_file_may_set_is_each_knobs_declaration():
    """The rule behind the list: a free text field is refused unless its knob says from_file=True
    (a new one is refused until someone decides); numbers, switches and closed choices are not."""
    import dataclasses
    assert sorted(config.FILE_REFUSED) == sorted(REFUSED_FROM_FILES)

    @dataclasses.dataclass
    class Probe:
        text: str = config.knob("", section="run")
        data: str = config.knob("", section="data", from_file=True)
        arms: bool = config.knob(False, section="run", from_file=False)
        kind: str = config.knob("a", section="run", choices=("a", "b"))
        rate: float = config.knob(1.0, section="optimizer")

    allowed = {f.name: config.knobs._from_file(f) for f in dataclasses.fields(Probe)}
    assert allowed == {"text": False, "data": True, "arms": False, "kind": True, "rate": True}


@pytest.mark.parametrize("field", ["input_bin", "input_val_bin", "hellaswag", "model"])
@pytest.mark.parametrize("uri", ["s3://b/x_*.bin?endpoint_override=evil:80&scheme=http",
                                 "s3://b/x_*.bin?region=eu-west-1", "s3://AK:SE@b/x_*.bin",
                                 "gs://b/x_*.bin?endpoint_override=evil:80&scheme=http"])
def test_a_uri_from_a_file_names_a_place_and_not_its_server(tmp_path, field, uri):
    """The credentials go where a URI's options point: only the command line and the environment
    may give them (issue 53: a config file's -i sent the user's keys to another host)."""
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({field: uri}))
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(path)])
    message = str(e.value)
    assert message.startswith(f"--config {path}: {field}: expected a plain URI or path")
    assert "--storage-endpoint" in message and "\n" not in message
    assert "SE" not in message.split("found", 1)[1].split("with", 1)[0]  # credentials redacted
    # the same URI on the command line is the user's own to give
    flag = {"input_bin": "-i", "input_val_bin": "-j", "hellaswag": "--hellaswag", "model": "-e"}[field]
    assert getattr(parse_args([flag, uri]), field) == uri


def test_a_plain_uri_and_a_local_path_from_a_file_are_data(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"input_bin": "s3://b/fw/fw_train_*.bin",
                                "input_val_bin": str(tmp_path / "val_*.bin"),
                                "hellaswag": "gs://b/hellaswag_val.jsonl"}))
    cfg = parse_args(["--config", str(path)])
    assert cfg.input_bin == "s3://b/fw/fw_train_*.bin" and cfg.hellaswag.startswith("gs://")


def test_as_command_keeps_a_uris_options_on_the_command_line(tmp_path):
    """A launcher's split of a config whose shards carry their endpoint (resolve() writes it into
    the URI): the URI goes as a flag, the file holds only what a file may, and the two parse back
    to the same config."""
    cfg = TrainConfig(input_bin="s3://b/x_*.bin?endpoint_override=h:1&scheme=http",
                      shard_cache_dir="/fast/cache", wandb="proj", seed=5)
    fields, flags = config.as_command(cfg)
    assert "input_bin" not in fields and "shard_cache_dir" not in fields and "wandb" not in fields
    assert flags[flags.index("--input-bin") + 1] == cfg.input_bin
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(fields))
    assert parse_args(["--config", str(path), *flags]) == cfg


def test_a_config_read_back_from_a_directory_is_held_to_the_same_rule():
    base = TrainConfig().to_dict()
    for changed, match in (({"shard_cache_dir": "/home/u"}, "shard_cache_dir: expected ''"),
                           ({"wandb": "p"}, "wandb: expected ''"),
                           ({"input_val_bin": "s3://b/v_*.bin?endpoint_override=evil:1"},
                            "input_val_bin: expected a plain URI or path")):
        with pytest.raises(ConfigError, match=match):
            config.config_read_back({**base, **changed}, "sweep.json: base")
    stored = config.stored_fields({**base, "input_bin": "s3://AK:SE@b/x_*.bin?endpoint_override=h:1"})
    assert stored["input_bin"] == "s3://b/x_*.bin"
    assert config.config_read_back(stored, "sweep.json: base").input_bin == "s3://b/x_*.bin"


def test_a_stored_trials_override_may_not_carry_a_uris_options():
    from raygpt.ray.trials import check_trials
    trials = [{"name": "trial_000", "overrides": {"input_bin": "s3://b/x?endpoint_override=evil:1"}}]
    with pytest.raises(ConfigError, match=r"trials\[0\] \(trial_000\): overrides: input_bin: "
                                          r"expected a plain URI"):
        check_trials(TrainConfig(), trials, "sweep.json: trials")
    for key in ("shard_cache_dir", "wandb"):
        with pytest.raises(ConfigError, match=f"search space key '{key}'"):
            check_trials(TrainConfig(), [{"name": "trial_000", "overrides": {key: "x"}}], "t")
