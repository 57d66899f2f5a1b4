"""The training loop without Ray (LocalSession): exact resume, skips, signals, the audit."""


import shutil

import numpy as np
import pytest
import torch

from raygpt.checkpointing import protocol as ck
from raygpt.config import DEFAULT_TRAIN, DEFAULT_VAL, ConfigError
from raygpt.config.preflight import check_resume
from raygpt.llmc.state_file import read_state_file, write_state_file
from raygpt.storage import open_run_dir
from raygpt.train.faults import InjectedFault
from raygpt.train.loop import train
from raygpt.train.session import LocalSession
from tests.helpers import records, tiny_config, train_losses


def run_local(cfg):
    return train(cfg.resolve(0), LocalSession(open_run_dir(cfg.output_dir), torch.device("cpu")))


def state_arrays(run_dir, step, num_parameters):
    rd = open_run_dir(str(run_dir))
    sf = read_state_file(rd.read_bytes(f"{ck.step_dir(step)}/{ck.state_file(step, 0)}"),
                         num_parameters=num_parameters)
    model = rd.read_bytes(f"{ck.step_dir(step)}/{ck.model_file(step)}")
    return sf, model


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    cfg = tiny_config(run_dir, total_batch_size=4 * 32 * 2)  # grad accumulation 2, shuffled
    summary = run_local(cfg)
    return run_dir, cfg, summary


def test_resume_after_crash_is_bit_exact(uninterrupted, tmp_path):
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "crashed"
    # checkpoint 4 written inline: the crash at step 6 must find it complete, which an async
    # write still in flight on a loaded machine need not be (the losses do not depend on it)
    crashed = cfg.with_overrides({"output_dir": str(run_dir), "fault": "raise:rank=0,step=6",
                                  "async_checkpoint": False})
    with pytest.raises(InjectedFault):
        run_local(crashed)
    assert ck.list_checkpoint_steps(open_run_dir(str(run_dir))) == [4]
    summary = run_local(crashed.with_overrides({"resume": 1}))  # the fault fired once already
    assert summary["step"] == 12
    full, resumed = train_losses(full_dir), train_losses(run_dir, attempt=2)
    assert sorted(resumed) == list(range(4, 12))
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)  # equal as floats
    # final weights and optimizer state equal bit for bit
    sf_a, model_a = state_arrays(full_dir, 12, summary_params(full_dir))
    sf_b, model_b = state_arrays(run_dir, 12, summary_params(full_dir))
    assert model_a == model_b
    assert np.array_equal(sf_a.m, sf_b.m) and np.array_equal(sf_a.v, sf_b.v)
    audit = [r for r in records(run_dir) if r["kind"] == "audit"]
    assert audit and "verified bit-exact over 2 steps" in audit[0]["message"]


def test_recompute_levels_train_and_resume_with_the_same_losses(uninterrupted, tmp_path):
    """--recompute changes memory, not the function: a run at -r 1 crashes at step 6 and
    resumes at -r 2 (a checkpoint resumes with another level), and every loss of both attempts
    equals the uninterrupted -r 0 run's as a float, as do the final weights."""
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "recomputed"
    crashed = cfg.with_overrides({"output_dir": str(run_dir), "fault": "raise:rank=0,step=6",
                                  "async_checkpoint": False, "recompute": 1})
    with pytest.raises(InjectedFault):
        run_local(crashed)
    resumed_cfg = crashed.with_overrides({"resume": 1, "recompute": 2})
    assert check_resume(resumed_cfg.resolve(0)) == ["resume: step 4"]
    assert run_local(resumed_cfg)["step"] == 12
    full = train_losses(full_dir)
    first, resumed = train_losses(run_dir, attempt=1), train_losses(run_dir, attempt=2)
    assert sorted(first) == list(range(6)) and sorted(resumed) == list(range(4, 12))
    assert all(first[s] == full[s] for s in first), (first, full)  # -r 1, equal as floats
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)  # -r 2
    assert state_arrays(run_dir, 12, summary_params(full_dir))[1] == \
        state_arrays(full_dir, 12, summary_params(full_dir))[1]


def test_a_run_resumes_where_its_shards_moved_but_not_onto_other_bytes(uninterrupted, tmp_path):
    """Shards are identified by their bytes, not their path: a moved checkout (the bundled data's
    default path moves with it), another mount point or Ray's working_dir puts the same files
    elsewhere, and -y 1 from there resumes with the uninterrupted run's losses. Validation
    shards with other bytes at the new path are refused, before Ray and in the loop."""
    full_dir, cfg, _ = uninterrupted
    old, new = tmp_path / "old_checkout", tmp_path / "new_checkout"
    old.mkdir()
    for path in (DEFAULT_TRAIN, DEFAULT_VAL):
        shutil.copy(path, old)
    at = lambda d: {"input_bin": str(d / "tiny_shakespeare_train.bin"),  # noqa: E731
                    "input_val_bin": str(d / "tiny_shakespeare_val.bin")}
    run_dir = tmp_path / "run"
    crashed = cfg.with_overrides({"output_dir": str(run_dir), "fault": "raise:rank=0,step=6",
                                  "async_checkpoint": False, **at(old)})
    with pytest.raises(InjectedFault):
        run_local(crashed)
    old.rename(new)
    moved = crashed.with_overrides({"resume": 1, **at(new)})
    assert check_resume(moved.resolve(0)) == ["resume: step 4"]
    summary = run_local(moved)
    assert summary["step"] == 12
    full, resumed = train_losses(full_dir), train_losses(run_dir, attempt=2)
    assert sorted(resumed) == list(range(4, 12))
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)  # equal as floats
    # the same names at the new path, other validation bytes: refused, naming the hash
    val = new / "tiny_shakespeare_val.bin"
    data = val.read_bytes()
    swapped = data[:-4] + data[-2:] + data[-4:-2]  # the last two tokens swapped: same size
    assert swapped != data
    val.write_bytes(swapped)
    with pytest.raises(ConfigError, match=r"val_data_hash: checkpoint '[0-9a-f]+', this run"):
        check_resume(moved.resolve(0))
    with pytest.raises(ck.CheckpointError, match="val_data_hash"):
        run_local(moved)


def test_a_run_from_a_model_file_resumes_where_the_file_moved_but_not_from_another(tmp_path):
    """-e FILE is compared by the file's bytes (checkpointing.fingerprints.model_source), not by
    its path: the same file elsewhere resumes with the uninterrupted run's losses; another model
    there is refused."""
    from raygpt.llmc.model_file import write_model_file
    from raygpt.model.gpt import GPT, GPTConfig

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    write_model_file(str(old / "m.bin"), GPT(GPTConfig.from_depth(2), init_seed=5))
    base = tiny_config(tmp_path / "full", model=str(old / "m.bin"), max_steps=8)
    run_local(base)
    run_dir = tmp_path / "run"
    crashed = base.with_overrides({"output_dir": str(run_dir), "fault": "raise:rank=0,step=6",
                                   "async_checkpoint": False})
    with pytest.raises(InjectedFault):
        run_local(crashed)
    old.rename(new)
    moved = crashed.with_overrides({"resume": 1, "model": str(new / "m.bin")})
    assert check_resume(moved.resolve(0)) == ["resume: step 4"]
    assert run_local(moved)["step"] == 8
    full, resumed = train_losses(tmp_path / "full"), train_losses(run_dir, attempt=2)
    assert sorted(resumed) == list(range(4, 8))
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)
    write_model_file(str(new / "m.bin"), GPT(GPTConfig.from_depth(2), init_seed=6))
    with pytest.raises(ConfigError, match=r"model_source: checkpoint 'llm.c model file"):
        check_resume(moved.resolve(0))


def summary_params(run_dir):
    return ck.read_manifest(open_run_dir(str(run_dir)), 12)["num_parameters"]


def test_resume_audit_reports_a_difference(uninterrupted, tmp_path):
    """A resume that lost state is caught at once: corrupt the checkpoint's m and resume."""
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "lossy"
    lossy = cfg.with_overrides({"output_dir": str(run_dir), "fault": "raise:rank=0,step=6",
                                "async_checkpoint": False})  # checkpoint 4 complete at the crash
    with pytest.raises(InjectedFault):
        run_local(lossy)
    rd = open_run_dir(str(run_dir))
    sf_name = f"{ck.step_dir(4)}/{ck.state_file(4, 0)}"
    n = ck.read_manifest(rd, 4)["num_parameters"]
    sf = read_state_file(rd.read_bytes(sf_name), num_parameters=n)
    import io
    buf = io.BytesIO()
    write_state_file(buf, step=sf.step, num_processes=1, process_rank=0, rng_state=sf.rng_state,
                     rng_state_last_update=sf.rng_state_last_update, m=np.zeros_like(sf.m),
                     v=sf.v, master=None, loader_state=sf.loader_state, extras=sf.extras)
    rd.write_bytes_atomic(sf_name, buf.getvalue())
    # re-sign the manifest so the file verifies: this simulates a resume that forgets m
    ck.write_manifest(rd, 4, **{k: v for k, v in ck.read_manifest(rd, 4).items()
                               if k in ("world_size", "num_parameters", "config_hash",
                                        "tokenizer_hash", "data_hash", "config_identity", "extra")})
    run_local(lossy.with_overrides({"resume": 1}))
    audit = [r for r in records(run_dir) if r["kind"] == "audit"]
    assert audit and "WARNING step 5" in audit[0]["message"]


def test_sigterm_checkpoints_and_stops_then_resumes(uninterrupted, tmp_path):
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "sigterm"
    stopped = cfg.with_overrides({"output_dir": str(run_dir), "fault": "sigterm:rank=0,step=6"})
    summary = run_local(stopped)
    assert summary["stopped_early"] and summary["step"] == 7
    rd = open_run_dir(str(run_dir))
    assert ck.list_checkpoint_steps(rd) == [4, 7] and not ck.verify_checkpoint(rd, 7)
    summary = run_local(stopped.with_overrides({"resume": 1}))
    assert summary["step"] == 12 and not summary["stopped_early"]
    full, resumed = train_losses(full_dir), train_losses(run_dir)
    assert resumed == full


def test_sigusr1_checkpoints_and_continues_unchanged(uninterrupted, tmp_path):
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "usr1"
    summary = run_local(cfg.with_overrides({"output_dir": str(run_dir),
                                            "fault": "sigusr1:rank=0,step=5"}))
    assert summary["step"] == 12 and not summary["stopped_early"]
    assert ck.list_checkpoint_steps(open_run_dir(str(run_dir))) == [4, 6, 8, 12]
    assert train_losses(run_dir) == train_losses(full_dir)


def test_fresh_start_over_an_existing_run_is_refused(uninterrupted):
    from raygpt.config import ConfigError
    from raygpt.train.run_dir import prepare_run_dir
    full_dir, cfg, _ = uninterrupted
    with pytest.raises(ConfigError, match="pass -y 1 to resume it"):
        prepare_run_dir(cfg)


def test_nonfinite_step_is_skipped_without_touching_weights(tmp_path):
    """A NaN loss drops exactly one update: weights and moments unchanged, step advanced."""
    # -nk 0: it reads checkpoints 3, 4 and 5, which the default retention would let go
    cfg = tiny_config(tmp_path, max_steps=6, checkpoint_every=1, checkpoints_keep=0,
                      fault="nan:rank=0,step=3")
    summary = run_local(cfg)
    assert summary["skips"] == 1 and summary["step"] == 6
    verdicts = {r["step"]: r["verdict"] for r in records(tmp_path) if r["kind"] == "train"}
    assert verdicts[3] == "skip" and all(v == "ok" for s, v in verdicts.items() if s != 3)
    n = ck.read_manifest(open_run_dir(str(tmp_path)), 3)["num_parameters"]
    before, model_before = state_arrays(tmp_path, 3, n)
    after, model_after = state_arrays(tmp_path, 4, n)
    assert model_before == model_after
    assert np.array_equal(before.m, after.m) and np.array_equal(before.v, after.v)
    assert after.step == before.step + 1
    later, _ = state_arrays(tmp_path, 5, n)
    assert not np.array_equal(after.m, later.m)  # the next clean step updates again


def test_watch_metrics_are_logged_every_k_steps(tmp_path):
    run_local(tiny_config(tmp_path, max_steps=6, watch_every=3, checkpoint_every=0, grad_clip=0.5))
    watch = [r for r in records(tmp_path) if r["kind"] == "watch"]
    assert [r["step"] for r in watch] == [2, 5]
    for r in watch:
        assert r["clipped_frac"] == 1.0  # every norm of a fresh model is above 0.5
        assert r["max_logit"] > 0
        assert set(r["update_ratio"]) >= {"wte", "qkvw", "lnfw"}
        assert all(0 < v < 1 for v in r["update_ratio"].values())
    log = (tmp_path / "main.log").read_text()
    assert "s:2 watch:1" in log


def test_deterministic_mode_refuses_an_op_without_a_deterministic_kernel(tmp_path, monkeypatch):
    """--deterministic is strict: an op with no deterministic implementation stops the run with
    the op's name (a ConfigError, not retried) instead of warning and running it anyway."""
    from raygpt.config import ConfigError
    from raygpt.model.gpt import GPT
    from raygpt.train.determinism import NonDeterministicOp

    forward = GPT.forward

    def forward_with_put(self, *args, **kwargs):
        # put_ has no deterministic CPU kernel: it raises under strict mode, runs under warn_only
        torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", forward_with_put)
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(NonDeterministicOp, match=r"put_ has no deterministic") as info:
        run_local(tiny_config(tmp_path / "det", deterministic=True, max_steps=2))
    assert isinstance(info.value, ConfigError) and info.value.op == "put_"
    # the switch is process-wide: the loop hands the caller's setting back, even when it raises
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory


def test_sigterm_still_checkpoints_after_something_replaced_the_handler(tmp_path):
    """A process that trained once, then had its SIGTERM handler replaced (ray.init installs its
    own in a driver; a driver hands its handlers back after a run), trains again: the loop puts
    its handlers back, so the sigterm fault checkpoints and stops instead of killing the process
    (it used to kill the pytest process that ran the whole suite)."""
    import signal
    run_local(tiny_config(tmp_path / "first", max_steps=2))
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        summary = run_local(tiny_config(tmp_path / "second", fault="sigterm:rank=0,step=3"))
    finally:
        signal.signal(signal.SIGTERM, old)
    assert summary["stopped_early"] and summary["step"] == 4


def test_performance_fields_reach_the_loop(tmp_path, monkeypatch):
    """The speed switches a bench flips are config fields the loop reads (not module globals):
    --no-prefetch builds each batch after the sync, --no-gc-freeze leaves the collector alone,
    --loss-impl and --no-ce-kernel reach the model, --compile-mode reaches torch.compile."""
    import gc

    from raygpt.data import loader as data
    from raygpt.train import loop

    calls = {"prefetch": 0, "freeze": 0}
    real_prefetch = data.DistributedDataLoader.prefetch

    def counting_prefetch(self, device):
        calls["prefetch"] += 1
        return real_prefetch(self, device)

    monkeypatch.setattr(data.DistributedDataLoader, "prefetch", counting_prefetch)
    monkeypatch.setattr(gc, "freeze", lambda: calls.__setitem__("freeze", calls["freeze"] + 1))
    compiled_with, built = [], []
    monkeypatch.setattr(torch, "compile",
                        lambda model, mode=None, **kw: compiled_with.append(mode) or model)
    real_build = loop.build_model
    monkeypatch.setattr(loop, "build_model", lambda cfg, device, **kw: built.append(real_build(cfg, device, **kw))
                        or built[-1])
    base = dict(max_steps=2, checkpoint_every=0)
    run_local(tiny_config(tmp_path / "on", **base))
    assert calls == {"prefetch": 2, "freeze": 1} and (built[0].loss_impl, built[0].ce_kernel) == (
        "fused", True)
    calls.update(prefetch=0, freeze=0)
    run_local(tiny_config(tmp_path / "off", prefetch_batches=False, gc_freeze=False, compile=True,
                          compile_mode="reduce-overhead", loss_impl="reference", ce_kernel=False,
                          **base))
    assert calls == {"prefetch": 0, "freeze": 0} and compiled_with == ["reduce-overhead"]
    assert (built[1].loss_impl, built[1].ce_kernel) == ("reference", False)
