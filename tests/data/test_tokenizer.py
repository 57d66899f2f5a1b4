"""Tests of raygpt.data.tokenizer: offline GPT-2 BPE (the corpus rule is tests/data/test_corpus.py)."""

import pytest

from raygpt.data import tokenizer
from raygpt.data.tokenizer import EOT, decode, encode, get_encoding


def test_hello_world():
    assert encode("Hello world") == [15496, 995]
    assert decode([15496, 995]) == "Hello world"


def test_encoding_is_gpt2():
    enc = get_encoding()
    assert enc is get_encoding()  # cached
    assert enc.n_vocab == 50257 and enc.eot_token == EOT == 50256
    assert decode([EOT]) == "<|endoftext|>"
    # the split pattern is r50k_base's, as tiktoken itself defines it
    from tiktoken_ext.openai_public import r50k_pat_str
    assert tokenizer.R50K_PAT_STR == r50k_pat_str


@pytest.mark.parametrize("s", ["", "Hello world", "  leading and trailing  \n\n",
                               "First Citizen:\nBefore we proceed any further, hear me speak.",
                               "naïve café — 日本語 🙂", "it's 1,234.5 o'clock",
                               "text with <|endoftext|> inside"])
def test_decode_encode_round_trip(s):
    assert decode(encode(s)) == s


def test_special_token_text_is_plain_text():
    assert EOT not in encode("<|endoftext|>")


def test_tokenizer_fingerprint_is_the_ranks_sha256():
    assert tokenizer.tokenizer_fingerprint() == \
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
