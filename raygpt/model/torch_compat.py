"""Every use of PyTorch's private API in raygpt, in one place: a torch upgrade is checked here.

torch.compile's public surface does not say two things raygpt needs: that AOTAutograd may cache
graphs holding raygpt's own autograd Functions, and how to import the compiler ahead of the
first compilation. Each hook says why and the torch versions it was checked on. No other module
of raygpt imports a private torch module or touches one (tests/model/test_torch_compat.py enforces it).
"""

from __future__ import annotations

CHECKED_ON = "torch 2.13.0"


def allow_custom_autograd_in_aot_cache() -> None:
    """Let AOTAutograd's cache keep graphs that hold custom autograd Functions (raygpt's kernels
    are ones): it refuses them by default, since it cannot tell whether their code changed
    (raygpt.artifacts.compile_cache puts a hash of that code in every key). The flag is torch's
    TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD, which wins when the user sets it.
    Checked on torch 2.13.0."""
    import torch._functorch.config

    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True


def import_compiler() -> None:
    """Import torch.compile's machinery (Dynamo, Inductor) and compute Inductor's per-process
    system key (the device's compiler versions, Triton's source hashed: about a second), which
    it otherwise computes on the first compilation; a torch without that key skips it.
    Checked on torch 2.13.0."""
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor import codecache

    getattr(getattr(codecache, "CacheBase", None), "get_system", lambda: None)()
