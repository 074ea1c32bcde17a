"""The depth study (benchmarks/lookup_depth.py): a short run on the built-in model and on a tiny GGUF writes every
k's figures against the first k's, the lookup chains at both ends, and the plot."""

from __future__ import annotations

import json

from conftest import script, write_gemma3_gguf


def test_a_short_run_compares_each_k_with_the_first_and_writes_the_plot(tmp_path):
    study = script("lookup_depth")
    out = tmp_path / "depth.json"
    report = study.main(["--windows", "1", "--rounds", "1", "--threads", "1", "--new-tokens", "8", "--ks", "8,16",
                         "--out", str(out)])  # fmt: skip
    assert list(report["sets"]) == ["64", "300", "all"] and report["sets"]["all"]["windows"] == 2
    medians = report["sets"]["all"]["median_vs_greedy"]
    assert set(medians) == {"transformers greedy", "transformers prompt lookup", "default k=8", "default k=16",
                            "ngram chain k=8", "ngram chain k=16"}  # fmt: skip
    assert medians["transformers greedy"] == 1.0 and set(report["sets"]["64"]["vs_first_k"]) == {"16"}
    vs = report["sets"]["all"]["vs_first_k"]["16"]
    assert 0 < vs["worst"] <= vs["median"]
    assert json.loads(out.read_text())["ks"] == [8, 16] and out.with_suffix(".png").stat().st_size > 0
    gguf = tmp_path / "toy.gguf"
    write_gemma3_gguf(gguf)
    report = study.main(["--gguf", str(gguf), "--rounds", "1", "--threads", "1", "--new-tokens", "4", "--ks", "4,8",
                         "--out", str(tmp_path / "real.json")])  # fmt: skip
    assert (
        list(report["sets"]) == ["code", "prose", "all"]
        and "suffix chain k=8" in report["sets"]["all"]["tokens_per_call"]
    )
