"""The `raygpt` command as a user meets it: --help and --version exit 0, every subcommand has
its own help, `python -m raygpt` and `python -m raygpt.ray.sweep` work, exit codes are documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raygpt import __version__

REPO = Path(__file__).resolve().parents[1]


def sh(*argv, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_top_level_help_and_version():
    out = sh("-m", "raygpt", "--help")
    assert out.returncode == 0, out.stderr
    for command in ("train", "sweep", "prepare", "status", "plot"):
        assert f"\n  {command} " in out.stdout
    for code in ("0  finished", "1  failed", "2  bad input", "3  stopped early"):
        assert code in out.stdout
    out = sh("-m", "raygpt", "--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"raygpt {__version__}")
    out = sh("-m", "raygpt")  # no command: the help, on stderr, and a usage error
    assert out.returncode == 2 and "train" in out.stderr
    out = sh("-m", "raygpt", "fly")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_train_help_lists_every_flag_with_defaults():
    out = sh("-m", "raygpt", "train", "--help")
    assert out.returncode == 0, out.stderr
    assert "-x INT, --max-steps INT" in out.stdout and "exit status:" in out.stdout
    assert out.stdout == sh(str(REPO / "experiments" / "shakespeare.py"), "--help").stdout


@pytest.mark.parametrize("entry", [("-m", "raygpt", "sweep"), ("-m", "raygpt.ray.sweep")])
def test_sweep_front_doors_have_their_own_help(entry):
    out = sh(*entry, "--help")
    assert out.returncode == 0, out.stderr
    assert "--grid KEY=V1,V2" in out.stdout and "(default: asha)" in out.stdout
    assert "--learning-rate" in out.stdout  # and the train flags of the base config
    # the sweep's own exit statuses, once (not a train run's)
    assert out.stdout.count("exit status:") == 1 and "0  a best trial exists" in out.stdout


def test_other_subcommands_have_help():
    for command in ("status", "plot", "prepare"):
        out = sh("-m", "raygpt", command, "--help")
        assert out.returncode == 0 and "usage:" in out.stdout, (command, out.stderr)


def test_status_and_plot_of_a_sweep_directory_go_through_the_sweep_reader_the_command_hands_down(
        tmp_path):
    """runlog/ sits below the Ray seam: `raygpt status` / `raygpt plot` of a directory holding no
    run get the sweep's reader (ray/sweep_results.py) from the command line."""
    from raygpt.ray import sweep
    from raygpt.storage import open_run_dir
    sweep_dir = tmp_path / "sweep"
    plan = sweep.SweepPlan(sweep_dir=str(sweep_dir), mode="grid", user_base={}, base={},
                           settings={}, trials=[{"name": "trial_000",
                                                 "overrides": {"learning_rate": 0.002}}])
    sweep.write_plan(open_run_dir(str(sweep_dir)), plan)
    out = sh("-m", "raygpt", "status", str(sweep_dir))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"sweep {sweep_dir} | mode grid | 1 trial(s): 1 pending")
    assert "trial_000  pending  learning_rate=0.002" in out.stdout
    neither = tmp_path / "neither"
    neither.mkdir()
    out = sh("-m", "raygpt", "status", str(neither))  # no run, no sweep: the run's own error
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"(is {neither} a raygpt run directory?)" in out.stderr
    pytest.importorskip("matplotlib")
    out = sh("-m", "raygpt", "plot", str(sweep_dir), "-o", str(tmp_path / "val.png"))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"raygpt plot: wrote {tmp_path / 'val.png'} (1 trial(s))\n"
    assert (tmp_path / "val.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
