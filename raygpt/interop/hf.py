"""GPT-2 in Hugging Face's layout, writer and reader side by side: `export_hf` writes a folder
that `GPT2LMHeadModel.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load
offline; `load_hf` reads such a folder (one `raygpt export` wrote, or a GPT-2 checkpoint in
safetensors from elsewhere) back as raygpt's GPT, for `-e DIR`.

The map is llm.c's `dev/eval/export_hf.py`'s: raygpt's parameters carry GPT-2's names
(`transformer.wte`, `transformer.h.{i}.attn.c_attn`, ...); Hugging Face's Conv1D keeps its weight
as (in, out) where raygpt's Linear keeps (out, in), so the four projection weights are
transposed; wte's padded rows (Vp > V) are dropped on export and zero on import (raygpt never
trains them: the loss and the logits stop at V); lm_head is wte. The tokenizer files (vocab.json,
merges.txt) are made from the vendored BPE ranks, so no download is needed.

`transformers` and `safetensors` are the `hf` extra; nothing in training imports this module
unless `-e` names a folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path

import torch

from raygpt.model.gpt import GPT, GPTConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GPT2_VOCAB = 50257
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# GPT-2's fixed choices: a config that differs is another model, refused naming the field
GPT2_FIXED = {"model_type": "gpt2", "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
              "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
              "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
              "reorder_and_upcast_attn": False}
MAX_CONFIG_BYTES = 1 << 20
# What missing GPT2_FIXED fields mean: transformers' GPT2Config defaults (GPT-2's own choices)
GPT2_DEFAULTS = {"activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                 "tie_word_embeddings": True, "scale_attn_weights": True,
                 "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
# Upper bounds on config.json's shape fields, checked before anything is built from them: past
# these a file is corrupt or hostile (hf_shapes makes 12 entries a layer, wpe holds T rows).
MAX_N_LAYER = 1024  # 20x GPT-2 XL's 48 layers
MAX_N_EMBD = 1 << 16  # 40x GPT-2 XL's 1600 channels
MAX_N_HEAD = 1 << 10  # 40x GPT-2 XL's 25 heads
MAX_N_POSITIONS = 1 << 20  # 1024x GPT-2's context
SHAPE_BOUNDS = {"n_positions": MAX_N_POSITIONS, "n_ctx": MAX_N_POSITIONS, "n_embd": MAX_N_EMBD,
                "n_layer": MAX_N_LAYER, "n_head": MAX_N_HEAD}


class HFError(ValueError):
    """A folder is not a GPT-2 that raygpt can train; the message names the file and field."""


def _need_extra():
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise HFError(f"Hugging Face export and import need transformers and safetensors: "
                      f"pip install 'raygpt[hf]' ({e})") from None


def is_hf_dir(path: str) -> bool:
    """Whether `path` is a folder holding a Hugging Face config.json (what -e DIR names)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG))


# ---------------------------------------------------------------------- writer

def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face's GPT2LMHeadModel names and layouts (V rows of
    wte; lm_head tied, so left out), on the CPU, as the model holds them."""
    V = model.config.vocab_size
    out = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        t = p.detach().to("cpu")
        if name == "transformer.wte.weight":
            t = t[:V]
        elif name.endswith(TRANSPOSED):
            t = t.t()
        out[name] = t.contiguous()
    return out


def hf_config(cfg: GPTConfig):
    from transformers import GPT2Config
    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                      n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu_new",
                      layer_norm_epsilon=1e-5, bos_token_id=GPT2_VOCAB - 1,
                      eos_token_id=GPT2_VOCAB - 1, tie_word_embeddings=True)


def export_hf(model: GPT, out_dir: str, *, dtype: torch.dtype) -> Path:
    """Write `model` as a Hugging Face GPT-2 folder at `out_dir` (new or empty): config.json,
    model.safetensors in `dtype`, the GPT-2 tokenizer. Written into a temporary sibling and
    renamed into place, so a folder at `out_dir` is always complete."""
    _need_extra()
    from transformers import GPT2LMHeadModel

    if model.config.vocab_size != GPT2_VOCAB:
        raise HFError(f"vocab_size: expected GPT-2's {GPT2_VOCAB} (its tokenizer is exported "
                      f"with it), found {model.config.vocab_size}")
    out = Path(out_dir).absolute()
    if out.exists() and (not out.is_dir() or out.is_symlink() or any(out.iterdir())):
        raise HFError(f"-o {out}: expected a new or empty directory, found one holding files")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with torch.device("meta"):
            hf = GPT2LMHeadModel(hf_config(model.config))
        sd = {k: v.to(dtype) for k, v in hf_state_dict(model).items()}
        hf.load_state_dict(sd, strict=False, assign=True)
        hf.tie_weights()
        hf.save_pretrained(tmp, safe_serialization=True)
        write_gpt2_tokenizer(tmp)
        # mkdtemp's 0700, and safetensors' own temp file's 0600 (it renames one into place),
        # would hide the folder and its weights from a shared volume: modes as open() makes them
        umask = _umask()
        os.chmod(tmp, 0o777 & ~umask)
        for f in tmp.rglob("*"):
            os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character (its encoder.py)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def gpt2_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[str]]:
    """GPT-2's vocab.json and merges.txt from tiktoken's ranks: each token in the byte-level
    alphabet, and, for every token past the 256 bytes in rank order, the pair BPE merges to make
    it (found by running BPE on its bytes with only the ranks below its own)."""
    alphabet = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        parts = [bytes([b]) for b in tok]
        while len(parts) > 2:
            best = min(range(len(parts) - 1),
                       key=lambda i: ranks.get(parts[i] + parts[i + 1], math.inf))
            if ranks.get(parts[best] + parts[best + 1], math.inf) >= rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        merges.append(f"{text(parts[0])} {text(b''.join(parts[1:]))}")
    return vocab, merges


def write_gpt2_tokenizer(out_dir) -> None:
    """GPT-2's tokenizer files (vocab.json, merges.txt, and the fast tokenizer's own) in
    `out_dir`, from the vendored ranks, with <|endoftext|> as id 50256."""
    from transformers import GPT2TokenizerFast

    from raygpt.data import tokenizer
    vocab, merges = gpt2_vocab_and_merges(tokenizer.get_encoding()._mergeable_ranks)
    vocab["<|endoftext|>"] = tokenizer.EOT
    import inspect
    if "vocab" in inspect.signature(GPT2TokenizerFast.__init__).parameters:  # transformers 5
        tok = GPT2TokenizerFast(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                                model_max_length=1024)
        tok.save_pretrained(out_dir)
        return
    with tempfile.TemporaryDirectory() as d:  # transformers 4 reads the two files
        (Path(d) / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        (Path(d) / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
        tok = GPT2TokenizerFast(vocab_file=str(Path(d) / "vocab.json"),
                                merges_file=str(Path(d) / "merges.txt"), model_max_length=1024)
        tok.save_pretrained(out_dir)


# ---------------------------------------------------------------------- reader

def read_config_json(path: str) -> dict:
    """The JSON object of the folder `path`'s config.json: the one read of that file (HFError
    naming it, one line, when it is not a regular file, larger than MAX_CONFIG_BYTES, nested too
    deep, not UTF-8 JSON, or not an object). Never blocks on a FIFO planted there."""
    from raygpt.storage import parse_json
    file = os.path.join(path, CONFIG)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise HFError(f"{file}: expected a regular file, found another kind of entry")
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise HFError(f"{file}: expected a readable Hugging Face config.json "
                      f"({e.strerror or e})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise HFError(f"{file}: expected at most {MAX_CONFIG_BYTES:,} bytes, found more")
    try:
        d = parse_json(raw, file)
    except ValueError as e:  # storage.JSONError: names the file, one line
        raise HFError(" ".join(str(e).split())[:300]) from None
    if not isinstance(d, dict):
        raise HFError(f"{file}: expected a JSON object, found {type(d).__name__}")
    return d


def _size(d: dict, field: str, file: str, *, required: bool = True) -> int | None:
    """The positive integer `field` of config.json, at most its SHAPE_BOUNDS bound."""
    v = d.get(field)
    if v is None and not required:
        return None
    bound = SHAPE_BOUNDS.get(field)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1 or (bound and v > bound):
        within = f" of at most {bound:,}" if bound else ""
        raise HFError(f"{file}: {field}: expected a positive integer{within}, "
                      f"found {v!r:.60}")
    return v


def read_hf_config(path: str) -> GPTConfig:
    """The GPTConfig of the Hugging Face folder `path`, its config.json (read_config_json)
    checked against GPT-2's fixed choices and every shape field against its bound (HFError
    naming the field) before anything is built from it."""
    file = os.path.join(path, CONFIG)
    d = read_config_json(path)
    for field, want in GPT2_FIXED.items():
        found = d.get(field, GPT2_DEFAULTS.get(field))
        if found not in (want if isinstance(want, tuple) else (want,)):
            raise HFError(f"{file}: {field}: expected {want!r} (GPT-2), found {found!r:.60}")
    sizes = {}
    for field in ("vocab_size", "n_embd", "n_layer", "n_head"):
        sizes[field] = _size(d, field, file)
    ctx = _size(d, "n_ctx", file, required=False)  # the older name of n_positions
    sizes["n_positions"] = _size(d, "n_positions", file, required=ctx is None) or ctx
    if ctx is not None and ctx != sizes["n_positions"]:
        raise HFError(f"{file}: n_ctx: expected n_positions {sizes['n_positions']} (or no "
                      f"n_ctx), found {ctx}")
    if sizes["vocab_size"] != GPT2_VOCAB:
        raise HFError(f"{file}: vocab_size: expected GPT-2's {GPT2_VOCAB} (raygpt trains with "
                      f"GPT-2's tokenizer), found {sizes['vocab_size']}")
    if d.get("n_inner") not in (None, 4 * sizes["n_embd"]):
        raise HFError(f"{file}: n_inner: expected None or 4 * n_embd = {4 * sizes['n_embd']}, "
                      f"found {d.get('n_inner')!r:.60}")
    if sizes["n_embd"] % sizes["n_head"]:
        raise HFError(f"{file}: n_embd: expected a multiple of n_head {sizes['n_head']}, found "
                      f"{sizes['n_embd']}")
    V = sizes["vocab_size"]
    return GPTConfig(block_size=sizes["n_positions"], vocab_size=V,
                     padded_vocab_size=math.ceil(V / 128) * 128, n_layer=sizes["n_layer"],
                     n_head=sizes["n_head"], n_embd=sizes["n_embd"])


def hf_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of Hugging Face's GPT2LMHeadModel for `cfg` (lm_head tied, so not stored),
    with its shape in Hugging Face's layout."""
    C, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C),
              "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)}
    per_layer = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C),
                 "attn.c_attn.bias": (3 * C,), "attn.c_proj.weight": (C, C),
                 "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
                 "mlp.c_fc.weight": (C, 4 * C), "mlp.c_fc.bias": (4 * C,),
                 "mlp.c_proj.weight": (4 * C, C), "mlp.c_proj.bias": (C,)}
    for i in range(L):
        shapes.update({f"transformer.h.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def _weights(path: str):
    _need_extra()
    from safetensors import safe_open
    file = os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        raise HFError(f"{file}: expected the weights in safetensors (a pickled "
                      f"pytorch_model.bin is never loaded), found no such file")
    try:
        return file, safe_open(file, framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise HFError(f"{file}: expected a safetensors file ({e})") from None


def _key(name: str, names: set[str]) -> str | None:
    """The stored key of `name`: with the `transformer.` prefix (save_pretrained's) or without
    (the original GPT-2 checkpoints')."""
    for key in (name, name.removeprefix("transformer.")):
        if key in names:
            return key
    return None


def check_hf(path: str) -> GPTConfig:
    """The GPTConfig of the Hugging Face folder `path`, its config and every tensor's shape
    checked from the file's header (no weights read); HFError naming the first that is wrong."""
    cfg = read_hf_config(path)
    file, f = _weights(path)
    with f:
        names = set(f.keys())
        for name, shape in hf_shapes(cfg).items():
            key = _key(name, names)
            if key is None:
                raise HFError(f"{file}: expected tensor {name!r}, found none")
            found = tuple(f.get_slice(key).get_shape())
            if found != shape:
                raise HFError(f"{file}: {name}: expected shape {shape}, found {found}")
    return cfg


def load_hf(path: str) -> GPT:
    """raygpt's GPT (fp32, on the CPU) with the weights of the Hugging Face GPT-2 folder `path`
    (check_hf's checks first), read with safetensors, never a pickle."""
    cfg = check_hf(path)
    model = GPT.empty(cfg)
    params = model.state_dict()
    file, f = _weights(path)
    with torch.no_grad(), f:
        names = set(f.keys())
        for name in hf_shapes(cfg):
            t = f.get_tensor(_key(name, names)).to(torch.float32)
            dest = params[name]
            if name.endswith(TRANSPOSED):
                t = t.t()
            if name == "transformer.wte.weight":  # V rows stored, Vp in the model: pads zero
                dest.zero_()
                dest = dest[:cfg.vocab_size]
            dest.copy_(t)
    return model


def hf_fingerprint(path: str) -> str:
    """What a checkpoint compares for a run started from the folder `path`: its config and
    weights by their bytes."""
    from raygpt.data.sources import file_ends_sha256
    parts = []
    for name in (CONFIG, WEIGHTS):
        f = os.path.join(path, name)
        size = os.path.getsize(f)
        parts.append(f"{name} {size} bytes, ends sha256 {file_ends_sha256(f, size)}")
    return "Hugging Face GPT-2 folder: " + "; ".join(parts)
