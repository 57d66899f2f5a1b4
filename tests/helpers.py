"""Small shared pieces for the tests: tiny configs, reading a run's records, its log lines."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path

from raygpt.config import TrainConfig
from raygpt.tools.local_s3 import fix_moto_complete_multipart


# a line of Ray's own Python loggers ("2026-12-06 10:03:08,213\tWARNING file.py:85 -- ...")
RAY_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+\s+(DEBUG|INFO|WARNING)\s+\S+:\d+ -- ")


def tiny_config(run_dir, **overrides) -> TrainConfig:
    """A depth-2 model on short sequences: a few tens of ms per micro-step on one CPU thread."""
    base = dict(model="d2", batch_size=4, seq_len=32, max_steps=12, val_every=0, val_batches=2,
                sample_every=0, gen_tokens=8, checkpoint_every=4, output_dir=str(run_dir),
                device="cpu", num_workers=1, compile=False, warmup_steps=2)
    base.update(overrides)
    return TrainConfig(**base)


@contextlib.contextmanager
def log_lines(name: str, level: int = logging.WARNING):
    """The messages logger `name` emits at `level` or above while the block runs (raygpt's
    loggers do not propagate to the root, where pytest's caplog listens)."""
    logger, lines = logging.getLogger(name), []
    handler = logging.Handler(level)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def records(run_dir) -> list[dict]:
    path = Path(run_dir) / "loss_history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_losses(run_dir, attempt=None) -> dict[int, float]:
    """{step: loss} of the train records (the latest attempt of each step wins)."""
    out = {}
    for r in records(run_dir):
        if r["kind"] == "train" and (attempt is None or r["attempt"] == attempt):
            out[r["step"]] = r["loss"]
    return out


def samples_seen(run_dir) -> list[tuple[int, int]]:
    """Every (shard, sample) the final loss curve trained on (latest attempt of each step), from
    the train records of a run with record_samples on."""
    by_step = {}
    for r in records(run_dir):
        if r["kind"] == "train":
            by_step[r["step"]] = r["samples"]
    return sorted((shard, i) for ranges in by_step.values() for shard, a, b in ranges
                  for i in range(a, b))


def memory_fs():
    """fsspec's in-memory filesystem as a pyarrow FileSystem: a non-local run-dir store for tests
    (process-global: give every test its own root)."""
    import fsspec
    import pyarrow.fs as pafs

    return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))


class S3Server:
    """moto's S3 server (the S3 HTTP API, in this process) on 127.0.0.1 and a port the kernel
    picked while binding (port 0: no free port is looked up first and reused, so no other
    process can take it in between). `with S3Server() as s3:` starts it and stops it; `s3.fs()`
    is a pyarrow S3FileSystem on it, `s3.endpoint` its URL (what AWS_ENDPOINT_URL takes)."""

    KEY, SECRET = "AKIATEST", "moto-secret"

    def __init__(self):
        from moto.server import ThreadedMotoServer
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)

    def __enter__(self) -> "S3Server":
        fix_moto_complete_multipart()
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.address = f"{host}:{port}"
        self.endpoint = f"http://{self.address}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def fs(self, **options):
        import pyarrow.fs as pafs
        return pafs.S3FileSystem(**{"access_key": self.KEY, "secret_key": self.SECRET,
                                    "region": "us-east-1", "endpoint_override": self.address,
                                    "scheme": "http", "allow_bucket_creation": True,
                                    "allow_delayed_open": True, **options})

    def uri(self, path: str) -> str:
        """s3://path with this server's endpoint and moto's region in the URI."""
        return (f"s3://{path}?endpoint_override={self.address}&scheme=http&region=us-east-1"
                f"&allow_delayed_open=true")

    def require_auth(self) -> None:
        """From now on refuse requests whose credentials IAM does not know (moto's auth)."""
        from moto import settings
        from moto.core.responses import ActionAuthenticatorMixin
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        ActionAuthenticatorMixin.request_count = 0

    def allow_all(self) -> None:
        from moto import settings
        settings.INITIAL_NO_AUTH_ACTION_COUNT = float("inf")
