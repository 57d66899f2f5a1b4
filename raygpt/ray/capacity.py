"""What the Ray that a raygpt process starts on this machine will hold: the GPUs this process
sees, or Ray's own count of its CPUs (a container's CPU quota, not only the host's cores). The
config's defaults and the preflight take these numbers as arguments; only this seam asks Ray.
Light to import: Ray's helper (raygpt.ray.compat) is imported when a CPU count is asked for."""

from __future__ import annotations

import os

from raygpt.config import TrainConfig, local_gpus
from raygpt.ray import compat


def local_cpus() -> int:
    """The CPUs a Ray started on this machine has (os.cpu_count() where Ray cannot say)."""
    try:
        return compat.num_cpus()
    except Exception:  # noqa: BLE001 - another Ray layout: the host's count
        return os.cpu_count() or 1


def for_resolve(cluster: dict | None) -> tuple[int | None, int]:
    """resolve()'s (gpus_available, cpus_available) from a cluster's resources, or, for None (the
    Ray started here), (None: resolve() counts this machine's GPUs itself, Ray's CPU count)."""
    if cluster is None:
        return None, local_cpus()
    return int(cluster.get("GPU", 0)), int(cluster.get("CPU", 0))


def this_machine(cfg: TrainConfig) -> dict[str, int]:
    """{"GPU": n} for a GPU run, {"CPU": n} for a CPU one: what its workers can take here."""
    return {"GPU": local_gpus()} if cfg.device == "gpu" else {"CPU": local_cpus()}
