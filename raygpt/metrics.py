"""What a run reports: llm.c's main.log, MFU, the console line per step (with its ETA), and
`steps_logged` over loss_history.jsonl's records. `raygpt.runlog` sends each event here.

main.log (llm.c's llmc/logger.h, one line per call, rank 0 only):
    s:<step> trl:<loss %.4f> lr:<%.6f> norm:<%.2f>     train step
    s:<step> tel:<val loss %.4f>                       validation
    s:<step> eval:<%.4f>                               evaluation (e.g. HellaSwag accuracy)
    s:<step> <kind>:1 <key>:<value> ...                raygpt event (skip, rewind, resume, ...)
Event lines keep llm.c's shape "s:N name:number": llm.c's dev/ plotting code reads the second
token of every line as a named stream and plots only trl/tel/eval, so an event lands in a stream of
its own and is otherwise ignored. Event values: ints and bools as %d, floats as %.4f, None as
"none", anything else as its str() with each run of whitespace turned into "_" (one token).

loss_history.jsonl (written by raygpt.history through RunDir): one JSON object per line, never
truncated, across restarts and rewinds; a step re-run after a rewind appears again and the later
line wins.
"""

from __future__ import annotations

import math
import re

from raygpt.storage import RunDir, open_run_dir

# ---------------------------------------------------------------------- main.log


MAIN_LOG = "main.log"


def _append_text(run_dir: RunDir, rel: str, text: str) -> None:
    """The one place main.log is written: one durable append through the run directory's
    filesystem (local and NFS append + fsync; object stores emulate it, see RunDir.append_text)."""
    run_dir.append_text(rel, text)


def _truncate(run_dir: RunDir, rel: str) -> None:
    run_dir.write_bytes_atomic(rel, b"")


_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_LLMC_STREAMS = frozenset({"trl", "tel", "eval"})


class Logger:
    """llm.c's Logger: active only on rank 0 with a log_dir; every call appends one line to the
    file and makes it durable, so a crash loses no buffered lines. A fresh start (resume false)
    truncates `{log_dir}/main.log`; a resume appends to it. log_dir is anything `open_run_dir`
    takes (a local path, an s3:// / gs:// URI, an (fs, path) pair, a RunDir)."""

    def __init__(self, log_dir, process_rank: int, resume: bool | int) -> None:
        self.active = log_dir is not None and process_rank == 0
        self.run_dir = open_run_dir(log_dir) if self.active else None
        self.output_log_file = self.run_dir.uri(MAIN_LOG) if self.active else None
        if self.active and not resume:
            _truncate(self.run_dir, MAIN_LOG)  # wipe a previous run's log on a fresh start

    def _write(self, line: str) -> None:
        if self.active:
            _append_text(self.run_dir, MAIN_LOG, line + "\n")

    def log_train(self, step: int, loss: float, lr: float, norm: float) -> None:
        self._write("s:%d trl:%.4f lr:%.6f norm:%.2f" % (step, loss, lr, norm))

    def log_val(self, step: int, val_loss: float) -> None:
        self._write("s:%d tel:%.4f" % (step, val_loss))

    def log_eval(self, step: int, value: float) -> None:
        self._write("s:%d eval:%.4f" % (step, value))

    def log_event(self, step: int, kind: str, **fields) -> None:
        """`s:<step> <kind>:1 key:value ...`, e.g. `s:57 skip:1 lossz:7.3100 gnormx:1.0200`.
        Fields keep the order given."""
        self._write(format_event(step, kind, **fields))


def format_event(step: int, kind: str, **fields) -> str:
    if not _TOKEN.match(kind) or kind in _LLMC_STREAMS:
        raise ValueError(f"main.log event kind: expected an identifier other than "
                         f"{sorted(_LLMC_STREAMS)}, found {kind!r}")
    parts = ["s:%d" % step, f"{kind}:1"]
    for key, value in fields.items():
        if not _TOKEN.match(key):
            raise ValueError(f"main.log event {kind!r}: field names must be identifiers, "
                             f"found {key!r}")
        parts.append(f"{key}:{_event_value(value)}")
    return " ".join(parts)


def _event_value(value) -> str:
    # A log line must never stop a run, so every value has a one-token form.
    if value is None:
        return "none"
    if isinstance(value, (bool, int)):
        return "%d" % value
    if isinstance(value, float):
        return "%.4f" % value
    return "_".join(str(value).split()) or "_"  # whitespace would split the line's tokens


# ---------------------------------------------------------------------- loss_history.jsonl


def steps_logged(records: list[dict]) -> dict[int, float]:
    """{step: loss} from loss-history records, the latest attempt of each step winning (the file
    is in time order, so a step re-run after a resume or rewind overrides its earlier line).
    Step records carry "step" and "loss"; records with an "event" key (a skip or rewind note,
    even one that repeats the loss) are ignored."""
    out: dict[int, float] = {}
    for rec in records:
        if "step" in rec and "loss" in rec and "event" not in rec:
            out[int(rec["step"])] = float(rec["loss"])
    return out


# ---------------------------------------------------------------------- MFU


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


# ---------------------------------------------------------------------- console


def format_step_line(step: int, total_steps: int, loss: float, norm: float, lr: float,
                     dt_ms: float, tok_per_s: float, mfu: float | None, *,
                     precision: str = "bf16", loss_z: float | None = None,
                     norm_z: float | None = None, eta_s: float | None = None,
                     note: str = "") -> str:
    """One console line per step, llm.c's layout (one line, wrapped here):
        step    7/150 | loss 7.123456 (+nanz)| norm 1.2345 (+0.12z)| lr 3.00e-04 | 123.45 ms
        | 45.6% bf16 MFU | 12345 tok/s | eta 2m05s
    The z-scores appear only when given (NaN while llm.c's detector warms up, as llm.c prints
    it); MFU None prints "n/a"; the ETA (seconds to the last step) only when given. `step` is
    printed as given (llm.c prints step + 1). `note` (e.g. "SKIP") is appended at the end."""
    z_loss = f" ({loss_z:+.2f}z)" if loss_z is not None else " "
    z_norm = f" ({norm_z:+.2f}z)" if norm_z is not None else " "
    mfu_text = "n/a" if mfu is None or not math.isfinite(mfu) else f"{100 * mfu:.1f}%"
    line = (f"step {step:4d}/{total_steps} | loss {loss:.6f}{z_loss}| norm {norm:6.4f}{z_norm}| "
            f"lr {lr:.2e} | {dt_ms:.2f} ms | {mfu_text} {precision} MFU | {tok_per_s:.0f} tok/s")
    if eta_s is not None:
        line += f" | eta {format_duration(eta_s)}"
    return f"{line} | {note}" if note else line


def format_duration(seconds: float) -> str:
    """12s, 3m05s, 2h07m, 3d04h: two units at most, rounded down; "n/a" for NaN or inf."""
    if not math.isfinite(seconds):
        return "n/a"
    s = max(0, int(seconds))
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60),
                                      ("m", 60, "s", 1)):
        if s >= size:
            return f"{s // size}{unit}{(s % size) // sub_size:02d}{sub}"
    return f"{s}s"
