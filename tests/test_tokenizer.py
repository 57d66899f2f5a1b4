"""Tests of raygpt.tokenizer: offline GPT-2 BPE and llm.c's text -> shards recipe."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raygpt import tokenizer
from raygpt.llmc.shards import read_shard, read_shard_header
from raygpt.tokenizer import EOT, decode, encode, get_encoding, prepare_shards, text_to_tokens

DATA = Path(__file__).resolve().parent.parent / "raygpt" / "data_files"
REPO = Path(__file__).resolve().parent.parent


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


def test_text_to_tokens_follows_llmc_recipe():
    text = "Hello world\n\nSecond part\n\nlast"
    expected = ([EOT] + encode("Hello world\n\n") + [EOT] + encode("Second part\n\n")
                + [EOT] + encode("last"))
    assert text_to_tokens(text) == expected


def test_prepare_shards_reproduces_vendored_shakespeare(tmp_path):
    paths = prepare_shards(DATA / "input.txt", tmp_path, name="tiny_shakespeare")
    assert [os.path.basename(p) for p in paths] == ["tiny_shakespeare_val_000000.bin",
                                                     "tiny_shakespeare_train_000000.bin"]
    assert Path(paths[0]).read_bytes() == (DATA / "tiny_shakespeare_val.bin").read_bytes()
    assert Path(paths[1]).read_bytes() == (DATA / "tiny_shakespeare_train.bin").read_bytes()


def test_prepare_shards_splits_train_and_defaults_name(tmp_path):
    text = "\n\n".join(f"Section {i}: the quick brown fox jumps over the lazy dog." for i in range(20))
    src = tmp_path / "fox.txt"
    src.write_text(text)
    paths = prepare_shards(src, tmp_path / "out", val_tokens=50, shard_tokens=100)
    tokens = text_to_tokens(text)
    n_train = len(tokens) - 50
    assert [os.path.basename(p) for p in paths] == (
        ["fox_val_000000.bin"] + [f"fox_train_{i:06d}.bin" for i in range(-(-n_train // 100))])
    assert all(read_shard_header(p) <= 100 for p in paths[1:])
    got = np.concatenate([read_shard(p) for p in paths])
    assert got.tolist() == tokens


def test_prepare_shards_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare_shards(tmp_path / "nope.txt", tmp_path)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty.txt.*empty file"):
        prepare_shards(tmp_path / "empty.txt", tmp_path)
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(ValueError, match="short.txt.*val_tokens=32768"):
        prepare_shards(tmp_path / "short.txt", tmp_path)


def test_cli_writes_shards_and_reports(tmp_path, capsys):
    src = tmp_path / "small.txt"
    src.write_text("To be, or not to be: that is the question.\n\nWhether 'tis nobler in the mind")
    rc = tokenizer.main([str(src), "-o", str(tmp_path / "out"), "--name", "hamlet",
                         "--val-tokens", "5", "--shard-tokens", "8"])
    assert rc == 0
    out = capsys.readouterr().out
    tokens = text_to_tokens(src.read_text())
    files = sorted(os.listdir(tmp_path / "out"))
    assert files[-1] == "hamlet_val_000000.bin" and files[0] == "hamlet_train_000000.bin"
    assert "hamlet_val_000000.bin: 5 tokens" in out
    assert f"total: {len(tokens)} tokens in {len(files)} shards" in out
    assert np.concatenate([read_shard(tmp_path / "out" / f) for f in
                           ["hamlet_val_000000.bin"] + files[:-1]]).tolist() == tokens


def test_cli_missing_and_empty_input(tmp_path, capsys):
    assert tokenizer.main([str(tmp_path / "missing.txt"), "-o", str(tmp_path)]) == 1
    assert "missing.txt" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    assert tokenizer.main([str(tmp_path / "empty.txt"), "-o", str(tmp_path)]) == 1
    assert "empty file" in capsys.readouterr().err


def test_cli_runs_as_a_module(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("Hello world\n\nHello again, world")
    r = subprocess.run([sys.executable, "-m", "raygpt.tokenizer", str(src), "-o", str(tmp_path),
                        "--val-tokens", "3"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "t_val_000000.bin: 3 tokens" in r.stdout
    assert read_shard(tmp_path / "t_val_000000.bin").tolist() == [EOT, 15496, 995]
