"""A whole run on a non-local filesystem: fsspec's in-memory filesystem seen through pyarrow.fs
(what s3:// and gs:// run directories look like to raygpt: no local paths, no appends, no
renames of directories). The training loop runs without Ray (LocalSession); one run goes straight
to step 10, another is stopped at step 5 and resumed with -y 1, and the two must agree bit for
bit: losses as floats, val losses, and the sha256 of the final model file. Checkpoints, main.log
and the loss history must all be in the in-memory run directory and nothing on local disk. The
logs are segments (raygpt.runlog.segments; the segment interval is set to an hour so only the
loop's flushes count): a loss_history/ part is stored at the attempt's start, each checkpoint
publish and the end, not per line, and a fresh RunDir (another process) then reads everything
the run wrote. A spike rewind followed by a crash and a -y 1 resume reads its trajectory back
from the segments in order.
"""

from __future__ import annotations

import json
import math

import pyarrow.fs as pafs
import pytest
import torch

from raygpt.checkpointing import protocol as ck
from raygpt.config import SpikeConfig, TrainConfig
from raygpt.runlog.history import read_history, trajectory_losses
from raygpt.runlog.mainlog import read_main_log
from raygpt.runlog.report import load_run, run_status
from raygpt.storage import open_run_dir
from raygpt.train.faults import InjectedFault
from raygpt.train.loop import train
from raygpt.train.session import LocalSession

memory = pytest.importorskip("fsspec.implementations.memory")


class StopAfterStep(LocalSession):
    """A LocalSession whose surroundings ask for a stop (like SIGTERM to the driver) while step
    `step` trains; the loop then checkpoints at step + 1 and returns."""

    def __init__(self, run_dir, step: int):
        super().__init__(run_dir, torch.device("cpu"))
        self.stop_step, self.polls = step, 0

    def poll_requests(self):
        self.polls += 1  # one poll per step, from step 0 on a fresh run
        return self.polls > self.stop_step, False


class CountingHandler(pafs.FSSpecHandler):
    """The memory filesystem, recording every object written (a PUT on an object store)."""

    puts: list[str] = []  # shared by every handler of the module: one record of the writes

    def open_output_stream(self, path, metadata):
        self.puts.append(path)
        return super().open_output_stream(path, metadata)


@pytest.fixture(scope="module")
def mem():
    fs = memory.MemoryFileSystem()
    yield fs
    if fs.exists("/raygpt-storage-run"):
        fs.rm("/raygpt-storage-run", recursive=True)


def run_dir_on(mem, name: str):
    return open_run_dir((pafs.PyFileSystem(CountingHandler(mem)), f"/raygpt-storage-run/{name}"))


def config(output_dir, **overrides) -> TrainConfig:
    base = dict(model="d2", batch_size=4, seq_len=32, max_steps=10, checkpoint_every=5,
                val_every=5, val_batches=2, sample_every=0, device="cpu", num_workers=1,
                compile=False, output_dir=str(output_dir), log_segment_s=3600)
    return TrainConfig(**{**base, **overrides}).resolve(0)


def kinds(records, kind):
    return [r for r in records if r["kind"] == kind]


def main_log(run_dir) -> list[str]:
    return read_main_log(run_dir).decode().splitlines()


@pytest.fixture(scope="module")
def runs(mem, tmp_path_factory):
    """(straight run, stopped-then-resumed run) on the in-memory filesystem."""
    nowhere = tmp_path_factory.mktemp("local") / "never-written"
    straight = run_dir_on(mem, "straight")
    train(config(nowhere), LocalSession(straight, torch.device("cpu")))
    attempt1 = run_dir_on(mem, "resumed")  # kept alive: only the loop's own flushes store it
    first = train(config(nowhere), StopAfterStep(attempt1, 4))
    # the resume is a new process: a fresh RunDir that sees only what attempt 1 stored
    resumed = run_dir_on(mem, "resumed")
    second = train(config(nowhere, resume=1), LocalSession(resumed, torch.device("cpu")))
    assert not nowhere.exists(), "a local path was written for a non-local run directory"
    return straight, resumed, first, second


def test_the_run_directory_is_complete_on_the_memory_filesystem(runs):
    straight, resumed, first, second = runs
    assert not straight.caps.local_paths
    for rd in (straight, resumed):
        names = set(rd.listdir())
        # segments on an object store, never the single files a local run directory keeps
        assert {"main_log", "loss_history", "step_00000005", "step_00000010"} <= names
        assert not names & {"main.log", "loss_history.jsonl", "samples.jsonl"}
        assert ck.list_checkpoint_steps(rd) == [5, 10]
        for step in (5, 10):
            assert ck.verify_checkpoint(rd, step) == [], (rd, step)
    assert first["stopped_early"] and first["step"] == 5
    assert not second["stopped_early"] and second["step"] == 10


def test_resume_on_the_memory_filesystem_is_bit_exact(runs):
    straight, resumed, _, _ = runs
    want = {r["step"]: r["loss"] for r in kinds(read_history(straight), "train")}
    got = read_history(resumed)
    attempt1 = {r["step"]: r["loss"] for r in kinds(got, "train") if r["attempt"] == 1}
    attempt2 = {r["step"]: r["loss"] for r in kinds(got, "train") if r["attempt"] == 2}
    assert sorted(want) == list(range(10))
    assert attempt1 == {s: want[s] for s in range(5)}
    assert attempt2 == {s: want[s] for s in range(5, 10)}  # float equality, not approx
    val = lambda recs: {r["step"]: r["val_loss"] for r in kinds(recs, "val")}
    assert val(got) == val(read_history(straight)) and sorted(val(got)) == [0, 5, 10]
    (resume,) = kinds(got, "resume")
    assert resume["resumed_from"] == 5 and resume["attempt"] == 2
    # same weights and the same optimizer state at the end: the stored files hash the same
    a, b = ck.read_manifest(straight, 10)["files"], ck.read_manifest(resumed, 10)["files"]
    assert a[ck.model_file(10)]["sha256"] == b[ck.model_file(10)]["sha256"]
    assert a[ck.state_file(10, 0)]["sha256"] == b[ck.state_file(10, 0)]["sha256"]


def test_main_log_goes_through_the_run_directory(runs):
    straight, resumed, _, _ = runs
    log = main_log(straight)
    assert [line.split()[0] for line in log if " trl:" in line] == [f"s:{s}" for s in range(10)]
    assert [line for line in log if " tel:" in line][0].startswith("s:0 tel:")
    # the resumed run appended to its log: the same train lines, in the same order
    resumed_log = main_log(resumed)
    assert [x for x in resumed_log if " trl:" in x] == [x for x in log if " trl:" in x]
    # step 5's validation ran in both attempts (before the stop's checkpoint, and on resume)
    assert [x.split()[0] for x in resumed_log if " tel:" in x] == ["s:0", "s:5", "s:5", "s:10"]


def test_status_reads_the_remote_run(runs):
    _, resumed, _, _ = runs
    view = load_run(resumed)
    assert [(c.step, c.ok) for c in view.checkpoints] == [(5, True), (10, True)]
    text = run_status(resumed)
    assert "finished at step 10" in text
    assert "2 attempt(s), 1 restart(s)" in text
    assert "1 resume(s) (from step 5)" in text
    assert text.splitlines()[0].startswith("run       py::fsspec+memory://raygpt-storage-run/resumed")


def test_appends_to_the_object_store_keep_every_record(runs):
    # every segment is whole lines; no temp object is left behind
    straight, resumed, _, _ = runs
    for rd in (straight, resumed):
        assert [n for n in rd.listdir() if ".tmp-" in n] == []
        for folder in ("loss_history", "main_log"):
            parts = rd.listdir(folder)
            assert parts and all(n.startswith("part-") for n in parts)
            for name in parts:
                data = rd.read_bytes(f"{folder}/{name}")
                assert data.endswith(b"\n"), name
                if folder == "loss_history":
                    assert all(json.loads(line)["kind"] for line in data.splitlines())


def test_history_is_uploaded_at_the_flush_points_not_per_line(runs):
    straight, _, _, _ = runs
    folder = straight.path("loss_history") + "/"
    records = read_history(straight)
    assert len(records) == 15  # start, 10 train, 3 val, end: 15 appends
    # start event, checkpoint 5's publish, checkpoint 10's publish, the end event: one new
    # part object each, nothing rewritten
    puts = [p for p in CountingHandler.puts if p.startswith(folder)]
    assert len(puts) == 4 and len(set(puts)) == 4
    assert sorted(p.rpartition("/")[2] for p in puts) == straight.listdir("loss_history")


def test_another_process_reads_everything_the_run_wrote(mem, runs):
    for rd in runs[:2]:
        fresh = run_dir_on(mem, rd.root.rpartition("/")[2])
        assert read_history(fresh) == read_history(rd)
        assert read_main_log(fresh) == read_main_log(rd)
        assert read_history(fresh)[-1]["kind"] == "end"


def test_a_resume_after_a_rewind_reads_its_trajectory_from_the_segments(mem, tmp_path):
    """A NaN at step 9 rewinds to checkpoint 6 (abandoning 6..9 as logged), the process dies at
    step 7 of the re-run, and -y 1 resumes from 6. The resume reads the history back from its
    segments (the rewind record sealed a segment of its own, between the abandoned steps and
    the re-run): its audit must compare only with the trajectory the run is on (the re-run
    step 6, not the abandoned one) and say bit-exact. (That the whole curve then equals the run
    without the crash is test_spike's, on the local layout: the losses do not depend on it.)"""
    nowhere = tmp_path / "never-written"
    spike = SpikeConfig(enabled=True, min_history=4, window=8, safety_steps=3, max_rewinds=2)
    kw = dict(max_steps=12, checkpoint_every=2, val_every=0, spike=spike)
    crash_cfg = config(nowhere, **kw, fault="nan:rank=0,step=9;raise:rank=0,step=7,visit=2")
    with pytest.raises(InjectedFault):
        train(crash_cfg, LocalSession(run_dir_on(mem, "rewind-crash"), torch.device("cpu")))
    crashed = run_dir_on(mem, "rewind-crash")  # a new process: only what was stored
    assert len(crashed.listdir("loss_history")) >= 3  # start, checkpoints, rewind: segments
    kinds_before = [r["kind"] for r in read_history(crashed)]
    assert kinds_before.index("rewind") < len(kinds_before) - 1  # the re-run's step 6 is there
    summary = train(crash_cfg.with_overrides({"resume": 1}), LocalSession(crashed, torch.device("cpu")))
    assert summary["rewinds"] == 1 and summary["step"] == 12
    got = read_history(run_dir_on(mem, "rewind-crash"))
    (resume,) = kinds(got, "resume")
    assert resume["resumed_from"] == 6
    audits = [r["message"] for r in kinds(got, "audit")]
    assert audits == ["resume verified bit-exact over 1 steps"], audits
    trajectory = trajectory_losses(got)
    assert sorted(trajectory) == list(range(12))
    assert all(math.isfinite(loss) for loss in trajectory.values())  # the NaN step was abandoned
