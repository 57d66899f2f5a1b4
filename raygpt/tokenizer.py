"""GPT-2's BPE tokenizer, fully offline, and the text -> llm.c token shards recipe.

The encoding is tiktoken's r50k_base ("gpt2") built from the ranks file vendored in
raygpt/data_files, checked against its published sha256; nothing here touches the network.
`prepare_shards` is llm.c's tinyshakespeare.py recipe, and `python -m raygpt.tokenizer` its CLI:

    python -m raygpt.tokenizer INPUT.txt -o OUT_DIR [--name N] [--val-tokens N] [--shard-tokens N]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import sys
from pathlib import Path

import tiktoken
import tiktoken.load

from raygpt.llmc.shards import read_shard_header, write_shard

RANKS_PATH = Path(__file__).resolve().parent / "data_files" / "r50k_base.tiktoken"
# sha256 of r50k_base.tiktoken; tiktoken checks the same value for its own download.
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# r50k_base's split pattern, as in tiktoken_ext/openai_public.py (r50k_pat_str): equivalent to
# GPT-2's original regex, with possessive quantifiers.
R50K_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

EOT = 50256  # <|endoftext|>, GPT-2's only special token
N_VOCAB = 50257


@functools.lru_cache(maxsize=1)
def _ranks_bytes() -> bytes:
    try:
        data = RANKS_PATH.read_bytes()
    except OSError as e:
        raise FileNotFoundError(f"{RANKS_PATH}: cannot read the vendored GPT-2 BPE ranks ({e})") from e
    found = hashlib.sha256(data).hexdigest()
    if found != RANKS_SHA256:
        raise ValueError(f"{RANKS_PATH}: sha256: expected {RANKS_SHA256}, found {found}")
    return data


@functools.lru_cache(maxsize=1)
def get_encoding() -> tiktoken.Encoding:
    """GPT-2's encoding (r50k_base), built once from the vendored ranks file."""
    _ranks_bytes()  # a clear error for a missing or altered file before tiktoken reads it
    ranks = tiktoken.load.load_tiktoken_bpe(str(RANKS_PATH), expected_hash=RANKS_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=R50K_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=N_VOCAB)


def encode(text: str) -> list[int]:
    """GPT-2 tokens of `text`. Special-token strings in the text are encoded as plain text (as
    llm.c's data scripts do with encode_ordinary): only `prepare_shards` inserts EOT."""
    return get_encoding().encode_ordinary(text)


def decode(tokens) -> str:
    return get_encoding().decode(list(tokens))


def tokenizer_fingerprint() -> str:
    """sha256 of the BPE ranks file, for checkpoint compatibility checks."""
    return hashlib.sha256(_ranks_bytes()).hexdigest()


def text_to_tokens(text: str) -> list[int]:
    """llm.c's recipe: split on blank lines; each section becomes EOT, then the tokens of the
    section followed by "\\n\\n" (the last section without it)."""
    sections = text.split("\n\n")
    enc = get_encoding()
    tokens: list[int] = []
    for i, section in enumerate(sections):
        tokens.append(EOT)
        tokens.extend(enc.encode_ordinary(section if i == len(sections) - 1 else section + "\n\n"))
    return tokens


def prepare_shards(text_path: str | os.PathLike, out_dir: str | os.PathLike, *, name: str | None = None,
                   val_tokens: int = 32768, shard_tokens: int = 10**8) -> list[str]:
    """Tokenize a text file into llm.c shards: the first `val_tokens` tokens go to
    <name>_val_000000.bin, the rest to <name>_train_000000.bin, _000001, ... of at most
    `shard_tokens` tokens each. Returns the paths written, val first."""
    text_path = Path(text_path)
    if val_tokens < 1 or shard_tokens < 1:
        raise ValueError(f"val_tokens and shard_tokens: expected integers >= 1, found "
                         f"val_tokens={val_tokens}, shard_tokens={shard_tokens}")
    if not text_path.is_file():
        raise FileNotFoundError(f"{text_path}: input text: expected an existing file, found none")
    text = text_path.read_text(encoding="utf-8")
    if not text:
        raise ValueError(f"{text_path}: input text: expected some text, found an empty file")
    name = name or text_path.stem
    tokens = text_to_tokens(text)
    if len(tokens) <= val_tokens:
        raise ValueError(f"{text_path}: token count: expected more than val_tokens={val_tokens} "
                         f"so that some are left for training, found {len(tokens)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    val_path = out / f"{name}_val_{0:06d}.bin"
    write_shard(val_path, tokens[:val_tokens])
    written.append(str(val_path))
    train = tokens[val_tokens:]
    for i, lo in enumerate(range(0, len(train), shard_tokens)):
        path = out / f"{name}_train_{i:06d}.bin"
        write_shard(path, train[lo:lo + shard_tokens])
        written.append(str(path))
    return written


def prepare_parser() -> argparse.ArgumentParser:
    """`raygpt prepare`'s (and `python -m raygpt.tokenizer`'s) argparse parser."""
    p = argparse.ArgumentParser(prog="python -m raygpt.tokenizer",
                                description="Tokenize a text file into llm.c GPT-2 token shards.")
    p.add_argument("input", help="UTF-8 text file")
    p.add_argument("-o", "--out-dir", required=True, help="directory for the .bin shards")
    p.add_argument("--name", default=None, help="shard name prefix (default: the input's stem)")
    p.add_argument("--val-tokens", type=int, default=32768, help="tokens in the validation shard")
    p.add_argument("--shard-tokens", type=int, default=10**8, help="max tokens per train shard")
    return p


def main(argv: list[str] | None = None) -> int:
    args = prepare_parser().parse_args(argv)
    try:
        paths = prepare_shards(args.input, args.out_dir, name=args.name, val_tokens=args.val_tokens,
                               shard_tokens=args.shard_tokens)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    total = 0
    for path in paths:
        n = read_shard_header(path)
        total += n
        print(f"wrote {path}: {n:,} tokens")
    print(f"total: {total:,} tokens in {len(paths)} shards")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
