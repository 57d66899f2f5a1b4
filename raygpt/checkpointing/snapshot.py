"""The copy of a checkpoint's tensors taken at the step boundary (`StateSnapshot`), in three
parts: what the training thread pays at the checkpoint's step (`capture`), what every later
write to those tensors does first (`before_write`), and what the writer thread does
(`to_host`).

On a GPU, by default (`host`), the tensors (m, v, master weights, rank 0's working weights) go
from the device straight into pinned host buffers on a side stream, with no device copy:

    compute stream:  update(k-1) -[A]- forward/backward(k) ----(waits for B)- update(k)
    side stream:                  (waits for A) m, v, master, params -> pinned host -[B]-

`capture` records A on the compute stream, enqueues the copies behind it on the side stream
(non_blocking: a few launches, the training thread waits for nothing) and records B. The next
step's forward and backward only read the weights, so they run beside the copy. Whatever
writes those tensors next (the optimizer's update, ZeRO's gather, a rederive, a restore or a
rewind) calls `before_write` first, which makes the current stream wait for B on the device
(no host sync): the copy reads the state of the checkpoint's step, never a later one. When
the copy outlasts the next step's forward and backward (a large state, a short step), that
step's update waits for the rest of it, once per checkpoint. `to_host` (the writer thread)
waits for B on the host. The snapshot holds no GPU memory.

The pinned buffers are allocated once at their exact sizes (pageable memory registered with
CUDA: torch's pinned allocator rounds each allocation up to a power of two, 8 GiB for a
5.8 GiB tensor) by `reserve`, on a background thread the checkpointer starts when it is
built: pinning touches every page, seconds for tens of GB, so no checkpoint pays it on the
training thread unless it comes before the reservation is done.

`device` keeps the older scheme: device-to-device copies enqueued on the compute stream into
buffers of the state's size on the GPU (allocated at the first capture and held for the
whole run), which the writer thread copies to the host on its side stream; kernels enqueued
after the copies run after them, so nothing else needs to wait. It buys the part of the host
copy the next forward and backward do not hide with the state's size in GPU memory at every
step; when the GPU's free memory cannot hold the buffers with `HEADROOM_BYTES` to spare, it
takes the host path and says so once.

On a CPU, `capture` is the copy (into buffers allocated once) and `to_host` hands them over.
At most one checkpoint is in flight (the checkpointer waits for the writer before it captures
again), so one set of buffers serves every checkpoint.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from contextlib import nullcontext

import torch

log = logging.getLogger(__name__)

MODES = ("host", "device")  # --checkpoint-snapshot

# GPU memory that must stay free after the device path's buffers are allocated (the next
# steps' allocator growth, fragmentation): below it the snapshot takes the host path.
HEADROOM_BYTES = 2 << 30

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current one
PAGE = 4096  # cudaHostRegister locks whole pages


def fits_on_device(needed: int, free: int, headroom: int = HEADROOM_BYTES) -> bool:
    """Whether device snapshot buffers of `needed` bytes may be allocated with `free` bytes free
    on the GPU (the driver's figure: memory the caching allocator holds is the next step's)."""
    return needed + headroom <= free


def nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values() if t is not None)


def on_whole_pages(like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(an empty host tensor shaped like `like`, the address and the length of the whole pages
    it lies on, which no other allocation shares): what cudaHostRegister may lock. CUDA refuses
    to register a page twice, and a small allocation can share its first or last page with
    another buffer."""
    size = like.numel() * like.element_size()
    pages = -(-size // PAGE) * PAGE
    raw = torch.empty(pages + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    return raw[start:start + size].view(like.dtype).view(like.shape), raw.data_ptr() + start, pages


class PinnedBuffers:
    """Host tensors by name, page-locked at their exact size (`torch.empty` registered with
    cudaHostRegister) and unregistered before they are freed. Where the registration fails
    (host memory, limits) the buffer stays pageable, with one warning: the copies into it then
    block the thread that enqueues them."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self._registered: dict[str, int] = {}  # name -> data_ptr registered with CUDA
        self._lengths: dict[str, int] = {}  # name -> bytes registered from that address
        self._warned = False
        self._finalizer = weakref.finalize(self, _unregister_all, self._registered)

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is not None and buf.shape == like.shape and buf.dtype == like.dtype:
            return buf
        self._drop(name)
        buf, ptr, pages = on_whole_pages(like)
        if pages:
            err = torch.cuda.cudart().cudaHostRegister(ptr, pages, CUDA_HOST_REGISTER_PORTABLE)
            if err == torch.cuda.cudart().cudaError.success:
                self._registered[name] = ptr
                self._lengths[name] = pages
            elif not self._warned:
                self._warned = True
                log.warning(f"raygpt | WARNING: checkpoint snapshot: could not pin "
                            f"{pages / 2**30:.2f} GiB of host memory for {name!r} "
                            f"({torch.cuda.cudart().cudaGetErrorString(err)}): each "
                            f"checkpoint's copy to the host blocks the training thread")
        self.buffers[name] = buf
        return buf

    def pins(self, t: torch.Tensor) -> bool:
        """Whether t's bytes lie on pages this object registered with CUDA. (torch's
        is_pinned() asks about the start of t's storage, which here lies before the registered
        pages: the buffers are page-aligned views into a larger allocation.)"""
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return any(ptr <= lo and hi <= ptr + self._lengths[name]
                   for name, ptr in self._registered.items())

    def _drop(self, name: str) -> None:
        self._lengths.pop(name, None)
        ptr = self._registered.pop(name, None)
        if ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self.buffers.pop(name, None)

    def close(self) -> None:
        """Unregister and free every buffer (a later `get` allocates again)."""
        for name in list(self.buffers):
            self._drop(name)


def _unregister_all(registered: dict) -> None:
    for ptr in registered.values():
        torch.cuda.cudart().cudaHostUnregister(ptr)
    registered.clear()


class CudaStreams:
    """The CUDA calls of the host path, behind one seam: streams, events, the asynchronous
    copy, the pinned buffers. The ordering tests drive the snapshot with a fake whose side
    stream runs only when something waits for it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side = None

    def current(self):
        return torch.cuda.current_stream(self.device)

    def side(self):
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        stream.wait_event(event)  # on the device: the host does not wait

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(stream)  # src's memory is not reused before the copy is done

    def synchronize(self, event) -> None:
        event.synchronize()

    def pinned(self) -> PinnedBuffers:
        return PinnedBuffers()


class StateSnapshot:
    """Buffers for one rank's checkpointed tensors and the copy into them (see the module
    docstring). `mode` is --checkpoint-snapshot; `streams` replaces the CUDA calls of the
    host path (tests: given one, CPU tensors take that path too)."""

    def __init__(self, mode: str = "host", *, mem_get_info=None, streams=None):
        assert mode in MODES, mode
        self.mode = mode
        self._streams = streams
        self._device: dict[str, torch.Tensor] = {}  # device path (and the CPU's copies)
        self._host: PinnedBuffers | None = None  # the pinned buffers (GPU, either path)
        self._event = None  # device path: the end of capture's device copies
        self._copied = None  # host path: the end of the copies to the host (event B)
        self._pending: dict | None = None  # {name: tensor | None} captured, not yet handed over
        self.on_device: bool | None = None  # device buffers used: decided at the first capture
        self._mem_get_info = mem_get_info or torch.cuda.mem_get_info
        self._reserving: threading.Thread | None = None
        self.reserve_seconds: float | None = None  # how long pinning the host buffers took

    # ------------------------------------------------------------------ pinned buffers
    def pins(self, t: torch.Tensor) -> bool:
        """Whether t lies in host memory this snapshot pinned (PinnedBuffers.pins)."""
        return self._host is not None and self._host.pins(t)

    def reserve(self, tensors: dict) -> None:
        """Allocate and pin the host buffers for `tensors` ({name: tensor or None}) ahead of
        the first capture (nothing to do on a CPU)."""
        streams = self._streams_for(tensors)
        if streams is None:
            return
        t0 = time.perf_counter()
        if self._host is None:
            self._host = streams.pinned()
        for name, t in tensors.items():
            if t is not None:
                self._host.get(name, t)
        self.reserve_seconds = time.perf_counter() - t0
        log.info(f"raygpt | checkpoint snapshot: {nbytes(tensors) / 2**30:.2f} GiB of host memory "
                 f"pinned in {self.reserve_seconds:.1f} s")

    def reserve_in_background(self, tensors: dict) -> None:
        """`reserve` on a thread; the first capture waits for it if it is still pinning."""
        if self._streams_for(tensors) is None:
            return

        def run():
            try:
                with torch.cuda.device(_device_of(tensors)) if _cuda(tensors) else nullcontext():
                    self.reserve(tensors)
            except Exception as e:  # noqa: BLE001 - the first capture allocates what is missing
                log.warning(f"raygpt | WARNING: checkpoint snapshot: pinning the host buffers "
                            f"ahead of the first checkpoint failed ({type(e).__name__}: {e}); "
                            f"the first checkpoint allocates them")

        self._reserving = threading.Thread(target=run, name="raygpt-ckpt-pin", daemon=True)
        self._reserving.start()

    def close(self) -> None:
        """Free the buffers, pinned and on the device (after the last checkpoint was written;
        a later capture allocates them again)."""
        self._join_reserve()
        if self._host is not None:
            self._host.close()
        self._device.clear()

    # ------------------------------------------------------------------ the three parts
    def capture(self, tensors: dict) -> None:
        """Training thread: take the state of `tensors` ({name: tensor or None}) now."""
        streams = self._streams_for(tensors)
        if streams is None:  # CPU: the copy, here
            for name, t in tensors.items():
                if t is not None:
                    _buffer(self._device, name, t, t.device).copy_(t.detach())
            self._pending = {n: (None if t is None else self._device[n]) for n, t in tensors.items()}
            return
        self._join_reserve()
        if self.on_device is None:
            self.on_device = self._decide(tensors)
        if self.on_device:
            self._capture_on_device(tensors)
        else:
            self._capture_to_host(tensors, streams)

    def before_write(self) -> None:
        """Called before anything writes a captured tensor: the current stream waits, on the
        device, for the last capture's copy to the host (nothing to do once `to_host` saw it
        finish, on the device path or on a CPU)."""
        copied = self._copied
        if copied is not None:
            self._streams.wait(self._streams.current(), copied)

    def to_host(self) -> dict:
        """Writer thread: {name: host tensor or None} of the last capture."""
        captured, self._pending = self._pending, None
        if self._copied is not None:  # host path: wait for the copies here, off the training thread
            self._streams.synchronize(self._copied)
            self._copied = None
            return captured
        if self._event is None:  # a CPU's copies: already there
            return captured
        return self._device_to_host(captured)

    # ------------------------------------------------------------------ the host path
    def _capture_to_host(self, tensors: dict, streams) -> None:
        if self._host is None:
            self._host = streams.pinned()
        compute, side = streams.current(), streams.side()
        streams.wait(side, streams.record(compute))  # A: the state as of this step
        for name, t in tensors.items():
            if t is not None:
                streams.copy(self._host.get(name, t), t.detach(), side)
        self._pending = {n: (None if t is None else self._host.buffers[n])
                         for n, t in tensors.items()}
        self._copied = streams.record(side)  # B: what the next write waits for

    # ------------------------------------------------------------------ the device path
    def _capture_on_device(self, tensors: dict) -> None:
        for name, t in tensors.items():
            if t is not None:
                _buffer(self._device, name, t, t.device).copy_(t.detach(), non_blocking=True)
        self._pending = {n: (None if t is None else self._device[n]) for n, t in tensors.items()}
        self._event = torch.cuda.Event()
        self._event.record()  # on the current stream, after the copies

    def _device_to_host(self, captured: dict) -> dict:
        out = {}
        device = next(t.device for t in captured.values() if t is not None)
        streams = self._streams or CudaStreams(device)
        if self._host is None:
            self._host = streams.pinned()
        with torch.cuda.device(device):
            side = streams.side()
            side.wait_event(self._event)  # capture's copies, in the training stream
            for name, t in captured.items():
                out[name] = None if t is None else self._host.get(name, t)
                if t is not None:
                    streams.copy(out[name], t, side)
            side.synchronize()
        return out

    def _decide(self, tensors: dict) -> bool:
        total = nbytes(tensors)
        if self.mode == "host":
            log.info(f"raygpt | checkpoint snapshot: {total / 2**30:.2f} GiB of this rank's state "
                     f"copied straight to pinned host memory on a side stream (no GPU memory); "
                     f"the update after a checkpoint waits for the copy's end")
            return False
        needed = total - nbytes({n: self._device.get(n) for n in tensors})
        free, _ = self._mem_get_info()
        if fits_on_device(needed, free):
            log.info(f"raygpt | checkpoint snapshot: {needed / 2**30:.2f} GiB of GPU memory for "
                     f"the device copy of this rank's state (--checkpoint-snapshot device)")
            return True
        log.warning(f"raygpt | WARNING: checkpoint snapshot: {needed / 2**30:.2f} GiB of GPU memory "
                    f"needed for a device copy, {free / 2**30:.2f} GiB free (keeping "
                    f"{HEADROOM_BYTES / 2**30:.0f} GiB spare): every checkpoint copies its state "
                    f"straight to the host instead (--checkpoint-snapshot host)")
        return False

    # ------------------------------------------------------------------ helpers
    def _streams_for(self, tensors: dict):
        """The stream interface of the host path, or None for CPU tensors (copied in place)."""
        if self._streams is None and _cuda(tensors):
            self._streams = CudaStreams(_device_of(tensors))
        return self._streams

    def _join_reserve(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None


def _cuda(tensors: dict) -> bool:
    return any(t is not None and t.is_cuda for t in tensors.values())


def _device_of(tensors: dict) -> torch.device:
    return next(t.device for t in tensors.values() if t is not None)


def _buffer(pool: dict, name: str, like: torch.Tensor, device) -> torch.Tensor:
    """`pool[name]`, (re)allocated when it does not match `like`'s shape and dtype."""
    buf = pool.get(name)
    if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
        buf = torch.empty(like.shape, dtype=like.dtype, device=device)
        pool[name] = buf
    return buf
