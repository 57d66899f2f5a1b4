"""raygpt.checkpointing.snapshot, the copy of the state at a checkpoint's step: what a checkpoint
saves is the state at its step even while training goes on and overwrites the live tensors
before the background writer has read them; the buffers are allocated once; a GPU without
the memory for the device copy falls back loudly. The CUDA tests run on the GPU machine."""

import contextlib
import logging
import threading

import pytest
import torch

from raygpt.checkpointing import snapshot
from raygpt.checkpointing.protocol import model_file, state_file, step_dir, verify_checkpoint
from raygpt.checkpointing.snapshot import StateSnapshot, fits_on_device
from raygpt.llmc.model_file import read_model_file_flat
from raygpt.llmc.state_file import read_state_file
from raygpt.storage import open_run_dir


def _live(r) -> dict:
    return {"m": r.opt.m, "v": r.opt.v, "master": r.opt.master,
            "params": r.flat.params[:r.flat.num_parameters]}


def test_a_checkpoint_saves_the_state_at_its_step_while_training_overwrites_it(tmp_path):
    """A real async save through the checkpointer (LocalSession): the writer thread is held
    before it takes the tensors to the host, the training thread meanwhile overwrites m, v and
    the weights in place (as the next optimizer step does) and moves the RNG on; the files then
    hold the values of the step saved, not the later ones. The next checkpoint, due meanwhile,
    waits for the writer before it reuses the buffers, and the wait is recorded."""
    from raygpt.loop import build_run
    from raygpt.session import LocalSession
    from tests.helpers import tiny_config

    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, max_steps=8, checkpoint_every=4).resolve(0)
    with contextlib.ExitStack() as stack:
        r = build_run(cfg, LocalSession(open_run_dir(str(run_dir)), torch.device("cpu")), stack)
        ck = r.ckpt
        with torch.no_grad():  # a state that is not all zeros
            for i, t in enumerate(x for x in _live(r).values() if x is not None):
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
        r.state.step = 4
        at_step = {k: (None if t is None else t.clone()) for k, t in _live(r).items()}
        rng_at_step = r.state.rng_state

        held, took = threading.Event(), threading.Event()
        to_host = ck._snapshot.to_host

        def held_to_host():
            took.set()
            assert held.wait(30), "the test never released the writer"
            return to_host()

        ck._snapshot.to_host = held_to_host
        ck.save(r.state, r.train_loader, blocking=False)
        assert took.wait(30) and ck.ready() == 0.0  # the writer is in flight, holding
        with torch.no_grad():  # training goes on: the next update overwrites the live state
            for t in _live(r).values():
                if t is not None:
                    t.mul_(-3.0).add_(1.0)
        r.state.rng_state += 12345
        # the next checkpoint comes due while the writer still holds the first one's buffers:
        # it must wait (the buffers are reused), and it says how long
        r.state.step = 5
        at_5 = {k: (None if t is None else t.clone()) for k, t in _live(r).items()}
        threading.Timer(0.5, held.set).start()
        ck.save(r.state, r.train_loader, blocking=False)
        with torch.no_grad():
            for t in _live(r).values():
                if t is not None:
                    t.add_(7.0)
        ck.finish()  # join, publish, finalize (LocalSession)
    assert [s for s, _ in ck.waits] == [5] and ck.waits[0][1] >= 0.3

    for step, expected, rng in ((4, at_step, rng_at_step), (5, at_5, rng_at_step + 12345)):
        sdir = run_dir / step_dir(step)
        sf = read_state_file((sdir / state_file(step, 0)).read_bytes(),
                             num_parameters=r.opt.hi - r.opt.lo, expect_processes=1, expect_rank=0)
        assert torch.equal(torch.from_numpy(sf.m), expected["m"]), step
        assert torch.equal(torch.from_numpy(sf.v), expected["v"]), step
        if expected["master"] is not None:
            assert torch.equal(torch.from_numpy(sf.master), expected["master"])
        assert sf.rng_state == rng
        _, weights = read_model_file_flat((sdir / model_file(step)).read_bytes(), "model")
        assert torch.equal(weights.to(expected["params"].dtype), expected["params"]), step
        # the sha256 the writer fed while writing (nothing read back) is the stored files' own
        assert verify_checkpoint(open_run_dir(str(run_dir)), step, hashes=True) == []


def test_a_whole_file_hash_behind_the_writes_is_of_the_step_saved(tmp_path, monkeypatch):
    """The state file's whole-file sha256 runs behind its writes, over the snapshot's buffers
    (HashingWriter borrow=True). Made slow here, it is still hashing when the writer has written
    every byte; the next checkpoint, due at once, must not refill those buffers before it is
    done: both checkpoints' MANIFEST digests are their files' and hold the state of their step."""
    import hashlib
    import time

    from raygpt import hashing_writer
    from raygpt.loop import build_run
    from raygpt.session import LocalSession
    from tests.helpers import tiny_config

    class SlowSha256:
        def __init__(self):
            self.h = hashlib.sha256()

        def update(self, b):
            time.sleep(0.05)
            self.h.update(b)

        def hexdigest(self):
            return self.h.hexdigest()

    class SlowHashlib:
        sha256 = SlowSha256

    monkeypatch.setattr(hashing_writer, "hashlib", SlowHashlib)
    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, max_steps=8, checkpoint_every=4).resolve(0)
    expected = {}
    with contextlib.ExitStack() as stack:
        r = build_run(cfg, LocalSession(open_run_dir(str(run_dir)), torch.device("cpu")), stack)
        for step in (4, 5):
            with torch.no_grad():
                for i, t in enumerate(x for x in _live(r).values() if x is not None):
                    t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(step * 10 + i)))
            r.state.step = step
            expected[step] = r.opt.m.clone()
            r.ckpt.save(r.state, r.train_loader, blocking=False)
        with torch.no_grad():
            r.opt.m.add_(1.0)
        r.ckpt.finish()
    for step in (4, 5):
        assert verify_checkpoint(open_run_dir(str(run_dir)), step, hashes=True) == [], step
        sf = read_state_file((run_dir / step_dir(step) / state_file(step, 0)).read_bytes(),
                             num_parameters=r.opt.hi - r.opt.lo, expect_processes=1, expect_rank=0)
        assert torch.equal(torch.from_numpy(sf.m), expected[step]), step


def test_the_snapshot_buffers_are_allocated_once_and_reused():
    snap = StateSnapshot()
    m = torch.arange(6, dtype=torch.float32)
    snap.capture({"m": m, "params": None})
    first = snap.to_host()
    ptr = first["m"].data_ptr()
    assert first["params"] is None and torch.equal(first["m"], torch.arange(6, dtype=torch.float32))
    m.add_(1)
    second = snap.capture({"m": m, "params": None}) or snap.to_host()
    assert second["m"].data_ptr() == ptr  # the same memory: bounded, one checkpoint in flight
    assert torch.equal(second["m"], torch.arange(1, 7, dtype=torch.float32))
    assert second["m"].data_ptr() != m.data_ptr()  # a copy, never the live tensor


def test_the_device_copy_needs_its_size_plus_headroom_free():
    gib = 1 << 30
    assert fits_on_device(1 * gib, 10 * gib, headroom=2 * gib)
    assert fits_on_device(8 * gib, 10 * gib, headroom=2 * gib)
    assert not fits_on_device(8 * gib + 1, 10 * gib, headroom=2 * gib)
    assert not fits_on_device(1, 0)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
def test_on_a_gpu_the_training_thread_does_not_wait_and_the_copy_is_the_state_at_capture():
    """Device path: capture enqueues device copies and returns; kernels enqueued after it that
    overwrite the live tensors (the next step) do not reach what the writer thread copies to
    the host on its side stream."""
    dev = torch.device("cuda")
    n = 64 << 20  # 256 MB of float32 per tensor: copies long enough to race with
    live = {"m": torch.randn(n, device=dev), "v": torch.randn(n, device=dev), "params": None}
    expected = {k: t.cpu() for k, t in live.items() if t is not None}
    snap = StateSnapshot()
    snap.capture(live)
    assert snap.on_device is True
    for _ in range(20):  # the next steps, queued behind the capture on the same stream
        live["m"].mul_(1.5).add_(1.0)
        live["v"].sub_(2.0)
    out = {}
    writer = threading.Thread(target=lambda: out.update(snap.to_host()))
    writer.start()
    writer.join(60)
    assert out["m"].is_pinned() and out["params"] is None
    assert torch.equal(out["m"], expected["m"]) and torch.equal(out["v"], expected["v"])


@pytest.mark.gpu
@cuda
def test_without_gpu_memory_for_the_device_copy_it_says_so_and_copies_to_the_host(caplog):
    dev = torch.device("cuda")
    live = {"m": torch.randn(1 << 20, device=dev), "params": None}
    expected = live["m"].cpu()
    snap = StateSnapshot(mem_get_info=lambda: (snapshot.HEADROOM_BYTES, 80 << 30))
    with caplog.at_level(logging.WARNING, logger="raygpt.checkpointing.snapshot"):
        snap.capture(live)
    assert snap.on_device is False
    assert "copies its state to the host on the training thread" in caplog.text
    live["m"].add_(1.0)
    out = snap.to_host()
    assert out["m"].is_pinned() and torch.equal(out["m"], expected)
