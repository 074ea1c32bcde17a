"""The sampling study (benchmarks/sampling_speed.py): a short run on the built-in model times the default's sampling
against `transformers`' at each temperature on both window sets, and writes the plot; a bad temperature is one line."""

from __future__ import annotations

import json

import pytest
from conftest import script

from blockdecode.core import hardware


def test_a_short_run_times_each_temperature_on_both_sets_and_writes_the_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "native_bf16", lambda device="cpu": False)  # a CPU that emulates bf16
    out = tmp_path / "sampling.json"
    report = script("sampling_speed").main(["--windows", "1", "--rounds", "1", "--threads", "1", "--new-tokens", "8",
                                            "--temperatures", "0.7,1.0", "--out", str(out)])  # fmt: skip
    assert list(report["sets"]) == ["64", "300"]
    assert report["dtype"] == "fp32" and report["model"] == "built-in code model"  # what `auto` picks there
    for found in report["sets"].values():
        assert list(found) == ["0.7", "1.0"]
        for t in found.values():
            assert t["vs_transformers"] > 0 and 1 <= t["tokens_per_call"] <= 8 and "ranked chain" in t["plan"]
            assert t["forward_ms_per_call"] > 0 and t["transformers_ms_per_token"] > 0
    assert json.loads(out.read_text())["rounds"] == 1 and out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("bad", ["0", "warm", "-1"])
def test_a_temperature_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(SystemExit, match=f"--temperatures takes numbers > 0, got '{bad}'"):
        script("sampling_speed").main(["--temperatures", f"0.7,{bad}"])
