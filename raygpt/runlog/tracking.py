"""Experiment trackers where users already look: Weights & Biases (`--wandb PROJECT`) and MLflow
(`--mlflow URI`), both optional extras (`pip install 'raygpt[wandb]'`, `'raygpt[mlflow]'`).

Rank 0 logs, with the step numbers of loss_history.jsonl and TensorBoard, the resolved config
when the tracker run is created and then:
    train/loss  train/lr  train/grad_norm  train/tok_per_s      every --log-every steps
    val/loss                                                    every validation

One raygpt run is one tracker run across resumes, Ray restarts and rewinds: its ids are kept in
`<run dir>/tracking.json` (written before the first metric) and a later attempt continues it
(W&B `id` + `resume="allow"`, MLflow `run_id`); a re-done step is logged again and the later
value counts. W&B gets a custom x-axis ("step", `define_metric`): its own `_step` must only grow.

Offline: `WANDB_MODE=offline` keeps W&B's files in `<run dir>/wandb/` (a local run dir, else
`WANDB_DIR`); `wandb sync --id ID <run dir>/wandb/offline-run-*` uploads every attempt. `--mlflow` takes a local
directory (MLflow's file store, which raygpt requests) or `sqlite:///path.db`, made absolute on
the driver. The driver checks packages and URI before Ray starts (`check_installed`,
`check_mlflow_uri`) and hands workers its WANDB_* / MLFLOW_* settings but no keys (`worker_env`);
a tracker that still cannot start raises TrackingError (bad input unless the network caused it).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the config imports this module: keep its import free of pyarrow
    from raygpt.storage import RunDir

TRACKING_FILE = "tracking.json"

# (flag, config field, what the workers import, the pip extra that brings it)
TRACKERS = (("--wandb", "wandb", ("wandb",), "wandb"),
            ("--mlflow", "mlflow", ("mlflow",), "mlflow"))
# an MLflow database store needs these as well (the `mlflow` extra installs them)
MLFLOW_DB_MODULES = ("sqlalchemy", "alembic")
MLFLOW_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
# the tracking-store schemes MLflow itself registers ("" is a plain path; "databricks" may come
# without a colon); plugins add theirs under the "mlflow.tracking_store" entry point group
MLFLOW_SCHEMES = ("", "file", "http", "https", "databricks", "databricks-uc", "uc",
                  *MLFLOW_DB_SCHEMES)

# names of driver variables never copied to the workers' environment (credentials belong to
# each node's own login, and a runtime_env is shown on Ray's dashboard)
_SECRET_MARKS = ("KEY", "TOKEN", "PASSWORD", "SECRET")


class TrackingError(RuntimeError):
    """A tracker that was asked for cannot be used; the message names the flag."""


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a blocked or half-imported module counts as missing
        return False


def check_installed(cfg) -> str | None:
    """The first tracker flag whose package is missing, as a one-line message (None: all there).
    Runs on the driver before Ray starts, so a missing package costs milliseconds, not a run."""
    for flag, field_name, modules, extra in TRACKERS:
        if not getattr(cfg, field_name, ""):
            continue
        needed = list(modules)
        if field_name == "mlflow" and _scheme(cfg.mlflow) in MLFLOW_DB_SCHEMES:
            needed += MLFLOW_DB_MODULES
        missing = [m for m in needed if not installed(m)]
        if missing:
            return (f"{flag} {getattr(cfg, field_name)}: expected the {' and '.join(missing)} "
                    f"package{'s' if len(missing) > 1 else ''} installed, found "
                    f"{'them' if len(missing) > 1 else 'it'} missing; "
                    f"pip install 'raygpt[{extra}]'")
    return None


def check_mlflow_uri(uri: str) -> str | None:
    """What the driver can tell about an --mlflow URI without a network round trip, as a
    one-line message (None: nothing wrong found): a scheme MLflow has no store for, a file store
    or SQLite database whose directory cannot be created or written, an http(s) URI without a
    host. A server that does not answer is not judged here: it may answer on the next attempt."""
    if not uri or uri == "databricks":
        return None
    scheme = _scheme(uri)
    if scheme not in MLFLOW_SCHEMES and scheme not in _plugin_schemes():
        return (f"--mlflow {uri}: expected a tracking URI MLflow can open (a directory, file:, "
                f"sqlite:///, http(s)://, postgresql://, mysql://, mssql://, databricks), "
                f"found the scheme {scheme!r}")
    parsed = urlparse(uri)
    if scheme in ("http", "https") and not parsed.netloc:
        return f"--mlflow {uri}: expected {scheme}://HOST[:PORT], found no host"
    if scheme == "file":
        where, what = Path(unquote(parsed.path)), "file store directory"
    elif scheme == "sqlite" and uri.startswith("sqlite:///") and ":memory:" not in uri:
        # sqlite:///rel.db is relative, sqlite:////abs.db absolute; SQLite makes no directories
        where, what = Path(uri[len("sqlite:///"):]).parent, "SQLite database's directory"
        if not where.is_dir():
            return f"--mlflow {uri}: expected the {what} {where} to exist, found none"
    else:
        return None
    existing = next((p for p in [where, *where.parents] if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return (f"--mlflow {uri}: expected a {what} this process can create and write, found "
                f"{existing} {'not a directory' if existing and not existing.is_dir() else 'not writable'}")
    return None


def _plugin_schemes() -> set[str]:
    try:
        from importlib.metadata import entry_points
        return {ep.name for ep in entry_points(group="mlflow.tracking_store")}
    except Exception:  # noqa: BLE001 - a broken distribution's metadata: no plugins then
        return set()


def _scheme(uri: str) -> str:
    return uri.split(":", 1)[0].split("+", 1)[0] if ":" in uri else ""


def normalize_mlflow_uri(uri: str) -> str:
    """A plain local path becomes an absolute file: URI (the workers' working directory is not
    the driver's); URIs with a scheme (http:, file:, sqlite:, databricks) stay as given."""
    if not uri or ":" in uri or uri == "databricks":
        return uri
    return Path(uri).expanduser().resolve().as_uri()


def worker_env(environ=None) -> dict[str, str]:
    """The driver's WANDB_* and MLFLOW_* settings (WANDB_MODE, WANDB_DIR, WANDB_ENTITY,
    MLFLOW_EXPERIMENT_NAME, ...) for the workers' runtime_env, without keys, tokens or passwords."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items()
            if k.startswith(("WANDB_", "MLFLOW_")) and not any(m in k for m in _SECRET_MARKS)}


# ---------------------------------------------------------------------- tracking.json


def read_ids(run_dir: RunDir) -> dict:
    """{"wandb": {"id", "project"}, "mlflow": {"uri", "run_id"}} kept by an earlier attempt."""
    if not run_dir.exists(TRACKING_FILE):
        return {}
    from raygpt.storage import MAX_JSON_BYTES, read_json_bounded
    try:
        ids = read_json_bounded(run_dir, TRACKING_FILE, MAX_JSON_BYTES)
    except ValueError as e:  # larger than the bound, a link, not JSON, nested too deep
        raise TrackingError(f"{run_dir.uri(TRACKING_FILE)}: expected a JSON object of tracker run "
                            f"ids, found unreadable content ({e})") from e
    if not isinstance(ids, dict):
        raise TrackingError(f"{run_dir.uri(TRACKING_FILE)}: expected a JSON object of tracker run "
                            f"ids, found {type(ids).__name__}")
    return ids


def write_ids(run_dir: RunDir, ids: dict) -> None:
    run_dir.write_bytes_atomic(TRACKING_FILE, json.dumps(ids, indent=1).encode())


# ---------------------------------------------------------------------- the trackers


def flat_config(cfg) -> dict:
    """The config as one level of keys ("spike.soft_z"), as MLflow params want it."""
    out = {}
    for k, v in cfg.to_dict().items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


class WandbTracker:
    name = "wandb"

    def __init__(self, cfg, run_dir: RunDir, kept: dict | None, attempt: int):
        import wandb

        kept = kept if kept and kept.get("project") == cfg.wandb else None
        run_id = kept["id"] if kept else secrets.token_hex(6)  # W&B ids: [a-z0-9]
        self.ids = {"id": run_id, "project": cfg.wandb}
        local = str(run_dir.local_path("")) if run_dir.caps.local_paths else None
        try:
            self.run = wandb.init(project=cfg.wandb, id=run_id, resume="allow",
                                  name=Path(cfg.output_dir.rstrip("/")).name, dir=local,
                                  config=flat_config(cfg), allow_val_change=True)
        except Exception as e:  # noqa: BLE001 - wandb raises its own errors (login, network)
            raise TrackingError(f"--wandb {cfg.wandb}: could not start a W&B run: "
                                f"{type(e).__name__}: {e}") from e
        # W&B's own _step must only grow; a re-done step (resume, rewind) goes again on "step"
        self.run.define_metric("step")
        self.run.define_metric("train/*", step_metric="step")
        self.run.define_metric("val/*", step_metric="step")
        self.run.summary["raygpt_attempt"] = attempt

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({"step": step, **metrics})

    def stored_steps(self, key: str) -> set[int] | None:
        return None  # offline or not, W&B's history cannot be read back from here

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class MlflowTracker:
    name = "mlflow"

    def __init__(self, cfg, run_dir: RunDir, kept: dict | None, attempt: int):
        if cfg.mlflow.startswith("file:"):
            # MLflow 3 refuses its file store unless asked; a directory named by --mlflow is the ask
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        self._RunStatus = RunStatus
        try:
            self.client = MlflowClient(tracking_uri=cfg.mlflow)
            if kept and kept.get("uri") == cfg.mlflow:
                run_id = kept["run_id"]
                self.client.update_run(run_id, status="RUNNING")
            else:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "raygpt")
                exp = self.client.get_experiment_by_name(name)
                exp_id = (exp.experiment_id if exp is not None
                          else self.client.create_experiment(name))
                run_id = self.client.create_run(
                    exp_id, run_name=Path(cfg.output_dir.rstrip("/")).name,
                    tags={"raygpt.output_dir": cfg.output_dir}).info.run_id
                params = [Param(k, str(v)[:6000]) for k, v in flat_config(cfg).items()]
                for i in range(0, len(params), 100):  # MLflow's limit per batch
                    self.client.log_batch(run_id, params=params[i:i + 100])
            self.client.set_tag(run_id, "raygpt.attempt", str(attempt))
        except Exception as e:  # noqa: BLE001 - MLflow raises its own errors (store, network)
            raise TrackingError(f"--mlflow {cfg.mlflow}: could not start an MLflow run: "
                                f"{type(e).__name__}: {e}") from e
        self.run_id = run_id
        self.ids = {"uri": cfg.mlflow, "run_id": run_id}
        self._pending: list = []  # MLflow's RunOperations of queued batches, waited on at close

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # queued to MLflow's logging thread: a remote server's round trip never holds a step
        self._pending.append(self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()],
            synchronous=False))
        if len(self._pending) > 256:  # long done by now: keep the list short
            for ops in self._pending[:128]:
                ops.wait()
            del self._pending[:128]

    def stored_steps(self, key: str) -> set[int] | None:
        return {m.step for m in self.client.get_metric_history(self.run_id, key)}

    def close(self, status: str) -> None:
        # this client's queued batches (mlflow.flush_async_logging would flush the default
        # tracking store instead, and may create ./mlflow.db to do it)
        for ops in self._pending:
            ops.wait()
        self._pending = []
        self.client.set_terminated(self.run_id, status)


_CLASSES = {"wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """The trackers of one attempt on rank 0 (none elsewhere, or when no flag asks for one).

    `log` never stops training: a tracker that raises is reported once on the console and in
    the loss history (via `on_error`) and dropped for the rest of the attempt. Starting one
    that was asked for and cannot start is an error (TrackingError), not a silent skip."""

    def __init__(self, cfg, run_dir: RunDir, *, enabled: bool, attempt: int = 1, on_error=None):
        self.active: list = []
        self.on_error = on_error
        if not enabled or not (cfg.wandb or cfg.mlflow):
            return
        ids = read_ids(run_dir)
        for _, field_name, _, _ in TRACKERS:
            if getattr(cfg, field_name):
                tracker = _CLASSES[field_name](cfg, run_dir, ids.get(field_name), attempt)
                ids[field_name] = tracker.ids
                self.active.append(tracker)
                write_ids(run_dir, ids)  # before the first metric: a restart continues this run

    def top_up(self, records: list[dict], before_step: int, log_every: int,
               tokens_per_step: int) -> int:
        """A resumed attempt's first act: give each tracker that can say what it stored the
        log steps and validations before `before_step` that it lacks (the latest record of each
        step, from loss_history.jsonl). A killed process takes its tracker's unsent queue with it,
        and those steps are never trained again. W&B cannot be asked (its lost tail stays lost).
        Returns the number of metric rows sent."""
        train, val, sets = {}, {}, {}
        for r in records:
            if r.get("kind") == "train" and r["step"] < before_step and r["step"] % log_every == 0:
                train[r["step"]] = r
            elif r.get("kind") == "val" and r["step"] < before_step:
                val[r["step"]] = r["val_loss"]
            elif r.get("kind") == "eval_set" and r["step"] < before_step:  # --eval-set's val/NAME
                sets.setdefault(f"val/{r['name']}", {})[r["step"]] = r["val_loss"]
        sent = 0
        for tracker in list(self.active):
            try:
                have_train = tracker.stored_steps("train/loss")
                if have_train is None:
                    continue
                have_val = tracker.stored_steps("val/loss")
                for step in sorted(set(train) - have_train):
                    r = train[step]
                    tracker.log(step, {"train/loss": r["loss"], "train/lr": r["lr"],
                                       "train/grad_norm": r["norm"],
                                       "train/tok_per_s": tokens_per_step / r["dt"]})
                    sent += 1
                for step in sorted(set(val) - have_val):
                    tracker.log(step, {"val/loss": val[step]})
                    sent += 1
                for key, losses in sets.items():
                    for step in sorted(set(losses) - tracker.stored_steps(key)):
                        tracker.log(step, {key: losses[step]})
                        sent += 1
            except Exception as e:  # noqa: BLE001 - a tracker must not stop a training run
                self._drop(tracker, before_step, e)
        return sent

    def log(self, step: int, metrics: dict) -> None:
        for tracker in list(self.active):
            try:
                tracker.log(step, metrics)
            except Exception as e:  # noqa: BLE001 - a tracker must not stop a training run
                self._drop(tracker, step, e)

    def close(self, status: str = "FINISHED") -> None:
        """status: FINISHED, FAILED or KILLED (stopped early, resumable)."""
        for tracker in self.active:
            try:
                tracker.close(status)
            except Exception as e:  # noqa: BLE001
                log.warning(f"raygpt | WARNING: {tracker.name}: closing the tracker run failed: "
                            f"{type(e).__name__}: {e}")
        self.active = []

    def _drop(self, tracker, step: int, error: Exception) -> None:
        self.active.remove(tracker)
        message = f"{type(error).__name__}: {error}"[:300]
        log.warning(f"raygpt | WARNING: {tracker.name} logging failed at step {step} ({message}); "
                    f"no more {tracker.name} metrics this attempt (loss_history.jsonl has them all)")
        if self.on_error is not None:
            self.on_error(step, tracker.name, message)
