"""A run on corpora mixed by weight under Ray Train: a worker SIGKILLed mid-run resumes to the
uninterrupted run's losses and weights bit for bit, and the history, main.log and
`raygpt status` show the tokens of each source and the epoch a source that ran out began."""

import numpy as np
import pytest

from raygpt.checkpointing import protocol as ck
from raygpt.ray.driver import run
from raygpt.runlog.report import run_status
from raygpt.storage import open_run_dir
from raygpt.llmc.shards import write_shard
from tests.helpers import records, tiny_config, train_losses

pytestmark = pytest.mark.usefixtures("local_ray")  # tests/ray_seam/conftest.py

# 2 workers x B=4 x grad accumulation 2: 16 samples of T=32 a step
RUN = dict(num_workers=2, max_steps=12, checkpoint_every=4, total_batch_size=4 * 32 * 2 * 2,
           record_samples=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """web: 3 shards, code: 2 small ones (24 samples an epoch: at 0.3 of 16 a step, 57 of the
    run's 192, it begins epoch 1 near step 5 and epoch 2 near step 10)."""
    d = tmp_path_factory.mktemp("mix")
    for s in range(3):
        write_shard(d / f"web_{s}.bin", (s * 1000 + np.arange(2000)) % 50000)
    for s in range(2):
        write_shard(d / f"code_{s}.bin", (30000 + s * 1000 + np.arange(400)) % 50000)
    return f"web=0.7:{d}/web_*.bin\ncode=0.3:{d}/code_*.bin"


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    cfg = tiny_config(run_dir, input_bin=data, **RUN)
    summary = run(cfg.resolve(0))
    return run_dir, cfg, summary


def test_a_mixed_run_logs_tokens_per_source_and_each_new_epoch(uninterrupted):
    run_dir, cfg, summary = uninterrupted
    assert summary["failures"] == 0
    train = {r["step"]: r for r in records(run_dir) if r["kind"] == "train"}
    assert sorted(train) == list(range(12))
    for step, r in train.items():
        tokens = r["source_tokens"]
        assert sum(tokens.values()) == r["tokens"] == (step + 1) * 16 * 32
        # every step's 16 samples hold the weights within one sample per source
        assert abs(tokens["code"] - 0.3 * r["tokens"]) <= 32 * 2, (step, tokens)
    epochs = [(r["step"], r["source"], r["epoch"]) for r in records(run_dir)
              if r["kind"] == "source_epoch"]
    assert [e[1:] for e in epochs] == [("code", 1), ("code", 2)], epochs
    # code's 24 samples an epoch: epoch 1's first sample is its 25th, drawn at that step
    first = next(s for s, r in train.items() if r["source_tokens"]["code"] > 24 * 32)
    assert epochs[0][0] == first
    log = (run_dir / "main.log").read_text()
    assert f"s:{first} source_epoch:1 source:code epoch:1" in log
    status = run_status(str(run_dir))
    code = train[11]["source_tokens"]["code"]
    assert (f"sources   web {12 * 512 - code:,} tokens ({100 * (12 * 512 - code) / 6144:.1f}%), "
            f"epoch 0 | code {code:,} tokens ({100 * code / 6144:.1f}%), epoch 2") in status


def test_a_killed_worker_resumes_a_mix_with_identical_losses_and_samples(uninterrupted, tmp_path):
    full_dir, cfg, _ = uninterrupted
    run_dir = tmp_path / "killed"
    summary = run(cfg.with_overrides({"output_dir": str(run_dir),
                                      "fault": "kill:rank=1,step=6,after=4"}).resolve(0))
    assert summary["failures"] == 1 and summary["resumes"] == 1
    assert [r["resumed_from"] for r in records(run_dir) if r["kind"] == "resume"] == [4]
    assert train_losses(run_dir) == train_losses(full_dir)  # as floats, step by step
    latest = {r["step"]: r for r in records(run_dir) if r["kind"] == "train"}
    full = {r["step"]: r for r in records(full_dir) if r["kind"] == "train"}
    assert all(latest[s]["samples"] == full[s]["samples"] for s in full)  # the same samples
    assert all(latest[s]["source_tokens"] == full[s]["source_tokens"] for s in full)
    name = f"{ck.step_dir(12)}/{ck.model_file(12)}"
    assert open_run_dir(str(full_dir)).read_bytes(name) == open_run_dir(str(run_dir)).read_bytes(name)
