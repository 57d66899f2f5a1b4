"""The run log's knobs: the run directory (-o) and its store's endpoint, the console and the
history's cadence, segments on an object store, trackers (W&B, MLflow) and fault injection for
tests, with their checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from raygpt.config.errors import ConfigError
from raygpt.config.knobs import knob, need
from raygpt.runlog import tracking


@dataclass
class RunLogConfig:
    """Where a run keeps its files and what it tells a person and a tracker."""

    output_dir: str = knob("runs/shakespeare", section="run", short="-o", metavar="DIR|URI",
                           may_change_on_resume=True,
                           hints=("--out-dir", "--save-dir", "--run-dir"))
    """Run directory: main.log, loss_history.jsonl, checkpoints; a local path or a URI."""
    storage_endpoint: str = knob("", section="run", metavar="URL", may_change_on_resume=True)
    """S3-compatible endpoint of an s3:// run directory and s3:// -i/-j shards (MinIO, Ceph...),
    e.g. http://minio:9000; default: AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, else AWS's own.
    An endpoint in the URI itself (?endpoint_override=host:port&scheme=http) wins."""
    log_every: int = knob(1, section="run", may_change_on_resume=True)
    """Console line every N steps."""
    log_segment_s: float = knob(30.0, section="run", metavar="SECONDS", may_change_on_resume=True)
    """On an object store (s3://, gs://), how long rank 0 keeps the lines of loss_history,
    main.log and samples before storing them as a new segment (a part object); a killed rank 0
    loses at most this much (plus one upload). Local and NFS run directories append each line."""
    log_segment_lines: int = knob(10000, section="run", metavar="N", may_change_on_resume=True)
    """... or this many lines, whichever comes first (a segment never holds more)."""
    record_samples: bool = knob(False, section="run", may_change_on_resume=True)
    """Record each step's global sample ranges in loss_history.jsonl (audits data coverage)."""
    wandb: str = knob("", section="run", may_change_on_resume=True)
    """W&B project for train/val metrics and the config (needs 'raygpt[wandb]');
    WANDB_MODE=offline keeps the files in <run dir>/wandb; empty: off."""
    mlflow: str = knob("", section="run", may_change_on_resume=True)
    """MLflow tracking URI for the same metrics: a server URL, sqlite:///FILE.db or a local
    directory (needs 'raygpt[mlflow]'); empty: off."""
    fault: str = knob("", section="run", metavar="SPEC", may_change_on_resume=True)
    """Fault injection for tests, e.g. 'kill:rank=1,step=7' (see raygpt.train.faults); off when empty."""
    allow_fault_injection: bool = knob(False, section="run", may_change_on_resume=True,
                                       from_file=False)
    """Let RAYGPT_FAULT from the environment arm faults (refused without it: an inherited
    variable must not inject kills into a real run)."""


    def resolve_run_log(self) -> None:
        self.mlflow = tracking.normalize_mlflow_uri(self.mlflow)  # workers run in other directories

    def validate_run_log(self) -> None:
        need(bool(self.output_dir.strip()), "-o/--output-dir",
             "a run directory (a path or URI; empty is the current directory: an unset variable?)",
             self.output_dir)
        need(self.log_every >= 1, "--log-every", "an integer >= 1", self.log_every)
        need(isinstance(self.log_segment_s, (int, float)) and math.isfinite(self.log_segment_s)
             and self.log_segment_s > 0, "--log-segment-s", "a number of seconds > 0",
             self.log_segment_s)
        need(isinstance(self.log_segment_lines, int) and self.log_segment_lines >= 1,
             "--log-segment-lines", "an integer >= 1", self.log_segment_lines)
        missing = tracking.check_installed(self)  # here, not in a worker after Ray has started
        if missing:
            raise ConfigError(missing)
