"""raygpt.eval.hellaswag: the score against an independent statement of llm.c's completion-style
scoring, and every malformed line refused naming it."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from raygpt.data.tokenizer import get_encoding
from raygpt.eval import hellaswag
from raygpt.model.gpt import GPT, GPTConfig


def llmc_prediction(model, ex: hellaswag.Example) -> int:
    """llm.c's rule, one ending at a time, no padding: the mean loss over the ending's tokens
    (encoded with a leading space, after the context's), lowest wins."""
    enc = get_encoding()
    ctx = enc.encode_ordinary(ex.ctx)
    means = []
    for ending in ex.endings:
        end = enc.encode_ordinary(" " + ending)
        row = torch.tensor([ctx + end])
        with torch.no_grad():
            logits = model(row)[0]                                   # (T, V)
        losses = F.cross_entropy(logits[:-1], row[0, 1:], reduction="none")
        means.append(losses[len(ctx) - 1:].mean().item())
    return min(range(4), key=means.__getitem__)


def examples(n: int) -> list[hellaswag.Example]:
    import random
    rng = random.Random(0)
    words = ["the", "man", "is", "sitting", "on", "a", "roof", "naïve", "café", "He", "she",
             "starts", "pulling", "up", "shingles", "."]
    def text(k):
        return " ".join(rng.choice(words) for _ in range(k))
    return [hellaswag.Example(text(rng.randint(3, 20)),
                              tuple(text(rng.randint(1, 12)) for _ in range(4)), rng.randrange(4))
            for _ in range(n)]


def test_score_is_llmcs_completion_style_acc_norm():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_depth(2, block_size=128), init_seed=3).eval()
    exs = examples(40)
    want = [llmc_prediction(model, ex) for ex in exs]
    got = []
    for ex in exs:
        tokens, mask = hellaswag.render(ex)
        with torch.no_grad():
            got.append(hellaswag.predict(model(tokens), tokens, mask))
    assert got == want
    assert len(set(want)) > 1  # the check is not vacuous: the model prefers different endings
    correct, total = hellaswag.score(model, exs, torch.device("cpu"))
    assert (correct, total) == (sum(p == ex.label for p, ex in zip(want, exs)), 40)


def test_render_puts_the_context_then_each_ending_with_its_leading_space():
    enc = get_encoding()
    ex = hellaswag.Example("A man is on a roof.", ("he sits", "x", "he is ripping it up", "y"), 2)
    tokens, mask = hellaswag.render(ex)
    ctx = enc.encode_ordinary(ex.ctx)
    for i, ending in enumerate(ex.endings):
        end = enc.encode_ordinary(" " + ending)
        n = len(ctx) + len(end)
        assert tokens[i, :n].tolist() == ctx + end and not tokens[i, n:].any()
        assert mask[i].tolist() == [0] * len(ctx) + [1] * len(end) + [0] * (tokens.shape[1] - n)


GOOD = {"ctx": "A man is sitting on a roof. he", "endings": ["a", "b", "c", "d"], "label": 3}


@pytest.mark.parametrize("line,message", [
    ("not json", "line 2: expected a JSON object"),
    ("[1]", "line 2: expected a JSON object, found list"),
    (json.dumps({**GOOD, "ctx": None}), "line 2: ctx: expected a string"),
    (json.dumps({**GOOD, "endings": ["a", "b", "c"]}), "line 2: endings: expected a list of 4 strings"),
    (json.dumps({**GOOD, "endings": ["a", "b", "c", 4]}), "line 2: endings: expected a list of 4 strings"),
    (json.dumps({**GOOD, "label": 4}), "line 2: label: expected 0, 1, 2 or 3, found 4"),
    (json.dumps({**GOOD, "label": -1}), "line 2: label: expected 0, 1, 2 or 3, found -1"),
    (json.dumps({**GOOD, "label": True}), "line 2: label: expected 0, 1, 2 or 3, found True"),
    ("[" * 100_000, "line 2: expected a JSON object"),
])
def test_a_malformed_line_is_refused_naming_it(tmp_path, line, message):
    f = tmp_path / "hs.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(hellaswag.HellaSwagError, match=f"hs.jsonl: {message}") as e:
        hellaswag.read_examples(str(f))
    assert "\n" not in str(e.value)


def test_read_examples_reads_every_line_and_refuses_an_empty_file(tmp_path):
    f = tmp_path / "hs.jsonl"
    f.write_text(json.dumps(GOOD) + "\n\n" + json.dumps({**GOOD, "label": 0}) + "\n")
    assert [ex.label for ex in hellaswag.read_examples(str(f))] == [3, 0]
    f.write_text("\n")
    with pytest.raises(hellaswag.HellaSwagError, match="expected HellaSwag examples"):
        hellaswag.read_examples(str(f))
    with pytest.raises(hellaswag.HellaSwagError, match="cannot read"):
        hellaswag.read_examples(str(tmp_path / "missing.jsonl"))


def test_a_run_scores_hellaswag_at_its_validation_steps_on_every_rank_share(tmp_path):
    """--hellaswag in a (one-rank, no Ray) run: main.log's llm.c line and the history's eval
    record at each -v step and the last, equal to scoring the checkpoint's model."""
    from raygpt.interop.trained import model_at
    from raygpt.runlog.history import read_history
    from raygpt.storage import open_run_dir
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    f = tmp_path / "hs.jsonl"
    f.write_text("\n".join(json.dumps({"ctx": ex.ctx, "endings": list(ex.endings),
                                       "label": ex.label}) for ex in examples(12)) + "\n")
    cfg = tiny_config(tmp_path / "run", max_steps=4, val_every=2, checkpoint_every=4,
                      hellaswag=str(f)).resolve(0)
    assert cfg.hellaswag_every == 2
    train(cfg, LocalSession(open_run_dir(cfg.output_dir), torch.device("cpu")))
    evals = [r for r in read_history(open_run_dir(cfg.output_dir)) if r.get("kind") == "eval"]
    assert [(r["step"], r["total"]) for r in evals] == [(0, 12), (2, 12), (4, 12)]
    model, _, _ = model_at(cfg.output_dir, 4)
    correct, _ = hellaswag.score(model, hellaswag.read_examples(str(f)), torch.device("cpu"))
    assert evals[-1]["correct"] == correct and evals[-1]["hellaswag"] == correct / 12
    log = (tmp_path / "run" / "main.log").read_text().splitlines()
    assert f"s:4 eval:{correct / 12:.4f}" in log


def test_examples_are_spread_over_the_ranks():
    from raygpt.train.loop_tasks import hellaswag_share
    from tests.helpers import tiny_config
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        f = f"{d}/hs.jsonl"
        with open(f, "w") as out:
            out.write("\n".join(json.dumps({**GOOD, "label": i % 4}) for i in range(7)) + "\n")
        cfg = tiny_config(d, hellaswag=f)
        shares = [hellaswag_share(cfg, r, 3) for r in range(3)]
        assert [[ex.label for ex in s] for s in shares] == [[0, 3, 2], [1, 0], [2, 1]]
        assert hellaswag_share(tiny_config(d), 0, 1) is None


def test_preflight_refuses_a_bad_file_or_an_example_longer_than_the_context(tmp_path):
    from raygpt.config import ConfigError
    from raygpt.config.preflight import check_hellaswag
    from tests.helpers import tiny_config
    f = tmp_path / "hs.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "label": 9}) + "\n")
    with pytest.raises(ConfigError, match="--hellaswag: .*hs.jsonl: line 2: label"):
        check_hellaswag(tiny_config(tmp_path, hellaswag=str(f)).resolve(0))
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "ctx": "word " * 1100}) + "\n")
    with pytest.raises(ConfigError, match="hs.jsonl: line 2: expected an example of at most 1024 "
                                          "tokens .*, found 110"):
        check_hellaswag(tiny_config(tmp_path, hellaswag=str(f)).resolve(0))
    f.write_text(json.dumps(GOOD) + "\n")
    check_hellaswag(tiny_config(tmp_path, hellaswag=str(f)).resolve(0))


@pytest.mark.timeout(30)
def test_a_fifo_as_the_hellaswag_file_is_refused_without_waiting_on_it(tmp_path):
    fifo = tmp_path / "hellaswag_val.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(hellaswag.HellaSwagError, match="expected a regular file, found a FIFO"):
        hellaswag.read_examples(str(fifo))


@pytest.mark.timeout(60)
def test_a_store_that_never_answers_ends_the_read_within_its_bounds(monkeypatch):
    """A --hellaswag URI goes through the URI door like every other reader: bounded calls (a
    server that accepts and then says nothing hung the run for good before, issue 53)."""
    import socket
    import threading

    from raygpt.storage import uri
    monkeypatch.setattr(uri, "CONNECT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(uri, "REQUEST_TIMEOUT_S", 1.0)
    monkeypatch.setattr(uri, "S3_MAX_ATTEMPTS", 1)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # accepts connections (the kernel's backlog) and never answers
        where = "%s:%d" % server.getsockname()
        outcome = []

        def read():
            try:
                hellaswag.read_examples(f"s3://b/hellaswag_val.jsonl?endpoint_override={where}"
                                        f"&scheme=http&region=us-east-1")
            except hellaswag.HellaSwagError as e:
                outcome.append(e)

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "the read still waits on a server that never answers"
    assert outcome and "cannot read" in str(outcome[0])
