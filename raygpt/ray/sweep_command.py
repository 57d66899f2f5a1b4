"""`raygpt sweep`'s command line: every trial config that can be known is checked first
(raygpt.ray.trials: no Ray Tune, no torch, Ray asked only for this machine's CPU count), and only
then is the runner, raygpt.ray.sweep_tune (Ray Tune, Ray Train and torch: seconds of imports),
loaded to run them.
"""

from __future__ import annotations

import os
import sys

from raygpt.config import ConfigError, TrainConfig, mixture, output_dir_with_endpoint, parse_args
from raygpt.config.flag_hints import shown_flags
from raygpt.ray import capacity
from raygpt.ray.trials import (DEFAULT_SCHEDULERS, _branch_totals, build_sweep_parser,
                               check_space, known_space, pin_for_trials, preflight_sweep,
                               space_items)


def main(argv: list[str] | None = None, prog: str = "raygpt sweep") -> int:
    """The sweep's command line (`raygpt sweep`, `python -m raygpt.ray.sweep`,
    experiments/sweep_shakespeare.py): 0 when a best trial exists, 1 when none finished, 2 on
    bad input (found before Ray starts, or met by every trial)."""
    from raygpt.train.errors import EXIT_BAD_INPUT, EXIT_FAILED
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        build_sweep_parser(prog).print_help()
        print("\nbase config flags (every raygpt train flag; -o is the sweep directory, -y 1 "
              "resumes the sweep):")
        from raygpt.config import build_parser
        train = build_parser(prog)
        train.epilog = None  # a train run's exit statuses: the sweep's are above
        train.print_help()
        return 0
    try:
        sweep_parser = build_sweep_parser(prog)
        ns, rest = sweep_parser.parse_known_args(argv)
        base = parse_args(rest, base=TrainConfig(output_dir="runs/sweep_shakespeare"), prog=prog,
                          also_known=shown_flags(sweep_parser))
        # the sweep directory names its store's endpoint (--storage-endpoint or the AWS
        # variables) like a run's: the driver, Tune and every trial then open the same store
        base = base.with_overrides({"output_dir": output_dir_with_endpoint(
            base.output_dir, base.storage_endpoint,
            data=(*mixture.patterns(base.input_bin), base.input_val_bin))})
        items = space_items(ns)
        if base.resume != 1 and not (ns.address or os.environ.get("RAY_ADDRESS")):
            # this machine's Ray, not started yet: every known trial checked before importing it
            space = known_space(items)
            check = base
            if ns.wsd_branches:
                check = base.with_overrides({"scheduler": "wsd"})
                space["max_steps"] = {"grid_search": _branch_totals(ns.wsd_branches)}
            elif not space:
                space = {"scheduler": {"grid_search": list(DEFAULT_SCHEDULERS)}}
            check_space(check, space)
            preflight_sweep(pin_for_trials(check, None, capacity.local_cpus()), space,
                            base.output_dir, on_this_machine=True)
        from raygpt.ray import sweep_tune  # Ray Tune, Ray Train and torch: seconds of imports
        from raygpt.ray.driver import RunFailed
    except ConfigError as e:
        print(f"raygpt sweep: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        report = sweep_tune.run_from_args(ns, items, base)
    except ConfigError as e:
        print(f"raygpt sweep: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunFailed as e:  # the WSD stable phase, run by this driver
        print(f"raygpt sweep: {'error: ' if e.exit_code == EXIT_BAD_INPUT else ''}{e}",
              file=sys.stderr)
        return e.exit_code
    if report.best is not None:
        return 0
    bad = report.rows and all(r.stopped == EXIT_BAD_INPUT for r in report.rows)
    return EXIT_BAD_INPUT if bad else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
