"""Whether every node of the Ray cluster sees a local directory as this driver does.

A local `-o` on a cluster of several machines works only when it is a shared filesystem: a
prepare's tasks read units another node staged, and Ray Train's ranks store their checkpoint
files into it. Asked before anything is written there: the driver writes a probe file with a
random token into the directory's nearest existing parent, one task pinned to each alive node
reads it back, and the probe is removed. A store without local paths (a bucket) needs none."""

from __future__ import annotations

import os
import secrets

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raygpt.storage.atomic_file import write_local_atomic

PROBE_PREFIX = ".raygpt-shared-probe-"
TIMEOUT_S = 60.0  # each node's task: a cold worker start on a loaded node


def _read_probe(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read(64)
    except OSError:
        return None


def _existing_parent(directory: str) -> str:
    d = os.path.abspath(directory)
    while not os.path.isdir(d):
        d = os.path.dirname(d)
    return d


def nodes_not_seeing(directory: str, timeout_s: float = TIMEOUT_S) -> tuple[list[str], int]:
    """([the IP of each alive node that does not see `directory`], alive nodes); ([], 1) on
    one node without asking. Ray must be initialized."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return [], len(nodes)
    parent = _existing_parent(directory)
    token = secrets.token_hex(16)
    probe = os.path.join(parent, PROBE_PREFIX + token)
    write_local_atomic(probe, [token.encode("ascii")])  # (a new random name: nothing replaced)
    try:
        read = ray.remote(_read_probe)
        refs = {n["NodeManagerAddress"] + f" ({n['NodeID'][:8]})": read.options(
                    num_cpus=0, max_retries=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
                ).remote(probe) for n in nodes}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        seen = {name: (ray.get(ref) if ref in ready else None) for name, ref in refs.items()}
    finally:
        os.unlink(probe)
    return sorted(name for name, got in seen.items() if got != token), len(nodes)


def blind_nodes_line(flag: str, directory: str, blind: list[str], alive: int) -> str | None:
    """The one line refusing `directory` when some nodes do not see it (None: every node does)."""
    if not blind:
        return None
    return (f"{flag} {directory}: expected a directory every node of the Ray cluster sees (a "
            f"shared filesystem such as NFS) or an s3:// / gs:// URI; {len(blind)} of {alive} "
            f"nodes do not see it: {', '.join(blind[:3])}{' ...' if len(blind) > 3 else ''}")
