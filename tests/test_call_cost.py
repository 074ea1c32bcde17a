"""What a decode call costs beside its forward (benchmarks/call_cost.py): every method's figures add up,
the profile names the default's parts, and the JSON and its plot are written."""

from __future__ import annotations

import json

from conftest import script


def test_a_short_run_writes_every_method_its_parts_and_the_plot(tmp_path):
    out = tmp_path / "call_cost.json"
    report = script("call_cost").main(["--third-party", "1", "--prompt-len", "48", "--new-tokens", "12",
                                       "--threads", "1", "--profile", "--out", str(out)])  # fmt: skip
    assert set(report["methods"]) == {"default", "n-gram chain", "n-gram tree 16", "heads chain"}
    for r in report["methods"].values():
        assert abs(r["forward_ms_per_call"] + r["loop_ms_per_call"] - r["ms_per_call"]) < 1e-6
        assert 0 < r["forward_ms_per_call"] < r["ms_per_call"] and r["tokens_per_call"] >= 1
        assert r["verified_per_call"] >= 1
        assert r["decode_ms_per_call"] > 0 and r["vs_bare_forward"] == r["decode_ms_per_call"] / r["bare_forward_ms"]
    assert report["methods"]["n-gram chain"]["setting"].startswith("ngram")
    shares = report["default_profile"]
    assert 0 < shares["forward"] < 1 and 0 < shares["predict"] < 1 and 0 < shares["accept"] < shares["forward"]
    assert json.loads(out.read_text())["methods"].keys() == report["methods"].keys()
    assert out.with_suffix(".png").stat().st_size > 0
