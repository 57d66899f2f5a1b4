"""Append-only log segments on object stores (raygpt.runlog.segments): written in order off the
caller's thread, read back as one log with the old single-file layout, compacted on request,
a cut-short part tolerated only where nothing can be missing after it, and a writer killed
outright (SIGKILL, a real process) losing at most the segment bound. Object stores are
fsspec's memory filesystem here (in one process) or fsspec's local filesystem seen through
pyarrow.fs as a non-local store (shared by two processes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import fsspec
import pyarrow.fs as pafs
import pytest

from raygpt.runlog import segments
from raygpt.runlog.history import (LOSS_HISTORY_LOG, RunHistory, append_record, read_history,
                                   read_samples)
from raygpt.runlog.mainlog import MAIN_LOG_LAYOUT, Logger, read_main_log
from raygpt.runlog.segments import CorruptSegment, SegmentWriter
from raygpt.storage import open_run_dir
from tests.helpers import memory_fs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def rd():
    """A fresh run directory on the in-memory object store."""
    return open_run_dir((memory_fs(), f"/segments-{uuid.uuid4().hex[:8]}"))


class Cfg:
    """The two TrainConfig fields RunHistory reads."""

    def __init__(self, log_segment_s=3600.0, log_segment_lines=10_000):
        self.log_segment_s, self.log_segment_lines = log_segment_s, log_segment_lines


def line(i: int) -> str:
    return json.dumps({"kind": "train", "step": i, "loss": 1.0 / (i + 1)}) + "\n"


def steps(records) -> list:
    return [r.get("step") for r in records]


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


# ---------------------------------------------------------------------- order and round trip

def test_lines_round_trip_in_order_across_parts_and_writers(rd):
    w = SegmentWriter(rd, LOSS_HISTORY_LOG, interval_s=3600, max_lines=7)
    for i in range(30):
        w.append(line(i))
    w.close()
    parts = rd.listdir("loss_history")
    # sealed by line count: 7, 7, 7, 7, then the rest at close; never more than max_lines each
    assert len(parts) == 5
    assert [len(rd.read_bytes(f"loss_history/{p}").splitlines()) for p in parts] == [7, 7, 7, 7, 2]
    # another writer (the next attempt, the driver's failure record) numbers on from there
    append_record(rd, {"kind": "failure", "step": 30})
    w2 = SegmentWriter(rd, LOSS_HISTORY_LOG, interval_s=3600, max_lines=7)
    w2.append(line(31))
    w2.close()
    assert steps(read_history(rd)) == list(range(32))
    assert segments.read_bytes(rd, LOSS_HISTORY_LOG) == "".join(
        [line(i) for i in range(30)] + [json.dumps({"kind": "failure", "step": 30},
                                                   separators=(",", ":")) + "\n", line(31)]).encode()


def test_parts_of_equal_number_are_both_kept_and_read_in_writer_order(rd):
    # two processes that numbered a part the same (rank 0 and the driver at once) never
    # overwrite each other: the writer token keeps the names apart
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(3, "bbbbbbbb"), line(2).encode())
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(3, "aaaaaaaa"), line(1).encode())
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(10, "00000000"), line(3).encode())
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(2, "ffffffff"), line(0).encode())
    assert steps(read_history(rd)) == [0, 1, 2, 3]


def test_an_interval_seals_a_part_without_more_appends_and_off_the_callers_thread(rd):
    w = SegmentWriter(rd, LOSS_HISTORY_LOG, interval_s=0.2, max_lines=10_000)
    t0 = time.monotonic()
    w.append(line(0))
    w.append(line(1))
    assert rd.listdir("loss_history") == []  # the append only queued the line
    wait_for(lambda: rd.listdir("loss_history"), what="the interval's part")
    assert time.monotonic() - t0 >= 0.2
    assert steps(read_history(rd)) == [0, 1]
    w.close()


def test_run_dir_flush_stores_the_segments_as_a_checkpoint_publish_does(rd):
    h = RunHistory(rd, Cfg(), enabled=True)
    h.train(0, loss=1.0, norm=1.0)
    h.train(1, loss=0.5, norm=1.0)
    assert read_history(open_run_dir((rd.fs, rd.root))) == []  # an hour's interval: nothing yet
    rd.flush()  # what Checkpointer.publish_pending calls before reporting a checkpoint
    assert steps(read_history(open_run_dir((rd.fs, rd.root)))) == [0, 1]
    h.close()


def test_the_end_record_is_stored_before_end_returns(rd):
    h = RunHistory(rd, Cfg(), enabled=True)
    h.begin_attempt(None, None, max_steps=2)
    h.train(0, loss=1.0, norm=1.0)
    h.end({"step": 1, "val_loss": None})
    assert [r["kind"] for r in read_history(open_run_dir((rd.fs, rd.root)))] == ["start", "train", "end"]
    h.close()


def test_a_rewind_record_is_stored_before_the_next_step(rd):
    # a crash right after a rewind must not lose the record that tells a resume which steps
    # the rewind abandoned (trajectory_losses), whatever the segment interval
    h = RunHistory(rd, Cfg(), enabled=True)
    h.train(5, loss=float("nan"), norm=1.0)
    h.event(5, "rewind", to_step=4)
    assert [r["kind"] for r in read_history(open_run_dir((rd.fs, rd.root)))] == ["train", "rewind"]
    h.close()


def test_samples_and_main_log_are_segments_too(rd):
    h = RunHistory(rd, Cfg(), enabled=True)
    h.sample(0, "hello")
    h.close()
    assert rd.listdir("samples") and not rd.exists("samples.jsonl")
    assert [r["text"] for r in read_samples(rd)] == ["hello"]
    rd.write_bytes_atomic("main.log", b"s:0 trl:9.0000 lr:0.000100 norm:1.00\n")  # an old layout
    resumed = Logger(rd, 0, resume=True, segment_s=3600)
    resumed.log_val(1, 2.5)
    resumed.close()
    assert read_main_log(rd) == b"s:0 trl:9.0000 lr:0.000100 norm:1.00\ns:1 tel:2.5000\n"
    fresh = Logger(rd, 0, resume=False, segment_s=3600)  # a fresh start wipes both layouts
    fresh.log_val(0, 3.0)
    fresh.close()
    assert read_main_log(rd) == b"s:0 tel:3.0000\n"
    assert rd.listdir("main_log") and not rd.exists("main.log")


def test_a_local_run_directory_keeps_the_single_files(tmp_path):
    rd = open_run_dir(str(tmp_path))
    h = RunHistory(rd, Cfg(log_segment_s=0.01, log_segment_lines=1), enabled=True)
    h.train(0, loss=1.0, norm=1.0)
    log = Logger(rd, 0, resume=False, segment_s=0.01, segment_lines=1)
    log.log_val(0, 2.0)
    h.close()
    log.close()
    assert sorted(os.listdir(tmp_path)) == ["loss_history.jsonl", "main.log"]
    assert (tmp_path / "main.log").read_text() == "s:0 tel:2.0000\n"  # llm.c's tools read this


def test_a_bad_bound_is_refused_naming_it(rd):
    with pytest.raises(ValueError, match="segment interval: expected seconds > 0, found 0"):
        RunHistory(rd, Cfg(log_segment_s=0), enabled=True)
    with pytest.raises(ValueError, match="segment max lines: expected an integer >= 1, found 0"):
        Logger(rd, 0, resume=True, segment_lines=0)


# ---------------------------------------------------------------------- the old layout

def test_the_old_single_file_is_read_first_then_the_segments(rd):
    # a run written by an older raygpt (one loss_history.jsonl object), resumed by this one
    rd.write_bytes_atomic("loss_history.jsonl", (line(0) + line(1)).encode())
    assert steps(read_history(rd)) == [0, 1]
    h = RunHistory(rd, Cfg(), enabled=True)
    assert h.begin_attempt(1, None, max_steps=4) == 1 + 0  # the old records carry no attempt
    h.train(1, loss=1.0 / 2, norm=1.0)
    h.close()
    assert [r["kind"] for r in read_history(rd)] == ["train", "train", "resume", "train", "audit"]
    assert rd.read_bytes("loss_history.jsonl") == (line(0) + line(1)).encode()  # not rewritten


# ---------------------------------------------------------------------- torn parts

def test_a_cut_newest_part_loses_only_its_cut_line(rd, capsys):
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(0, "aaaaaaaa"), (line(0) + line(1)).encode())
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(1, "aaaaaaaa"), (line(2) + line(3)[:9]).encode())
    assert steps(read_history(rd)) == [0, 1, 2]
    assert "part-00000001-aaaaaaaa.jsonl: the newest segment ends in a cut line" in capsys.readouterr().err
    # main.log's lines are not JSON: the cut line is dropped by the segment reader itself
    rd.write_bytes_atomic(MAIN_LOG_LAYOUT.part(0, "aaaaaaaa"), b"s:0 tel:3.0000\ns:1 te")
    assert read_main_log(rd) == b"s:0 tel:3.0000\n"


def test_a_cut_part_with_newer_parts_after_it_is_an_error_naming_it(rd):
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(0, "aaaaaaaa"), (line(0) + line(1)[:9]).encode())
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(1, "aaaaaaaa"), line(2).encode())
    with pytest.raises(CorruptSegment, match=r"part-00000000-aaaaaaaa\.jsonl: expected a segment "
                                             r"that ends with a newline, found one cut short"):
        read_history(rd)


def test_a_name_that_is_not_a_segment_is_ignored_with_a_warning(rd, capsys):
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(0, "aaaaaaaa"), line(0).encode())
    rd.write_bytes_atomic("loss_history/notes.txt", b"hello\n")
    assert steps(read_history(rd)) == [0]
    assert "loss_history/notes.txt: not a segment of loss_history.jsonl" in capsys.readouterr().err


# ---------------------------------------------------------------------- compaction

def test_compaction_merges_everything_into_one_object_and_readers_see_the_same_log(rd):
    rd.write_bytes_atomic("loss_history.jsonl", line(0).encode())  # the old layout folds in too
    w = SegmentWriter(rd, LOSS_HISTORY_LOG, interval_s=3600, max_lines=2)
    for i in range(1, 8):
        w.append(line(i))
    w.close()
    before = segments.read_bytes(rd, LOSS_HISTORY_LOG)
    done = segments.compact(rd, LOSS_HISTORY_LOG)
    assert done == {"parts": 4, "bytes": len(before), "base": "loss_history/base-00000003.jsonl"}
    assert rd.listdir("loss_history") == ["base-00000003.jsonl"] and not rd.exists("loss_history.jsonl")
    assert segments.read_bytes(rd, LOSS_HISTORY_LOG) == before
    # the run goes on after compaction: new parts number above the base
    w = SegmentWriter(rd, LOSS_HISTORY_LOG, interval_s=3600, max_lines=2)
    w.append(line(8))
    w.close()
    assert steps(read_history(rd)) == list(range(9))
    assert segments.compact(rd, LOSS_HISTORY_LOG)["base"] == "loss_history/base-00000004.jsonl"
    assert rd.listdir("loss_history") == ["base-00000004.jsonl"]
    assert steps(read_history(rd)) == list(range(9))
    assert segments.compact(rd, LOSS_HISTORY_LOG)["base"] is None  # nothing new to merge


def test_compaction_deletes_nothing_until_the_merged_object_is_stored(rd):
    for i in range(3):
        rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(i, "aaaaaaaa"), line(i).encode())

    class NoBase(pafs.FSSpecHandler):
        def open_output_stream(self, path, metadata):
            if "/base-" in path:
                raise OSError(f"{path}: upload refused")
            return super().open_output_stream(path, metadata)

    failing = open_run_dir((pafs.PyFileSystem(NoBase(rd.fs.handler.fs)), rd.root))
    with pytest.raises(OSError, match="upload refused"):
        segments.compact(failing, LOSS_HISTORY_LOG)
    assert len(rd.listdir("loss_history")) == 3 and steps(read_history(rd)) == [0, 1, 2]


def test_leftover_parts_below_a_base_are_not_read_twice(rd):
    # compaction stored the base, then died before deleting the parts it merged and the old
    # single file it folded in
    rd.write_bytes_atomic("loss_history.jsonl", line(0).encode())
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.base(1), (line(0) + line(1)).encode())
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(0, "aaaaaaaa"), line(0).encode())
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(1, "aaaaaaaa"), line(1).encode())
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(2, "aaaaaaaa"), line(2).encode())
    assert steps(read_history(rd)) == [0, 1, 2]
    segments.compact(rd, LOSS_HISTORY_LOG)
    assert rd.listdir("loss_history") == ["base-00000002.jsonl"] and not rd.exists("loss_history.jsonl")
    assert steps(read_history(rd)) == [0, 1, 2]


def test_raygpt_compact_on_a_local_run_directory_has_nothing_to_do(tmp_path, capsys):
    from raygpt.cli import main
    from raygpt.storage.ownership import write_marker

    write_marker(open_run_dir(tmp_path), "run")  # compact changes only a run of this user's
    (tmp_path / "loss_history.jsonl").write_text(line(0))
    assert main(["compact", str(tmp_path)]) == 0
    assert "loss_history.jsonl: nothing to compact" in capsys.readouterr().out
    assert (tmp_path / "loss_history.jsonl").read_text() == line(0)


# ---------------------------------------------------------------------- failures and the bound

def test_a_failed_upload_is_raised_by_the_next_append_naming_the_log(rd):
    class Refuse(pafs.FSSpecHandler):
        def open_output_stream(self, path, metadata):
            raise OSError("bucket is gone")

    broken = open_run_dir((pafs.PyFileSystem(Refuse(fsspec.filesystem("memory"))), rd.root))
    w = SegmentWriter(broken, LOSS_HISTORY_LOG, interval_s=3600, max_lines=1)
    w.append(line(0))  # sealed at once; the thread's put fails
    with pytest.raises(RuntimeError, match=r"loss_history: storing a segment failed \(OSError: "
                                           r"bucket is gone\)"):
        wait_for(lambda: w.append(line(1)) and False, what="the failure")
    with pytest.raises(RuntimeError, match="bucket is gone"):
        w.flush()


def test_a_store_that_falls_behind_makes_appends_wait_rather_than_grow(rd):
    release = threading.Event()

    class Slow(pafs.FSSpecHandler):
        def open_output_stream(self, path, metadata):
            release.wait(10)
            return super().open_output_stream(path, metadata)

    slow = open_run_dir((pafs.PyFileSystem(Slow(rd.fs.handler.fs)), rd.root))
    w = SegmentWriter(slow, LOSS_HISTORY_LOG, interval_s=3600, max_lines=1, max_queued=2)
    w.append(line(0))  # sealed; its put hangs
    w.append(line(1))  # sealed; the queue is now full
    third = threading.Thread(target=w.append, args=(line(2),))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # waiting for room, not piling lines up in memory
    release.set()
    third.join(10)
    assert not third.is_alive()
    w.close()
    assert steps(read_history(rd)) == [0, 1, 2]


WRITER = textwrap.dedent("""
    import json, sys, time
    import fsspec, pyarrow.fs as pafs
    from raygpt.runlog.history import RunHistory
    from raygpt.storage import open_run_dir

    class Cfg:
        log_segment_s, log_segment_lines = float(sys.argv[2]), int(sys.argv[3])

    store = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("file")))
    h = RunHistory(open_run_dir((store, sys.argv[1])), Cfg, enabled=True)
    h.begin_attempt(None, None, max_steps=10**9)
    step = 0
    while True:
        h.train(step, loss=1.0, norm=1.0, lr=1e-4, tokens=64 * (step + 1), dt=0.005)
        print(json.dumps({"step": step, "time": time.time()}), flush=True)
        step += 1
        time.sleep(0.005)
""")


def run_writer(root, interval_s: float, max_lines: int, until_step: int):
    """A real process appending a train record every ~5 ms to a non-local store at `root`,
    SIGKILLed once it has appended `until_step`; returns its appends as {step: time}."""
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(interval_s), str(max_lines)],
                         stdout=subprocess.PIPE, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO})
    appended = {}
    try:
        for out in p.stdout:
            rec = json.loads(out)
            appended[rec["step"]] = rec["time"]
            if rec["step"] >= until_step:
                p.send_signal(signal.SIGKILL)
                break
    finally:
        p.kill()
        p.wait(30)
    assert p.returncode == -signal.SIGKILL
    return appended, time.time()


def stored_steps(root) -> list[int]:
    store = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("file")))
    return [r["step"] for r in read_history(open_run_dir((store, str(root)))) if r["kind"] == "train"]


def test_a_killed_writer_loses_at_most_the_interval(tmp_path):
    appended, _ = run_writer(tmp_path / "run", interval_s=0.3, max_lines=10**6, until_step=300)
    got = stored_steps(tmp_path / "run")
    assert got == list(range(len(got)))  # a gap-free prefix: nothing missing in the middle
    assert 0 < len(got) <= len(appended)
    lost = [s for s in appended if s >= len(got)]
    # everything appended more than one interval (plus a put's slack) before the writer's last
    # append, which the kill followed, is stored (the writer's own clock: the time this process
    # took to read its line and send the kill on a busy machine is not the writer's to answer for)
    last = appended[max(appended)]
    assert all(last - appended[s] < 0.3 + 1.0 for s in lost), (len(lost), len(appended))


def test_a_killed_writer_loses_at_most_the_line_bound(tmp_path):
    appended, _ = run_writer(tmp_path / "run", interval_s=3600, max_lines=25, until_step=120)
    got = stored_steps(tmp_path / "run")
    assert got == list(range(len(got)))
    # the lines since the last seal (< 25) and at most the one sealed part being stored
    assert len(appended) - len(got) < 2 * 25, (len(appended), len(got))
    assert len(got) >= 25


def test_status_and_plot_in_another_process_see_a_live_run_within_the_interval(tmp_path):
    """A run writing through the object-store path in one process; `raygpt status` and
    `raygpt plot` in others see each step within the segment interval (plus slack) of its
    append, while the run goes on."""
    from raygpt.runlog.report import run_status

    root, interval = tmp_path / "run", 0.5
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(interval), "1000000"],
                         stdout=subprocess.PIPE, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO})
    appended = {}
    reader = threading.Thread(target=lambda: [appended.setdefault(r["step"], r["time"]) for r in
                                              map(json.loads, p.stdout)], daemon=True)
    reader.start()
    try:
        wait_for(lambda: 40 in appended, what="the writer's step 40")
        progress = re.compile(r"progress  (\d+)/")

        def shown(text: str) -> int:  # steps done as status says; 0 before the first train record
            m = progress.search(text)
            return int(m[1]) if m else 0

        delays = []
        for target in (40, 120):
            wait_for(lambda: target in appended, what=f"the writer's step {target}")
            # this process reads with a RunDir of its own: only what the writer stored
            wait_for(lambda: shown(run_status(str(root))) > target,
                     timeout=interval + 5, what=f"status showing step {target}")
            delays.append(time.time() - appended[target])
        assert max(delays) < interval + 2.0, delays
        cli = dict(cwd=REPO, capture_output=True, text=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": REPO})
        status = subprocess.run([sys.executable, "-m", "raygpt", "status", str(root)], **cli)
        assert status.returncode == 0, status.stderr
        assert shown(status.stdout) > 120
        png = tmp_path / "run.png"
        plot = subprocess.run([sys.executable, "-m", "raygpt", "plot", str(root), "-o", str(png)],
                              **cli)
        assert plot.returncode == 0, plot.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        p.kill()
        p.wait(30)


def test_a_part_stored_while_compaction_runs_is_neither_merged_nor_read_twice(rd):
    for i in range(3):
        rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(i, "aaaaaaaa"), line(i).encode())
    mem = rd.fs.handler.fs

    class LiveWriter(pafs.FSSpecHandler):
        """A writer stores part 3 right after compaction's first listing of the folder."""
        listed = 0

        def get_file_info_selector(self, selector):
            infos = super().get_file_info_selector(selector)
            LiveWriter.listed += 1
            if LiveWriter.listed == 1:
                with mem.open(f"{rd.root}/{LOSS_HISTORY_LOG.part(3, 'bbbbbbbb')}", "wb") as f:
                    f.write(line(3).encode())
            return infos

    racing = open_run_dir((pafs.PyFileSystem(LiveWriter(mem)), rd.root))
    assert segments.compact(racing, LOSS_HISTORY_LOG)["base"] == "loss_history/base-00000002.jsonl"
    assert steps(read_history(rd)) == [0, 1, 2, 3]
    assert rd.listdir("loss_history") == ["base-00000002.jsonl", "part-00000003-bbbbbbbb.jsonl"]


def test_a_part_larger_than_any_raygpt_writes_is_skipped_unread_and_said(rd, monkeypatch, capsys,
                                                                        caplog):
    """A part above MAX_PART_BYTES (a planted one: raygpt's hold `max_lines` lines) is skipped
    by its listed size, before a byte is read, with a warning naming it; the rest read on.
    A part that grows past the bound after the listing is cut off at the bound the same way."""
    monkeypatch.setattr(segments, "MAX_PART_BYTES", 100)
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(0, "00000000"), line(0).encode())
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(1, "00000000"), b" " * 101 + b"\n")
    rd.write_bytes_atomic(LOSS_HISTORY_LOG.part(2, "00000000"), line(2).encode())
    read, real = [], type(rd).read_bytes
    monkeypatch.setattr(type(rd), "read_bytes", lambda self, rel, **kw: (
        read.append(rel), real(self, rel, **kw))[1])
    assert steps(read_history(rd)) == [0, 2]
    assert not any("part-00000001" in r for r in read)
    assert "part-00000001-00000000.jsonl: skipped, unread: expected a segment of at most 100 " \
           "bytes (what raygpt writes), found 102 bytes" in capsys.readouterr().err + caplog.text
    monkeypatch.setattr(type(rd), "file_sizes", lambda self, rel="": {
        n: 0 for n in self.listdir(rel, files_only=True)})  # a listing that predates the growth
    assert steps(read_history(rd)) == [0, 2]
    assert "part-00000001-00000000.jsonl: skipped, unread: expected a segment of at most 100 " \
           "bytes (what raygpt writes), found more bytes" in capsys.readouterr().err + caplog.text
