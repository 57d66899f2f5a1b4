"""raygpt.interop.hf: a raygpt model exported as a Hugging Face GPT-2 folder (logits against raygpt's own
forward, tensors against an independent statement of llm.c's export_hf.py mapping, the tokenizer
against tiktoken) and read back for -e DIR: exact, and a run started from it trains with the
model file's losses, as floats. Folders that are not GPT-2 are refused naming the field."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from raygpt.config import ConfigError  # noqa: E402
from raygpt.data.tokenizer import RANKS_PATH, get_encoding  # noqa: E402
from raygpt.interop import hf  # noqa: E402
from raygpt.llmc.model_file import write_model_file  # noqa: E402
from raygpt.model.gpt import GPT, GPTConfig  # noqa: E402
from tests.helpers import tiny_config, train_losses  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    model = distinct(GPT(GPTConfig.from_depth(2, block_size=64), init_seed=7).eval())
    write_model_file(str(root / "model.bin"), model)
    return model, root / "model.bin", hf.export_hf(model, str(root / "out"), dtype=torch.float32)


def distinct(model: GPT) -> GPT:
    """`model` with every tensor seeded random and unlike every other (GPT's own init makes each
    LayerNorm weight 1 and bias 0, so two of them swapped in the map would go unseen); wte's
    padded rows stay zero, as raygpt keeps them."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 + (1.0 if name.endswith("ln_1.weight")
                    or name.endswith("ln_2.weight") or name.endswith("ln_f.weight") else 0.0)
                    + 1e-3 * i)
        model.transformer.wte.weight[model.config.vocab_size:] = 0
    return model


def llmc_export_mapping(model_file) -> dict[str, np.ndarray]:
    """llm.c's dev/eval/export_hf.py, restated: the model file's tensors in its order, padded
    vocab rows cut, the four projection weights transposed, under GPT2LMHeadModel's names."""
    raw = open(model_file, "rb").read()
    h = np.frombuffer(raw[:1024], dtype="<i4")
    assert h[0] == 20240326 and h[1] == 3
    maxT, V, L, H, C, Vp = (int(x) for x in h[2:8])
    shapes = [("wte", (Vp, C)), ("wpe", (maxT, C)), ("ln1w", (L, C)), ("ln1b", (L, C)),
              ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)), ("attprojw", (L, C, C)),
              ("attprojb", (L, C)), ("ln2w", (L, C)), ("ln2b", (L, C)), ("fcw", (L, 4 * C, C)),
              ("fcb", (L, 4 * C)), ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
              ("lnfw", (C,)), ("lnfb", (C,))]
    w, off = {}, 1024
    for name, shape in shapes:
        n = math.prod(shape)
        w[name] = np.frombuffer(raw, dtype="<f4", count=n, offset=off).reshape(shape)
        off += 4 * n
    assert off == len(raw)
    out = {"transformer.wte.weight": w["wte"][:V], "transformer.wpe.weight": w["wpe"],
           "transformer.ln_f.weight": w["lnfw"], "transformer.ln_f.bias": w["lnfb"]}
    names = {"ln_1.weight": ("ln1w", False), "ln_1.bias": ("ln1b", False),
             "attn.c_attn.weight": ("qkvw", True), "attn.c_attn.bias": ("qkvb", False),
             "attn.c_proj.weight": ("attprojw", True), "attn.c_proj.bias": ("attprojb", False),
             "ln_2.weight": ("ln2w", False), "ln_2.bias": ("ln2b", False),
             "mlp.c_fc.weight": ("fcw", True), "mlp.c_fc.bias": ("fcb", False),
             "mlp.c_proj.weight": ("fcprojw", True), "mlp.c_proj.bias": ("fcprojb", False)}
    for i in range(L):
        for hf_name, (llmc, transpose) in names.items():
            t = w[llmc][i]
            out[f"transformer.h.{i}.{hf_name}"] = t.T if transpose else t
    return out


def test_export_holds_llmcs_tensors_under_hugging_faces_names(exported):
    _, model_file, out = exported
    stored = {k: v.numpy() for k, v in load_file(str(out / "model.safetensors")).items()}
    want = llmc_export_mapping(model_file)
    stored.pop("lm_head.weight", None)  # tied: transformers may or may not store it
    assert sorted(stored) == sorted(want)
    for name in want:
        assert np.array_equal(stored[name], want[name]), name


def test_transformers_loads_it_offline_and_its_logits_are_raygpts(exported):
    from transformers import AutoTokenizer, GPT2LMHeadModel
    model, _, out = exported
    hf_model = GPT2LMHeadModel.from_pretrained(out, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "First Citizen:\nBefore we proceed any further, hear me speak. naïve café 🙂"
    ids = tok(text)["input_ids"]
    assert ids == get_encoding().encode_ordinary(text)
    x = torch.tensor([ids[:60]])
    with torch.no_grad():
        theirs, ours = hf_model(x).logits, model(x)
    assert theirs.shape == ours.shape == (1, len(ids[:60]), 50257)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert torch.equal(hf_model.lm_head.weight, hf_model.transformer.wte.weight)


def test_the_exported_tokenizer_is_gpt2s_on_a_whole_text(exported):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(exported[2], local_files_only=True)
    text = (RANKS_PATH.parent / "input.txt").read_text()[:50_000] + " <|endoftext|> 'll 1,234.5\t\n"
    ids = tok(text)["input_ids"]
    assert ids == get_encoding().encode(text, allowed_special="all")
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 50256


def test_bf16_export_and_import_round_trip(exported, tmp_path):
    model = exported[0]
    out = hf.export_hf(model, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    stored = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    back = hf.load_hf(str(out))
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name


def test_import_is_exact(exported):
    model, _, out = exported
    back = hf.load_hf(str(out))
    assert back.config == model.config
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_run_from_the_exported_folder_has_the_model_files_losses(exported, tmp_path):
    """-e DIR against -e model.bin for the same weights: every loss equal, as floats."""
    from raygpt.storage import open_run_dir
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession
    _, model_file, out = exported
    for name, source in (("file", model_file), ("folder", out)):
        cfg = tiny_config(tmp_path / name, model=str(source), max_steps=6).resolve(0)
        train(cfg, LocalSession(open_run_dir(cfg.output_dir), torch.device("cpu")))
    a, b = train_losses(tmp_path / "file"), train_losses(tmp_path / "folder")
    assert sorted(a) == list(range(6)) and a == b


def _folder(tmp_path, config: dict, tensors: dict | None = None):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(d / "model.safetensors"))
    return d


GPT2_CONFIG = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 64, "n_embd": 128,
               "n_layer": 2, "n_head": 2, "activation_function": "gelu_new",
               "layer_norm_epsilon": 1e-5}


@pytest.mark.parametrize("change,message", [
    ({"model_type": "llama"}, "model_type: expected 'gpt2'"),
    ({"vocab_size": 32000}, "vocab_size: expected GPT-2's 50257"),
    ({"activation_function": "relu"}, "activation_function: expected"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon: expected 1e-05"),
    ({"n_inner": 100}, "n_inner: expected None or 4 \\* n_embd = 512"),
    ({"n_head": 3}, "n_embd: expected a multiple of n_head 3"),
    ({"n_layer": "2"}, "n_layer: expected a positive integer"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings: expected True"),
])
def test_a_config_that_is_not_gpt2_is_refused_naming_the_field(tmp_path, change, message):
    d = _folder(tmp_path, {**GPT2_CONFIG, **change})
    with pytest.raises(hf.HFError, match=f"config.json: {message}"):
        hf.read_hf_config(str(d))


def test_weights_that_are_missing_misshapen_or_pickled_are_refused(exported, tmp_path):
    good = load_file(str(exported[2] / "model.safetensors"))
    good.pop("lm_head.weight", None)
    d = _folder(tmp_path, GPT2_CONFIG, {k: v for k, v in good.items()
                                        if k != "transformer.h.1.mlp.c_fc.bias"})
    with pytest.raises(hf.HFError, match="expected tensor 'transformer.h.1.mlp.c_fc.bias'"):
        hf.load_hf(str(d))
    bad = dict(good, **{"transformer.h.0.attn.c_attn.weight": torch.zeros(384, 128)})
    d = _folder(tmp_path, GPT2_CONFIG, bad)
    with pytest.raises(hf.HFError, match=r"attn.c_attn.weight: expected shape \(128, 384\), "
                                         r"found \(384, 128\)"):
        hf.check_hf(str(d))
    (d / "model.safetensors").unlink()
    torch.save(good, d / "pytorch_model.bin")
    with pytest.raises(hf.HFError, match="a pickled pytorch_model.bin is never loaded"):
        hf.load_hf(str(d))
    # the original GPT-2 checkpoints store names without "transformer."
    d = _folder(tmp_path, GPT2_CONFIG, {k.removeprefix("transformer."): v for k, v in good.items()})
    assert torch.equal(hf.load_hf(str(d)).transformer.wpe.weight, exported[0].transformer.wpe.weight)


def test_preflight_refuses_a_bad_folder_before_ray(exported, tmp_path):
    from raygpt.config.preflight import check_model
    d = _folder(tmp_path, {**GPT2_CONFIG, "model_type": "gpt_neox"})
    with pytest.raises(ConfigError, match="-e/--model: .*config.json: model_type"):
        check_model(tiny_config(tmp_path / "r", model=str(d)).resolve(0))
    with pytest.raises(ConfigError, match="-t/--seq-len: expected at most 64"):
        check_model(tiny_config(tmp_path / "r", model=str(exported[2]), seq_len=128).resolve(0))


def test_export_refuses_a_directory_holding_files(exported, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(hf.HFError, match="expected a new or empty directory"):
        hf.export_hf(exported[0], str(tmp_path / "taken"), dtype=torch.float32)
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]


def test_a_config_without_activation_function_is_gpt2s_default(tmp_path):
    config = {k: v for k, v in GPT2_CONFIG.items() if k != "activation_function"}
    assert hf.read_hf_config(str(_folder(tmp_path, config))).n_layer == 2


@pytest.mark.parametrize("field,value", [
    ("n_layer", 10**8), ("n_embd", 2**40), ("n_head", 10**9), ("n_positions", 10**12),
    ("n_ctx", 10**12),
])
def test_shape_fields_past_their_bound_are_refused_naming_the_field(tmp_path, field, value):
    d = _folder(tmp_path, {**GPT2_CONFIG, field: value})
    with pytest.raises(hf.HFError, match=f"config.json: {field}: expected .*at most"):
        hf.read_hf_config(str(d))


def test_a_config_too_large_or_too_deep_is_one_line_naming_the_file(tmp_path):
    d = _folder(tmp_path, GPT2_CONFIG)
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(hf.HFError, match=r"config.json: .*nested") as e:
        hf.read_hf_config(str(d))
    assert "\n" not in str(e.value)
    with open(d / "config.json", "wb") as f:
        f.truncate(2 << 30)  # sparse: costs no disk
    with pytest.raises(hf.HFError, match=r"config.json: expected at most"):
        hf.read_hf_config(str(d))


def test_the_preflight_reads_a_hostile_config_only_through_the_bounded_reader(tmp_path):
    """The memory estimate (raygpt.model.memory.shape_of) runs before check_model: it must neither
    recurse out on deep nesting nor take a huge n_layer, and the error names the file."""
    from raygpt.config import preflight
    d = _folder(tmp_path, GPT2_CONFIG)
    machine = {"CPU": 64, "memory": 1 << 50}
    cfg = tiny_config(tmp_path / "r", model=str(d)).resolve(0)
    (d / "config.json").write_text("{\"a\":" * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(ConfigError, match=r"-e/--model: .*config.json: .*nested") as e:
        preflight.check(cfg, machine=machine)
    assert "\n" not in str(e.value)
    (d / "config.json").write_text(json.dumps({**GPT2_CONFIG, "n_layer": 10**8}))
    with pytest.raises(ConfigError, match=r"-e/--model: .*config.json: n_layer: expected"):
        preflight.check(cfg, machine=machine)


def test_the_hf_folders_shape_for_the_estimate_is_the_bounded_readers(tmp_path):
    import tracemalloc

    from raygpt.model import memory
    d = _folder(tmp_path, GPT2_CONFIG)
    assert memory.shape_of(str(d)) == memory.Shape(2, 128, 2, 50257, 50304, 64)  # Vp as GPT pads
    with open(d / "config.json", "r+b") as f:
        f.truncate(64 << 20)  # sparse
    tracemalloc.start()
    try:
        assert memory.shape_of(str(d)) is None  # preflight.check_model names why
        assert tracemalloc.get_traced_memory()[1] < (8 << 20)
    finally:
        tracemalloc.stop()
