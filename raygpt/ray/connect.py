"""Start or join Ray: the one `ray.init` of a raygpt driver (train, sweep, prepare).

Kept apart from raygpt.ray.driver, which imports Ray Train and through the config torch (about
1-3 s), so that `raygpt prepare`, which needs neither, joins a cluster on `import ray` alone.
"""

from __future__ import annotations

import os

import ray

from raygpt.ray import ray_logs


def starts_its_own_ray(address: str | None = None) -> bool:
    """Whether a run here would start a Ray of its own on this machine: no Ray joined yet and
    none named (the argument, else RAY_ADDRESS)."""
    return not (ray.is_initialized() or address or os.environ.get("RAY_ADDRESS"))


def init_ray(address: str | None = None) -> None:
    """Start or join Ray, unless this process already did. Without an address (the argument,
    else RAY_ADDRESS) this starts a Ray of its own (address="local"): a bare `ray.init()` would
    join whatever cluster /tmp/ray names on this machine, perhaps another user's. One started
    here has no dashboard (`ray start --head` and RAY_ADDRESS give a run one: docs/cluster.md)."""
    if ray.is_initialized():
        return
    # each worker's output once (Ray's dedup would fold the per-step lines of rank 0)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray_logs.quiet_ray_console()  # Ray's own lines to its log files: the terminal is raygpt's
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        # Ray's memory monitor kills one worker at a time (its default since 2.56 kills several,
        # and took the run's controller with them: nothing was left to restart the group)
        os.environ.setdefault("RAY_worker_killing_policy_by_group", "true")
    # a Ray of its own starts without the dashboard, which nothing of a run uses (raygpt's
    # placement-group cleanup asks the controller, not the State API): its nine module
    # processes are not started beside the run's own; a joined Ray keeps what it started with
    own = {"include_dashboard": False} if address == "local" else {}
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=True, **own)
    ray_logs.open_session_log()
