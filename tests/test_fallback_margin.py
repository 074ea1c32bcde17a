"""The fallback study (benchmarks/fallback_margin.py): a short run on the built-in model compares each margin with
the first, counts the sequences that fell back, leaves the product's margin as it was, and writes the plot."""

from __future__ import annotations

import json

import pytest
from conftest import script

from blockdecode.decoding import ranking


def test_a_short_run_compares_each_margin_with_the_first_and_writes_the_plot(tmp_path):
    out, kept = tmp_path / "margin.json", ranking.FALLBACK_MARGIN
    report = script("fallback_margin").main(["--windows", "1", "--rounds", "1", "--threads", "1", "--new-tokens", "8",
                                             "--margins", "1.0,never", "--out", str(out)])  # fmt: skip
    assert list(report["sets"]) == ["64", "300", "all"] and report["sets"]["all"]["windows"] == 2
    never = report["sets"]["all"]["vs_first"]["never"]
    assert 0 < never["worst"] <= never["median"] <= never["best"] and never["total"] > 0
    assert report["sets"]["all"]["fell_back"]["never"] == 0  # 8 new tokens: too few calls to judge, and never
    assert ranking.FALLBACK_MARGIN == kept  # the module's own, put back
    assert json.loads(out.read_text())["margins"] == ["1.0", "never"] and out.with_suffix(".png").stat().st_size > 0


def test_a_margin_that_is_not_a_positive_number_is_refused():
    for bad in ("0", "fast"):
        with pytest.raises(SystemExit, match=f"--margins takes numbers > 0 or 'never', got '{bad}'"):
            script("fallback_margin").main(["--margins", f"1.0,{bad}"])
