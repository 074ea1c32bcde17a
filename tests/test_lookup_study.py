"""The lookup study (benchmarks/lookup_study.py): a short run writes every part's figures and the plot."""

from __future__ import annotations

import json

from conftest import script

from blockdecode.core.hardware import auto_dtype
from blockdecode.core.hf import dtype_name


def test_a_short_run_writes_every_part_and_the_plot(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the corpora's indexes
    out = tmp_path / "study.json"
    report = script("lookup_study").main(["--windows", "2", "--new-tokens", "8", "--rounds", "1", "--threads", "1",
                                          "--no-llama-cpp", "--out", str(out)])  # fmt: skip
    assert report["dtype"] == dtype_name(auto_dtype()) and report["machine"]  # the heading every study opens with
    for length in ("64", "300"):
        found = report["code"][length]
        methods = found["methods"]["all"]
        assert {"transformers greedy", "transformers prompt lookup", "default", "n-gram chain"} <= set(methods)
        assert methods["transformers greedy"]["median_vs_transformers greedy"] == 1.0
        assert 0 < methods["default"]["worst_vs_best_part"] and methods["default"]["calls_per_token"] <= 1
        assert len(found["per_window"]) == 2 and all(
            w["same_as_greedy"].keys() == methods.keys() for w in found["per_window"]
        )
    corpus = report["code"]["corpus"]["methods"]["all"]
    assert corpus["heads+suffix ranked + corpus"]["windows"] == 2 and corpus["corpus_vs_none"] > 0
    assert set(report["sampling"]) == {"0.7", "1.0"} and "translation" not in report
    assert json.loads(out.read_text())["code"].keys() == report["code"].keys()
    assert out.with_suffix(".png").stat().st_size > 0
