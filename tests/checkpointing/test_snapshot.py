"""raygpt.checkpointing.snapshot, the copy of the state at a checkpoint's step: what a checkpoint
saves is the state at its step even while training goes on and overwrites the live tensors
before the background writer has read them; the buffers are allocated once; every write to the
checkpointed tensors waits for the copy to the host (on a CPU with a fake of CUDA's streams
whose side stream runs as late as CUDA allows; on a GPU with tensors large enough to race);
the GPU memory of a checkpoint stays flat; a GPU without the memory for the device copy falls
back loudly. The CUDA tests run on the GPU machine."""

import contextlib
import logging
import threading

import pytest
import torch

from raygpt.checkpointing import snapshot
from raygpt.checkpointing.protocol import model_file, state_file, step_dir, verify_checkpoint
from raygpt.checkpointing.snapshot import (PAGE, StateSnapshot, fits_on_device, nbytes,
                                           on_whole_pages)
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
    from raygpt.train.loop import build_run
    from raygpt.train.session import LocalSession
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

    from raygpt.storage import hashing_writer
    from raygpt.train.loop import build_run
    from raygpt.train.session import LocalSession
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


class FakeEvent:
    def __init__(self, done: bool):
        self.done = done


class FakePinned:
    """PinnedBuffers' surface over plain host tensors."""

    def __init__(self):
        self.buffers = {}

    def get(self, name, like):
        if name not in self.buffers:
            self.buffers[name] = torch.empty(like.shape, dtype=like.dtype)
        return self.buffers[name]

    def close(self):
        self.buffers.clear()


class LateSideStream:
    """CUDA's ordering rules for the snapshot's host path at their worst timing. The compute
    stream is the training thread's own CPU ops, which run at once (a GPU's kernels may run
    as soon as they are enqueued); the side stream's copies run only when something waits for
    one of its events, on the device (`wait` on the compute stream: nothing enqueued there
    after the wait may run before the side stream reached the event) or on the host
    (`synchronize`). A write that does not wait lands before the copy reads its tensor, as it
    can on a GPU. A copy enqueued before the side stream waited for the compute stream (whose
    last update may still be running on a GPU) is refused."""

    def __init__(self):
        self.queue = []  # the side stream's work not yet run: callables and FakeEvents
        self.waited = []  # the events the compute stream waited for
        self.after_compute = False  # the side stream waited for the compute stream's work

    def current(self):
        return "compute"

    def side(self):
        return "side"

    def record(self, stream):
        if stream == "compute":
            return FakeEvent(done=True)  # the compute stream's work has run already
        event = FakeEvent(done=False)
        self.queue.append(event)
        self.after_compute = False  # the next capture's copies wait again
        return event

    def wait(self, stream, event):
        if stream == "compute":
            self.waited.append(event)
            self._run_until(event)
        else:  # the side stream waiting for the compute stream: already there
            self.after_compute = True

    def copy(self, dst, src, stream):
        assert stream == "side"
        assert self.after_compute, "a copy not ordered after the compute stream's work"
        self.queue.append(lambda: dst.copy_(src))

    def synchronize(self, event):
        self._run_until(event)

    def pinned(self):
        return FakePinned()

    def _run_until(self, event):
        while not event.done:
            item = self.queue.pop(0)
            if isinstance(item, FakeEvent):
                item.done = True
            else:
                item()


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"m": torch.randn(1000, generator=g), "v": torch.rand(1000, generator=g),
            "master": None, "params": torch.randn(500, generator=g).bfloat16()}


@pytest.mark.parametrize("waits", [True, False])
def test_a_write_that_waits_for_the_copy_leaves_it_the_state_at_capture(waits):
    """The rule itself: capture, then a write to every tensor; the host copy is the state at
    capture when the write calls before_write first, and (the fake's own check: it can show
    the race) the overwritten state when it does not."""
    live = _state(0)
    at_capture = {k: t.clone() for k, t in live.items() if t is not None}
    streams = LateSideStream()
    snap = StateSnapshot(streams=streams)
    snap.capture(live)
    assert streams.queue, "capture enqueued the copies and returned"
    if waits:
        snap.before_write()
    for t in live.values():
        if t is not None:
            t.mul_(-3.0).add_(1.0)
    out = snap.to_host()
    assert out["master"] is None
    for k, t in at_capture.items():
        assert torch.equal(out[k], t) == waits, k
    snap.before_write()  # once to_host saw the copy end, a write has nothing to wait for
    assert len(streams.waited) == int(waits)


def _tiny_optimizer():
    from raygpt.model.gpt import GPT, GPTConfig
    from raygpt.train.optim import AdamW, FlatParameters

    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16),
                init_seed=1)
    flat = FlatParameters(model, torch.device("cpu"), torch.bfloat16)  # master weights too
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(2)
    flat.grads.copy_(torch.randn(flat.grads.shape, generator=g))
    opt.m.copy_(torch.randn(opt.m.shape, generator=g))
    opt.v.copy_(torch.rand(opt.v.shape, generator=g))
    opt.master.add_(torch.randn(opt.master.shape, generator=g) * 0.01)
    return flat, opt


WRITERS = {
    "update": lambda opt: opt.step(lr=0.1, grad_scale=1.0, t=3, seed=7),
    "rederive": lambda opt: opt.rederive_working_weights(seed=7),
    "master from params": lambda opt: opt.take_master_from_params(),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_every_optimizer_write_waits_for_the_checkpoint_copy(writer):
    """AdamW's writes to m, v, master and the working weights (the update, the rederive of a
    restore, the master taken from fresh weights) each wait for a capture's copy: right after
    a capture, with the side stream as late as CUDA allows, the host copy is still the state
    at capture, and the write did change what the checkpoint must not see."""
    flat, opt = _tiny_optimizer()
    snap = StateSnapshot(streams=LateSideStream())
    opt.before_write = snap.before_write  # as the Checkpointer wires it
    live = {"m": opt.m, "v": opt.v, "master": opt.master,
            "params": flat.params[:flat.num_parameters]}
    at_capture = {k: t.clone() for k, t in live.items()}
    snap.capture(live)
    WRITERS[writer](opt)
    out = snap.to_host()
    assert any(not torch.equal(live[k], at_capture[k]) for k in live), "the write wrote nothing"
    for k in live:
        assert torch.equal(out[k], at_capture[k]), k


def test_through_the_checkpointer_each_checkpoint_holds_its_steps_state_when_the_copy_runs_late(
        tmp_path):
    """The checkpointer's real saves with the host path's ordering at its worst (LateSideStream,
    the writer thread held while training goes on). After checkpoint 4 the next step's forward
    and backward run, then the optimizer's update overwrites m, v, master and the weights;
    after checkpoint 5 a restore of checkpoint 4 (a rewind's load) overwrites them at once.
    Each checkpoint's files hold the state of its own step."""
    from raygpt.train.loop import build_run, forward_backward
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, max_steps=8, checkpoint_every=4).resolve(0)
    with contextlib.ExitStack() as stack:
        r = build_run(cfg, LocalSession(open_run_dir(str(run_dir)), torch.device("cpu")), stack)
        ck = r.ckpt
        ck._snapshot = StateSnapshot(streams=LateSideStream())
        r.opt.before_write = ck._snapshot.before_write  # as the Checkpointer wires its own
        held = threading.Event()
        to_host = ck._snapshot.to_host

        def held_to_host():
            assert held.wait(30), "the test never released the writer"
            return to_host()

        ck._snapshot.to_host = held_to_host
        expected = {}
        for step in (4, 5):
            r.state.step = step
            expected[step] = {k: (None if t is None else t.clone()) for k, t in _live(r).items()}
            held.clear()
            ck.save(r.state, r.train_loader, blocking=False)
            if step == 4:  # the next step and its update, the copy not yet run
                forward_backward(r.micro, step)
                r.opt.step(lr=0.1, grad_scale=1.0, t=step + 1, seed=3)
            else:  # a rewind's restore of checkpoint 4, the copy not yet run
                ck.load(4, r.state, r.train_loader)
                assert torch.equal(r.opt.m, expected[4]["m"])
            assert not torch.equal(r.opt.m, expected[step]["m"])
            held.set()
        ck.finish()
    for step in (4, 5):
        sf = read_state_file((run_dir / step_dir(step) / state_file(step, 0)).read_bytes(),
                             num_parameters=r.opt.hi - r.opt.lo, expect_processes=1, expect_rank=0)
        assert torch.equal(torch.from_numpy(sf.m), expected[step]["m"]), step
        assert torch.equal(torch.from_numpy(sf.v), expected[step]["v"]), step
        _, weights = read_model_file_flat((run_dir / step_dir(step) / model_file(step)).read_bytes(),
                                          "model")
        assert torch.equal(weights.to(expected[step]["params"].dtype), expected[step]["params"])


def test_the_snapshot_path_is_host_by_default_and_a_bad_one_is_refused_by_its_flag():
    from raygpt.config import ConfigError, TrainConfig, parse_args

    assert TrainConfig().checkpoint_snapshot == "host"
    assert parse_args(["--checkpoint-snapshot", "device"]).checkpoint_snapshot == "device"
    with pytest.raises(ConfigError, match=r"--checkpoint-snapshot: expected host or device, found 'gpu'"):
        TrainConfig(checkpoint_snapshot="gpu").resolve(0)


def test_each_host_buffer_lies_on_whole_pages_no_other_buffer_shares():
    """What the pinned buffers register: whole pages, holding the tensor, and disjoint from
    every other buffer's even for small ones allocated side by side (CUDA refuses a page
    registered twice)."""
    spans = []
    for i, (n, dtype) in enumerate([(1, torch.float32), (1000, torch.bfloat16), (PAGE, torch.float32),
                                    (3, torch.float32), (0, torch.float32), (70_000, torch.float32)]):
        buf, ptr, length = on_whole_pages(torch.empty(n, dtype=dtype))
        assert buf.shape == (n,) and buf.dtype == dtype
        assert ptr % PAGE == 0 and length % PAGE == 0
        assert n == 0 or ptr <= buf.data_ptr() <= buf.data_ptr() + n * buf.element_size() <= ptr + length
        spans.append((ptr, ptr + length, buf))  # kept alive: the next allocation is its neighbour
    for a, b in zip(sorted(spans, key=lambda s: s[0]), sorted(spans, key=lambda s: s[0])[1:]):
        assert a[1] <= b[0], "two buffers share a page"


def test_pins_answers_for_the_pages_cuda_registered_and_nothing_else(monkeypatch):
    """PinnedBuffers.pins: a buffer whose registration succeeded, not one whose registration
    failed, not memory it never registered, not after close (CUDA's runtime stood in for)."""
    from raygpt.checkpointing.snapshot import PinnedBuffers

    calls = []

    class Runtime:
        class cudaError:
            success = 0

        def cudaHostRegister(self, ptr, length, flags):
            calls.append(("register", ptr, length))
            return 1 if len(calls) == 2 else 0  # the second buffer's registration fails

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))

        def cudaGetErrorString(self, err):
            return "out of memory"

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    pinned = PinnedBuffers()
    ok, failed = pinned.get("m", torch.empty(1000)), pinned.get("v", torch.empty(10))
    assert pinned.pins(ok) and pinned.pins(ok[10:20]) and not pinned.pins(failed)
    assert not pinned.pins(torch.empty(8))
    pinned.close()
    assert not pinned.pins(ok) and ("unregister", calls[0][1]) in calls


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_optimizer(depth: int = 12):
    """GPT-2 at `depth` on the GPU in bf16 with master weights, and every tensor a checkpoint
    holds made non-trivial (m, v, master, gradients): d12's 1.7 GB take tens of milliseconds
    to cross PCIe, the update about one."""
    from raygpt.model.gpt import GPT, GPTConfig
    from raygpt.train.optim import AdamW, FlatParameters

    dev = torch.device("cuda")
    model = GPT(GPTConfig.from_depth(depth), init_seed=1).to(dev)
    flat = FlatParameters(model, dev, torch.bfloat16)
    opt = AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    g = torch.Generator(device=dev).manual_seed(2)
    flat.grads.copy_(torch.randn(flat.grads.shape, generator=g, device=dev))
    opt.m.copy_(torch.randn(opt.m.shape, generator=g, device=dev))
    opt.v.copy_(torch.rand(opt.v.shape, generator=g, device=dev))
    live = {"m": opt.m, "v": opt.v, "master": opt.master,
            "params": flat.params[:flat.num_parameters]}
    return opt, live


@pytest.mark.gpu
@cuda
def test_on_a_gpu_the_host_copy_is_the_state_at_capture_though_the_update_follows_at_once():
    """Host path, real CUDA: capture enqueues the copies to pinned memory on a side stream and
    returns; the update enqueued right after it (it rewrites every element of m, v, master and
    the weights, in a fraction of the copy's time) waits for the copy on the device. The
    writer thread's tensors are the state at capture, bit for bit. Without the wait (AdamW.step
    not calling before_write) the update overtakes the copy and this fails."""
    opt, live = _gpu_optimizer()
    at_capture = {k: t.cpu() for k, t in live.items()}
    snap = StateSnapshot("host")
    opt.before_write = snap.before_write
    snap.reserve(live)  # as the checkpointer does ahead of the first checkpoint
    snap.capture(live)
    assert snap.on_device is False
    opt.step(lr=1e-2, grad_scale=1.0, t=3, seed=7)  # the next update, at once
    out = {}
    writer = threading.Thread(target=lambda: out.update(snap.to_host()))
    writer.start()
    writer.join(60)
    torch.cuda.synchronize()
    for k, t in live.items():
        assert not torch.equal(t.cpu(), at_capture[k]), f"the update left {k} unchanged"
        assert snap.pins(out[k]), k
        assert torch.equal(out[k], at_capture[k]), k


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", ["host", "device"])
def test_a_checkpoint_costs_the_step_no_gpu_memory_on_the_host_path(mode):
    """Peak GPU memory over a step with a checkpoint (capture, update, copy to the host)
    against the same step without: flat on the host path (no device buffers), up by the
    state's size on the device path (the older scheme, the measurement's own check)."""
    opt, live = _gpu_optimizer()
    snap = StateSnapshot(mode)
    opt.before_write = snap.before_write
    snap.reserve(live)
    update = lambda: opt.step(lr=1e-2, grad_scale=1.0, t=3, seed=7)  # noqa: E731
    update()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    update()
    torch.cuda.synchronize()
    without = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    snap.capture(live)
    update()
    snap.to_host()
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - without
    state = nbytes(live)
    if mode == "host":
        assert grown < 16 << 20, f"the checkpoint's step took {grown / 2**20:.0f} MiB more"
    else:
        assert snap.on_device and grown >= state, (grown, state)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", ["host", "device"])
def test_on_a_gpu_the_training_thread_does_not_wait_and_the_copy_is_the_state_at_capture(mode):
    """Either path: capture returns without waiting; kernels enqueued after it that overwrite
    the live tensors (the next steps, after before_write as every writer calls it) do not reach
    what the writer thread takes to the host."""
    dev = torch.device("cuda")
    n = 64 << 20  # 256 MB of float32 per tensor: copies long enough to race with
    live = {"m": torch.randn(n, device=dev), "v": torch.randn(n, device=dev), "params": None}
    expected = {k: t.cpu() for k, t in live.items() if t is not None}
    snap = StateSnapshot(mode)
    snap.capture(live)
    assert snap.on_device is (mode == "device")
    snap.before_write()
    for _ in range(20):  # the next steps, queued behind the capture on the same stream
        live["m"].mul_(1.5).add_(1.0)
        live["v"].sub_(2.0)
    out = {}
    writer = threading.Thread(target=lambda: out.update(snap.to_host()))
    writer.start()
    writer.join(60)
    assert snap.pins(out["m"]) and out["params"] is None
    assert torch.equal(out["m"], expected["m"]) and torch.equal(out["v"], expected["v"])


@pytest.mark.gpu
@cuda
def test_without_gpu_memory_for_the_device_copy_it_says_so_and_copies_to_the_host(caplog):
    dev = torch.device("cuda")
    live = {"m": torch.randn(1 << 20, device=dev), "params": None}
    expected = live["m"].cpu()
    snap = StateSnapshot("device", mem_get_info=lambda: (snapshot.HEADROOM_BYTES, 80 << 30))
    with caplog.at_level(logging.WARNING, logger="raygpt.checkpointing.snapshot"):
        snap.capture(live)
    assert snap.on_device is False
    assert "copies its state straight to the host instead" in caplog.text
    snap.before_write()
    live["m"].add_(1.0)
    out = snap.to_host()
    assert snap.pins(out["m"]) and torch.equal(out["m"], expected)


@pytest.mark.gpu
@cuda
def test_small_host_buffers_side_by_side_are_each_pinned():
    """Registered page by page, small buffers allocated next to each other are all pinned."""
    from raygpt.checkpointing.snapshot import PinnedBuffers

    pinned = PinnedBuffers()
    bufs = [pinned.get(f"t{i}", torch.empty(n)) for i, n in enumerate([1, 3, 1000, 5, 70_000])]
    assert all(pinned.pins(b) for b in bufs)
    assert not pinned.pins(torch.empty(8))  # memory it did not register
    pinned.close()
    assert not pinned.buffers
