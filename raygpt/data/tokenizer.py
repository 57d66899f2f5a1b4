"""GPT-2's BPE tokenizer, fully offline.

The encoding is tiktoken's r50k_base ("gpt2") built from the ranks file vendored in
raygpt/data_files, checked against its published sha256; nothing here touches the network.
`raygpt prepare` (raygpt.data.corpus, raygpt.ray.prepare) turns a corpus into shards with it.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import tiktoken
import tiktoken.load


RANKS_PATH = Path(__file__).resolve().parents[1] / "data_files" / "r50k_base.tiktoken"
# sha256 of r50k_base.tiktoken; tiktoken checks the same value for its own download.
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# r50k_base's split pattern, as in tiktoken_ext/openai_public.py (r50k_pat_str): equivalent to
# GPT-2's original regex, with possessive quantifiers.
R50K_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

EOT = 50256  # <|endoftext|>, GPT-2's only special token
EOT_TEXT = "<|endoftext|>"
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
                             special_tokens={EOT_TEXT: EOT}, explicit_n_vocab=N_VOCAB)


def encode(text: str) -> list[int]:
    """GPT-2 tokens of `text`. Special-token strings in the text are encoded as plain text (as
    llm.c's data scripts do with encode_ordinary): only the corpus rule inserts EOT."""
    return get_encoding().encode_ordinary(text)


def decode(tokens) -> str:
    return get_encoding().decode(list(tokens))


def tokenizer_fingerprint() -> str:
    """sha256 of the BPE ranks file, for checkpoint compatibility checks."""
    return hashlib.sha256(_ranks_bytes()).hexdigest()
