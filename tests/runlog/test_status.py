"""`raygpt status`'s report of a mixed -i (runlog/status.py, a pure function of the history):
each source's tokens, share and epoch at the last step; nothing for one glob or a bad record."""

from raygpt.runlog.run_view import view_from_records
from raygpt.runlog.status import format_status


def train(step, **extra):
    return {"kind": "train", "step": step, "loss": 5.0, "lr": 1e-3, "norm": 1.0, "dt": 0.5,
            "tokens": (step + 1) * 100, "time": 100.0 + step, "attempt": 1, **extra}


def status(records) -> str:
    return format_status(view_from_records("/runs/mix", records), now=200.0)


def test_status_shows_each_sources_tokens_share_and_epoch():
    recs = [{"kind": "start", "step": 0, "time": 99.0, "attempt": 1},
            train(0, source_tokens={"web": 70, "code": 30}),
            {"kind": "source_epoch", "step": 1, "source": "code", "epoch": 1, "time": 101.0},
            train(1, source_tokens={"web": 130, "code": 70}),
            {"kind": "source_epoch", "step": 2, "source": "code", "epoch": 2, "time": 102.0},
            {"kind": "source_epoch", "step": 2, "source": "web", "epoch": "x", "time": 102.0},
            train(2, source_tokens={"web": 210, "code": 90})]
    lines = status(recs).splitlines()
    assert "sources   web 210 tokens (70.0%), epoch 0 | code 90 tokens (30.0%), epoch 2" in lines


def test_one_glob_or_a_malformed_record_shows_no_sources_line():
    for extra in ({}, {"source_tokens": {"web": "many"}}, {"source_tokens": {"web": -1}},
                  {"source_tokens": []}, {"source_tokens": {"web": True}}):
        text = status([{"kind": "start", "step": 0, "time": 99.0, "attempt": 1}, train(0, **extra)])
        assert "sources" not in text and "speed" in text, extra
