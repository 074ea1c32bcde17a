"""docs/results.md's tables, written from the results that produced them (benchmarks/results_doc.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockdecode import BlockwiseLM
from blockdecode.bench import PRESETS, BenchConfig, markdown, run_bench
from blockdecode.cli import main
from blockdecode.core.toy import toy_model
from blockdecode.pretraining.corpus import train_tokenizer
from tests.conftest import perturb_heads, script


@pytest.fixture(scope="module")
def results_doc():
    return script("results_doc")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A quick bench run of a saved toy BlockwiseLM at k=2."""
    root = tmp_path_factory.mktemp("bench")
    tokenizer = train_tokenizer(["\n".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(300))], 300)
    lm = perturb_heads(BlockwiseLM.from_base(toy_model("llama", vocab=len(tokenizer), context=256), k=2), std=0.05)
    lm.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "prompts.json").write_text(json.dumps(["def f(x):\n", "def g(y):\n    return"]))
    cfg = BenchConfig.quick(model=str(root / "model"), prompts=str(root / "prompts.json"), ks=[2], dtype="fp32",
                            new_tokens=12, max_q=6, out=str(root / "out"))  # fmt: skip
    return run_bench(cfg, show=False)


def test_a_table_is_written_between_its_markers(results_doc, report: dict, tmp_path: Path) -> None:
    doc = tmp_path / "results.md"
    doc.write_text("# x\n<!-- bench-table:start -->\nold\n<!-- bench-table:end -->\nafter\n")
    results_doc.update_section(doc, "bench-table", markdown(report))
    text = doc.read_text()
    assert "old" not in text and "| heads k=2 |" in text and text.endswith("after\n")
    with pytest.raises(ValueError, match="no <!-- paper-table:start -->"):
        results_doc.update_section(doc, "paper-table", "x")
    # a causal model's, no approximate rule; quick's sampling at 0.7 and batch of 4
    assert list(results_doc.bench_tables(report)) == ["bench-table", "sampling-table", "batch-table"]


def test_a_core_bench_run_writes_the_core_table(results_doc, tmp_path: Path, monkeypatch) -> None:
    """`blockdecode bench --preset core` writes its results folder only; the script takes its table from there."""
    doc = tmp_path / "results.md"
    doc.write_text("# x\n<!-- core-table:start -->\nold\n<!-- core-table:end -->\n")
    small = dict(system_model=dict(vocab=300, width=32, layers=1, heads=2), system_accuracies=[1.0], fwd_reps=1)
    monkeypatch.setitem(PRESETS, "core", lambda **kw: BenchConfig.core(**{**small, "repeats": 1, **kw}))
    main(["bench", "--preset", "core", "--out", str(tmp_path / "cli"), "--new-tokens", "6"])
    assert results_doc.write_bench_tables(tmp_path / "cli", doc) == ["core-table"]
    text = doc.read_text()
    assert "old" not in text and "| scripted p=1 static |" in text
