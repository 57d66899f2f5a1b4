"""What a person sees in the terminal: the step line (llm.c's layout, with an ETA), and the
`raygpt` logger every module sends its messages to.

Messages go through Python's `logging` (logger "raygpt" and its children, `log` below), printed
as their bare text, as print() printed them: INFO to stdout, WARNING and above to stderr. The
stream is looked up at each record, not bound once, so a redirected sys.stdout (pytest's
capture, a notebook) gets the lines. The logger does not propagate to the root logger: an
application's own logging setup (or Ray's, in a worker) would print every line twice.
"""

from __future__ import annotations

import logging
import math
import sys

log = logging.getLogger("raygpt")


class _ConsoleHandler(logging.Handler):
    """The record's message on today's sys.stdout (below WARNING) or sys.stderr, flushed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: a message never stops the run
            self.handleError(record)


if not any(isinstance(h, _ConsoleHandler) for h in log.handlers):
    log.addHandler(_ConsoleHandler())
    log.setLevel(logging.INFO)
    log.propagate = False


def printable(text: str) -> str:
    """Model output for a terminal: newlines and tabs kept, every other control character
    (an escape sequence, a carriage return) shown as its escape instead of acting."""
    return "".join(ch if ch.isprintable() or ch in "\n\t" else ascii(ch)[1:-1] for ch in text)


def val_text(val_loss: float | None) -> str:
    return "n/a" if val_loss is None or not math.isfinite(val_loss) else f"{val_loss:.4f}"


def format_step_line(step: int, total_steps: int, loss: float, norm: float, lr: float,
                     dt_ms: float, tok_per_s: float, mfu: float | None, *,
                     precision: str = "bf16", loss_z: float | None = None,
                     norm_z: float | None = None, eta_s: float | None = None,
                     note: str = "") -> str:
    """One console line per step, llm.c's layout (one line, wrapped here):
        step    7/150 | loss 7.123456 (+nanz)| norm 1.2345 (+0.12z)| lr 3.00e-04 | 123.45 ms
        | 45.6% bf16 MFU | 12345 tok/s | eta 2m05s
    The z-scores appear only when given (NaN while llm.c's detector warms up, as llm.c prints
    it); the MFU column only where there is a figure (none on a CPU or an unknown device: None);
    the ETA (seconds to the run's end, raygpt.runlog.eta) only when given. `step` is
    printed as given (llm.c prints step + 1). `note` (e.g. "SKIP") is appended at the end."""
    z_loss = f" ({loss_z:+.2f}z)" if loss_z is not None else " "
    z_norm = f" ({norm_z:+.2f}z)" if norm_z is not None else " "
    mfu_text = ("" if mfu is None else
                f"| {'n/a' if not math.isfinite(mfu) else f'{100 * mfu:.1f}%'} {precision} MFU ")
    line = (f"step {step:4d}/{total_steps} | loss {loss:.6f}{z_loss}| norm {norm:6.4f}{z_norm}| "
            f"lr {lr:.2e} | {dt_ms:.2f} ms {mfu_text}| {tok_per_s:.0f} tok/s")
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
