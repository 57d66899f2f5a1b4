"""The copy of a checkpoint's tensors taken at the step boundary (`StateSnapshot`), in two
halves: what the training thread pays, and what a background thread does.

`capture` (training thread, at the checkpoint's step): one copy of each tensor (m, v, master
weights, rank 0's working weights) into buffers on the tensor's own device, allocated once and
reused. On a GPU these are device-to-device copies enqueued on the current stream (about 1 GB
at HBM bandwidth: well under a millisecond of GPU time) and nothing waits for them: the next
step's kernels, which overwrite the live tensors, run after them in stream order, so the buffers
hold exactly the state at the checkpoint's step. An event marks their end.

`to_host` (the checkpoint's writer thread): waits for that event on a side stream, copies the
buffers into pinned host memory there (allocated once, on this thread: pinning 1 GB takes a few
hundred milliseconds that the training thread no longer pays), and waits for its own stream
only. The device buffers are reused at the next `capture` only, which the checkpointer makes
after the previous writer finished (at most one checkpoint in flight).

The device buffers cost the size of this rank's checkpointed tensors in GPU memory. When the
GPU's free memory cannot hold them with `HEADROOM_BYTES` to spare, the snapshot copies straight into
pinned host memory on the training thread and waits for it (the stall of a device-to-host copy),
and says so once in the log. On a CPU the "device" buffers are host memory: `capture` is the
copy, `to_host` hands the buffers over, and the same two halves run.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# GPU memory that must stay free after the snapshot buffers are allocated (the next steps'
# allocator growth, fragmentation): below it the snapshot goes straight to the host.
HEADROOM_BYTES = 2 << 30


def fits_on_device(needed: int, free: int, headroom: int = HEADROOM_BYTES) -> bool:
    """Whether device snapshot buffers of `needed` bytes may be allocated with `free` bytes free
    on the GPU (the driver's figure: memory the caching allocator holds is the next step's)."""
    return needed + headroom <= free


def nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values() if t is not None)


class StateSnapshot:
    """Reusable buffers for one rank's checkpointed tensors (see the module docstring)."""

    def __init__(self, *, mem_get_info=None):
        self._device: dict[str, torch.Tensor] = {}
        self._host: dict[str, torch.Tensor] = {}
        self._event = None  # the end of capture's device copies (CUDA)
        self._stream = None  # the side stream of the device-to-host copies (CUDA)
        self._pending: dict | None = None  # {name: tensor | None} captured, not yet on the host
        self.on_device: bool | None = None  # decided at the first capture on a GPU
        self._mem_get_info = mem_get_info or torch.cuda.mem_get_info

    def capture(self, tensors: dict) -> None:
        """Training thread: take the state of `tensors` ({name: tensor or None}) now."""
        cuda = any(t is not None and t.is_cuda for t in tensors.values())
        if cuda and self.on_device is None:
            self.on_device = self._decide(tensors)
        if cuda and not self.on_device:  # the fallback: device-to-host on this thread
            for name, t in tensors.items():
                if t is not None:
                    _buffer(self._host, name, t, "cpu", pin=True).copy_(t.detach(), non_blocking=True)
            torch.cuda.current_stream().synchronize()
            self._pending = {n: (None if t is None else self._host[n]) for n, t in tensors.items()}
            self._event = None
            return
        for name, t in tensors.items():
            if t is not None:
                _buffer(self._device, name, t, t.device).copy_(t.detach(), non_blocking=True)
        self._pending = {n: (None if t is None else self._device[n]) for n, t in tensors.items()}
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()  # on the current stream, after the copies

    def to_host(self) -> dict:
        """Writer thread: {name: host tensor or None} of the last capture."""
        captured, self._pending = self._pending, None
        if self._event is None:  # CPU buffers, or the fallback's pinned copies: already there
            return captured
        out = {}
        with torch.cuda.device(next(t.device for t in captured.values() if t is not None)):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(self._event)  # capture's copies, in the training stream
                for name, t in captured.items():
                    if t is None:
                        out[name] = None
                        continue
                    host = _buffer(self._host, name, t, "cpu", pin=True)
                    host.copy_(t, non_blocking=True)
                    out[name] = host
            self._stream.synchronize()
        return out

    def _decide(self, tensors: dict) -> bool:
        needed = nbytes(tensors) - nbytes({n: self._device.get(n) for n in tensors})
        free, _ = self._mem_get_info()
        if fits_on_device(needed, free):
            log.info(f"raygpt | checkpoint snapshot: {needed / 2**30:.2f} GiB of GPU memory for "
                     f"the device copy of this rank's state (the training thread does not wait "
                     f"for the copy to the host)")
            return True
        log.warning(f"raygpt | WARNING: checkpoint snapshot: {needed / 2**30:.2f} GiB of GPU memory "
                    f"needed for a device copy, {free / 2**30:.2f} GiB free (keeping "
                    f"{HEADROOM_BYTES / 2**30:.0f} GiB spare): every checkpoint copies its state to "
                    f"the host on the training thread instead (a longer stall)")
        return False


def _buffer(pool: dict, name: str, like: torch.Tensor, device, pin: bool = False) -> torch.Tensor:
    """`pool[name]`, (re)allocated when it does not match `like`'s shape and dtype."""
    buf = pool.get(name)
    if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
        buf = torch.empty(like.shape, dtype=like.dtype, device=device, pin_memory=pin)
        pool[name] = buf
    return buf
