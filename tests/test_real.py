"""The real-model benchmark (benchmarks/real.py), run short on a tiny GGUF written here: every method on code and
prose windows at a thread count, the default against its parts, the fp32 check, JSON and plot."""

from __future__ import annotations

import json

import torch
from conftest import script, write_gemma3_gguf

from blockdecode.core import hardware
from blockdecode.decoding.choice import TREE_DEPTH


def test_a_short_run_on_a_gguf_writes_every_figure_and_the_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "native_bf16", lambda device="cpu": False)  # a CPU that emulates bf16
    gguf = tmp_path / "toy.gguf"
    write_gemma3_gguf(gguf)
    out = tmp_path / "real.json"
    args = ["--gguf", str(gguf), "--code", "2", "--prose", "1", "--prompt-len", "48", "--new-tokens", "8"]
    report = script("real").main([*args, "--threads", "1", "--no-llama-cpp", "--ranked", "ngram", "--out", str(out)])
    assert report["dtype"] == "fp32"  # what `auto` picks there, not bf16
    assert report["machine"].endswith(f"({torch.backends.cpu.get_cpu_capability()})")
    assert report["drafters"] == {"shipped": False, "default": "suffix", "k": TREE_DEPTH}  # none shipped for a GGUF
    part = report["threads"]["1"]
    assert [r["kind"] for r in part["per_window"]] == ["code", "code", "prose"]
    summary = part["summary"]
    assert summary["code"]["windows"] == 2 and summary["prose"]["windows"] == 1 and summary["all"]["windows"] == 3
    medians = summary["all"]["median_vs_greedy"]
    assert set(medians) == {"transformers greedy", "transformers prompt lookup", "default", "suffix chain",
                            "suffix chain k=16", "suffix chain k=32", "n-gram chain", "ngram ranked"}  # fmt: skip
    assert medians["transformers greedy"] == 1.0
    against = summary["all"]["default_vs_fastest_part"]
    assert 0 < against["worst"] <= against["median"] and against["windows"] == 3
    assert against["same_text"]["windows"] == 3  # every text is greedy's here: all compared on the same text
    for row in part["per_window"]:  # fp32 toy: every blockdecode method is greedy's output
        assert all(row["identical"][m] for m in ("default", "suffix chain", "n-gram chain", "ngram ranked")), row
    assert report["fp32_check"] == {"windows": 3, "identical": 3, "departures": []}
    assert json.loads(out.read_text())["threads"].keys() == {"1"}
    assert out.with_suffix(".png").stat().st_size > 0
