"""Ray Tune sweeps over raygpt runs: every trial is a full raygpt run in its own run directory.

The sweep lives in modules split by concern (none imports this one; `raygpt sweep`'s command
line, sweep_command.py, imports the runner):

    sweep_plan.py     the plan (sweep.json), its ledger (ledger.json) and the trials' rows; no Ray
    sweep_asha.py     ASHA's rungs: an early stop asks the trial's run to stop; rebuilt on resume
    sweep_wsd.py      WSD branches: the shared stable phase, trained once, and each branch's seed
    sweep_tune.py     the Tune runner: run_sweep, run_wsd_branches, resume_sweep, each trial
    sweep_results.py  results.txt, best_config.json, val_loss.png; `raygpt status`/`plot` of one

This module is their face: it re-exports their names (`raygpt.ray.sweep.run_sweep(...)`), and
`python -m raygpt.ray.sweep` is `raygpt sweep`.
"""

from __future__ import annotations

import sys

from ray import tune  # noqa: F401

from raygpt.ray.sweep_asha import (GracefulASHA, _ByName, _default_grace,  # noqa: F401
                                   request_stop, trial_control_name)
from raygpt.ray.sweep_plan import (BEST_CONFIG, LEDGER_FILE, LEDGER_FORMAT,  # noqa: F401
                                   LEDGER_VERSION, PLAN_FILE, PLAN_FORMAT, PLAN_VERSION, PLOT,
                                   RESULTS_JSON, RESULTS_TXT, STABLE_DIR, STOPPED_KEY,
                                   STOPPED_MESSAGE_KEY, TRIALS_DIR, TUNE_DIR, TUNE_STATUSES,
                                   SweepPlan, TrialRow, _abs, check_plan, ledger_entry,
                                   read_ledger, read_plan, trial_progress, trial_rows,
                                   trial_status, val_curve, write_ledger, write_plan)
from raygpt.ray.sweep_results import (SweepReport, best_config, collect_rows,  # noqa: F401
                                      format_table, plot_sweep, plot_val_curves, stable_curve,
                                      summarize, sweep_status, train_command)
from raygpt.ray.sweep_tune import (TRIAL_DRIVER_RESOURCES, VAL_KEYS, TrialLedger,  # noqa: F401
                                   _checked_before_ray, _ensure_ray, _fit, _new_plan,
                                   _NoRetryOfStoppedTrials, _tune_storage, _ValReportsToTune,
                                   max_concurrent_trials, needs_resume, next_experiment,
                                   raygpt_trial, resume_sweep, run_from_args, run_sweep,
                                   run_wsd_branches, space_from_args)
from raygpt.ray.sweep_wsd import (check_branch_space, run_stable_phase,  # noqa: F401
                                  seed_branch, shared_stable_step)


if __name__ == "__main__":
    from raygpt.ray.sweep_command import main  # the trials checked before the runner loads
    sys.exit(main())
