"""HellaSwag, completion style, exactly as llm.c's `dev/data/hellaswag.py` scores it.

An example is a context and four endings. Each ending is scored by the model's mean
cross-entropy over the ending's own tokens (context tokens, then the ending's with a leading
space: `encode(" " + ending)`), and the ending with the lowest mean loss is the prediction;
accuracy over examples is llm.c's acc_norm. The rows of a group of examples go through the model
as one batch, padded at the end (causal attention: padding never reaches the scored positions).

The file is the official JSON Lines (`hellaswag_val.jsonl`: `ctx`, `endings`, `label`); raygpt
cannot download it. `read_examples` checks every line before anything is scored, naming the line
of the first that is not an example.
"""

from __future__ import annotations

import dataclasses
import json

import torch
import torch.nn.functional as F

from raygpt.data import tokenizer

MAX_LINE_BYTES = 1 << 20


class HellaSwagError(ValueError):
    """The file is not HellaSwag's JSON Lines; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class Example:
    ctx: str
    endings: tuple[str, str, str, str]
    label: int
    line: int = dataclasses.field(default=0, compare=False)  # in its file, for errors


MAX_FILE_BYTES = 256 << 20  # the validation split is about 11 MB


def read_examples(path: str, endpoint: str = "") -> list[Example]:
    """Every example of a HellaSwag JSON Lines file (a local path, or a URI read through
    pyarrow.fs with the run's storage endpoint), each line checked (HellaSwagError naming the
    file, the line and the field)."""
    data = _read(path, endpoint)
    out = []
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if len(raw) > MAX_LINE_BYTES:
            raise HellaSwagError(f"{path}: line {n}: expected at most {MAX_LINE_BYTES:,} bytes, "
                                 f"found more")
        if raw.strip():
            out.append(_example(raw, path, n))
    if not out:
        raise HellaSwagError(f"{path}: expected HellaSwag examples (JSON Lines), found none")
    return out


def _read(path: str, endpoint: str) -> bytes:
    try:
        from raygpt.storage.uri import open_filesystem, open_regular  # bounded calls; no FIFO wait
        if "://" in path:
            fs, inner = open_filesystem(path, endpoint)
            stream = fs.open_input_stream(inner)
        else:
            stream = open_regular(path, "HellaSwag file")
        with stream as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except (OSError, ValueError) as e:
        raise HellaSwagError(f"{path}: cannot read ({e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise HellaSwagError(f"{path}: expected at most {MAX_FILE_BYTES:,} bytes, found more")
    return data


def _example(raw: bytes, path: str, n: int) -> Example:
    try:
        d = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise HellaSwagError(f"{path}: line {n}: expected a JSON object ({str(e)[:120]})") from None
    if not isinstance(d, dict):
        raise HellaSwagError(f"{path}: line {n}: expected a JSON object, found {type(d).__name__}")
    ctx, endings, label = d.get("ctx"), d.get("endings"), d.get("label")
    if not isinstance(ctx, str):
        raise HellaSwagError(f"{path}: line {n}: ctx: expected a string, found {ctx!r:.60}")
    if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
        raise HellaSwagError(f"{path}: line {n}: endings: expected a list of 4 strings, found "
                             f"{endings!r:.80}")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < 4:
        raise HellaSwagError(f"{path}: line {n}: label: expected 0, 1, 2 or 3, found {label!r}")
    return Example(ctx, tuple(endings), label, n)


def tokens_of(example: Example) -> int:
    """The length of the longest of the example's four rows (render's T)."""
    ctx = len(tokenizer.encode(example.ctx))
    return max(ctx + len(tokenizer.encode(" " + e)) for e in example.endings)


def check_context(examples: list[Example], block_size: int, path: str) -> None:
    """HellaSwagError naming the file and the line of the first example longer than the
    model's context (`block_size` tokens), checked for all before any is scored."""
    for ex in examples:
        n = tokens_of(ex)
        if n > block_size:
            raise HellaSwagError(f"{path}: line {ex.line}: expected an example of at most "
                                 f"{block_size} tokens (the model's context), found {n}")


def render(example: Example) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, mask), both (4, T) int64: each row the context's tokens then one ending's
    (with its leading space), zero-padded; the mask 1 on the ending's tokens."""
    ctx = tokenizer.encode(example.ctx)
    rows, masks = [], []
    for ending in example.endings:
        end = tokenizer.encode(" " + ending)
        rows.append(ctx + end)
        masks.append([0] * len(ctx) + [1] * len(end))
    T = max(len(r) for r in rows)
    tokens = torch.zeros((4, T), dtype=torch.long)
    mask = torch.zeros((4, T), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        tokens[i, :len(r)] = torch.tensor(r)
        mask[i, :len(m)] = torch.tensor(m)
    return tokens, mask


def predict(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> int:
    """The ending whose tokens have the lowest mean loss, from the (4, T, V) logits of its rows."""
    shift_logits = logits[:, :-1, :].float()                                  # (4, T-1, V)
    shift_tokens = tokens[:, 1:]                                              # (4, T-1)
    losses = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)),
                             shift_tokens.reshape(-1), reduction="none").view(4, -1)
    shift_mask = mask[:, 1:].to(losses.dtype)                                 # (4, T-1)
    mean = (losses * shift_mask).sum(dim=1) / shift_mask.sum(dim=1)           # (4,)
    return int(mean.argmin().item())


@torch.no_grad()
def score(model, examples: list[Example], device, *, group: int = 16,
          progress=None) -> tuple[int, int]:
    """(correct, total) acc_norm of `model` (raygpt's GPT: logits from `model(tokens)`) on the
    examples, `group` examples (4 rows each, zero-padded to the longest) per forward pass, as
    llm.c's C evaluation batches them."""
    model.eval()
    correct = 0
    for lo in range(0, len(examples), group):
        batch = examples[lo:lo + group]
        rendered = [render(ex) for ex in batch]
        T = max(t.shape[1] for t, _ in rendered)
        tokens = torch.zeros((4 * len(batch), T), dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for i, (t, m) in enumerate(rendered):
            tokens[4 * i:4 * i + 4, :t.shape[1]] = t
            mask[4 * i:4 * i + 4, :m.shape[1]] = m
        tokens, mask = tokens.to(device), mask.to(device)
        logits = model(tokens)
        for i, ex in enumerate(batch):
            rows = slice(4 * i, 4 * i + 4)
            correct += predict(logits[rows], tokens[rows], mask[rows]) == ex.label
        if progress is not None:
            progress(lo + len(batch), len(examples), correct)
    return correct, len(examples)
