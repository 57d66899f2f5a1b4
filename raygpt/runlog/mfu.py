"""Model FLOPs utilisation, llm.c's gpt2_estimate_mfu and llmc/mfu.h: FLOPs per token and the
promised FLOP/s of known devices (None for an unknown device or a CPU, never a made-up figure)."""

from __future__ import annotations

import re


def flops_per_token(num_params: int, num_layers: int, channels: int, seq_len: int) -> int:
    """Training FLOPs per token, llm.c's gpt2_estimate_mfu (Kaplan et al. 2020, section 2.1):
        6 N      every weight is in one matmul forward (2 flops) and two backward (4 flops)
        6 L C T  attention scores and the weighted sum of values, forward and backward
    N counts every parameter (LayerNorms, biases and wpe included, a slight over-count; wte is
    right to count, it is also the classifier). T is the runtime sequence length. llm.c does this
    in size_t because 6*L*C*T overflows int; Python ints do not overflow."""
    return 6 * int(num_params) + 6 * int(num_layers) * int(channels) * int(seq_len)


# Dense (no structured sparsity) tensor-core TFLOP/s from NVIDIA's datasheets and whitepapers; bf16
# and tf32 are the tensor-core figures llm.c's mfu.h uses (its fp32 mode uses the tf32 one), fp32
# is plain CUDA-core fp32 (for runs that turn TF32 off). The first key found in the device name
# as whole words wins, so variants come before their family. llm.c's table scales a
# per-architecture figure by core count and clock (988.8 for "NVIDIA H100 80GB HBM3"); these are
# the spec-sheet values.
PROMISED_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 80GB HBM3": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM5 (llm.c's name)
    "H100 SXM": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM: same tensor cores as H100 SXM
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},  # PCIe and SXM4, 40 and 80 GB
}
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


def promised_flops(device_name: str | None, precision: str) -> float | None:
    """Peak dense FLOP/s (not TFLOP/s) of `device_name` at `precision`, or None for an unknown
    device or a CPU: MFU is then unknown, never a made-up figure. fp16 uses the bf16 figure."""
    if precision not in PRECISIONS:
        raise ValueError(f"MFU precision: expected one of {' | '.join(PRECISIONS)}, found "
                         f"{precision!r}")
    if not device_name:
        return None
    key = "bf16" if precision == "fp16" else precision
    for substring, figures in PROMISED_TFLOPS.items():
        if _names_part(substring, device_name):
            return figures[key] * 1e12
    return None


def _names_part(substring: str, device_name: str) -> bool:
    """`substring` appears in the name as whole words: "A100" is in "NVIDIA A100-SXM4-80GB" but
    not in "NVIDIA RTX A1000", "H200" not in "NVIDIA GH200 480GB"."""
    pattern = r"(?<![a-z0-9])" + re.escape(substring.lower()) + r"(?![a-z0-9])"
    return re.search(pattern, device_name.lower()) is not None


def estimate_mfu(num_params: int, num_layers: int, channels: int, seq_len: int, tokens: int,
                 dt_seconds: float, device_name: str | None, precision: str) -> float | None:
    """Model FLOPs utilisation as a fraction (0.45 = 45%) of one device's promised FLOP/s:
    flops_per_token * tokens / dt / promised. `tokens` are the tokens this device processed in
    dt_seconds. None when the device is unknown."""
    promised = promised_flops(device_name, precision)
    if promised is None:
        return None
    if not dt_seconds > 0:
        raise ValueError(f"MFU: dt_seconds must be > 0, found {dt_seconds!r}")
    achieved = flops_per_token(num_params, num_layers, channels, seq_len) * tokens / dt_seconds
    return achieved / promised
