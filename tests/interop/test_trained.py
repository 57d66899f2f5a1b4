"""raygpt.interop.trained: a checkpoint's model, and `raygpt export`, `raygpt sample`, `raygpt eval` on a
real (tiny) run's checkpoints; every bad input one line, exit 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from raygpt.checkpointing import protocol as ck
from raygpt.cli import main as cli
from raygpt.data import tokenizer
from raygpt.interop import trained
from raygpt.storage import open_run_dir
from raygpt.train.loop import train
from raygpt.train.session import LocalSession
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = tiny_config(run_dir, max_steps=4, checkpoint_every=2).resolve(0)
    train(cfg, LocalSession(open_run_dir(cfg.output_dir), torch.device("cpu")))
    return run_dir


def test_model_at_is_the_checkpoints_model(run):
    from raygpt.llmc.model_file import load_model_file
    model, step, dtype = trained.model_at(str(run))
    assert (step, dtype) == (4, torch.float32)
    ref = load_model_file(str(run / ck.step_dir(4) / ck.model_file(4)))
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)
    assert trained.model_at(str(run), 2)[1] == 2


def test_model_at_skips_a_damaged_newest_checkpoint_and_refuses_a_named_one(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    model_file = copy / ck.step_dir(4) / ck.model_file(4)
    data = bytearray(model_file.read_bytes())
    data[5000] ^= 1
    model_file.write_bytes(bytes(data))
    assert trained.model_at(str(copy))[1] == 2
    with pytest.raises(trained.NoModel, match="step_00000004: not usable"):
        trained.model_at(str(copy), 4)


def test_export_writes_a_folder_transformers_loads(run, tmp_path, capsys):
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel
    assert cli(["export", str(run), "-o", str(tmp_path / "hf")]) == 0
    assert "step 4" in capsys.readouterr().out
    hf_model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    model, _, _ = trained.model_at(str(run))
    x = torch.tensor([tokenizer.encode("To be, or not to be")])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(x).logits, model.eval()(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755),
                                                        (0o027, 0o640, 0o750)])
def test_every_exported_file_has_the_mode_the_umask_gives(run, tmp_path, umask, file_mode,
                                                          dir_mode):
    """safetensors writes model.safetensors through a 0600 temp file: the export's files all
    get what open() gives under the user's umask, as their siblings do."""
    pytest.importorskip("transformers")
    import os
    import stat
    previous = os.umask(umask)
    try:
        assert cli(["export", str(run), "-o", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").rglob("*")}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(modes), modes
    assert modes == {name: file_mode for name in modes}
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == dir_mode


def test_sample_streams_what_generate_makes(run, capsys):
    model, _, _ = trained.model_at(str(run))
    prompt = "ROMEO:"
    idx = torch.tensor([tokenizer.encode(prompt)])
    want = model.eval().generate(idx, 12, temperature=0.0)[0, idx.shape[1]:].tolist()
    assert cli(["sample", str(run), "--prompt", prompt, "-g", "12", "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert out.out == prompt + tokenizer.decode(want) + "\n"
    assert out.err == f"raygpt sample: step 4 of {run}\n"  # the newest checkpoint's step
    assert cli(["sample", str(run), "--step", "2", "-g", "1", "--temperature", "0"]) == 0
    assert capsys.readouterr().err == f"raygpt sample: step 2 of {run}\n"
    outs = []
    for seed in (3, 3, 4):  # a seeded sample is the same each time
        assert cli(["sample", str(run), "-g", "10", "--seed", str(seed)]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] != outs[2]


def test_eval_prints_llmcs_acc_norm(run, tmp_path, capsys):
    from raygpt.eval import hellaswag
    lines = [{"ctx": "A man is sitting on a roof. he", "label": i % 4,
              "endings": ["is using wrap.", "is ripping level tiles off.", "is holding a cube.",
                          "starts pulling up roofing."]} for i in range(6)]
    f = tmp_path / "hellaswag_val.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert cli(["eval", str(run), "--hellaswag", str(f)]) == 0
    model, _, _ = trained.model_at(str(run))
    correct, total = hellaswag.score(model, hellaswag.read_examples(str(f)), torch.device("cpu"))
    assert capsys.readouterr().out.strip() == \
        f"raygpt eval: step 4 | HellaSwag acc_norm {correct}/{total} = {correct / total:.4f}"


@pytest.mark.parametrize("argv,message", [
    (["sample", "{empty}"], "expected a run directory with checkpoints"),
    (["sample", "{run}", "--step", "3"], "--step 3: expected one of the run's checkpoints"),
    (["sample", "{run}", "-g", "0"], "-g/--gen-tokens: expected an integer >= 1"),
    (["sample", "{run}", "--temperature", "-1"], "--temperature: expected a number >= 0"),
    (["eval", "{run}", "--hellaswag", "{empty}/none.jsonl"], "none.jsonl: cannot read"),
    (["export", "{run}", "-o", "{taken}"], "expected a new or empty directory"),
])
def test_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    argv = [a.format(run=run, empty=tmp_path / "empty", taken=tmp_path / "taken") for a in argv]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


HOSTILE = "ok\x1b]0;owned\x07\r\u202eevil\nnext line\x9b2J"


@pytest.fixture
def hostile_generate(monkeypatch):
    """A model whose weights were rewritten to emit escape sequences: generate() appends the
    tokens of HOSTILE one at a time (the streaming path), then spaces."""
    from raygpt.model.gpt import GPT
    want = tokenizer.encode(HOSTILE)

    def generate(self, idx, n, **_):
        i = idx.shape[1] - 1  # after the <|endoftext|> start
        nxt = want[i] if i < len(want) else tokenizer.encode(" ")[0]
        return torch.cat([idx, torch.tensor([[nxt]], device=idx.device)], dim=1)
    monkeypatch.setattr(GPT, "generate", generate)
    return len(want)


def test_sample_escapes_what_the_model_makes_but_keeps_its_newlines(run, capsys,
                                                                    hostile_generate):
    assert cli(["sample", str(run), "-g", str(hostile_generate)]) == 0
    out = capsys.readouterr().out
    assert out == "ok\\x1b]0;owned\\x07\\x0d\\u202eevil\nnext line\\x9b2J\n", out
    assert cli(["sample", str(run), "-g", str(hostile_generate), "--raw"]) == 0
    assert capsys.readouterr().out == HOSTILE + "\n"
    assert "--raw" in trained.sample_parser().format_help()


def test_eval_refuses_an_example_longer_than_the_context_before_scoring(run, tmp_path, capsys):
    ok = {"ctx": "A man is sitting on a roof. he", "label": 0,
          "endings": ["is using wrap.", "is ripping tiles off.", "is holding a cube.", "sits."]}
    long = dict(ok, ctx="word " * 1100)
    f = tmp_path / "hellaswag_val.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in (ok, ok, long)) + "\n")
    assert cli(["eval", str(run), "--hellaswag", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hellaswag_val.jsonl: line 3: expected" in err[0], err
    assert "at most 1024 tokens" in err[0], err
