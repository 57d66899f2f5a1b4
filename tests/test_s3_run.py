"""raygpt on a real S3 server (issue 22): moto's S3 server, spoken to over HTTP by pyarrow's S3
client, on 127.0.0.1 (started and stopped by this module). Ray Train (one local Ray of 2 CPUs
for the module) gets the run directory's S3 filesystem as `RunConfig(storage_filesystem=...)`,
so checkpoints, DONE and MANIFEST, main.log and the loss history all go to the bucket; nothing
of a run may land on local disk.

The endpoint reaches every process as the AWS tools take it: AWS_ENDPOINT_URL in the
environment (set before Ray starts, like the credentials), written into the run's URI by
`TrainConfig.resolve`. Three Ray runs, 2 CPU workers each, 10 steps of a depth-2 model:
- an uninterrupted run (the reference), on the local shards;
- a run whose rank 1 is SIGKILLed at step 7 (Ray restarts the group, which resumes from
  checkpoint 4 read back from the bucket) and then gets SIGTERM at step 8 (checkpoint 9, stop),
  its shards in the bucket too (-i/-j s3://, read through the node's shard cache);
- `raygpt train -y 1` (the CLI's driver: a new trainer and controller) resuming from the bucket,
  as a replacement node would: its shard cache empty (a fresh --shard-cache-dir), the shards
  fetched from the bucket alone.
The train losses of the killed-and-resumed run equal the reference's (trained on the local
copies of the same shards) as floats, step by step, and the final weights are byte-identical. `raygpt status` and `raygpt plot` (the CLI, in a
process of their own) read the run back from the bucket.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from raygpt.checkpointing import protocol as ck
from raygpt.cli import main as cli_main
from raygpt.config import DEFAULT_TRAIN, DEFAULT_VAL
from raygpt.ray.driver import run
from raygpt.runlog.history import read_history
from raygpt.storage import open_run_dir
from tests.helpers import S3Server, tiny_config

pytest.importorskip("moto.server")

TWO = dict(num_workers=2, max_steps=10, checkpoint_every=4, total_batch_size=4 * 32 * 2 * 2,
           val_every=5)


@pytest.fixture(scope="module")
def s3():
    """The S3 server, the AWS variables every process of the module's Ray inherits (set before
    ray.init), a bucket, and the local Ray."""
    env = pytest.MonkeyPatch()  # handed back as it was when the module ends
    with S3Server() as server:
        env.setenv("AWS_ACCESS_KEY_ID", S3Server.KEY)
        env.setenv("AWS_SECRET_ACCESS_KEY", S3Server.SECRET)
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookups
        env.setenv("AWS_ENDPOINT_URL", server.endpoint)
        server.fs().create_dir("bucket")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield server
        finally:
            ray.shutdown()
            env.undo()


def config(name: str, **overrides):
    return tiny_config(f"s3://bucket/runs/{name}", **{**TWO, **overrides}).resolve(0)


def train_losses(uri) -> dict[int, float]:
    """{step: loss} of the train records in the bucket (the latest attempt of each step wins)."""
    return {r["step"]: r["loss"] for r in read_history(open_run_dir(uri)) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cwd")  # a relative path written by mistake would land here
    here = pytest.MonkeyPatch()
    here.chdir(cwd)
    full = config("full")
    assert full.output_dir.startswith(f"s3://bucket/runs/full?endpoint_override={s3.address}")
    seconds = [time.monotonic()]
    run(full)
    seconds.append(time.monotonic())
    # both faults wait for checkpoint 4's DONE: the kill must not beat it (a checkpoint Ray's
    # controller had not yet taken from the killed worker stays without DONE), and the kill,
    # checked first at every step, then always comes before the SIGTERM
    fs = s3.fs()
    for path in (DEFAULT_TRAIN, DEFAULT_VAL):  # the bundled shards, copied into the bucket
        with fs.open_output_stream(f"bucket/data/{Path(path).name}") as f:
            f.write(Path(path).read_bytes())
    data = [f"s3://bucket/data/{Path(path).name}" for path in (DEFAULT_TRAIN, DEFAULT_VAL)]
    caches = tmp_path_factory.mktemp("shard-caches")
    killed = config("killed", fault="kill:rank=1,step=7,after=4;sigterm:rank=1,step=8,after=4",
                    input_bin=data[0], input_val_bin=data[1],
                    shard_cache_dir=str(caches / "first-node"))
    assert killed.input_bin.startswith(f"{data[0]}?endpoint_override={s3.address}")
    first = run(killed)
    seconds.append(time.monotonic())
    replacement = caches / "replacement-node"
    assert not replacement.exists()
    code = cli_main(["train", "--cpu", "-e", "d2", "-b", "4", "-t", "32", "-x", "10", "-n", "4",
                     "-v", "5", "-m", "2", "-s", "0", "-g", "8", "-u", "2", "--no-compile",
                     "--num-workers", "2", "-d", str(4 * 32 * 2 * 2), "-y", "1",
                     "-o", "s3://bucket/runs/killed", "-i", data[0], "-j", data[1],
                     "--shard-cache-dir", str(replacement)])
    seconds.append(time.monotonic())
    seconds = [round(b - a, 1) for a, b in zip(seconds, seconds[1:])]
    yield full.output_dir, killed.output_dir, first, code, seconds, cwd, caches
    here.undo()


def test_checkpoints_and_logs_are_in_the_bucket_and_nothing_on_local_disk(s3, runs):
    full, killed, _, _, seconds, cwd, _ = runs
    print(f"the 3 Ray runs on S3 took {seconds} s")
    fs = s3.fs()
    for uri in (full, killed):
        rd = open_run_dir(uri)
        assert not rd.is_local and rd.root.startswith("bucket/runs/")
        names = set(rd.listdir())
        # on an object store the logs are append-only parts (raygpt.runlog.segments), never a
        # whole file re-uploaded
        assert {"main_log", "loss_history", "config.json"} <= names, names
        assert not {"main.log", "loss_history.jsonl"} & names, names
        parts = rd.listdir("loss_history")
        assert parts and all(p.startswith("part-") and p.endswith(".jsonl") for p in parts), parts
        steps = ck.list_checkpoint_steps(rd)
        assert steps == ([4, 8, 10] if uri == full else [4, 8, 9, 10]), (uri, steps)
        for step in steps:  # DONE, MANIFEST, every file's size (and sha256 of the final one)
            assert ck.verify_checkpoint(rd, step, hashes=step == 10) == [], (uri, step)
        assert [n for n in rd.listdir() if ".tmp-" in n] == []
    # the same objects seen by a plain S3 client on the same server
    assert fs.get_file_info("bucket/runs/killed/step_00000009/MANIFEST.json").size > 0
    assert list(Path(cwd).iterdir()) == []


def test_a_killed_worker_and_a_resume_from_the_bucket_give_the_same_losses(runs):
    full, killed, first, code, _, _, _ = runs
    # attempt 1: rank 1 SIGKILLed at step 7 (or at the first step after it with checkpoint 4's
    # DONE in the bucket); Ray's restart resumed from checkpoint 4 (its files from this node's
    # local copies, checked against the bucket's MANIFEST);
    # SIGTERM at step 8 then checkpointed step 9 and stopped the run
    assert first["stopped_early"] and first["step"] == 9 and first["failures"] == 1
    assert code == 0  # the -y 1 driver finished the run
    records = read_history(open_run_dir(killed))
    resumes = [(r["attempt"], r["resumed_from"]) for r in records if r["kind"] == "resume"]
    # Ray's restart after the kill (attempt 2, from checkpoint 4), then the -y 1 driver's
    # (attempt 3, from checkpoint 9); a busy machine may add restarts after those (a worker
    # lost to memory pressure), which resume from 9 again and change no loss
    assert resumes[:2] == [(2, 4), (3, 9)] and all(r == 9 for _, r in resumes[2:]), resumes
    want = train_losses(full)
    assert sorted(want) == list(range(10))
    assert train_losses(killed) == want  # floats equal, step by step
    name = f"{ck.step_dir(10)}/{ck.model_file(10)}"
    assert open_run_dir(full).read_bytes(name) == open_run_dir(killed).read_bytes(name)
    fired = open_run_dir(killed).listdir("faults")
    assert len(fired) == 2, fired


def test_the_killed_runs_shards_came_through_each_nodes_cache(runs):
    """The killed run read its shards from the bucket through its node's cache (Ray's restart
    found them there); the -y 1 resume, on an empty cache, fetched them from the bucket alone."""
    *_, caches = runs
    for node in ("first-node", "replacement-node"):
        cached = sorted(p.name.split("-", 1)[1] for p in (caches / node).iterdir() if p.is_file())
        assert cached == ["tiny_shakespeare_train.bin", "tiny_shakespeare_val.bin"], (node, cached)
        assert (caches / node).stat().st_mode & 0o777 == 0o700


def test_status_and_plot_read_the_bucket(s3, runs, tmp_path):
    _, killed, _, _, _, _, _ = runs
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("AWS_ENDPOINT_URL")  # this time the endpoint comes from the flag
    status = subprocess.run([sys.executable, "-m", "raygpt", "status", "s3://bucket/runs/killed",
                             "--storage-endpoint", s3.endpoint], capture_output=True, text=True,
                            env=env, timeout=120)
    assert status.returncode == 0, status.stderr
    assert "finished at step 10" in status.stdout
    assert "3 attempt(s)" in status.stdout and "from step 9" in status.stdout, status.stdout
    out = tmp_path / "killed.png"
    code = cli_main(["plot", "s3://bucket/runs/killed", "-o", str(out)])
    assert code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ray_gets_the_run_directorys_filesystem_and_a_plain_path():
    """RunConfig(storage_filesystem=, storage_path=, name=): the URI's options (the endpoint)
    must reach Ray as the filesystem, not stay in the run's name (no server needed)."""
    import pyarrow.fs as pafs

    from raygpt.ray.driver import _split_storage
    fs, path, name = _split_storage("s3://bucket/runs/x?endpoint_override=h:1&scheme=http")
    assert isinstance(fs, pafs.S3FileSystem) and (path, name) == ("bucket/runs", "x")
    assert fs.__reduce__()[1][0]["endpoint_override"] == "h:1"
    assert fs.__reduce__()[1][0]["connect_timeout"] > 0  # the bounded filesystem
    assert _split_storage("/a/b/run") == (None, "/a/b", "run")


def test_a_sweep_in_the_bucket_takes_its_endpoint_from_the_flag(s3, monkeypatch, tmp_path):
    """`raygpt sweep -o s3://... --storage-endpoint URL` with no AWS endpoint variable in the
    driver: the sweep directory, Tune's experiment and the trial's run all go to the flag's
    store (the sweep once opened its directory with the store's default endpoint)."""
    from raygpt.ray import sweep_command
    from raygpt.storage import join_uri
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.chdir(tmp_path)  # a relative path written by mistake would land here
    code = sweep_command.main(["-o", "s3://bucket/sweeps/one", "--storage-endpoint", s3.endpoint,
                               "--grid", "scheduler=cosine", "--early-stop", "none", "--cpu",
                               "--num-workers", "1", "--no-compile", "-e", "d1", "-b", "4",
                               "-t", "32", "-x", "4", "-u", "1", "-v", "4", "--val-batches", "1",
                               "-s", "0", "-n", "4"])
    assert code == 0
    sweep_dir = open_run_dir(s3.uri("bucket/sweeps/one"))
    assert {"sweep.json", "results.json", "best_config.json", "tune", "trials"} <= set(sweep_dir.listdir())
    (trial,) = sweep_dir.listdir("trials")
    run_dir = open_run_dir(join_uri(s3.uri("bucket/sweeps/one"), f"trials/{trial}"))
    assert run_dir.exists(f"{ck.step_dir(4)}/DONE_00000004")
    assert [r["step"] for r in read_history(run_dir) if r["kind"] == "train"] == [0, 1, 2, 3]
    assert list(tmp_path.iterdir()) == []
    assert join_uri("s3://b/s?endpoint_override=h:1", "trials/t") == "s3://b/s/trials/t?endpoint_override=h:1"
    assert join_uri("/a/s/", "t") == "/a/s/t"


def test_tune_gets_the_sweep_directorys_bounded_filesystem_and_a_plain_path():
    """As for a run: Tune opening the URI string itself would get pyarrow's unbounded timeouts."""
    import pyarrow.fs as pafs

    from raygpt.ray.sweep import _tune_storage
    fs, path = _tune_storage("s3://bucket/sweeps/x?endpoint_override=h:1&scheme=http")
    assert isinstance(fs, pafs.S3FileSystem) and path == "bucket/sweeps/x"
    options = fs.__reduce__()[1][0]
    assert options["endpoint_override"] == "h:1" and options["connect_timeout"] > 0
    assert _tune_storage("/a/sweep") == (None, "/a/sweep")
