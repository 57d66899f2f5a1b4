"""A CPU worker's real peak memory, and raygpt.model.memory's estimate of it.

Each measurement is a child process running the real loop (raygpt.train.loop.train under a
LocalSession, no Ray) for two steps with a checkpoint after the first, as bench/memory_estimate.py
does; its peak resident set (VmHWM of the child) is what Ray's memory monitor and the machine
see.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raygpt.model.memory import GiB, Shape, estimate, shape_of

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys, tempfile, torch
torch.set_num_threads(1)
from raygpt.config import TrainConfig
from raygpt.storage import open_run_dir
from raygpt.train.loop import train
from raygpt.train.session import LocalSession
run_dir = tempfile.mkdtemp(dir=sys.argv[1])
fields = dict(json.loads(sys.argv[2]), max_steps=2, checkpoint_every=1, val_every=0,
              sample_every=0, output_dir=run_dir, device="cpu", num_workers=1, warmup_steps=0)
train(TrainConfig(**fields).resolve(0), LocalSession(open_run_dir(run_dir), torch.device("cpu")))
# VmHWM, this process's own high-water mark: ru_maxrss would also count the parent's resident
# set at the fork before exec (Linux folds the old address space's mark into it)
print("PEAK", [int(l.split()[1]) * 1024 for l in open("/proc/self/status")
               if l.startswith("VmHWM:")][0])
"""


@functools.cache
def peak_rss(tmp: str, **fields) -> int:
    """Peak resident bytes of a child that trains two steps of `fields` on the CPU."""
    proc = subprocess.run([sys.executable, "-c", CHILD, tmp, json.dumps(fields)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split("PEAK ")[-1])


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("memory"))


def test_a_d2_worker_at_b64_t256_peaks_under_3_gb(tmp):
    # the fused loss's chunk by device: 512 rows on a CPU (16384 held 14 GB of fp32 logits here)
    peak = peak_rss(tmp, model="d2", batch_size=64, seq_len=256)
    assert peak < 3 * 10**9, f"peak RSS {peak / GiB:.2f} GiB"


# Measured against estimated: the estimate is within MARGIN of the child's peak RSS at these
# shapes (bench/memory_estimate.py --cpu prints more of them).
MARGIN = 0.25
SHAPES = [dict(model="d2", batch_size=64, seq_len=256), dict(model="d2", batch_size=8, seq_len=64),
          dict(model="d4", batch_size=16, seq_len=128)]


@pytest.mark.parametrize("fields", SHAPES,
                         ids=lambda f: f"{f['model']}-B{f['batch_size']}-T{f['seq_len']}")
def test_the_estimate_is_within_the_margin_of_the_measured_peak(tmp, fields):
    peak = peak_rss(tmp, **fields)
    est = estimate(shape_of(fields["model"]), device="cpu", batch_size=fields["batch_size"],
                   seq_len=fields["seq_len"])
    assert abs(est.total / peak - 1) <= MARGIN, (
        f"estimate {est.total / GiB:.2f} GiB, measured {peak / GiB:.2f} GiB: {est.line()}")


# ---------------------------------------------------------------------- the formula


def test_the_parameter_count_is_the_models():
    from raygpt.model.gpt import GPT, GPTConfig, num_parameters

    for depth in (1, 2, 4):
        assert shape_of(f"d{depth}").num_parameters == num_parameters(
            GPT(GPTConfig.from_depth(depth), init_seed=None))
    assert shape_of("d12").num_parameters == 124_475_904  # llm.c's GPT-2 124M, padded wte


def test_shapes_from_a_model_file_and_a_hugging_face_folder(tmp_path):
    from raygpt.llmc.model_file import model_header
    from raygpt.model.gpt import GPTConfig

    cfg = GPTConfig(block_size=256, n_layer=3, n_head=2, n_embd=128)
    (tmp_path / "model.bin").write_bytes(model_header(cfg).tobytes())
    assert shape_of(str(tmp_path / "model.bin")) == Shape(3, 128, 2, 50257, 50304, 256)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        dict(model_type="gpt2", n_layer=3, n_embd=128, n_head=2, vocab_size=50257,
             n_positions=256)))  # read by raygpt.interop.hf's bounded reader, wte padded as GPT pads it
    assert shape_of(str(tmp_path / "hf")) == Shape(3, 128, 2, 50257, 50304, 256)
    (tmp_path / "zeros.bin").write_bytes(b"\0" * 4096)
    assert shape_of(str(tmp_path / "zeros.bin")) is None  # preflight.check_model names it
    assert shape_of(str(tmp_path / "missing.bin")) is None


def test_what_each_setting_moves():
    d12 = shape_of("d12")
    base = estimate(d12, device="gpu", batch_size=16, seq_len=1024, world=8,
                    snapshot_to="device")
    N = d12.num_parameters
    assert (base.weights, base.grads, base.optimizer) == (2 * N, 2 * N, 12 * N)
    assert base.snapshot == 12 * N + 2 * N
    zero = estimate(d12, device="gpu", batch_size=16, seq_len=1024, world=8, zero_stage=1,
                    snapshot_to="device")
    assert zero.optimizer == 12 * (-(-N // 8))  # m, v and master sharded over the ranks
    assert estimate(d12, device="gpu", batch_size=16, seq_len=1024, world=8, zero_stage=1,
                    rank=1, snapshot_to="device").snapshot == zero.optimizer  # rank 0's weights
    # the default snapshot goes to pinned host memory: none on the GPU, all of it on a CPU
    assert estimate(d12, device="gpu", batch_size=16, seq_len=1024).snapshot == 0
    assert estimate(d12, device="cpu", batch_size=16, seq_len=1024).snapshot == 8 * N + 4 * N  # no master in fp32
    # --overlap-comm's bucket buffers: one more gradient buffer, with more than one rank
    assert estimate(d12, device="gpu", batch_size=16, seq_len=1024, world=2,
                    overlap=True).grads == 4 * N
    assert estimate(d12, device="gpu", batch_size=16, seq_len=1024, world=1,
                    overlap=True).grads == 2 * N
    levels = [estimate(d12, device="gpu", batch_size=16, seq_len=1024, recompute=r).activations
              for r in (0, 1, 2)]
    assert levels[0] > levels[1] > levels[2]
    double = estimate(d12, device="gpu", batch_size=32, seq_len=1024)
    assert double.activations == 2 * base.activations
    # the fused loss holds a chunk; the reference loss the whole (B T, V)
    ref = estimate(d12, device="gpu", batch_size=16, seq_len=1024, loss_impl="reference")
    assert ref.loss > 3 * base.loss
    # a chunk never holds more rows than the micro-batch has
    small = estimate(d12, device="cpu", batch_size=1, seq_len=64)
    assert small.loss == 64 * 50304 * 16 + 2 * 50304 * 768 * 4 + 64 * 768 * 4
    old_chunk = estimate(shape_of("d2"), device="cpu", batch_size=64, seq_len=256,
                         ce_chunk_rows=16384)
    assert old_chunk.total > 12 * GiB  # what a d2 worker held before the CPU's chunk


# ---------------------------------------------------------------------- out of memory


def test_an_out_of_memory_error_in_the_loop_stops_the_run_naming_b(tmp_path, monkeypatch):
    """A torch.OutOfMemoryError raised in the step (here by a stand-in for the forward pass
    at step 2, in a real LocalSession run) leaves the loop as OutOfMemory: exit 2, not
    retried, one line with the step, the estimate and -b."""
    import torch

    from raygpt.model.memory import estimate_for
    from raygpt.storage import open_run_dir
    from raygpt.train import loop
    from raygpt.train.errors import EXIT_BAD_INPUT, OutOfMemory, stop_code
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    real = loop.forward_backward

    def forward_backward(r, step):
        if step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(r, step)

    monkeypatch.setattr(loop, "forward_backward", forward_backward)
    cfg = tiny_config(tmp_path).resolve(0)
    with pytest.raises(OutOfMemory) as e:
        loop.train(cfg, LocalSession(open_run_dir(str(tmp_path)), torch.device("cpu")))
    assert stop_code(e.value) == EXIT_BAD_INPUT
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert str(e.value) == (f"out of memory in host memory at step 2: the estimate for this "
                            f"shape is {estimate_for(cfg).total / GiB:.1f} GiB of "
                            f"{total / GiB:.1f} GiB; lower -b (now 4)")
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_stops_the_run_naming_b(tmp_path):
    """A micro-batch whose textbook loss (the whole (B T, V) logits, ~14 bytes a logit) is
    larger than the GPU: a real CUDA OOM at step 0, reported with the GPU's size."""
    import numpy as np
    import torch

    from raygpt.llmc.shards import write_shard
    from raygpt.storage import open_run_dir
    from raygpt.train import loop
    from raygpt.train.errors import EXIT_BAD_INPUT, OutOfMemory, stop_code
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    gpu = torch.cuda.get_device_properties(0).total_memory
    B, T = 64, 1024
    while B * T * 50257 * 14 < 1.5 * gpu:
        B *= 2
    write_shard(tmp_path / "train.bin", np.arange(B * T + 1) % 50257)
    cfg = tiny_config(tmp_path / "run", device="gpu", batch_size=B, seq_len=T, max_steps=2,
                      checkpoint_every=0, input_bin=str(tmp_path / "train.bin"), input_val_bin="",
                      loss_impl="reference", compile=False).resolve(1)
    with pytest.raises(OutOfMemory) as e:
        loop.train(cfg, LocalSession(open_run_dir(str(tmp_path / "run")), torch.device("cuda")))
    assert stop_code(e.value) == EXIT_BAD_INPUT
    assert str(e.value).startswith("out of memory on the GPU at step 0: the estimate for this "
                                   "shape is "), str(e.value)
    assert str(e.value).endswith(f" of {gpu / GiB:.1f} GiB; lower -b (now {B})"), str(e.value)
