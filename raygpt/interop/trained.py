"""A run's trained model, and the commands that use it (no Ray):

    raygpt export RUN_DIR [--step N] -o DIR [--dtype fp32|bf16]   a Hugging Face GPT-2 folder
    raygpt sample RUN_DIR [--step N] --prompt TEXT [-g 64] [--temperature 1] [--top-k 40]
                  [--seed 1337] [--device cpu|cuda]                  tokens streamed as made
    raygpt eval RUN_DIR [--step N] --hellaswag FILE [--device ...]  acc_norm, llm.c's way

`model_at` reads the model file of a checkpoint (the newest verified one, or `--step N`), every
byte checked against its MANIFEST first. Bad input is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

from raygpt.config.flag_hints import HintingParser
from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing.store import CheckpointStore
from raygpt.model.gpt import GPT
from raygpt.runlog.terminal import printable, printable_lines
from raygpt.storage import RunDir, open_run_dir
from raygpt.train.errors import EXIT_BAD_INPUT


class NoModel(ValueError):
    """No checkpoint of the run can give a model; the message names the run and step."""


def model_at(run_dir: RunDir | str, step: int | None = None) -> tuple[GPT, int, torch.dtype]:
    """(the model of checkpoint `step`, or of the newest verified one, fp32 on the CPU; its
    step; the precision its model file holds); `run_dir`: a RunDir, or a place a library
    caller names (opened here, once)."""
    from raygpt.llmc.model_file import read_model_file_flat

    run_dir = open_run_dir(run_dir)
    store = CheckpointStore(run_dir)
    steps = store.steps()
    if not steps:
        raise NoModel(f"{run_dir.uri()}: expected a run directory with checkpoints "
                      f"(step_XXXXXXXX/), found none")
    if step is None:
        step = store.latest_verified(hashes=True)
        if step is None:
            raise NoModel(f"{run_dir.uri()}: expected a verified checkpoint, found none of "
                          f"{len(steps)} (raygpt status --verify says why)")
    else:
        if step not in steps:
            raise NoModel(f"--step {step}: expected one of the run's checkpoints "
                          f"{steps[-10:]}, found no step_{step:08d}/")
        problems = ck.verify_checkpoint(run_dir, step)
        if problems:
            raise NoModel(f"{run_dir.uri(ck.step_dir(step))}: not usable: {problems[0]}")
    name = f"{ck.step_dir(step)}/{ck.model_file(step)}"
    data = run_dir.read_bytes(name)
    ck.verify_bytes(run_dir, step, ck.model_file(step), data, ck.read_manifest(run_dir, step))
    cfg, flat = read_model_file_flat(data, run_dir.uri(name))
    model = GPT.empty(cfg)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat.float(), _llmc_ordered(model))
    return model, step, flat.dtype


def _llmc_ordered(model: GPT) -> list[torch.nn.Parameter]:
    from raygpt.model.gpt import llmc_parameter_layout
    return [p for _, params in llmc_parameter_layout(model) for p in params]


# ---------------------------------------------------------------------- commands

def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run directory: a path or an s3:// / gs:// URI")
    p.add_argument("--step", type=int, default=None,
                   help="the checkpoint to use (default: the newest verified one)")


def _device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="where to run the model (default: cuda when there is a GPU)")


def export_parser() -> argparse.ArgumentParser:
    p = HintingParser(prog="raygpt export", description=(
        "Write a checkpoint's model as a Hugging Face GPT-2 folder (config.json, "
        "model.safetensors, the GPT-2 tokenizer) that transformers loads offline with "
        "GPT2LMHeadModel.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR)."))
    _common(p)
    p.add_argument("-o", "--out-dir", required=True, help="the folder to write (new or empty)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="the weights' precision (default: the model file's own)")
    return p


def sample_parser() -> argparse.ArgumentParser:
    p = HintingParser(prog="raygpt sample", description=(
        "Generate text from a checkpoint's model, streaming tokens to the terminal. The text "
        "is the model's, and a model file can be made to emit anything: every control or "
        "format character but the newline (escape sequences, CR, bidi overrides) is shown as "
        "a visible escape (\\x1b, \\u202e); newlines stay line breaks. --raw writes the "
        "bytes as made."))
    _common(p)
    p.add_argument("--prompt", default="", help="the text to continue (default: none, an "
                                                "<|endoftext|> start)")
    p.add_argument("-g", "--gen-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest (0: all)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--raw", action="store_true",
                   help="write the text exactly as decoded, control characters included (for a "
                        "file or a pipe; never a terminal you trust)")
    _device_flag(p)
    return p


def eval_parser() -> argparse.ArgumentParser:
    p = HintingParser(prog="raygpt eval", description=(
        "Score a checkpoint's model on HellaSwag as llm.c does (completion style, acc_norm). "
        "The file is HellaSwag's official hellaswag_val.jsonl (github.com/rowanz/hellaswag)."))
    _common(p)
    p.add_argument("--hellaswag", required=True, help="HellaSwag JSON Lines file")
    _device_flag(p)
    return p


def _device(name: str | None) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise NoModel("--device cuda: expected a CUDA GPU, found none")
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def export_main(argv: list[str]) -> int:
    from raygpt.interop.hf import DTYPES, HFError, export_hf
    args = export_parser().parse_args(argv)
    try:
        model, step, own = model_at(open_run_dir(args.run_dir), args.step)
        dtype = DTYPES[args.dtype] if args.dtype else own
        out = export_hf(model, args.out_dir, dtype=dtype)
    except (NoModel, HFError, ValueError, OSError) as e:
        print(f"raygpt export: error: {printable(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"raygpt export: step {step} of {printable(args.run_dir)} -> {printable(out)} "
          f"({str(dtype).removeprefix('torch.')})")
    return 0


def sample_main(argv: list[str]) -> int:
    from raygpt.data import tokenizer
    args = sample_parser().parse_args(argv)
    try:
        if args.gen_tokens < 1:
            raise NoModel(f"-g/--gen-tokens: expected an integer >= 1, found {args.gen_tokens}")
        if args.temperature < 0:
            raise NoModel(f"--temperature: expected a number >= 0, found {args.temperature}")
        device = _device(args.device)
        model, step, _ = model_at(open_run_dir(args.run_dir), args.step)
    except (NoModel, ValueError, OSError) as e:
        print(f"raygpt sample: error: {printable(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # which checkpoint speaks, on stderr: stdout is the text alone (a pipe gets only the text)
    print(f"raygpt sample: step {step} of {printable(args.run_dir)}", file=sys.stderr)
    model = model.to(device).eval()
    prompt = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.EOT]
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    # the model's text is data: escaped but its newlines (terminal.printable_lines) unless --raw
    show = (lambda text: text) if args.raw else printable_lines
    sys.stdout.write(show(args.prompt))
    done: list[int] = []
    shown = ""
    for _ in range(args.gen_tokens):
        idx = model.generate(idx, 1, temperature=args.temperature,
                             top_k=args.top_k or None, generator=gen)
        done.append(int(idx[0, -1]))
        text = tokenizer.decode(done)
        if not text.endswith("\ufffd"):  # a character split over tokens waits for its rest
            sys.stdout.write(show(text[len(shown):]))
            sys.stdout.flush()
            shown = text
    sys.stdout.write(show(tokenizer.decode(done)[len(shown):]) + "\n")
    return 0


def eval_main(argv: list[str]) -> int:
    from raygpt.eval import hellaswag
    args = eval_parser().parse_args(argv)
    try:
        examples = hellaswag.read_examples(args.hellaswag)
        device = _device(args.device)
        model, step, _ = model_at(open_run_dir(args.run_dir), args.step)
        hellaswag.check_context(examples, model.config.block_size, args.hellaswag)  # all, first
    except (NoModel, hellaswag.HellaSwagError, ValueError, OSError) as e:
        print(f"raygpt eval: error: {printable(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    correct, total = hellaswag.score(model.to(device), examples, device)
    print(f"raygpt eval: step {step} | HellaSwag acc_norm {correct}/{total} = {correct / total:.4f}")
    return 0
