"""raygpt status / plot / TensorBoard on a synthetic run directory (no Ray, no training).

The run: attempt 1 trains steps 0-7 (step 5's loss is NaN and its update skipped), spikes at
step 8 and rewinds to the checkpoint at step 4, re-trains 4-9, then a worker dies; attempt 2
resumes from step 8 and trains 8-11 before a SIGTERM stops it. Checkpoints: 4 and 8 complete,
10 with a corrupted state file, 12 without DONE/MANIFEST (a save cut short).
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from raygpt.checkpointing import protocol as ck
from raygpt.cli import main
from raygpt.llmc.state_file import write_state_file
from raygpt.runlog.history import LOSS_HISTORY, RunHistory
from raygpt.runlog.report import format_status, load_run, plot_run, run_status
from raygpt.runlog.tensorboard import TensorBoardWriter, read_events, read_scalars
from raygpt.storage import open_run_dir

TOKENS_PER_STEP = 256
DT = 0.5  # seconds per step -> 512 tok/s
WORLD = 2


def loss_at(step: int, attempt_tag: int) -> float:
    return 10.0 - 0.1 * step - 0.01 * attempt_tag


def lr_at(step: int) -> float:
    return 1e-3 * min(step + 1, 10) / 10


def train_step(h: RunHistory, step: int, loss: float, verdict: str = "ok") -> None:
    h.train(step, loss=loss, norm=1.0 + 0.01 * step, lr=lr_at(step),
            tokens=TOKENS_PER_STEP * (step + 1), dt=DT, verdict=verdict)


def make_checkpoint(run_dir, step: int, *, finished: bool = True) -> None:
    """A checkpoint in the real layout: llm.c state files from raygpt.checkpointing.protocol's
    writer (tiny optimizer shards), a model file (opaque bytes: verification checks hashes, not
    contents), then DONE and MANIFEST through the real writers when `finished`."""
    d = ck.step_dir(step)
    for rank in range(WORLD):
        buf = io.BytesIO()
        write_state_file(buf, step=step, num_processes=WORLD, process_rank=rank, rng_state=7,
                         rng_state_last_update=7, m=np.full(8, step, np.float32),
                         v=np.ones(8, np.float32), master=None,
                         loader_state={"shard_pos": 0, "sample_pos": step * 8,
                                       "should_shuffle": False, "skip_ranges": []},
                         extras={"tokens_seen": TOKENS_PER_STEP * step})
        run_dir.write_bytes_atomic(f"{d}/{ck.state_file(step, rank)}", buf.getvalue())
    run_dir.write_bytes_atomic(f"{d}/{ck.model_file(step)}", bytes(range(256)) * 4)
    if finished:
        ck.write_done(run_dir, step)
        ck.write_manifest(run_dir, step, world_size=WORLD, num_parameters=16, config_hash="c",
                          tokenizer_hash="t", data_hash="d")


@pytest.fixture
def run_dir(tmp_path):
    rd = open_run_dir(tmp_path / "run")
    rd.makedirs()
    h = RunHistory(rd, cfg=None, enabled=True)
    # attempt 1
    h.begin_attempt(None, None)
    for step in range(8):
        if step == 5:
            nan = float("nan")
            h.event(step, "skip", reason="non-finite loss nan or norm nan", loss=nan, norm=nan,
                    loss_z=nan)
            train_step(h, step, nan, verdict="skip")
        else:
            train_step(h, step, loss_at(step, 0))
        if step == 4:
            h.val(step, 9.75)
    h.event(8, "rewind", reason="loss z 25.0 > hard 20", to_step=4, window=[[0, 64, 72]],
            lr_scale=1.0, loss_z=25.0, rewinds=1)
    for step in range(4, 10):  # re-done from the checkpoint at 4, spike window skipped
        train_step(h, step, loss_at(step, 1))
        if step == 8:
            h.val(step, 9.5)
    # the Ray driver's record of a lost worker group (raygpt.ray.checkpoints.CheckpointFinalizer.after_exception)
    rd.append_text(LOSS_HISTORY, json.dumps({
        "kind": "failure", "failure": 1, "attempt": None, "time": h_time(rd),
        "causes": {"1": "ActorDiedError: the worker process died unexpectedly"}}) + "\n")
    # attempt 2: Ray restarted the group from checkpoint 8; steps 8-9 re-done bit-exactly
    h.begin_attempt(8, "restarted by Ray from step_00000008")
    for step in range(8, 12):
        train_step(h, step, loss_at(step, 1))
    h.end({"step": 12, "max_steps": 20, "val_loss": 9.5, "stopped_early": True, "skips": 1,
           "rewinds": 1, "elapsed_s": 6.0, "checkpoint_stall_s": 0.1, "attempt": 2})
    for step in (4, 8, 10):
        make_checkpoint(rd, step)
    make_checkpoint(rd, 12, finished=False)
    # flip one byte of a state file of checkpoint 10 (same size: only the hash can tell)
    rel = f"{ck.step_dir(10)}/{ck.state_file(10, 1)}"
    data = bytearray(rd.read_bytes(rel))
    data[-1] ^= 0xFF
    rd.write_bytes_atomic(rel, bytes(data))
    return rd


def h_time(rd) -> float:
    return json.loads(rd.read_bytes(LOSS_HISTORY).splitlines()[-1])["time"] + 0.001


# ---------------------------------------------------------------------- status

def test_status_names_the_failure_the_rewind_the_skip_and_the_checkpoints(run_dir):
    text = run_status(run_dir.root, verify="full")
    lines = {line[:10].strip(): line[10:] for line in text.splitlines() if line[:10].strip()}
    assert lines["run"] == run_dir.root
    assert lines["state"].startswith("stopped early at step 12 (resume with -y 1)")
    assert "2 attempt(s), 1 restart(s)" in lines["state"]
    assert lines["progress"] == (f"12/20 steps (60.0%) | loss {loss_at(11, 1):.4f} | val 9.5000 "
                                 f"(step 8) | lr {lr_at(11):.2e} | norm {1.11:.4f}")
    assert lines["speed"].startswith("512 tok/s last step, 512 tok/s over the last 12 | "
                                     "3,072 tokens seen | ETA 4 s of training")
    events = lines["events"].split(" | ")
    assert events == ["1 skip(s) (last at step 5: non-finite loss nan or norm nan)",
                      "1 rewind(s) (step 8 -> 4)",
                      "1 failure(s) (last after step 9: rank 1: ActorDiedError: the worker "
                      "process died unexpectedly)",
                      "1 resume(s) (from step 8)"]
    assert lines["resumes"] == ("attempt 2 from step 8: 2 step(s) re-done: resume verified "
                                "bit-exact over 2 steps")
    assert lines["ckpts"].startswith("2 verified: step 4, 8 | newest resumable: step 8 (")
    bad = [line.strip() for line in text.splitlines() if "NOT usable" in line]
    assert bad[0].startswith("NOT usable: step 10: step_00000010/state_00000010_00001.bin: sha256:")
    assert bad[1].startswith("NOT usable: step 12: step_00000012/DONE_00000012: missing")
    assert len(bad) == 2
    assert lines["goodput"].startswith("1 failure(s), 1 resume(s)")
    # the recovery's split, on the line under goodput (this history has no start-up marks)
    split = [line.strip() for line in text.splitlines() if line.strip().startswith("recovery 1: ")]
    assert len(split) == 1 and "failure detected" in split[0] and "(2 steps)" in split[0], split


def test_quick_check_sees_missing_files_but_not_a_flipped_byte(run_dir):
    view = load_run(run_dir, verify="quick")
    assert [(c.step, c.ok) for c in view.checkpoints] == [(4, True), (8, True), (10, True),
                                                          (12, False)]


def test_status_reports_progress_while_verifying(run_dir):
    said = []
    run_status(run_dir.root, verify="full", progress=said.append)
    assert said[0].startswith(f"reading {run_dir.uri(LOSS_HISTORY)}")
    assert [s.split(" (")[0] for s in said[1:]] == [f"verifying checkpoint {i}/4" for i in (1, 2, 3, 4)]


def test_status_of_a_run_that_has_not_trained_yet(tmp_path):
    rd = open_run_dir(tmp_path)
    RunHistory(rd, cfg=None, enabled=True).begin_attempt(None, None)
    text = format_status(load_run(rd))
    assert "progress  no step trained yet" in text
    assert "ckpts     0 complete" in text and "not hashed" not in text  # nothing to check


def test_status_and_plot_commands(run_dir, tmp_path, capsys):
    assert main(["status", run_dir.root]) == 0
    out = capsys.readouterr()
    assert "1 rewind(s) (step 8 -> 4)" in out.out
    # quick by default: nothing hashed, so checkpoint 10's flipped byte goes unseen, and the
    # checkpoints are called complete, not verified
    assert "ckpts     3 complete: step 4, 8, 10 | newest resumable: step 10" in out.out
    assert "sizes checked, not hashed (--verify hashes)" in out.out and " verified:" not in out.out
    assert "checking checkpoint 4/4" in out.err and "verifying" not in out.err
    assert "NOT usable: step 10" not in out.out and "NOT usable: step 12" in out.out
    assert main(["status", run_dir.root, "--verify"]) == 0
    out = capsys.readouterr()
    assert "verifying checkpoint 4/4" in out.err and "NOT usable: step 10: " in out.out
    png = tmp_path / "p.png"
    assert main(["plot", run_dir.root, "-o", str(png), "--quick"]) == 0
    assert png.stat().st_size > 10_000
    assert main(["status", str(tmp_path / "nowhere")]) == 2
    assert "no such file" in capsys.readouterr().err


# ---------------------------------------------------------------------- plot

def test_plot_draws_every_series_and_marker(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    png = tmp_path / "run.png"
    drawn = plot_run(run_dir, png, verify="full")

    steps = list(range(12))
    final = [loss_at(s, 0) for s in range(4)] + [loss_at(s, 1) for s in range(4, 12)]
    assert drawn["train_loss"] == (steps, pytest.approx(final))
    # the earlier attempts of re-done steps: 4-7 before the rewind (5 was NaN: drawn at the top
    # of the curve), 8-9 of attempt 1 before the failure
    top = max(final)
    assert drawn["train_loss_superseded"] == (
        [4, 5, 6, 7, 8, 9],
        pytest.approx([loss_at(4, 0), top, loss_at(6, 0), loss_at(7, 0), loss_at(8, 1), loss_at(9, 1)]))
    assert drawn["val_loss"] == ([4, 8], [9.75, 9.5])
    assert drawn["lr"] == (steps, pytest.approx([lr_at(s) for s in steps]))
    assert drawn["grad_norm"] == (steps, pytest.approx([1.0 + 0.01 * s for s in steps]))
    assert drawn["tok_per_s"] == (steps, pytest.approx([TOKENS_PER_STEP / DT] * 12))
    assert drawn["skips"] == ([5], [top])
    assert drawn["rewinds"] == ([8], [])
    assert drawn["failures"] == ([9], [])
    assert drawn["resumes"] == ([8], [])
    assert drawn["checkpoints_verified"] == ([4, 8], [])
    assert drawn["checkpoints_unusable"] == ([10, 12], [])

    assert "hellaswag" not in drawn
    image = matplotlib.image.imread(png)
    assert image.shape[:2] == (960, 1200)  # four panels: no HellaSwag panel without HellaSwag
    assert image[..., :3].std() > 0.05  # not a blank canvas
    # the train-loss colour (tab:blue, #1f77b4) is on the picture
    blue = np.all(np.abs(image[..., :3] - np.array([0x1F, 0x77, 0xB4]) / 255) < 0.02, axis=-1)
    assert blue.sum() > 200


def test_plot_has_a_hellaswag_panel_only_for_a_run_that_scored_hellaswag(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image
    without, with_ = tmp_path / "without.png", tmp_path / "with.png"
    assert main(["plot", run_dir.root, "-o", str(without)]) == 0
    for step, acc in ((4, 0.2575), (8, 0.2625)):
        run_dir.append_text(LOSS_HISTORY, json.dumps({"kind": "eval", "step": step, "attempt": 2,
                                                      "hellaswag": acc, "time": h_time(run_dir)}) + "\n")
    assert main(["plot", run_dir.root, "-o", str(with_)]) == 0
    # a panel is 240 px tall: four panels without HellaSwag, five with it
    assert matplotlib.image.imread(without).shape[:2] == (960, 1200)
    assert matplotlib.image.imread(with_).shape[:2] == (1200, 1200)
    assert plot_run(run_dir, tmp_path / "again.png")["hellaswag"] == ([4, 8], [0.2575, 0.2625])


def test_plot_refuses_a_run_without_train_records(tmp_path):
    pytest.importorskip("matplotlib")
    rd = open_run_dir(tmp_path)
    RunHistory(rd, cfg=None, enabled=True).begin_attempt(None, None)
    with pytest.raises(ValueError, match="no train records"):
        plot_run(rd, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------- TensorBoard

def test_tensorboard_scalars_and_the_purge_on_resume(tmp_path):
    pytest.importorskip("tensorboardX")
    w = TensorBoardWriter(open_run_dir(tmp_path))
    for step in range(4):
        w.train(step, loss=10.0 - step, lr=1e-3 * (step + 1), norm=0.5, tok_per_s=1000.0)
    w.val(3, 7.25)
    w.close()
    resumed = TensorBoardWriter(open_run_dir(tmp_path), purge_step=2)
    resumed.train(2, loss=5.0, lr=3e-3, norm=0.5, tok_per_s=1000.0)
    resumed.close()

    scalars = read_scalars(tmp_path)
    assert scalars["train/loss"] == [(0, 10.0), (1, 9.0), (2, 8.0), (3, 7.0), (2, 5.0)]
    assert [s for s, _ in scalars["train/lr"]] == [0, 1, 2, 3, 2]
    assert scalars["train/lr"][1][1] == pytest.approx(2e-3)
    assert scalars["train/grad_norm"][0] == (0, 0.5)
    assert scalars["train/tok_per_s"][0] == (0, 1000.0)
    assert scalars["val/loss"] == [(3, 7.25)]
    files = sorted((tmp_path / "tb").iterdir())
    assert len(files) == 2
    # the resumed attempt's file starts a session at step 2: TensorBoard drops older points >= 2
    events = read_events(files[1].read_bytes(), files[1].name)
    starts = [e.step for e in events if e.HasField("session_log")]
    assert starts == [2]


def test_tensorboard_restart_after_a_rewind_starts_a_purging_file(tmp_path):
    pytest.importorskip("tensorboardX")
    w = TensorBoardWriter(open_run_dir(tmp_path))
    for step in range(6):
        w.train(step, loss=float(step), lr=1.0, norm=1.0, tok_per_s=1.0)
    w.restart_at(3)  # the loop rewound to the checkpoint at step 3
    w.train(3, loss=30.0, lr=1.0, norm=1.0, tok_per_s=1.0)
    w.close()
    files = sorted((tmp_path / "tb").iterdir())
    assert len(files) == 2
    events = read_events(files[1].read_bytes(), files[1].name)
    assert [e.step for e in events if e.HasField("session_log")] == [3]
    assert read_scalars(tmp_path)["train/loss"][-2:] == [(5, 5.0), (3, 30.0)]


def test_tensorboard_event_file_damage_is_reported(tmp_path):
    pytest.importorskip("tensorboardX")
    w = TensorBoardWriter(open_run_dir(tmp_path))
    w.train(0, loss=1.0, lr=1.0, norm=1.0, tok_per_s=1.0)
    w.close()
    (path,) = (tmp_path / "tb").iterdir()
    data = bytearray(path.read_bytes())
    data[-6] ^= 0x01
    with pytest.raises(ValueError, match="data crc32c mismatch"):
        read_events(bytes(data), path.name)
    with pytest.raises(ValueError, match="truncated"):
        read_events(bytes(data[:-3]), path.name)


def test_tensorboard_on_a_remote_run_dir_uploads_on_close(memory_run_dir):
    pytest.importorskip("tensorboardX")
    w = TensorBoardWriter(memory_run_dir, upload_every_s=3600)
    w.train(0, loss=2.0, lr=1e-3, norm=1.0, tok_per_s=10.0)
    assert memory_run_dir.listdir("tb") == []  # staged locally until an upload is due
    w.val(0, 2.5)  # every validation uploads
    assert read_scalars(memory_run_dir)["val/loss"] == [(0, 2.5)]
    w.train(1, loss=1.5, lr=1e-3, norm=1.0, tok_per_s=10.0)
    w.close()
    assert read_scalars(memory_run_dir)["train/loss"] == [(0, 2.0), (1, 1.5)]


def test_tensorboard_without_tensorboardx_says_so_once_and_does_nothing(tmp_path, monkeypatch,
                                                                        capsys):
    import sys

    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboardX"] + ["tensorboardX"]:
        monkeypatch.setitem(sys.modules, name, None)  # every import of it now fails
    w = TensorBoardWriter(open_run_dir(tmp_path))
    w.train(0, loss=1.0, lr=1.0, norm=1.0, tok_per_s=1.0)
    w.val(0, 1.0)
    w.close()
    assert not w.active
    assert not (tmp_path / "tb").exists()
    assert capsys.readouterr().out.count("tensorboardX is not installed") == 1


def test_disabled_writer_does_nothing(tmp_path):
    w = TensorBoardWriter(open_run_dir(tmp_path), enabled=False)
    w.train(0, loss=math.nan, lr=1.0, norm=1.0, tok_per_s=1.0)
    w.close()
    assert not (tmp_path / "tb").exists()


@pytest.fixture
def memory_run_dir(request):
    """A run directory on fsspec's in-memory filesystem, seen through pyarrow.fs."""
    fsspec_memory = pytest.importorskip("fsspec.implementations.memory")
    import pyarrow.fs as pafs

    mem = fsspec_memory.MemoryFileSystem()
    root = f"/raygpt-test/{request.node.name}"
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(mem))
    yield open_run_dir((fs, root))
    if mem.exists(root):
        mem.rm(root, recursive=True)
