"""main.log: llm.c's line formats, event lines, rank 0 only, truncate or append."""

import pytest

from raygpt.runlog.mainlog import Logger, format_event
from raygpt.storage import open_run_dir

def read_log(d):
    return (d / "main.log").read_text().splitlines()


def test_llmc_line_formats(tmp_path):
    log = Logger(open_run_dir(str(tmp_path)), 0, resume=False)
    log.log_train(7, 5.123456, 3e-4, 1.23456)
    log.log_val(20, 4.56789)
    log.log_eval(40, 0.2951)
    log.log_event(57, "skip", lossz=7.31, gnormx=1.02, consecutive=1)
    assert read_log(tmp_path) == [
        "s:7 trl:5.1235 lr:0.000300 norm:1.23",
        "s:20 tel:4.5679",
        "s:40 eval:0.2951",
        "s:57 skip:1 lossz:7.3100 gnormx:1.0200 consecutive:1",
    ]


def test_event_lines_parse_like_llmc_streams(tmp_path):
    # llm.c's plotting reads "s:N name:value" and keys a stream by name; events must not
    # land in trl/tel/eval and must keep a numeric second token
    log = Logger(open_run_dir(str(tmp_path)), 0, resume=False)
    log.log_train(1, 3.0, 1e-3, 0.5)
    log.log_event(2, "rewind", to=0, lr_scale=0.7, reason="sustained_spike")
    streams = {}
    for line in read_log(tmp_path):
        parts = line.split()
        step = int(parts[0].split(":")[1])
        name, value = parts[1].split(":")
        streams.setdefault(name, {})[step] = float(value)
    assert streams == {"trl": {1: 3.0}, "rewind": {2: 1.0}}


def test_event_values_stay_one_token_each():
    line = format_event(9, "skip", reason="loss z 7.31 > soft_z 6.0\nagain", to=None, ok=True,
                        n=3, z=float("nan"))
    assert line == "s:9 skip:1 reason:loss_z_7.31_>_soft_z_6.0_again to:none ok:1 n:3 z:nan"
    assert len(line.split()) == 7


def test_event_kind_and_keys_are_checked():
    with pytest.raises(ValueError, match="kind"):
        format_event(1, "trl", x=1)  # would be read as a train loss
    with pytest.raises(ValueError, match="kind"):
        format_event(1, "bad kind")
    with pytest.raises(ValueError, match="field names"):
        format_event(1, "skip", **{"bad key": 1})


def test_only_rank_0_with_a_dir_writes(tmp_path):
    log = Logger(open_run_dir(str(tmp_path)), 1, resume=False)
    log.log_train(1, 3.0, 1e-3, 0.5)
    log.log_val(1, 3.0)
    log.log_event(1, "skip", lossz=1.0)
    assert not log.active
    assert list(tmp_path.iterdir()) == []
    nolog = Logger(None, 0, resume=False)
    nolog.log_train(1, 3.0, 1e-3, 0.5)
    assert not nolog.active


def test_fresh_start_truncates_and_resume_appends(tmp_path):
    first = Logger(open_run_dir(str(tmp_path)), 0, resume=False)
    first.log_train(1, 3.0, 1e-3, 0.5)
    first.log_train(2, 2.9, 1e-3, 0.5)
    resumed = Logger(open_run_dir(str(tmp_path)), 0, resume=1)
    assert len(read_log(tmp_path)) == 2
    resumed.log_train(3, 2.8, 1e-3, 0.5)
    assert [line.split()[0] for line in read_log(tmp_path)] == ["s:1", "s:2", "s:3"]
    fresh = Logger(open_run_dir(str(tmp_path)), 0, resume=0)
    assert read_log(tmp_path) == []
    fresh.log_val(5, 1.0)
    assert read_log(tmp_path) == ["s:5 tel:1.0000"]


def test_each_call_leaves_the_file_complete(tmp_path):
    # nothing stays buffered between calls: the line is on disk when the call returns
    log = Logger(open_run_dir(str(tmp_path)), 0, resume=False)
    log.log_train(1, 3.0, 1e-3, 0.5)
    assert (tmp_path / "main.log").read_bytes() == b"s:1 trl:3.0000 lr:0.001000 norm:0.50\n"
