"""ZeRO-1 optimizer sharding and elastic resume on a different number of workers (2 gloo workers
under one shared local Ray): same losses as DDP, half the optimizer state per rank, and a run
that continues 2 -> 1 and 1 -> 2 workers seeing every sample exactly once."""

import numpy as np
import pytest
import ray
import torch

from raygpt.checkpointing import protocol as ck
from raygpt.llmc.state_file import read_state_file
from raygpt.ray.driver import run
from raygpt.storage import open_run_dir
from tests.helpers import records, samples_seen, tiny_config, train_losses

GLOBAL = 4 * 32 * 2  # tokens per step: 2 workers x B=4 x T=32, or 1 worker with grad accum 2


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def cfg_for(run_dir, **kw):
    base = dict(num_workers=2, max_steps=10, checkpoint_every=4, total_batch_size=GLOBAL,
                record_samples=True)
    base.update(kw)
    return tiny_config(run_dir, **base).resolve(0)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    run(cfg_for(d))
    return d


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    d = tmp_path_factory.mktemp("zero1")
    run(cfg_for(d, zero_stage=1))
    return d


def test_zero1_matches_ddp_with_half_the_optimizer_state(ddp, zero1):
    a, b = train_losses(ddp), train_losses(zero1)
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-5, abs=1e-6)
    zero, full = open_run_dir(str(zero1)), open_run_dir(str(ddp))
    n = ck.read_manifest(full, 8)["num_parameters"]
    sizes = [zero.size_of(f"step_00000008/{ck.state_file(8, r)}") for r in (0, 1)]
    full_size = full.size_of(f"step_00000008/{ck.state_file(8, 0)}")
    # m and v (fp32) are split in two: each rank's file holds half of the 8 bytes per parameter
    assert all(abs(s - (full_size - 4 * n)) < 4096 for s in sizes)


def test_zero1_gather_overlapped_with_the_forward_trains_and_resumes_as_the_all_gather(
        zero1, tmp_path):
    """ZeRO-1 with --overlap-comm, the gather waited for in the next forward, stopped by SIGTERM
    at step 7 and resumed (the restore's gather, then overlapped ones again): the losses equal
    the blocking all-gather's uninterrupted run as floats and each checkpoint's model file is
    the same bytes (captured at steps 4 and 8 right after an update, its gather in flight:
    validation comes at 3, 6, 9); validation, samples and the watch metrics read the weights
    between updates."""
    overlapped = dict(zero_stage=1, overlap_comm=True, val_every=3, sample_every=3, watch_every=2)
    assert run(cfg_for(tmp_path, fault="sigterm:rank=0,step=7", **overlapped))["stopped_early"]
    assert run(cfg_for(tmp_path, resume=1, **overlapped))["step"] == 10
    assert train_losses(tmp_path) == train_losses(zero1)
    assert sorted({r["step"] for r in records(tmp_path) if r["kind"] == "val"}) == [0, 3, 6, 9, 10]
    a, b = open_run_dir(str(zero1)), open_run_dir(str(tmp_path))
    for step in (4, 8, 10):
        name = f"{ck.step_dir(step)}/{ck.model_file(step)}"
        assert a.read_bytes(name) == b.read_bytes(name), step


def test_resume_two_to_one_worker(ddp, tmp_path):
    stopped = cfg_for(tmp_path, zero_stage=1, fault="sigterm:rank=0,step=5")
    assert run(stopped)["stopped_early"]
    summary = run(cfg_for(tmp_path, zero_stage=1, num_workers=1, resume=1))
    assert summary["step"] == 10
    worlds = {r["step"]: r["world"] for r in records(tmp_path) if r["kind"] == "train"}
    assert worlds[0] == 2 and worlds[9] == 1
    a, b = train_losses(ddp), train_losses(tmp_path)
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-4, abs=1e-5)
    assert samples_seen(tmp_path) == samples_seen(ddp)  # each sample exactly once, same ones
    assert len(set(samples_seen(tmp_path))) == len(samples_seen(tmp_path))


def test_resume_one_to_two_workers(ddp, tmp_path):
    stopped = cfg_for(tmp_path, num_workers=1, fault="sigterm:rank=0,step=5")
    assert run(stopped)["stopped_early"]
    run(cfg_for(tmp_path, num_workers=2, zero_stage=1, resume=1))
    a, b = train_losses(ddp), train_losses(tmp_path)
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-4, abs=1e-5)
    assert samples_seen(tmp_path) == samples_seen(ddp)


def test_resharded_optimizer_state_equals_the_concatenated_shards(zero1):
    """Load a 2-rank ZeRO-1 checkpoint (the shared run's step 4) into a 1-rank run: m, v are the
    shards, concatenated."""
    from raygpt.checkpointing.runtime import Checkpointer
    from raygpt.data.loader import DistributedDataLoader
    from raygpt.train.loop import build_model
    from raygpt.train.optim import AdamW, FlatParameters
    from raygpt.train.session import LocalSession
    from raygpt.train.state import TrainState

    cfg = cfg_for(zero1, zero_stage=0, num_workers=1)
    model = build_model(cfg, torch.device("cpu"))
    flat = FlatParameters(model, torch.device("cpu"), torch.float32)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    session = LocalSession(open_run_dir(str(zero1)), torch.device("cpu"))
    loader = DistributedDataLoader(cfg.input_bin, cfg.batch_size, cfg.seq_len, 0, 1, shuffle=True,
                                   seed=cfg.seed)
    Checkpointer(cfg, session, flat, opt, model.config, 4).load(4, TrainState.fresh(cfg), loader)
    rd = open_run_dir(str(zero1))
    n = flat.num_parameters
    half = -(-n // 2)
    shards = [read_state_file(rd.read_bytes(f"step_00000004/{ck.state_file(4, r)}"),
                              num_parameters=min(half, n - r * half)) for r in (0, 1)]
    assert torch.equal(opt.m, torch.from_numpy(np.concatenate([s.m for s in shards])))
    assert torch.equal(opt.v, torch.from_numpy(np.concatenate([s.v for s in shards])))


def test_a_global_batch_that_cannot_be_kept_is_a_clear_error(tmp_path):
    from raygpt.config import ConfigError
    with pytest.raises(ConfigError, match="-d/--total-batch-size"):
        tiny_config(tmp_path, num_workers=3, total_batch_size=GLOBAL).resolve(0)
