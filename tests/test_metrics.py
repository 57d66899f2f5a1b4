"""main.log lines, loss_history.jsonl durability and torn-line tolerance, MFU arithmetic and the
console line."""


import pytest

from raygpt.metrics import (PROMISED_TFLOPS, Logger, estimate_mfu, flops_per_token,
                            format_event, format_step_line, promised_flops, steps_logged)

# ---------------------------------------------------------------------- Logger


def read_log(d):
    return (d / "main.log").read_text().splitlines()


def test_llmc_line_formats(tmp_path):
    log = Logger(str(tmp_path), 0, resume=False)
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
    log = Logger(str(tmp_path), 0, resume=False)
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
    log = Logger(str(tmp_path), 1, resume=False)
    log.log_train(1, 3.0, 1e-3, 0.5)
    log.log_val(1, 3.0)
    log.log_event(1, "skip", lossz=1.0)
    assert not log.active
    assert list(tmp_path.iterdir()) == []
    nolog = Logger(None, 0, resume=False)
    nolog.log_train(1, 3.0, 1e-3, 0.5)
    assert not nolog.active


def test_fresh_start_truncates_and_resume_appends(tmp_path):
    first = Logger(str(tmp_path), 0, resume=False)
    first.log_train(1, 3.0, 1e-3, 0.5)
    first.log_train(2, 2.9, 1e-3, 0.5)
    resumed = Logger(str(tmp_path), 0, resume=1)
    assert len(read_log(tmp_path)) == 2
    resumed.log_train(3, 2.8, 1e-3, 0.5)
    assert [line.split()[0] for line in read_log(tmp_path)] == ["s:1", "s:2", "s:3"]
    fresh = Logger(str(tmp_path), 0, resume=0)
    assert read_log(tmp_path) == []
    fresh.log_val(5, 1.0)
    assert read_log(tmp_path) == ["s:5 tel:1.0000"]


def test_each_call_leaves_the_file_complete(tmp_path):
    # nothing stays buffered between calls: the line is on disk when the call returns
    log = Logger(str(tmp_path), 0, resume=False)
    log.log_train(1, 3.0, 1e-3, 0.5)
    assert (tmp_path / "main.log").read_bytes() == b"s:1 trl:3.0000 lr:0.001000 norm:0.50\n"


# ---------------------------------------------------------------------- steps_logged


def test_steps_logged_keeps_the_latest_attempt():
    records = [{"step": 0, "loss": 3.0}, {"step": 1, "loss": 9.0}, {"event": "rewind", "to": 0},
               {"step": 1, "loss": 2.9}, {"step": 2, "loss": 2.8},
               {"step": 2, "event": "skip", "loss": 9.9}]
    assert steps_logged(records) == {0: 3.0, 1: 2.9, 2: 2.8}


# ---------------------------------------------------------------------- MFU

N_124M = 124475904  # GPT-2 124M with the vocab padded to 50304, llm.c's count


def test_flops_per_token_gpt2_124m():
    # 6 N + 6 L C T = 746,855,424 + 56,623,104
    assert flops_per_token(N_124M, 12, 768, 1024) == 803_478_528
    assert flops_per_token(N_124M, 12, 768, 64) == 6 * N_124M + 6 * 12 * 768 * 64
    # 1558M at T=1024: 6*L*C*T alone is past 2^31 (the reason llm.c uses size_t)
    assert flops_per_token(1_557_686_400, 48, 1600, 1024) == 9_346_118_400 + 471_859_200


def test_promised_flops_for_known_devices():
    assert promised_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert promised_flops("NVIDIA H200", "bf16") == pytest.approx(989.4e12)
    assert promised_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756e12)
    assert promised_flops("NVIDIA H100 PCIe", "tf32") == pytest.approx(378e12)
    assert promised_flops("NVIDIA A100-SXM4-80GB", "bf16") == pytest.approx(312e12)
    assert promised_flops("NVIDIA A100-PCIE-40GB", "fp32") == pytest.approx(19.5e12)
    assert promised_flops("NVIDIA H200", "fp16") == promised_flops("NVIDIA H200", "bf16")
    for figures in PROMISED_TFLOPS.values():
        # tensor cores do twice the bf16 rate of tf32 (datasheets round, hence approx)
        assert figures["bf16"] == pytest.approx(2 * figures["tf32"], rel=1e-3)
        assert figures["fp32"] < figures["tf32"]


@pytest.mark.parametrize("name", ["cpu", "", None, "NVIDIA GeForce RTX 4090", "NVIDIA RTX A1000",
                                  "NVIDIA GH200 480GB"])
def test_unknown_devices_have_no_promised_flops(name):
    assert promised_flops(name, "bf16") is None
    assert estimate_mfu(N_124M, 12, 768, 1024, 524288, 0.5, name, "bf16") is None


def test_estimate_mfu_h100_and_h200():
    tokens, dt = 524288, 1.0  # one 0.5M-token step per second
    achieved = 803_478_528 * tokens / dt
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        mfu = estimate_mfu(N_124M, 12, 768, 1024, tokens, dt, name, "bf16")
        assert mfu == pytest.approx(achieved / 989.4e12)
        assert 0.42 < mfu < 0.43
    assert estimate_mfu(N_124M, 12, 768, 1024, tokens, dt, "NVIDIA H100 PCIe", "bf16") == \
        pytest.approx(achieved / 756e12)
    with pytest.raises(ValueError, match="dt_seconds"):
        estimate_mfu(N_124M, 12, 768, 1024, tokens, 0.0, "NVIDIA H200", "bf16")
    with pytest.raises(ValueError, match="precision"):
        promised_flops("NVIDIA H200", "int8")


# ---------------------------------------------------------------------- console


def test_step_line_layout():
    line = format_step_line(7, 150, 7.123456, 1.2345, 3e-4, 123.45, 12345.4, 0.456,
                            loss_z=float("nan"), norm_z=0.123)
    assert line == ("step    7/150 | loss 7.123456 (+nanz)| norm 1.2345 (+0.12z)| lr 3.00e-04 | "
                    "123.45 ms | 45.6% bf16 MFU | 12345 tok/s")
    plain = format_step_line(12, 150, 3.0, 0.5, 1e-3, 50.0, 100.0, None, precision="fp32",
                             note="SKIP")
    assert plain == ("step   12/150 | loss 3.000000 | norm 0.5000 | lr 1.00e-03 | 50.00 ms | "
                     "n/a fp32 MFU | 100 tok/s | SKIP")
