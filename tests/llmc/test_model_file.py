"""raygpt.llmc.model_file: llm.c's model file (train_gpt2.cu's gpt2_write_to_checkpoint and
gpt2_build_from_checkpoint) byte for byte, fp32 (version 3) and bf16 (version 5), read back by an
independent numpy reader at llm.c's offsets; every malformed file an error naming the file and
the field; an interrupted write leaves the old file."""

import numpy as np
import pytest
import torch

from raygpt.llmc import model_file
from raygpt.llmc.model_file import (
    MODEL_MAGIC, ModelFileError, load_model_file, read_model_file, read_model_header,
    write_model_file, write_model_file_from_flat,
)
from raygpt.model.gpt import GPT, llmc_parameter_layout, llmc_tensor_shapes, num_parameters
from tests.model.test_model import CFG, batch, repoint_to_flat


@pytest.fixture
def model():
    return GPT(CFG, init_seed=7)


def read_header_numpy(path):
    return np.fromfile(path, dtype="<i4", count=256)


def test_model_file_round_trip_fp32(model, tmp_path):
    path = tmp_path / "model_00000001.bin"
    write_model_file(path, model, torch.float32)
    h = read_header_numpy(path)
    assert list(h[:8]) == [MODEL_MAGIC, 3, CFG.block_size, CFG.vocab_size, CFG.n_layer,
                           CFG.n_head, CFG.n_embd, CFG.padded_vocab_size]
    assert not h[8:].any()
    assert path.stat().st_size == 1024 + num_parameters(model) * 4
    assert read_model_header(path) == (CFG, torch.float32)  # what preflight checks, no weights read
    cfg, tensors = read_model_file(path)
    assert cfg == CFG
    for (name, params), (_, shape) in zip(llmc_parameter_layout(model), llmc_tensor_shapes(CFG)):
        assert tensors[name].shape == shape and tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], torch.stack(params) if len(params) > 1 else params[0]), name
    loaded = load_model_file(path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    idx, _ = batch()
    assert torch.equal(loaded(idx), model(idx))
    assert not list(tmp_path.glob("*.tmp*")), "no temporary file left behind"


def test_model_file_raw_layout_matches_llmc_offsets(model, tmp_path):
    """An independent numpy reader at llm.c's offsets: wte first, then wpe, ln1w, ..."""
    path = tmp_path / "m.bin"
    write_model_file(path, model)
    data = np.fromfile(path, dtype="<f4", offset=1024)
    C, L, Vp, T = CFG.n_embd, CFG.n_layer, CFG.padded_vocab_size, CFG.block_size
    t = model.transformer
    np.testing.assert_array_equal(data[:Vp * C], t.wte.weight.detach().numpy().ravel())
    o = Vp * C + T * C
    np.testing.assert_array_equal(data[o:o + C], t.h[0].ln_1.weight.detach().numpy())
    o += 2 * L * C  # past ln1w, ln1b: qkvw of layer 0 then layer 1
    np.testing.assert_array_equal(data[o + 3 * C * C:o + 6 * C * C],
                                  t.h[1].attn.c_attn.weight.detach().numpy().ravel())
    np.testing.assert_array_equal(data[-C:], t.ln_f.bias.detach().numpy())


def test_model_file_round_trip_bf16(model, tmp_path):
    path = tmp_path / "model_bf16.bin"
    write_model_file(path, model, torch.bfloat16)
    h = read_header_numpy(path)
    assert h[0] == MODEL_MAGIC and h[1] == 5 and h[7] == CFG.padded_vocab_size
    assert path.stat().st_size == 1024 + num_parameters(model) * 2
    assert read_model_header(path) == (CFG, torch.bfloat16)
    cfg, tensors = read_model_file(path)
    assert cfg == CFG
    for name, params in llmc_parameter_layout(model):
        want = (torch.stack(params) if len(params) > 1 else params[0]).detach().to(torch.bfloat16)
        assert tensors[name].dtype == torch.bfloat16 and torch.equal(tensors[name], want), name
    # the bf16 bits on disk are the raw 16-bit words of the cast
    raw = np.fromfile(path, dtype="<u2", offset=1024)
    wte_bits = model.transformer.wte.weight.detach().to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(raw[:wte_bits.size], wte_bits.ravel().view(np.uint16))
    loaded = load_model_file(path)
    assert torch.equal(loaded.transformer.h[1].mlp.c_fc.weight,
                       model.transformer.h[1].mlp.c_fc.weight.detach().to(torch.bfloat16).float())


def test_write_from_flat_equals_write_model_file(model, tmp_path):
    flat = repoint_to_flat(model)
    for dtype in (torch.float32, torch.bfloat16):
        a, b, c = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"
        write_model_file(a, model, dtype)
        write_model_file_from_flat(b, CFG, flat, dtype)
        host = flat.numpy() if dtype == torch.float32 else flat.to(torch.bfloat16).view(torch.int16).numpy()
        write_model_file_from_flat(c, CFG, host, dtype)  # numpy host copy (raw bits for bf16)
        assert a.read_bytes() == b.read_bytes() == c.read_bytes(), dtype
    with pytest.raises(ModelFileError, match="flat_params"):
        write_model_file_from_flat(tmp_path / "d.bin", CFG, flat[:-1], torch.float32)
    assert not (tmp_path / "d.bin").exists()


def test_model_file_errors_name_file_and_field(model, tmp_path):
    good = tmp_path / "good.bin"
    write_model_file(good, model)
    raw = good.read_bytes()

    def corrupt(name, header_edits=None, data=None):
        h = np.frombuffer(raw[:1024], dtype="<i4").copy()
        for slot, value in (header_edits or {}).items():
            h[slot] = value
        p = tmp_path / name
        p.write_bytes(h.tobytes() + (raw[1024:] if data is None else data))
        return p

    cases = [
        (corrupt("magic.bin", {0: 20240327}), "magic", "20240326", "20240327"),
        (corrupt("version.bin", {1: 1}), "version", "3", "found 1"),
        (corrupt("truncated.bin", data=raw[1024:-4]), "file size", str(len(raw)), str(len(raw) - 4)),
        (corrupt("layers.bin", {4: 3}), "file size", "bytes", str(len(raw))),
        (corrupt("vp.bin", {7: 50}), "padded_vocab_size", "vocab_size", "50"),
    ]
    for path, field, expected, found in cases:
        with pytest.raises(ModelFileError) as e:
            read_model_file(path)
        msg = str(e.value)
        assert str(path) in msg and field in msg and expected in msg and found in msg, msg
        assert e.value.field == field
    short = tmp_path / "short.bin"
    short.write_bytes(raw[:100])
    with pytest.raises(ModelFileError, match="header"):
        load_model_file(short)
    with pytest.raises(ValueError, match="float32 or torch.bfloat16"):
        write_model_file(tmp_path / "x.bin", model, torch.float16)


def test_atomic_write_keeps_old_file_on_failure(model, tmp_path, monkeypatch):
    path = tmp_path / "m.bin"
    write_model_file(path, model)
    before = path.read_bytes()
    bad = torch.zeros(num_parameters(model), dtype=torch.int32)
    with pytest.raises(ModelFileError, match="floating-point"):
        write_model_file_from_flat(path, CFG, bad, torch.float32)

    def disk_full(f, flat, dtype):  # half a write, then the device fills up
        f.write(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_file, "_write_values", disk_full)
    with pytest.raises(OSError, match="No space"):
        write_model_file(path, GPT(CFG, init_seed=1))
    assert path.read_bytes() == before, "the old file is untouched"
    assert not list(tmp_path.glob("*.tmp*")), "the partial temporary file is removed"
