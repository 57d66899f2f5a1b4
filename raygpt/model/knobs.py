"""The model component's knobs: which GPT-2 to train or start from (-e), its precision and its
z-loss, with their defaults from the hardware and their checks."""

from __future__ import annotations

import os
from dataclasses import dataclass

from raygpt.config.knobs import knob, need
from raygpt.model.shapes import MODEL_SHAPES


@dataclass
class ModelConfig:
    """The model a run trains."""

    model: str | None = knob(None, section="model", short="-e", metavar="dN|FILE|DIR",
                             from_file=True,
                             hints=("--init-from", "--model-name-or-path"))
    """d1..d6 (CPU sizes), d12/d24/d36/d48 (GPT-2 124M/350M/774M/1558M), an llm.c model_*.bin
    file, or a Hugging Face GPT-2 folder (config.json, model.safetensors: `raygpt export` writes
    one) to start from. Default: d12 on GPUs, d4 on CPUs."""
    precision: str | None = knob(None, section="model", choices=("bf16", "fp32"))
    """bf16 (working weights bf16, fp32 master) or fp32. Default: bf16 on GPUs, fp32 on CPUs."""
    z_loss: float = knob(0.0, section="model")
    """Coefficient of the z-loss on the output logits (about 1e-4 when on); 0 turns it off."""


    @property
    def depth(self) -> int | None:
        if self.model and self.model.startswith("d") and self.model[1:].isdigit():
            return int(self.model[1:])
        return None

    def block_size(self) -> int:
        """max_seq_len of an llm.c model file given as -e (1024 for dN names and for a file that
        cannot be read: `raygpt.config.preflight` names that file's problem)."""
        if not self.model or self.depth is not None or not os.path.isfile(self.model):
            return 1024
        import numpy as np
        try:
            header = np.fromfile(self.model, dtype="<i4", count=256)
        except OSError:
            return 1024
        return int(header[2]) if len(header) == 256 and header[2] >= 1 else 1024

    def resolve_model(self, *, on_gpu: bool) -> None:
        if self.model is None:
            self.model = "d12" if on_gpu else "d4"
        if self.precision is None:
            self.precision = "bf16" if on_gpu else "fp32"

    def validate_model(self, *, device: str) -> None:
        need(self.precision in ("fp32", "bf16"), "--precision", "fp32 or bf16", self.precision)
        need(not (device == "cpu" and self.precision == "bf16"), "--precision",
             "fp32 on CPU (bf16 master-weight training needs a GPU)", self.precision)
        need(self.z_loss >= 0, "--z-loss", "a coefficient >= 0", self.z_loss)
        depth = self.depth
        if depth is not None:
            need(depth in MODEL_SHAPES, "-e/--model",
                 f"d{{{','.join(str(d) for d in sorted(MODEL_SHAPES))}}} or a model_*.bin file",
                 self.model)
        else:
            need(os.path.isfile(self.model) or os.path.isfile(os.path.join(self.model, "config.json")),
                 "-e/--model", "dN (N in 1-6, 12, 24, 36, 48), an existing llm.c model_*.bin file "
                 "or a Hugging Face GPT-2 folder (config.json, model.safetensors)", self.model)
