"""What the Ray that a raygpt process starts on this machine will hold: the GPUs this process
sees, or Ray's own count of its CPUs (a container's CPU quota, not only the host's cores). The
config's defaults and the preflight take these numbers as arguments; only this seam asks Ray.
Light to import: Ray's helper (raygpt.ray.compat) is imported when a CPU count is asked for."""

from __future__ import annotations

import os

from raygpt.ray.knobs import RayConfig, local_gpus
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


# What Ray's own processes on the node it starts hold (GCS, raylet, dashboard, Ray Train's
# controller, raygpt's control actor): memory the workers cannot have.
RAY_PROCESSES_BYTES = 2 << 30
# Ray's memory monitor kills a worker once the node's used memory passes this fraction of its
# total (RAY_memory_usage_threshold, Ray's default).
RAY_MEMORY_THRESHOLD = 0.95


def this_machine(cfg: RayConfig) -> dict[str, int]:
    """What a run's workers can take here: {"GPU": n, "gpu_memory": bytes of one} for a GPU
    run, {"CPU": n, "memory": bytes} for a CPU one (`memory_for_workers`)."""
    if cfg.device == "gpu":
        gpus, each = local_gpus(), gpu_memory()
        return {"GPU": gpus, **({"gpu_memory": each} if gpus and each else {})}
    return {"CPU": local_cpus(), "memory": memory_for_workers()}


def gpu_memory() -> int | None:
    """Bytes of this machine's first GPU (the GPUs of one machine are alike); None where torch
    sees no CUDA device."""
    import torch
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def memory_for_workers(meminfo: str | None = None, environ=os.environ) -> int:
    """The host memory the workers of a Ray started here may take before Ray's memory monitor
    kills one: what is available now, less what the monitor keeps free above its threshold
    (RAY_memory_usage_threshold of the total) and less Ray's own processes. `meminfo`: the
    text of /proc/meminfo (read when None)."""
    if meminfo is None:
        with open("/proc/meminfo") as f:
            meminfo = f.read()
    kib = {line.split(":")[0]: int(line.split()[1]) for line in meminfo.splitlines()
           if line.split()[1:2] and line.split()[1].isdigit()}
    total, available = kib["MemTotal"] * 1024, kib.get("MemAvailable", kib["MemFree"]) * 1024
    threshold = float(environ.get("RAY_memory_usage_threshold", RAY_MEMORY_THRESHOLD))
    return max(0, int(available - (1 - threshold) * total) - RAY_PROCESSES_BYTES)
