"""The `raygpt` command (also `python -m raygpt`): train, and the tools around a run directory.

    raygpt train [llm.c flags | long options]   run a job under Ray Train
    raygpt sweep [sweep options] [train flags]   a Ray Tune sweep whose trials are raygpt runs
    raygpt prepare INPUT... -o OUT_DIR           tokenize a corpus into llm.c shards as Ray tasks
    raygpt status RUN_DIR [--verify]             what ran, last step, loss, checkpoints, goodput
    raygpt status SWEEP_DIR                      every trial's row of a sweep, as of now
    raygpt plot RUN_DIR [-o OUT.png]             loss / lr / grad norm / tok/s with events marked
    raygpt plot SWEEP_DIR [-o OUT.png]           every trial's validation curve of a sweep
    raygpt compact RUN_DIR                       merge a run's log segments (object stores)
    raygpt export RUN_DIR -o DIR                 a checkpoint as a Hugging Face GPT-2 folder
    raygpt sample RUN_DIR --prompt TEXT          generate text from a checkpoint
    raygpt eval RUN_DIR --hellaswag FILE         HellaSwag acc_norm of a checkpoint, llm.c's way

Every command takes --help. Exit codes (train and sweep): see `EXIT_CODES` in raygpt.config.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from raygpt import __version__
from raygpt.storage.atomic_file import RefusedPath
from raygpt.config import (EXIT_CODES, ConfigError, FlagParser, absolute_paths, build_parser,
                           parse_args)
from raygpt.ray import capacity
from raygpt.runlog.startup import process_started
from raygpt.runlog.terminal import printable, printable_lines

COMMANDS = {
    "train": "pretrain GPT-2 under Ray Train (llm.c's flags; raygpt train --help lists them all)",
    "sweep": "a Ray Tune sweep over train flags; every trial a full raygpt run",
    "prepare": "tokenize Parquet, JSON Lines or text (local or s3://) into llm.c shards, as Ray tasks",
    "status": "a run at a glance from its run directory (or a sweep's trials from its directory)",
    "plot": "a PNG of a run's loss, lr, grad norm, tok/s and events, or of a sweep's val curves",
    "compact": "merge the log segments of a run on an object store into one object per log",
    "export": "a checkpoint's model as a Hugging Face GPT-2 folder (transformers loads it offline)",
    "sample": "generate text from a checkpoint's model, streamed to the terminal",
    "eval": "HellaSwag acc_norm of a checkpoint's model, scored as llm.c scores it",
}


def _train(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        build_parser("raygpt train").print_help()
        return 0
    adapted: list[str] = []
    # the launch's start-up, as wall times (raygpt.runlog.startup): the driver adds its own
    marks = {"process_started": process_started(), "cli_started": time.time()}
    try:
        cfg = absolute_paths(parse_args(argv))  # the workers' working directory is not this one
        gpus, cpus = _cluster_capacity()
        cfg = cfg.resolve(gpus, notes=adapted, cpus_available=cpus)
        from raygpt.config import preflight  # before Ray starts: a bad input costs ~1 s
        plan = preflight.check(cfg, machine=None if os.environ.get("RAY_ADDRESS")
                               else capacity.this_machine(cfg))
    except ConfigError as e:
        print(f"raygpt: error: {printable(e)}", file=sys.stderr)
        return 2
    marks["checked"] = time.time()
    from raygpt.ray.driver import RunAborted, RunFailed, run
    from raygpt.train.errors import EXIT_BAD_INPUT, EXIT_FINISHED, EXIT_STOPPED

    try:
        summary = run(cfg, adapted=adapted, plan=plan, marks=marks)
    except (ConfigError, RefusedPath) as e:  # RefusedPath: a link planted in the run directory
        print(f"raygpt: error: {printable(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunFailed as e:  # exit code by cause: a bad input met in a worker is 2, else 1
        print(f"raygpt: {'error: ' if e.exit_code == EXIT_BAD_INPUT else ''}"
              f"{printable_lines(str(e))}", file=sys.stderr)  # a report of several lines
        return e.exit_code
    except RunAborted as e:
        print(f"raygpt: {printable(e)}", file=sys.stderr)
        return e.exit_code
    return EXIT_FINISHED if not summary.get("stopped_early") else EXIT_STOPPED


def _cluster_capacity() -> tuple[int | None, int]:
    """resolve()'s (GPUs, CPUs): the cluster's that RAY_ADDRESS names (under `ray job submit`
    the driver runs on the head node, which often has no GPU), else this machine's, without
    starting Ray or importing Ray Train (capacity.for_resolve)."""
    if not os.environ.get("RAY_ADDRESS"):
        return capacity.for_resolve(None)
    from raygpt.ray.driver import cluster_resources
    return capacity.for_resolve(cluster_resources())


def _sweep(argv: list[str]) -> int:
    from raygpt.ray.sweep_command import main as sweep_main  # the trials checked before Ray Tune loads
    return sweep_main(argv, prog="raygpt sweep")


def _prepare(argv: list[str]) -> int:
    from raygpt.ray.prepare import main as prepare_main
    return prepare_main(argv)


def _sweeps(directory, not_a_run: FileNotFoundError):
    """The sweep reader for `raygpt status` / `raygpt plot` of a directory holding no run
    (imported only then: a run's status and plot need none of the Ray seam)."""
    from raygpt.ray import sweep_results
    return sweep_results.for_directory(directory, not_a_run)


def _status(argv: list[str]) -> int:
    from raygpt.runlog.status import status_main
    return status_main(argv, sweeps=_sweeps)


def _plot(argv: list[str]) -> int:
    from raygpt.runlog.plot import plot_main
    return plot_main(argv, sweeps=_sweeps)


def _compact(argv: list[str]) -> int:
    from raygpt.runlog.compact import compact_main
    return compact_main(argv)


def build_main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="raygpt", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fault-tolerant GPT-2 pretraining on Ray, with llm.c's flags and files.",
        epilog="commands:\n" + "\n".join(f"  {name:<9}{text}" for name, text in COMMANDS.items())
        + "\n\n`raygpt COMMAND --help` for each command's options.\n\n" + EXIT_CODES)
    p.add_argument("--version", action="version", version=f"raygpt {__version__}")
    p.add_argument("command", nargs="?", choices=list(COMMANDS), metavar="COMMAND",
                   help="one of: " + ", ".join(COMMANDS))
    return p


def _trained(command: str):
    def handler(argv: list[str]) -> int:
        from raygpt.interop import trained  # torch, and transformers for export: only when asked
        return getattr(trained, f"{command}_main")(argv)
    return handler


def parser_for(command: str | None) -> argparse.ArgumentParser:
    """The argparse parser that reads `raygpt COMMAND`'s arguments (None: `raygpt` itself), built
    without starting Ray or running anything, for checks of quoted command lines
    (tests/test_docs.py). `sweep` reads its own options and every train flag, as
    raygpt.ray.sweep_command.main does in two passes."""
    if command is None:
        return build_main_parser()
    if command == "train":
        return build_parser("raygpt train")
    if command == "sweep":
        from raygpt.ray.trials import build_sweep_parser
        return FlagParser(prog="raygpt sweep", allow_abbrev=False, add_help=False,
                          parents=[build_sweep_parser(), build_parser("raygpt sweep")])
    if command in ("status", "plot"):
        from raygpt.runlog import plot, status
        return status.status_parser() if command == "status" else plot.plot_parser()
    if command in ("export", "sample", "eval"):
        from raygpt.interop import trained
        return getattr(trained, f"{command}_parser")()
    if command == "prepare":
        from raygpt.ray.prepare import build_parser as prepare_parser
        return prepare_parser()
    if command == "compact":
        from raygpt.runlog.compact import build_parser as compact_parser
        return compact_parser()
    raise ValueError(f"unknown command {command!r}: expected one of {', '.join(COMMANDS)}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    handlers = {"train": _train, "sweep": _sweep, "prepare": _prepare, "status": _status,
                "plot": _plot, "compact": _compact, "export": _trained("export"),
                "sample": _trained("sample"), "eval": _trained("eval")}
    if argv and argv[0] in handlers:
        return handlers[argv[0]](argv[1:])
    parser = build_main_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    try:
        parser.parse_args(argv)  # --help and --version exit 0 here
    except SystemExit as e:
        return int(e.code or 0)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
