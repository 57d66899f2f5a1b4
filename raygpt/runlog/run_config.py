"""`config.json` in the run directory: what ran, written by the driver at every launch.

Format (JSON object, "format": "raygpt-config", "version": 1):

    launch      1 for the run's first start, then one more for each later start (-y 1 resumes)
    time        when the driver wrote it (Unix seconds)
    command     the command line (argv, and as one shell-quoted string) and working directory
    config      every TrainConfig field, resolved (what the workers received)
    adapted     what resolving the defaults changed to fit the data, and why
    plan        what the driver's checks found (data sizes, validation layout, resume step)
    hardware    the driver's host, CPUs and GPUs, and the workers asked for
    versions    python, raygpt, ray, torch, numpy, pyarrow, triton; the git commit if any

A launch never loses an earlier one: before writing the new `config.json`, the previous one is
kept as `config.<its launch>.json` (config.1.json is the first start). `read_launches` returns
them all, oldest first; `config_changes` names the fields that differ between two launches, which
`raygpt status` prints.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
from importlib import metadata

from raygpt import __version__
from raygpt.config import PACKAGE_DIR, ConfigError, TrainConfig
from raygpt.runlog.terminal import printable
from raygpt.storage import RunDir, read_json_bounded, redact

CONFIG_FILE = "config.json"
FORMAT, VERSION = "raygpt-config", 1
_KEPT_RE = re.compile(r"^config\.(\d+)\.json$")
MAX_CONFIG_BYTES = 1 << 20  # a record is a few KB: every TrainConfig field, argv, versions


def launch_record(cfg: TrainConfig, *, launch: int, argv: list[str] | None = None,
                  adapted: list[str] = (), plan: list[str] = (), cwd: str | None = None,
                  cluster: dict | None = None) -> dict:
    """argv and cwd: this process's unless given (a sweep trial records its sweep's command).
    `cluster`: the Ray cluster's resources when the driver is in one already (the Ray seam,
    raygpt.ray.driver, reads them: this module does not import Ray)."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    return {
        "format": FORMAT, "version": VERSION, "launch": launch, "time": time.time(),
        "command": {"argv": argv, "line": shlex.join(argv), "cwd": cwd or os.getcwd()},
        "config": cfg.to_dict(), "adapted": list(adapted), "plan": list(plan),
        "hardware": _hardware(cfg, cluster), "versions": _versions(),
    }


def write_launch(run_dir: RunDir, cfg: TrainConfig, *, argv: list[str] | None = None,
                 adapted: list[str] = (), plan: list[str] = (), cwd: str | None = None,
                 cluster: dict | None = None) -> dict:
    """Keep the previous config.json as config.<launch>.json, then write this launch's."""
    kept = [int(m.group(1)) for n in run_dir.listdir(files_only=True) if (m := _KEPT_RE.match(n))]
    launch = max(kept, default=0) + 1
    if run_dir.exists(CONFIG_FILE):
        try:  # bounded, and never through a link: a planted one is not copied into the run
            previous = run_dir.read_bytes(CONFIG_FILE, max_bytes=MAX_CONFIG_BYTES)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{e} (the previous launch's record, kept before this launch's "
                              f"is written: move it away to start anew)") from e
        run_dir.write_bytes_atomic(f"config.{launch}.json", previous)
        launch += 1
    record = launch_record(cfg, launch=launch, argv=argv, adapted=adapted, plan=plan, cwd=cwd,
                           cluster=cluster)
    # a URI's credentials (s3://KEY:SECRET@...) in -o or the command line are never stored
    text = redact(json.dumps(record, indent=1, default=str))
    run_dir.write_bytes_atomic(CONFIG_FILE, (text + "\n").encode())
    return json.loads(text)


def read_launches(run_dir: RunDir, *, skipped: list[str] | None = None) -> list[dict]:
    """Every launch's record, oldest first (config.1.json ... config.json). A file that is not
    a raygpt config record (larger than MAX_CONFIG_BYTES, a link, not JSON, another format) is
    skipped, and why is added to `skipped` (one line each)."""
    names = sorted((int(m.group(1)), n) for n in run_dir.listdir(files_only=True)
                   if (m := _KEPT_RE.match(n)))
    names = [n for _, n in names] + ([CONFIG_FILE] if run_dir.exists(CONFIG_FILE) else [])
    out = []
    for name in names:
        try:
            rec = read_json_bounded(run_dir, name, max_bytes=MAX_CONFIG_BYTES)
        except (OSError, ValueError) as e:
            rec = e
        if isinstance(rec, dict) and rec.get("format") == FORMAT and isinstance(rec.get("config"), dict):
            out.append(rec)
        elif skipped is not None:
            skipped.append(str(rec) if isinstance(rec, Exception) else
                           f"{run_dir.uri(name)}: expected a {FORMAT!r} record, found another")
    return out


def with_defaults(config: dict) -> dict:
    """A launch's recorded config with the fields its raygpt did not have yet (a config.json
    written before a field existed) at their defaults, the values that launch ran with."""
    defaults = TrainConfig().to_dict()
    out = {**defaults, **config}
    if isinstance(config.get("spike"), dict):
        out["spike"] = {**defaults["spike"], **config["spike"]}
    return out


def config_changes(before: dict, after: dict, prefix: str = "") -> list[str]:
    """'field: old -> new' for every config field that differs between two launches."""
    changes = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return changes


def format_launches(launches: list[dict], skipped: list[str] = ()) -> list[str]:
    """`raygpt status`'s lines about what ran: the newest launch's command, hardware, versions
    and config, what resolution adapted, and what each later launch changed; then a line per
    record `read_launches` skipped. Each line is `printable` (the records are untrusted)."""
    lines = [f"{'launch' if i == 0 and not launches else '':<10}skipped {why}"
             for i, why in enumerate(skipped)]
    if not launches:
        return [printable(line) for line in lines]
    try:
        lines = _launch_lines(launches) + lines
    except (AttributeError, KeyError, TypeError, ValueError, RecursionError) as e:  # hand-edited
        lines = [f"launch    {len(launches)} launch(es); {CONFIG_FILE} not as raygpt writes it "
                 f"({type(e).__name__}: {e})"] + lines
    return [printable(line) for line in lines]


def _launch_lines(launches: list[dict]) -> list[str]:
    new = launches[-1]
    c, hw, v = new["config"], new.get("hardware", {}), new.get("versions", {})
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(new.get("time", 0)))
    lines = [f"launch    {len(launches)} launch(es), newest {when}: "
             f"{new.get('command', {}).get('line', '?')}",
             f"config    {hw.get('workers', '?')} on {hw.get('host', '?')} | {c.get('model')} | "
             f"{c.get('precision')} | B={c.get('batch_size')} T={c.get('seq_len')} | "
             f"{c.get('total_batch_size'):,} tokens/step | -x {c.get('max_steps')} | "
             f"lr {c.get('learning_rate')} {c.get('scheduler')} | " + ", ".join(
                 f"{k} {v[k]}" for k in ("raygpt", "ray", "torch") if k in v)
             + (f" | git {v['git_commit'][:10]}" if "git_commit" in v else "")]
    lines += [f"          adapted: {note}" for note in new.get("adapted", [])]
    for before, after in zip(launches, launches[1:]):
        changes = config_changes(with_defaults(before["config"]), with_defaults(after["config"]))
        lines.append(f"          launch {after.get('launch')} changed: "
                     + ("; ".join(changes) if changes else "nothing in the config"))
    return lines


def _hardware(cfg: TrainConfig, cluster: dict | None = None) -> dict:
    hw = {"host": socket.gethostname(), "platform": platform.platform(),
          "cpus": os.cpu_count(), "workers": f"{cfg.num_workers} x {cfg.device}"}
    try:
        import torch
        if torch.cuda.is_available():
            hw["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken CUDA install is not this record's business
        pass
    if cluster is not None:  # under `ray job submit` the driver joined the cluster already
        hw["cluster"] = {k: v for k, v in cluster.items() if k in ("CPU", "GPU", "memory")}
    return hw


def _versions() -> dict:
    v = {"python": platform.python_version(), "raygpt": __version__}
    for dist in ("ray", "torch", "numpy", "pyarrow", "triton"):
        try:
            v[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:  # a checkout's commit; an installed wheel has none
        out = subprocess.run(["git", "-C", str(PACKAGE_DIR), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            v["git_commit"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return v
