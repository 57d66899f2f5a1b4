"""The `raygpt` command: train, and the operator's tools around a run directory.

    raygpt train [llm.c flags | long options]   run a job under Ray Train (see --help)
    raygpt prepare INPUT.txt -o OUT_DIR          tokenize a text file into llm.c shards
    raygpt status RUN_DIR [--quick]              last step, loss, tok/s, checkpoints, goodput
    raygpt plot RUN_DIR [-o OUT.png]             loss / lr / grad norm / tok/s with events marked
"""

from __future__ import annotations

import sys

from raygpt.config import ConfigError, build_parser, parse_args


def _train(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        build_parser("raygpt train").print_help()
        return 0
    try:
        cfg = parse_args(argv)
        cfg = cfg.resolve(_cluster_gpus())
    except ConfigError as e:
        print(f"raygpt: error: {e}", file=sys.stderr)
        return 2
    from raygpt.errors import EXIT_BAD_INPUT, EXIT_FINISHED, EXIT_STOPPED
    from raygpt.trainer import RunAborted, RunFailed, run

    try:
        summary = run(cfg)
    except ConfigError as e:
        print(f"raygpt: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunFailed as e:  # exit code by cause: a bad input met in a worker is 2, else 1
        print(f"raygpt: {'error: ' if e.exit_code == EXIT_BAD_INPUT else ''}{e}", file=sys.stderr)
        return e.exit_code
    except RunAborted as e:
        print(f"raygpt: {e}", file=sys.stderr)
        return e.exit_code
    return EXIT_FINISHED if not summary.get("stopped_early") else EXIT_STOPPED


def _cluster_gpus() -> int | None:
    """Under `ray job submit` the driver runs on the head node, which often has no GPU: count the
    cluster's GPUs instead of the local ones (None: no cluster to join, count locally)."""
    import os
    if not os.environ.get("RAY_ADDRESS"):
        return None
    import ray
    ray.init(address=os.environ["RAY_ADDRESS"], ignore_reinit_error=True)
    return int(ray.cluster_resources().get("GPU", 0))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": _train}
    from raygpt import tokenizer
    commands["prepare"] = tokenizer.main
    from raygpt import report
    commands["status"], commands["plot"] = report.status_main, report.plot_main
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
