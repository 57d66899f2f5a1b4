"""What --hellaswag costs a run: raygpt's scoring (raygpt.eval.hellaswag, one batched forward of
four rows per example, llm.c's dev/data/hellaswag.py rule) of 10,042 examples shaped like
HellaSwag's validation split, at GPT-2 124M, timed after a warm-up.

    python bench/hellaswag_cost.py [--examples 10042] [--dtype bf16] [--file hellaswag_val.jsonl]

Without --file the examples are made from Tiny Shakespeare's text with HellaSwag's shape (a
context of 20-100 tokens, four endings of 5-30 tokens; the machines here cannot download the
real file), which fixes the cost, not the accuracy. Prints one table row per dtype.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raygpt.data.tokenizer import RANKS_PATH, decode, encode  # noqa: E402
from raygpt.eval import hellaswag  # noqa: E402
from raygpt.model.gpt import GPT, GPTConfig  # noqa: E402


def shaped_examples(n: int) -> list[hellaswag.Example]:
    tokens = encode((RANKS_PATH.parent / "input.txt").read_text())
    rng = random.Random(0)

    def piece(lo, hi):
        start = rng.randrange(len(tokens) - hi)
        return decode(tokens[start:start + rng.randint(lo, hi)]).strip()
    return [hellaswag.Example(piece(20, 100), tuple(piece(5, 30) for _ in range(4)),
                              rng.randrange(4)) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=10042)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--file", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    examples = hellaswag.read_examples(a.file) if a.file else shaped_examples(a.examples)
    model = GPT(GPTConfig.from_depth(12), init_seed=1).to(device)
    if a.dtype == "bf16":
        model = model.to(torch.bfloat16)
    hellaswag.score(model, examples[:50], device)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    correct, total = hellaswag.score(model, examples, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    s = time.perf_counter() - t
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{'device':<24}{'model':>8}{'dtype':>7}{'examples':>10}{'seconds':>9}{'ms/example':>12}")
    print(f"{name:<24}{'d12':>8}{a.dtype:>7}{total:>10,}{s:>9.1f}{1e3 * s / total:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
