"""A run's process-wide torch switches, owned by one context manager: deterministic mode
(--deterministic, the GPU default) and TF32, set for the loop's duration and the caller's own
values given back after it, so a process that trains and then goes on (a test session, a
notebook, the bench) is not left computing differently.

Deterministic mode is strict: an op with no deterministic implementation raises, and
`run_switches` turns PyTorch's error into `NonDeterministicOp` (a bad input: a restart would
meet the same op).
"""

from __future__ import annotations

import contextlib
import os

import torch

from raygpt.config import ConfigError

# How PyTorch words the error an op without a deterministic implementation raises in strict mode
NOT_DETERMINISTIC = "does not have a deterministic implementation"


class NonDeterministicOp(ConfigError):
    """Deterministic mode (the GPU default, or --deterministic) met an op with no deterministic
    implementation: the run cannot keep its promise, and a restart would meet the same op (a
    bad-input error, not a fault to retry)."""

    def __init__(self, op: str):
        super().__init__(f"--deterministic (the default on GPUs): {op} has no deterministic "
                         f"implementation on this device; run with --no-deterministic (resumes "
                         f"are then close, not bit-exact), or avoid the op")
        self.op = op


def op_named_in(message: str) -> str:
    """The op's name from PyTorch's error ('<op> does not have a deterministic ...')."""
    return message.split(NOT_DETERMINISTIC)[0].strip().rstrip(",") or "an op"


@contextlib.contextmanager
def run_switches(deterministic: bool):
    """The run's switches for the duration of the `with` (deterministic mode when
    `deterministic`, TF32 always), the caller's values back after it; inside it, PyTorch's
    error for an op with no deterministic implementation becomes NonDeterministicOp."""
    with torch_settings_restored():
        set_switches(deterministic)
        try:
            yield
        except RuntimeError as e:
            if deterministic and NOT_DETERMINISTIC in str(e):
                raise NonDeterministicOp(op_named_in(str(e))) from e
            raise


@contextlib.contextmanager
def torch_settings_restored():
    """The process-wide torch switches a run sets (deterministic algorithms, TF32) given back
    to the caller's values when the `with` ends, by a return or an error."""
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory,
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[3:]


def set_switches(deterministic: bool) -> None:
    """The process-wide torch switches of a run (`run_switches` gives the caller's back after)."""
    if deterministic:
        # cuBLAS is deterministic only with a fixed workspace (PyTorch's reproducibility notes);
        # read when the first cuBLAS handle is made, which is after this point in a worker
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # strict: an op without a deterministic implementation raises (see run_switches), rather
        # than warning and running its non-deterministic kernel (on an H200, with warn_only,
        # cuDNN's attention backward made step 2's loss differ run to run)
        torch.use_deterministic_algorithms(True)
        # ...but not its filling of every torch.empty with NaN (49 fill kernels, 1.5 ms a step
        # at d12 B=64 on an H200): the loop reads no memory it has not written, and the GPU
        # tests' two-run equality would show it if it did
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
