"""Seeing a run at a glance: `raygpt status RUN_DIR` (text) and `raygpt plot RUN_DIR` (a PNG).

Split by concern, none of them importing this module:

    run_view.py   the run as both commands read it from its run directory (`load_run`,
                  `RunView`), and the flags and checks both share
    status.py     `raygpt status`: the text report (`format_status`, `run_status`)
    plot.py       `raygpt plot`: the PNG (`plot_series`, `plot_run`)

This module is their face: it re-exports their names (`raygpt.runlog.report.run_status`).
"""

from __future__ import annotations

from raygpt.runlog.plot import (_PANELS, _STYLE, EVAL_SET_SERIES, _plot_sweep, _read_back,  # noqa: F401
                                plot_main, plot_parser, plot_run, plot_series)
from raygpt.runlog.run_view import (STATUS_FAULTS, STATUS_RECENT, CheckpointInfo,  # noqa: F401
                                    Progress, RunView, _human_bytes, _open_checked,
                                    _stderr_progress, _storage_flags, _sweep_module,
                                    _verify_flags, check_checkpoints, load_run, max_steps_of,
                                    run_state, throughput, tokens_per_step, view_from_records)
from raygpt.runlog.status import (RECOVERIES_SHOWN, _first_cause, _human_seconds,  # noqa: F401
                                  fired_lines, format_status, resume_lines, run_status,
                                  status_main, status_parser)
