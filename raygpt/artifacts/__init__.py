"""Compiled artifacts kept between runs, trusted only when signed with the user's key.

    signed_file.py    the user's artifact key and the HMAC-signed envelope (SECURITY.md)
    compile_cache.py  torch.compile's cache artifacts in the run directory, signed
    kernel_bundle.py  raygpt's Triton kernels, compiled once, bundled and signed
"""
