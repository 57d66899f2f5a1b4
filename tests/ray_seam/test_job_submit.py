"""The job-submission round trip on a real (one-node) Ray cluster, as a user runs it:

    ray start --head ...                                       (its own ports, temp dir, token)
    ray job submit --no-wait -- python experiments/shakespeare.py -x 200 ...   a long run
    ray job stop JOB                     once its first checkpoint is verified: SIGTERM to the
                                         driver -> every rank checkpoints -> DONE + MANIFEST
    ray job submit -- python experiments/shakespeare.py -y 1 ...     resumes it to the end

The cluster is private to this test: free ports for every Ray service (another Ray on the same
machine holds the defaults), a short temp dir of its own (so no other `ray.init()` on the
machine finds it), token auth with a fresh token. Teardown stops exactly the processes this
test started (the `ray start --block` process and its process group), never `ray stop`, which
would stop every Ray on the machine.

The stop is given RAY_JOB_STOP_WAIT_TIME_S=60 through the job's runtime env, as
docs/cluster.md says:
with Ray's default of 3 s the driver is SIGKILLed while the final checkpoint is being stored,
before it can write DONE/MANIFEST, and that checkpoint is left incomplete (the resume then
takes the previous one).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from raygpt.checkpointing import protocol as ck
from raygpt.runlog.history import read_history
from raygpt.storage import open_run_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "experiments" / "shakespeare.py")
TINY = ["-e", "d2", "-b", "4", "-t", "32", "-v", "6", "-m", "2", "-s", "0", "-n", "4"]
STOP_WAIT = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})

pytestmark = pytest.mark.timeout(420)


def ray_cli() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def free_ports(n: int) -> list[int]:
    """n ports free a moment ago. Ray's `ray start` must be told its ports, so they are released
    before it binds them and another process may take one in between: the fixture starts the
    head again on fresh ports when it failed on a port in use (`PORT_TAKEN`)."""
    socks = []
    for _ in range(n):  # all bound at once, so the n ports differ
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# how a Ray process says a port it was given is taken (gRPC, asyncio, the GCS)
PORT_TAKEN = ("address already in use", "Address already in use", "Failed to bind",
              "errno 98", "EADDRINUSE")
HEAD_STARTS = 3  # attempts on fresh ports before a head that will not come up fails the test


class Cluster:
    def __init__(self, address: str, env: dict, tmp: Path):
        self.address, self.env, self.tmp = address, env, tmp

    def ray(self, *args, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([ray_cli(), *args], capture_output=True, text=True, env=self.env,
                              cwd=ROOT, timeout=timeout)

    def job(self, *args, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.ray("job", args[0], "--address", self.address, *args[1:], timeout=timeout)

    def submit(self, job_id: str, *argv: str, deadline_s: float = 90) -> None:
        """`ray job submit --no-wait`; retried while the head's job agent is still starting."""
        deadline = time.monotonic() + deadline_s
        while True:
            r = self.job("submit", "--no-wait", "--submission-id", job_id,
                         "--runtime-env-json", STOP_WAIT, "--", sys.executable, SCRIPT, *argv)
            if r.returncode == 0:
                return
            if "No available agent" not in r.stderr or time.monotonic() > deadline:
                raise AssertionError(f"ray job submit {job_id} failed:\n{r.stderr[-3000:]}")
            time.sleep(1)

    def api(self, path: str) -> dict:
        """GET on the job API over HTTP: polling with the CLI would start a Python process (and
        import Ray) per poll, stealing the CPU the training job runs on."""
        req = urllib.request.Request(f"{self.address}{path}",
                                     headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def status(self, job_id: str) -> str:
        return self.api(f"/api/jobs/{job_id}")["status"]

    def wait_for(self, job_id: str, wanted: str, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while (st := self.status(job_id)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {st} after {deadline_s} s:\n"
                                     f"{self.logs(job_id)[-3000:]}")
            time.sleep(1)
        assert st == wanted, f"job {job_id}: expected {wanted}, found {st}:\n{self.logs(job_id)[-4000:]}"

    def logs(self, job_id: str) -> str:
        return self.job("logs", job_id).stdout


@pytest.fixture(scope="module")
def cluster():
    # Ray's unix sockets live under the temp dir: keep its path short (pytest's tmp_path is not)
    tmp = Path(tempfile.mkdtemp(prefix="rgjob-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_USAGE_STATS_ENABLED="0",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")  # teardown: stop at once
    log = open(tmp / "head.log", "w")
    head = None
    try:
        for attempt in range(1, HEAD_STARTS + 1):
            head, c = _start_head(env, tmp, log)
            up = _wait_for_head(head, c, deadline=time.monotonic() + 90)
            if up is not None:
                print(f"ray head up in {up:.1f} s (start {attempt})")
                break
            text = (tmp / "head.log").read_text()
            if head.poll() is None or not any(m in text for m in PORT_TAKEN) \
                    or attempt == HEAD_STARTS:
                raise AssertionError(f"ray head did not come up:\n{text[-3000:]}")
            # another process took one of the ports between free_ports and Ray's bind
            _stop_head(head)
        yield c
    finally:
        if head is not None:
            _stop_head(head)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _start_head(env: dict, tmp: Path, log) -> tuple[subprocess.Popen, Cluster]:
    gcs, dashboard, *others = free_ports(9)
    names = ("dashboard-agent-grpc-port", "dashboard-agent-listen-port", "metrics-export-port",
             "node-manager-port", "object-manager-port", "ray-client-server-port",
             "runtime-env-agent-port")
    head = subprocess.Popen(
        [ray_cli(), "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dashboard}",
         "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         "--node-ip-address=127.0.0.1", "--disable-usage-stats", f"--temp-dir={tmp}/ray",
         *(f"--{n}={p}" for n, p in zip(names, others))],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    return head, Cluster(f"http://127.0.0.1:{dashboard}", env, tmp)


def _wait_for_head(head: subprocess.Popen, c: Cluster, deadline: float) -> float | None:
    """Seconds until the dashboard answered, or None if the head exited or the deadline passed."""
    t0 = time.monotonic()
    while True:
        try:
            c.api("/api/version")
            return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if head.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.5)


def _stop_head(head: subprocess.Popen) -> None:
    """Stop exactly the processes this test started: the `ray start --block` process and its
    process group (never `ray stop`, which would stop every Ray on the machine)."""
    head.send_signal(signal.SIGTERM)  # `ray start --block` stops the node's processes
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)  # whatever of ours outlived it (same group)
    except ProcessLookupError:
        pass


def verified_steps(run_dir) -> list[int]:
    if not run_dir.exists():
        return []
    return [s for s in ck.list_checkpoint_steps(run_dir) if not ck.verify_checkpoint(run_dir, s)]


@pytest.fixture(scope="module")
def stopped_run(cluster):
    """A long job, stopped with `ray job stop` right after its first verified checkpoint."""
    run_dir = open_run_dir(cluster.tmp / "run")
    t0 = time.monotonic()
    cluster.submit("raygpt-long", *TINY, "-x", "200", "-o", run_dir.root)
    deadline = time.monotonic() + 180
    while not verified_steps(run_dir):
        if time.monotonic() > deadline or cluster.status("raygpt-long") in ("FAILED", "STOPPED"):
            raise AssertionError(f"no verified checkpoint:\n{cluster.logs('raygpt-long')[-4000:]}")
        time.sleep(0.5)
    first = verified_steps(run_dir)[0]
    print(f"submitted -> first verified checkpoint (step {first}) in {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    r = cluster.job("stop", "raygpt-long", timeout=120)  # waits for the job to exit
    assert r.returncode == 0, r.stderr[-2000:]
    cluster.wait_for("raygpt-long", "STOPPED", 60)
    print(f"ray job stop -> STOPPED in {time.monotonic() - t0:.1f} s")
    return run_dir, first, cluster.logs("raygpt-long")


def test_job_stop_leaves_a_verified_checkpoint_at_the_stop(stopped_run):
    run_dir, first, logs = stopped_run
    assert "raygpt | driver got SIGTERM: asking the workers to checkpoint and stop" in logs
    records = read_history(run_dir)
    (end,) = [r for r in records if r["kind"] == "end"]
    stop_step = end["step"]
    assert end["stopped_early"] and first <= stop_step < 200
    trained = sorted({r["step"] for r in records if r["kind"] == "train"})
    assert trained == list(range(stop_step))
    # the checkpoint written because of the stop is complete: DONE, MANIFEST, every hash
    assert ck.list_checkpoint_steps(run_dir)[-1] == stop_step
    assert ck.verify_checkpoint(run_dir, stop_step) == []
    assert run_dir.exists(f"{ck.step_dir(stop_step)}/{ck.done_file(stop_step)}")
    assert ck.read_manifest(run_dir, stop_step)["world_size"] == 2


def test_a_resubmitted_job_resumes_the_stopped_run_to_the_end(cluster, stopped_run):
    run_dir, _, _ = stopped_run
    stop_step = ck.list_checkpoint_steps(run_dir)[-1]
    final = stop_step + 4
    cluster.submit("raygpt-resume", *TINY, "-x", str(final), "-y", "1", "-o", run_dir.root)
    t0 = time.monotonic()
    cluster.wait_for("raygpt-resume", "SUCCEEDED", 240)
    print(f"resume job: submitted -> SUCCEEDED in {time.monotonic() - t0:.1f} s")
    assert ck.find_latest_verified(run_dir) == final
    assert run_dir.exists(f"{ck.step_dir(final)}/{ck.done_file(final)}")
    assert ck.read_manifest(run_dir, final)["step"] == final
    records = read_history(run_dir)
    resumes = [r for r in records if r["kind"] == "resume"]
    assert [(r["resumed_from"], r["attempt"]) for r in resumes] == [(stop_step, 2)]
    ends = [r for r in records if r["kind"] == "end"]
    assert [(e["step"], e["stopped_early"]) for e in ends] == [(stop_step, True), (final, False)]
    assert {r["step"] for r in records if r["kind"] == "train" and r["attempt"] == 2} == \
        set(range(stop_step, final))
    assert "main.log" in run_dir.listdir()
