"""MFU arithmetic: llm.c's FLOPs per token and the promised FLOP/s of known devices."""

import pytest

from raygpt.runlog.mfu import PROMISED_TFLOPS, estimate_mfu, flops_per_token, promised_flops

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
