"""The Ray seam's knobs: where the workers train, how many, and how many restarts Ray Train may
make (FailureConfig), with their defaults from the hardware and their checks. (Declarations
only: Ray itself is imported by the seam's other modules.)"""

from __future__ import annotations

from dataclasses import dataclass

from raygpt.config.errors import ConfigError
from raygpt.config.knobs import knob, need


def local_gpus() -> int:
    """The GPUs this process can see (CUDA_VISIBLE_DEVICES applies), as a Ray started here
    counts them."""
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:  # torch missing or broken CUDA: treat as no GPU, the caller says so
        return 0


@dataclass
class RayConfig:
    """The worker group Ray Train runs and its failure policy."""

    device: str = knob("auto", section="ray", choices=("auto", "cpu", "gpu"))
    """Where the workers train: auto picks gpu when the machine (or, under ray job submit, the
    cluster) has a GPU, else cpu. --cpu and --gpu are short for it."""
    num_workers: int | None = knob(None, section="ray", may_change_on_resume=True)
    """Ray Train workers. Default: every visible GPU, or 2 CPU workers (1 where the Ray has a
    single CPU)."""
    min_workers: int | None = knob(None, section="ray", may_change_on_resume=True)
    """Elastic: continue on as few as this many workers after losing nodes. The global batch
    (-d) stays the same; grad accumulation absorbs the change. Default: none (a fixed size)."""
    max_failures: int = knob(3, section="ray", may_change_on_resume=True)
    """Worker-group restarts Ray Train may make after failures (FailureConfig.max_failures)."""
    max_preemption_failures: int = knob(10, section="ray", may_change_on_resume=True)
    """Restarts after preemptions, counted apart from max_failures."""


    def resolve_ray(self, *, gpus_available: int | None, cpus_available: int | None,
                    notes: list[str]) -> bool:
        """Fill --device and --num-workers where unset; True when the workers train on GPUs.
        `gpus_available` / `cpus_available`: what the Ray the run uses holds (GPUs: None counts
        this machine's; CPUs: None is not known, and a CPU run gets its default of 2 workers)."""
        if gpus_available is None:  # (counting GPUs imports torch: not for --cpu)
            gpus_available = 0 if self.device == "cpu" else local_gpus()
        if self.device == "auto":
            self.device = "gpu" if gpus_available > 0 else "cpu"
        if self.device == "gpu" and gpus_available == 0 and self.num_workers is None:
            raise ConfigError("--gpu: no GPU is visible on this machine (expected at least 1, found 0)")
        on_gpu = self.device == "gpu"
        if self.num_workers is None and on_gpu:
            self.num_workers = gpus_available
        elif self.num_workers is None:  # two CPU workers, where the Ray has two CPUs to hold them
            self.num_workers = 2 if cpus_available is None else max(1, min(2, cpus_available))
            if self.num_workers < 2:
                notes.append(f"workers=1 (not 2): the Ray this run uses has {cpus_available} CPU, "
                             f"and a second CPU worker would wait for one forever")
        return on_gpu

    def world_sizes(self) -> range:
        """Every number of workers the run may train on (elastic runs shrink to --min-workers)."""
        return range(self.min_workers or self.num_workers, self.num_workers + 1)

    def validate_ray(self) -> None:
        need(self.device in ("cpu", "gpu"), "--device", "cpu or gpu", self.device)
        need(self.num_workers >= 1, "--num-workers", "an integer >= 1", self.num_workers)
        need(self.max_failures >= 0, "--max-failures", "an integer >= 0", self.max_failures)
        need(self.min_workers is None or 1 <= self.min_workers <= self.num_workers,
             "--min-workers", f"an integer in [1, --num-workers={self.num_workers}]", self.min_workers)
