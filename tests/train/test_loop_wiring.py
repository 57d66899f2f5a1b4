"""The loop's wiring against a hand-rolled reference (LocalSession, no Ray, a d2 model, CPU).

tests/train/test_loop_steps.py checks the step's decisions (agree, update, act_on, rewind...) with
stand-ins; this file checks what connects them in a real run: build_model, build_run,
forward_backward, evaluate, sample_text, _train's order of events, after_first_step, finish and
train()'s switches, handlers and error mapping. The reference run's every recorded figure (train
loss, grad norm, learning rate, samples, validation loss, sample text, watch metrics, the
checkpointed weights) is compared as floats with a loop written out here from the same
components (model, FlatParameters, AdamW, loaders, schedule), so a wiring change that alters
the numbers fails. bench/mutants.sh's `loop-wiring` target mutates the wiring functions against
this file (seconds a mutant).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._inductor  # noqa: F401  (what torch.use_deterministic_algorithms imports: once, here)

from raygpt.checkpointing import protocol as ck
from raygpt.data import tokenizer
from raygpt.data.loader import DistributedDataLoader, ranks_with_data, samples_to_ranges
from raygpt.data.sources import shard_token_counts
from raygpt.llmc.model_file import read_model_file_flat
from raygpt.llmc.state_file import read_state_file
from raygpt.model.gpt import GPT, GPTConfig
from raygpt.storage import open_run_dir
from raygpt.train import determinism, loop, loop_tasks, signals
from raygpt.train.optim import AdamW, FlatParameters, random_u32
from raygpt.train.schedule import learning_rate
from raygpt.train.session import LocalSession
from raygpt.train.state import TrainState
from tests.helpers import records, tiny_config

STEPS = 3
CLIP = 1.0  # a fresh d2 model's grad norms are 3-7: every reference step clips


def wiring_config(run_dir, **overrides):
    """Every wiring branch on at once: two micro-steps, validation, samples, watch metrics,
    recorded samples, checkpoints at 2 and 3, a z-loss, the reference loss implementation,
    deterministic switches."""
    base = dict(batch_size=2, seq_len=8, total_batch_size=32, max_steps=STEPS, val_every=2,
                val_batches=2, sample_every=2, gen_tokens=4, watch_every=1, record_samples=True,
                checkpoint_every=2, z_loss=1e-3, loss_impl="reference", grad_clip=CLIP,
                deterministic=True, warmup_steps=2)
    base.update(overrides)
    return tiny_config(run_dir, **base).resolve(0)


def session_for(run_dir, cls=LocalSession):
    return cls(open_run_dir(str(run_dir)), torch.device("cpu"))


class RecordingSession(LocalSession):
    """A LocalSession that keeps the metrics it is asked to report (Ray's report in a worker)."""

    def __init__(self, run_dir):
        super().__init__(open_run_dir(str(run_dir)), torch.device("cpu"))
        self.metrics = []

    def report_metrics(self, metrics):
        self.metrics.append(metrics)


@contextlib.contextmanager
def console_lines():
    """The reporter's console lines (its logger), as a list filled while the block runs."""
    console = logging.getLogger("raygpt.runlog.reporter")
    lines, handler, level = [], logging.Handler(logging.INFO), console.level
    handler.emit = lambda record: lines.append(record.getMessage())
    console.addHandler(handler)
    console.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        console.removeHandler(handler)
        console.setLevel(level)


# ---------------------------------------------------------------------- the hand-rolled reference


def reference_model(cfg):
    model = GPT(GPTConfig.from_depth(2), init_seed=cfg.seed)
    model.loss_impl = cfg.loss_impl
    return model


@torch.no_grad()
def reference_val_loss(model, cfg):
    loader = DistributedDataLoader(cfg.input_val_bin, cfg.val_batch_size, cfg.seq_len, 0, 1,
                                   shuffle=False, seed=cfg.seed)
    total, tokens = 0.0, 0
    for _ in range(cfg.val_batches):
        x, y = loader.next_batch(torch.device("cpu"))
        loss_sum, _ = model(x, y)
        total += float(loss_sum.double())
        tokens += y.numel()
    return total / tokens


@torch.no_grad()
def reference_sample(model, cfg, step):
    gen = torch.Generator().manual_seed(cfg.seed + step)
    idx = torch.full((1, 1), tokenizer.EOT, dtype=torch.long)
    out = model.generate(idx, cfg.gen_tokens, top_k=40, generator=gen)
    return tokenizer.decode(out[0, 1:].tolist())


def reference_run(cfg):
    """llm.c's loop written out: {step: figures} of train, val, sample, watch, and the final
    flat parameters."""
    model = reference_model(cfg)
    flat = FlatParameters(model, torch.device("cpu"), torch.float32)
    opt = AdamW(flat, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                weight_decay=cfg.weight_decay)
    loader = DistributedDataLoader(cfg.input_bin, cfg.batch_size, cfg.seq_len, 0, 1,
                                   shuffle=cfg.shuffle, seed=cfg.seed)
    accum = cfg.total_batch_size // (cfg.batch_size * cfg.seq_len)
    rng = TrainState.fresh(cfg).rng_state
    out = {"train": {}, "val": {}, "sample": {}, "watch": {}, "params": {}}
    clipped = 0
    for step in range(STEPS + 1):
        if step % cfg.val_every == 0 or step == STEPS:
            model.eval()
            out["val"][step] = reference_val_loss(model, cfg)
            model.train()
        if step > 0 and (step % cfg.sample_every == 0 or step == STEPS):
            model.eval()
            out["sample"][step] = reference_sample(model, cfg, step)
            model.train()
        out["params"][step] = flat.params[:flat.num_parameters].clone()
        if step == STEPS:
            break
        flat.zero_grad()
        loss_sum, samples = torch.zeros(()), []
        for _ in range(accum):
            x, y = loader.next_batch(torch.device("cpu"))
            samples.append(loader.last_global_samples)
            ls, zs = model(x, y, z_loss=cfg.z_loss)
            ((ls + zs) / cfg.total_batch_size).backward()
            loss_sum += ls.detach()
        # the loop's agreement vector is float32: the loss and the squared norm pass through it
        agreed = torch.tensor([float(loss_sum), float(opt.grad_norm_squared())],
                              dtype=torch.float32).tolist()
        loss, norm = agreed[0] / cfg.total_batch_size, math.sqrt(agreed[1])
        lr = learning_rate(cfg.scheduler, step, peak_lr=cfg.learning_rate,
                           warmup_steps=cfg.warmup_steps, total_steps=STEPS,
                           final_lr_frac=cfg.final_lr_frac)
        before = flat.params[:flat.num_parameters].clone()
        seed, rng = random_u32(rng)
        opt.step(lr=lr, grad_scale=CLIP / norm if norm > CLIP else 1.0, t=step + 1, seed=seed)
        clipped += norm > CLIP
        out["train"][step] = dict(loss=loss, norm=norm, lr=lr, tokens=(step + 1) * cfg.total_batch_size,
                                  samples=samples_to_ranges(np.concatenate(samples)))
        if (step + 1) % cfg.watch_every == 0:
            out["watch"][step] = loop_tasks.watch_metrics(flat, before, model.last_max_logit,
                                                    clipped / cfg.watch_every)
            clipped = 0
    return out


def checkpoint_params(run_dir, step):
    """The checkpoint's weights (its model file) as a flat float32 array, and its state file."""
    rd = open_run_dir(str(run_dir))
    n = ck.read_manifest(rd, step)["num_parameters"]
    _, params = read_model_file_flat(rd.read_bytes(f"{ck.step_dir(step)}/{ck.model_file(step)}"))
    sf = read_state_file(rd.read_bytes(f"{ck.step_dir(step)}/{ck.state_file(step, 0)}"),
                         num_parameters=n)
    return params.numpy(), sf


def history(run_dir, kind):
    return [r for r in records(run_dir) if r["kind"] == kind]


def switches():
    return (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


@contextlib.contextmanager
def caller_switches(values):
    # the session's own switches come back afterwards through the loop's restorer (what
    # train() itself is checked to do, by the switches compared in the reference test)
    with determinism.torch_settings_restored():
        torch.use_deterministic_algorithms(values[0], warn_only=values[1])
        torch.utils.deterministic.fill_uninitialized_memory = values[2]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = values[3:]
        yield


# the caller's switches before the reference run: each differs from what a deterministic run sets
CALLER = (False, True, True, False, False)


@pytest.fixture(scope="module")
def wired(tmp_path_factory):
    """The reference run through raygpt.train.loop.train, recording what the wiring hands around."""
    run_dir = tmp_path_factory.mktemp("wired")
    cfg = wiring_config(run_dir)
    seen = {"gc": [], "appends": [], "during": None, "cublas": None}
    session = RecordingSession(run_dir)
    appends = session.run_dir.background_appends

    def recording_appends(enabled):
        seen["appends"].append(enabled)
        return appends(enabled=enabled)

    session.run_dir.background_appends = recording_appends
    with pytest.MonkeyPatch.context() as mp, caller_switches(CALLER), console_lines() as lines:
        mp.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        for name in ("collect", "freeze", "unfreeze"):
            real = getattr(gc, name)
            mp.setattr(gc, name, lambda *a, _n=name, _f=real: (seen["gc"].append(_n), _f(*a))[1])
        build_run = loop.build_run

        def recording_build_run(*args):
            seen["during"] = switches()
            seen["cublas"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            return build_run(*args)

        mp.setattr(loop, "build_run", recording_build_run)
        # the device each part is handed (on a GPU, None would put it on the CPU)
        seen["devices"] = []
        for name, at in (("evaluate", 3), ("sample_text", 2)):  # as the loop's tasks call them
            real = getattr(loop_tasks, name)
            mp.setattr(loop_tasks, name, lambda *a, _n=name, _i=at, _f=real: (
                seen["devices"].append((_n, a[_i])), _f(*a))[1])
        summary = loop.train(cfg, session)
        seen["after"] = switches()
        seen["freeze_count"] = gc.get_freeze_count()
    seen["console"] = "\n".join(lines)
    seen["metrics"] = session.metrics
    return dict(cfg=cfg, run_dir=run_dir, summary=summary, seen=seen, ref=reference_run(cfg))


# ---------------------------------------------------------------------- the reference run


def check_each_step_trains_as_the_reference_loop(wired):
    ref = wired["ref"]["train"]
    recs = history(wired["run_dir"], "train")
    assert [r["step"] for r in recs] == list(range(STEPS))
    for r in recs:
        want = ref[r["step"]]
        assert r["loss"] == want["loss"], r["step"]
        assert r["norm"] == want["norm"], r["step"]
        assert r["lr"] == want["lr"], r["step"]
        assert r["tokens"] == want["tokens"]
        assert r["samples"] == [list(s) for s in want["samples"]]
        assert r["verdict"] == "ok" and r["world"] == 1
    assert all(want["norm"] > CLIP for want in ref.values())  # the premise: every step clips


def check_validation_and_samples_at_their_steps_with_the_reference_values(wired):
    ref = wired["ref"]
    vals = history(wired["run_dir"], "val")
    assert {r["step"]: r["val_loss"] for r in vals} == ref["val"]
    assert [r["step"] for r in vals] == [0, 2, 3]
    samples = [json.loads(line) for line in
               (Path(wired["run_dir"]) / "samples.jsonl").read_text().splitlines()]
    assert {s["step"]: s["text"] for s in samples} == ref["sample"]
    assert [s["step"] for s in samples] == [2, 3]


def check_watch_metrics_every_watch_every_steps(wired):
    ref = wired["ref"]["watch"]
    watches = history(wired["run_dir"], "watch")
    assert [w["step"] for w in watches] == [0, 1, 2]
    for w in watches:
        want = ref[w["step"]]
        assert w["clipped_frac"] == want["clipped_frac"] == 1.0
        assert w["max_logit"] == want["max_logit"]
        assert w["update_ratio"] == want["update_ratio"]


def check_checkpoints_hold_the_reference_weights(wired):
    ref = wired["ref"]
    rd = open_run_dir(str(wired["run_dir"]))
    assert ck.list_checkpoint_steps(rd) == [2, 3]
    for step in (2, 3):
        params, sf = checkpoint_params(wired["run_dir"], step)
        assert np.array_equal(params, ref["params"][step].numpy()), step
        assert sf.step == step


def check_the_summary_and_the_end_record(wired):
    s, ref = wired["summary"], wired["ref"]
    assert s["step"] == STEPS and s["max_steps"] == STEPS
    assert s["val_loss"] == ref["val"][STEPS]
    assert s["stopped_early"] is False and s["skips"] == 0 and s["rewinds"] == 0
    assert s["checkpoints_written"] == 2 and len(s["checkpoint_write_s"]) == 2
    assert [st for st, _ in s["checkpoint_stalls"]] == [2, 3]
    assert s["checkpoint_stall_s"] == pytest.approx(sum(t for _, t in s["checkpoint_stalls"]))
    # validation is reported to the surroundings (Ray) with the run's skip and rewind counts
    assert [m for m in wired["seen"]["metrics"] if "val_loss" in m] == [
        {"step": st, "val_loss": v, "skips": 0, "rewinds": 0} for st, v in ref["val"].items()]
    assert s["checkpoint_load_s"] == 0.0 and s["attempt"] == 1 and s["peak_memory_gib"] is None
    assert 0 < s["elapsed_s"] < 600
    [end] = history(wired["run_dir"], "end")
    assert end["step"] == STEPS and end["val_loss"] == s["val_loss"]
    [start] = history(wired["run_dir"], "start")
    assert start["resumed_from"] is None and start["max_steps"] == STEPS
    marks = start["startup"]
    assert set(marks) == {"restore_started", "state_loaded", "load_s", "load_from", "setup"}
    assert marks["restore_started"] <= marks["state_loaded"] and marks["load_s"] == 0.0
    assert marks["load_from"] == []  # a fresh start loads nothing
    assert {"model_built", "loader_built", "fingerprints"} <= set(marks["setup"])
    log = wired["seen"]["console"]
    assert "| 1 x cpu | fp32 | B=2 T=8 grad_accum=2 | 32 tokens/step | 3 steps | attempt 1" in log
    assert "raygpt | done at step 3/3" in log
    assert "torch.compile" not in log


def check_train_sets_the_run_switches_and_hands_the_callers_back(wired):
    seen = wired["seen"]
    # during the run (build_run is called after the switches are set)
    assert seen["during"] == (True, False, False, True, True)
    assert seen["cublas"] == ":4096:8"
    assert seen["after"] == CALLER
    assert seen["appends"] == [True]  # rank 0's appends go to the writer thread
    cpu = torch.device("cpu")
    assert seen["devices"] == [("evaluate", cpu), ("evaluate", cpu), ("sample_text", cpu),
                               ("evaluate", cpu), ("sample_text", cpu)]


def check_the_collector_is_frozen_after_the_first_step_and_unfrozen_at_the_end(wired):
    assert wired["seen"]["gc"] == ["collect", "freeze", "unfreeze"]
    assert wired["seen"]["freeze_count"] == 0


def test_the_run_is_the_reference_loop(wired):
    """One test for every check of the reference run: mutmut maps a function to the tests that
    called it, and only the test whose setup ran the module's fixture is mapped to the run's
    functions, so the checks of that one run live in one test."""
    check_each_step_trains_as_the_reference_loop(wired)
    check_validation_and_samples_at_their_steps_with_the_reference_values(wired)
    check_watch_metrics_every_watch_every_steps(wired)
    check_checkpoints_hold_the_reference_weights(wired)
    check_the_summary_and_the_end_record(wired)
    check_train_sets_the_run_switches_and_hands_the_callers_back(wired)
    check_the_collector_is_frozen_after_the_first_step_and_unfrozen_at_the_end(wired)


# ---------------------------------------------------------------------- resume


def test_a_resumed_run_continues_as_the_reference(wired, tmp_path):
    """From the step-2 checkpoint: build_run restores weights, loader position and state; the
    checkpoint it resumed from is not written again; step 2 trains as the reference."""
    run_dir = tmp_path / "resumed"
    shutil.copytree(wired["run_dir"], run_dir)
    shutil.rmtree(run_dir / ck.step_dir(3))
    cfg = wired["cfg"].with_overrides({"output_dir": str(run_dir), "resume": 1})
    with console_lines() as lines:
        summary = loop.train(cfg, session_for(run_dir))
    assert "attempt 2 | resumed from step 2" in lines[0]
    ref = wired["ref"]
    recs = [r for r in history(run_dir, "train") if r["attempt"] == 2]
    assert [r["step"] for r in recs] == [2]
    for r in recs:
        assert (r["loss"], r["norm"], r["lr"]) == tuple(ref["train"][r["step"]][k]
                                                        for k in ("loss", "norm", "lr"))
        assert r["samples"] == [list(s) for s in ref["train"][r["step"]]["samples"]]
    assert summary["checkpoints_written"] == 1 and summary["attempt"] == 2
    assert summary["checkpoint_load_s"] > 0
    [start] = [r for r in history(run_dir, "resume") if r["attempt"] == 2]
    assert start["resumed_from"] == 2 and start["step"] == 2
    assert np.array_equal(checkpoint_params(run_dir, 3)[0], ref["params"][3].numpy())


# ---------------------------------------------------------------------- build_run, build_model


def test_build_run_builds_what_the_config_says(tmp_path):
    cfg = wiring_config(tmp_path, fault="nan:rank=0,step=1", checkpoint_minutes=2.5,
                        weight_decay=0.05, beta1=0.8, beta2=0.9, eps=1e-6, shuffle=False,
                        seed=7)
    with contextlib.ExitStack() as on_exit, signals.handlers_restored():
        r = loop.build_run(cfg, session_for(tmp_path), on_exit)
        ref = reference_model(cfg)
        assert all(torch.equal(a, b) for a, b in zip(r.model.state_dict().values(),
                                                      ref.state_dict().values()))
        assert r.forward is r.model and r.compiled is None and r.model.training
        assert r.flat.params.dtype == torch.float32 and r.flat.params.device.type == "cpu"
        assert r.flat.num_parameters == sum(p.numel() for p in ref.parameters())
        o = r.opt
        assert (o.beta1, o.beta2, o.eps, o.weight_decay) == (0.8, 0.9, 1e-6, 0.05)
        assert (o.rank, o.world, o.zero_stage) == (0, 1, cfg.zero_stage)
        assert o.flat is r.flat
        tl = r.train_loader
        assert (tl.pattern, tl.B, tl.T, tl.rank, tl.world, tl.should_shuffle, tl.seed) == (
            cfg.input_bin, 2, 8, 0, 1, False, 7)
        vl = r.task("val").loader
        assert (vl.pattern, vl.B, vl.T, vl.rank, vl.world, vl.should_shuffle, vl.seed) == (
            cfg.input_val_bin, cfg.val_batch_size, 8, 0, 1, False, 7)
        assert r.max_steps == STEPS and r.micro.grad_accum == 2 and r.micro.tokens_per_step == 32
        assert r.ckpt.loaded_step is None and r.state.step == 0
        assert r.state.rng_state == TrainState.fresh(cfg).rng_state
        assert r.micro.faults.nan_now(1) and not r.micro.faults.nan_now(0)
        assert r.task("drill").faults is r.micro.faults is r.agreement.faults
        assert r.agreement.save_clock.interval_s == 150.0
        assert r.task("checkpoint").save_clock is r.agreement.save_clock
        assert r.ckpt.max_steps == STEPS  # the WSD decay point in every manifest's retention
        assert not r.agreement.flags.stop_requested() and not r.agreement.flags.take_save_request()
        assert r.agreement.vector.dtype == torch.float32
        assert r.agreement.vector.tolist() == [0.0] * loop.NUM_SLOTS
        assert r.ckpt.rank == 0 and r.ckpt.world == 1 and r.ckpt.flat is r.flat
        assert r.runlog.max_steps == STEPS and r.session.rank == 0 and r.cfg is cfg
        assert r.stop_requested is False and math.isnan(r.val_loss)


def test_gpt2_init_is_drawn_once_and_only_when_no_checkpoint_is_loaded(wired, tmp_path,
                                                                       monkeypatch):
    """A run that may resume (-y 1, or a Ray restart) builds its model without an init and
    draws GPT-2's only when the restore found nothing: then its working weights and bf16
    masters equal a -y 0 run's bit for bit. A resume draws no init (a restarted GPU worker
    saved 2-4 s of its start-up)."""
    calls = []
    real = GPT.init_gpt2
    monkeypatch.setattr(GPT, "init_gpt2", lambda self, seed: (calls.append(seed), real(self, seed)))
    built = {}
    for resume in (0, 1):
        cfg = dataclasses.replace(wiring_config(tmp_path / f"y{resume}", resume=resume, seed=5),
                                  precision="bf16")
        with contextlib.ExitStack() as on_exit, signals.handlers_restored():
            r = loop.build_run(cfg, session_for(cfg.output_dir), on_exit)
            assert r.ckpt.loaded_step is None
            built[resume] = (r.flat.params.clone(), r.opt.master.clone())
    assert calls == [5, 5]
    assert torch.equal(built[0][0], built[1][0]) and torch.equal(built[0][1], built[1][1])
    calls.clear()
    run_dir = tmp_path / "resumed"
    shutil.copytree(wired["run_dir"], run_dir)
    cfg = wired["cfg"].with_overrides({"output_dir": str(run_dir), "resume": 1})
    with contextlib.ExitStack() as on_exit, signals.handlers_restored():
        r = loop.build_run(cfg, session_for(run_dir), on_exit)
        assert r.ckpt.loaded_step == STEPS and calls == []
        assert np.array_equal(r.flat.params[:r.flat.num_parameters].numpy(),
                              checkpoint_params(run_dir, STEPS)[0])


def test_build_run_without_validation_or_max_steps(tmp_path):
    """No validation loader when validation is off (val_every 0 or no val files); max_steps
    below 1 means one epoch of the training data."""
    for overrides in ({"val_every": 0}, {"input_val_bin": ""}):
        cfg = wiring_config(tmp_path / str(len(overrides)), max_steps=-1, **overrides)
        with contextlib.ExitStack() as on_exit, signals.handlers_restored():
            r = loop.build_run(cfg, session_for(cfg.output_dir), on_exit)
            assert r.task("val").loader is None
            assert r.max_steps == r.train_loader.tokens_per_epoch // 32 > STEPS
            assert type(r.max_steps) is int
    cfg = wiring_config(tmp_path / "one", max_steps=1)
    with contextlib.ExitStack() as on_exit, signals.handlers_restored():
        assert loop.build_run(cfg, session_for(cfg.output_dir), on_exit).max_steps == 1


def test_a_bf16_run_keeps_bf16_working_weights(tmp_path):
    # the config refuses bf16 on a CPU (slow): changed after its checks, as the bf16 CPU tests do
    cfg = dataclasses.replace(wiring_config(tmp_path), precision="bf16")
    with contextlib.ExitStack() as on_exit, signals.handlers_restored():
        r = loop.build_run(cfg, session_for(tmp_path), on_exit)
        assert r.flat.params.dtype == torch.bfloat16 and r.opt.use_master_weights


def test_build_model_takes_the_performance_fields(tmp_path, monkeypatch):
    asked = []
    kernels_for = loop.kernels_for
    monkeypatch.setattr(loop, "kernels_for",
                        lambda *a, **kw: (asked.append((a, kw)), kernels_for(*a, **kw))[1])
    cfg = wiring_config(tmp_path, loss_impl="fused", ce_kernel=False, ce_chunk_rows=123,
                        sdpa_backend="flash", embedding_impl="raygpt", seed=11, recompute=2)
    model = loop.build_model(cfg, torch.device("cpu"))
    # the kernel choice is asked with the run's deterministic mode and the device's type (on a
    # GPU, deterministic picks raygpt's kernels for "auto")
    assert asked == [((True, "cpu"), {"sdpa_backend": "flash", "embedding_impl": "raygpt"})]
    assert (model.loss_impl, model.ce_kernel, model.ce_chunk_rows) == ("fused", False, 123)
    assert model.recompute == 2
    assert {b.attn.sdpa_backend for b in model.transformer.h} == {"flash"}
    assert model.embedding_impl == "raygpt"
    ref = GPT(GPTConfig.from_depth(2), init_seed=11)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  ref.state_dict().values()))
    # "auto" on a CPU is the default kernels, deterministic or not
    auto = loop.build_model(wiring_config(tmp_path, sdpa_backend="auto"), torch.device("cpu"))
    assert {b.attn.sdpa_backend for b in auto.transformer.h} == {"default"}
    assert auto.embedding_impl == "torch"


def test_build_model_loads_a_model_file(tmp_path):
    from raygpt.llmc.model_file import write_model_file
    src = GPT(GPTConfig.from_depth(2), init_seed=5)
    path = tmp_path / "m.bin"
    write_model_file(str(path), src)
    cfg = wiring_config(tmp_path, model=str(path))
    assert cfg.depth is None
    model = loop.build_model(cfg, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  src.state_dict().values()))
    assert model.loss_impl == "reference"


def test_build_val_loader_feeds_only_the_ranks_with_data(tmp_path):
    cfg = wiring_config(tmp_path, val_batch_size=4)
    vl = loop.build_val_loader(cfg, 1, 2)
    assert (vl.rank, vl.world, vl.B, vl.T) == (1, 2, 4, 8)
    # a world larger than the validation set's batches: the ranks past it sit validation out
    big = 10 ** 6
    val_world = ranks_with_data([n for _, n in shard_token_counts(cfg.input_val_bin)], 4, 8, big)
    assert 1 <= val_world < big
    assert loop.build_val_loader(cfg, val_world, big) is None
    assert loop.build_val_loader(cfg, val_world - 1, big).world == val_world


# ---------------------------------------------------------------------- evaluate, sample_text


def test_evaluate_is_the_mean_over_the_same_batches_each_time(tmp_path):
    cfg = wiring_config(tmp_path, val_batches=3)
    model = reference_model(cfg)
    vl = loop.build_val_loader(cfg, 0, 1)
    first = loop.evaluate(model, vl, cfg, torch.device("cpu"), 1)
    assert model.training
    assert first == reference_val_loss(model, cfg)
    assert loop.evaluate(model, vl, cfg, torch.device("cpu"), 1) == first
    # a rank without validation data adds nothing: 0 / 0
    assert math.isnan(loop.evaluate(model, None, cfg, torch.device("cpu"), 1))


def test_sample_text_is_seeded_by_the_step(tmp_path):
    cfg = wiring_config(tmp_path, gen_tokens=6)
    model = reference_model(cfg)
    text = loop_tasks.sample_text(model, cfg, torch.device("cpu"), 3)
    assert model.training
    assert text == reference_sample(model, cfg, 3)
    assert len(tokenizer.encode(text)) >= 1


# ---------------------------------------------------------------------- train()'s error mapping


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_non_deterministic_op_is_a_config_error_only_in_deterministic_mode(
        tmp_path, monkeypatch, deterministic):
    message = f"aten::foo_out {determinism.NOT_DETERMINISTIC}. You can turn off ..."
    unfrozen = []

    def failing(*args):
        raise RuntimeError(message)

    monkeypatch.setattr(loop, "_train", failing)
    monkeypatch.setattr(gc, "unfreeze", lambda: unfrozen.append(1))
    cfg = wiring_config(tmp_path, deterministic=deterministic, gc_freeze=deterministic)
    with pytest.raises(Exception) as err:
        loop.train(cfg, session_for(tmp_path))
    if deterministic:
        assert isinstance(err.value, determinism.NonDeterministicOp) and err.value.op == "aten::foo_out"
        assert unfrozen == [1]
    else:
        assert type(err.value) is RuntimeError and str(err.value) == message
        assert unfrozen == []


# ---------------------------------------------------------------------- the step's other paths


class PollingSession(LocalSession):
    """A LocalSession whose poll (one a step, in the agreement) asks for a save at step 0 and
    sends this process a real SIGTERM at step 1; it records the metrics it is given."""

    def __init__(self, run_dir):
        super().__init__(run_dir, torch.device("cpu"))
        self.polls, self.metrics = 0, []

    def poll_requests(self):
        self.polls += 1
        if self.polls == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # raygpt's handler: a flag, read in the same step
        return False, self.polls == 1

    def report_metrics(self, metrics):
        self.metrics.append(metrics)


def test_a_save_request_and_a_sigterm_checkpoint_and_stop(tmp_path, monkeypatch):
    """A save asked for at step 0 is written at step 1 (no periodic checkpoint is due), the
    SIGTERM of step 1 checkpoints step 2 and stops there; the flags are cleared at the end and
    the caller's SIGTERM handler is back. The save clock restarts at each checkpoint."""
    saved = []
    monkeypatch.setattr(signals.SaveClock, "saved", lambda self: saved.append(1))
    cfg = wiring_config(tmp_path, max_steps=6, checkpoint_every=1000, val_every=0, sample_every=0,
                        watch_every=0, record_samples=False, gc_freeze=False)
    caller = signal.getsignal(signal.SIGTERM)
    session = PollingSession(open_run_dir(str(tmp_path)))
    summary = loop.train(cfg, session)
    assert signal.getsignal(signal.SIGTERM) is caller
    assert not signals.watch().stop_requested()
    signal.signal(signal.SIGTERM, caller)
    assert ck.list_checkpoint_steps(open_run_dir(str(tmp_path))) == [1, 2]
    assert summary["step"] == 2 and summary["stopped_early"] is True
    assert summary["checkpoints_written"] == 2 and len(saved) == 2
    assert [r["step"] for r in history(tmp_path, "train")] == [0, 1]
    assert all("samples" not in r for r in history(tmp_path, "train"))  # record_samples off
    assert session.polls == 2
    # every trained step is reported (metrics_interval_s 0), with the loss the history has
    train = {r["step"]: r for r in history(tmp_path, "train")}
    assert [(m["step"], m["train_loss"], m["lr"], m["grad_norm"]) for m in session.metrics] == [
        (s, train[s]["loss"], train[s]["lr"], train[s]["norm"]) for s in (0, 1)]


def test_lr_scale_scales_the_rate_and_a_nan_step_is_skipped(tmp_path, monkeypatch):
    """A state whose ledger holds lr_scale 0.5 trains at half the schedule's rate (the rate
    AdamW is given); a NaN loss (the fault plan, in the micro-step) skips the update."""
    from raygpt.train import optim
    used = []
    update = optim.ops.adamw_update
    monkeypatch.setattr(optim.ops, "adamw_update",
                        lambda *a, lr, **kw: (used.append(lr), update(*a, lr=lr, **kw))[1])
    fresh = loop.TrainState.fresh

    def halved(cfg):
        state = fresh(cfg)
        state.ledger.lr_scale = 0.5
        return state

    monkeypatch.setattr(loop.TrainState, "fresh", halved)
    cfg = wiring_config(tmp_path, max_steps=3, checkpoint_every=1000, val_every=0,
                        sample_every=0, watch_every=3, fault="nan:rank=0,step=1",
                        allow_fault_injection=True)
    summary = loop.train(cfg, session_for(tmp_path))
    sched = [learning_rate(cfg.scheduler, s, peak_lr=cfg.learning_rate,
                           warmup_steps=cfg.warmup_steps, total_steps=3,
                           final_lr_frac=cfg.final_lr_frac) for s in range(3)]
    assert used == [0.5 * sched[0], 0.5 * sched[2]]
    recs = history(tmp_path, "train")
    assert [r["lr"] for r in recs] == [0.5 * s for s in sched]
    assert [r["verdict"] for r in recs] == ["ok", "skip", "ok"] and math.isnan(recs[1]["loss"])
    assert summary["skips"] == 1 and [r["step"] for r in history(tmp_path, "skip")] == [1]
    # one watch, after 3 steps: 2 of them clipped (a skipped step's NaN norm clips nothing)
    [watch] = history(tmp_path, "watch")
    assert watch["step"] == 2 and watch["clipped_frac"] == 2 / 3
    assert recs[0]["norm"] > CLIP and recs[2]["norm"] > CLIP
    # the fault plan knows the run directory: the injection is recorded there
    assert (tmp_path / "faults" / "nan_r0_s1").exists()


def test_an_injected_fault_strikes_before_its_steps_update(tmp_path):
    from raygpt.train.faults import InjectedFault
    cfg = wiring_config(tmp_path, max_steps=3, checkpoint_every=1000, val_every=0,
                        sample_every=0, watch_every=0, fault="raise:rank=0,step=1",
                        allow_fault_injection=True)
    with pytest.raises(InjectedFault):
        loop.train(cfg, session_for(tmp_path))
    assert [r["step"] for r in history(tmp_path, "train")] == [0]


def test_a_spike_rewinds_to_the_checkpoint_before_it(tmp_path):
    """Under the spike policy a NaN step rewinds: the run goes back to the newest checkpoint
    before it and trains on from there (the rewind recorded, its checkpoint not written again)."""
    from raygpt.config import SpikeConfig
    cfg = wiring_config(tmp_path, max_steps=3, checkpoint_every=1, val_every=0, sample_every=0,
                        watch_every=0, fault="nan:rank=0,step=2", allow_fault_injection=True,
                        spike=SpikeConfig(enabled=True, min_history=4, window=8, safety_steps=1))
    summary = loop.train(cfg, session_for(tmp_path))
    [rw] = history(tmp_path, "rewind")
    assert rw["step"] == 2 and rw["to_step"] == 1 and rw["lr_scale"] == 1.0
    assert "at step 2" in rw["reason"]  # the detector was told the step it judged
    # each step's time is its own duration: positive, and within the run's wall time
    assert all(0 < r["dt"] < summary["elapsed_s"] for r in history(tmp_path, "train"))
    assert [r["step"] for r in history(tmp_path, "train")] == [0, 1, 1, 2]
    assert summary["rewinds"] == 1 and summary["step"] == 3 and summary["skips"] == 0
    # 1, 2, then after the rewind to 1 (not written again) 2 of the new trajectory and 3
    assert summary["checkpoints_written"] == 4


def test_a_compiled_run_trains_through_the_compiled_forward(tmp_path, monkeypatch):
    """torch.compile (a stand-in here: compiling on a CPU takes minutes) wraps the model with
    static shapes in the configured mode; validation and training call the wrapper, the first
    step stores the compiled graphs beside the run, and the console says it compiles."""
    compiled, calls, stored, made = [], [], [], []

    class Compiled(torch.nn.Module):  # like torch.compile's wrapper: a module around the model
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *a, **k):
            calls.append("train" if self.training else "eval")
            return self.model(*a, **k)

    def fake_compile(model, **kw):
        compiled.append(kw)
        return Compiled(model)

    class FakeCache:
        @classmethod
        def for_run(cls, cfg, session):
            made.append((cfg, session))
            return cls()

        def save_if_new(self, run_dir):
            stored.append(run_dir)

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(loop, "CompileCache", FakeCache)
    cfg = dataclasses.replace(wiring_config(tmp_path, max_steps=2, checkpoint_every=1000,
                                            val_every=1, sample_every=0, watch_every=0),
                              compile=True, compile_mode="max-autotune-no-cudagraphs")
    session = session_for(tmp_path)
    with console_lines() as lines:
        loop.train(cfg, session)
    assert made == [(cfg, session)]
    assert compiled == [{"mode": "max-autotune-no-cudagraphs", "dynamic": False}]
    # validation at 0, 1, 2 (val_batches 2 each) and two steps of two micro-steps
    assert calls == ["eval"] * 2 + ["train"] * 2 + ["eval"] * 2 + ["train"] * 2 + ["eval"] * 2
    assert stored == [session.run_dir]
    assert any("torch.compile: compiling" in line for line in lines)
    # the start-up marks of a compiled run: the compiler's imports joined, then its cache ready
    [start] = history(tmp_path, "start")
    setup = start["startup"]["setup"]
    assert setup["loader_built"] <= setup["compiler_imported"] <= setup["compile_cache_ready"]


def test_compile_scope_blocks_compiles_each_block_and_keeps_the_model(monkeypatch):
    """--compile-scope blocks: torch.compile (a recording stand-in) once per block, in the
    configured mode with static shapes; the model itself is the forward, the rest eager."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    model = GPT(GPTConfig.from_depth(2, block_size=8), init_seed=None)
    assert loop.compile_model(model, "default", "blocks") is model
    assert compiled == [{"mode": "default", "dynamic": False}] * 2
    x = torch.zeros(1, 4, dtype=torch.long)
    assert model(x, x)[0].isfinite()  # the blocks run through the (stand-in) compiled calls


def test_build_run_as_rank_1_of_3(tmp_path, monkeypatch):
    """What a second rank of three builds (the process group's broadcast stood in for: the test is one
    process): no GPT-2 init of its own (rank 0's is broadcast), padded flat buffers, its loader shard, its ZeRO-1 optimizer shard, and no save
    clock of its own (only rank 0's wall clock may ask for a checkpoint), and with
    --overlap-comm the gradient reduction overlapped with backward and the gather with forward."""
    broadcasts, inits = [], []
    monkeypatch.setattr(loop.dist, "broadcast", lambda t, src: broadcasts.append((t, src)))
    monkeypatch.setattr(loop.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(GPT, "init_gpt2", lambda self, seed: inits.append(seed))

    class Rank1(LocalSession):
        rank, world = 1, 3

    cfg = wiring_config(tmp_path, checkpoint_minutes=2.5, zero_stage=1, num_workers=3,
                        total_batch_size=96, overlap_comm=True)
    with contextlib.ExitStack() as on_exit, signals.handlers_restored():
        r = loop.build_run(cfg, Rank1(open_run_dir(str(tmp_path)), torch.device("cpu")), on_exit)
        assert [(t is r.flat.params, src) for t, src in broadcasts] == [(True, 0)]
        assert inits == []  # rank 0's init arrives by that broadcast: none drawn here
        assert r.flat.num_parameters % 3 != 0 and r.flat.params.numel() % 3 == 0  # padded
        assert (r.opt.rank, r.opt.world, r.opt.zero_stage) == (1, 3, 1)
        assert (r.train_loader.rank, r.train_loader.world) == (1, 3)
        assert (r.task("val").loader.rank, r.task("val").loader.world) == (1, 3)
        assert r.agreement.save_clock.interval_s == 0.0 and r.micro.grad_accum == 2
        assert r.opt.overlap is not None and len(r.opt.overlap.buckets) == 2  # d2: 1 + embeddings
        # and ZeRO-1's gather overlapped with the forward, waited for per unit: embeddings,
        # 2 blocks, ln_f
        assert r.opt.gather is not None and len(r.opt.gather.pieces) == 4


def test_finish_reports_the_peak_memory_of_a_gpu(monkeypatch):
    """finish() on a CUDA device (stand-ins for the run's parts: no GPU here) reports the
    allocator's high-water mark in GiB; the summary is what the reporter's end record gets."""
    from types import SimpleNamespace as NS
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device: 3 * 2**29 if device == torch.device("cuda", 0) else None)
    ended, finished = [], []
    ckpt = NS(finish=lambda: finished.append(1), stall_seconds=0.5, stalls=[(4, 0.5)],
              write_seconds=[0.25, 0.5], load_seconds=0.125, waits=[(8, 0.75)],
              timeline=[{"step": 4, "saved": 1.0}])
    r = NS(state=NS(step=4, skips=1, ledger=NS(rewinds=2)), ckpt=ckpt, max_steps=5,
           session=NS(device=torch.device("cuda", 0)), val_loss=3.5,
           runlog=NS(attempt=3, end=ended.append))
    summary = loop.finish(r.state, r.ckpt, r.runlog, 12.0, max_steps=r.max_steps,
                          val_loss=r.val_loss, device=r.session.device)
    assert summary == {"step": 4, "max_steps": 5, "val_loss": 3.5, "stopped_early": True,
                       "skips": 1, "rewinds": 2, "elapsed_s": 12.0, "checkpoint_stall_s": 0.5,
                       "checkpoint_stalls": [(4, 0.5)], "checkpoints_written": 2,
                       "checkpoint_write_s": [0.25, 0.5], "checkpoint_load_s": 0.125,
                       "checkpoint_waits": [(8, 0.75)],
                       "checkpoint_timeline": [{"step": 4, "saved": 1.0}],
                       "attempt": 3, "peak_memory_gib": 1.5}
    assert ended == [summary] and finished == [1]
