"""The console: the step line's layout and ETA, durations, model text made safe to print."""

import pytest

from raygpt.runlog.console import format_duration, format_step_line, printable, val_text


def test_step_line_layout():
    line = format_step_line(7, 150, 7.123456, 1.2345, 3e-4, 123.45, 12345.4, 0.456,
                            loss_z=float("nan"), norm_z=0.123)
    assert line == ("step    7/150 | loss 7.123456 (+nanz)| norm 1.2345 (+0.12z)| lr 3.00e-04 | "
                    "123.45 ms | 45.6% bf16 MFU | 12345 tok/s")
    plain = format_step_line(12, 150, 3.0, 0.5, 1e-3, 50.0, 100.0, None, precision="fp32",
                             note="SKIP")
    # no MFU column where there is no figure (a CPU, an unknown device): not "n/a fp32 MFU"
    assert plain == ("step   12/150 | loss 3.000000 | norm 0.5000 | lr 1.00e-03 | 50.00 ms | "
                     "100 tok/s | SKIP")
    unknown = format_step_line(12, 150, 3.0, 0.5, 1e-3, 50.0, 100.0, float("nan"))
    assert "| 50.00 ms | n/a bf16 MFU | 100 tok/s" in unknown


def test_step_line_carries_an_eta():
    line = format_step_line(8, 150, 3.0, 0.5, 1e-3, 50.0, 100.0, None, precision="fp32",
                            eta_s=125.7, note="SKIP: loss z 9.1")
    assert line.endswith("| 100 tok/s | eta 2m05s | SKIP: loss z 9.1")
    assert "eta" not in format_step_line(1, 150, 3.0, 0.5, 1e-3, 50.0, 100.0, None)


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (59.9, "59s"), (60, "1m00s"),
                                           (3599, "59m59s"), (7620, "2h07m"),
                                           (3 * 86400 + 4 * 3600 + 5, "3d04h"),
                                           (float("nan"), "n/a"), (-3, "0s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_samples_print_as_text_with_control_characters_escaped():
    assert printable("To be,\n\tor not") == "To be,\n\tor not"
    assert printable("a\x1b[2Jb\rc\x00") == "a\\x1b[2Jb\\rc\\x00"
    assert val_text(float("nan")) == "n/a" and val_text(None) == "n/a"
    assert val_text(3.14159) == "3.1416"
