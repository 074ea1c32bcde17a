"""The translation Table 1 script's choice of the set to ship (benchmarks/translation_table.py)."""

from __future__ import annotations

import pytest

from tests.conftest import script


def test_translation_ship_passes_over_a_base_that_lost_bleu(monkeypatch, tmp_path):
    """The fastest set at k=8 loses 2 BLEU against the frozen base's and is passed over; a set
    trained at k=6 competes with its k=6 block; k=10 is never the measure."""
    table = script("translation_table")
    installed = {}
    monkeypatch.setattr(table, "install", lambda run, directory, training, sources: installed.update(training))
    rows = []
    for name, mode, bleu, by_k in (
        ("a", "distill", 30.0, {"8": 1.5, "10": 9.9}),
        ("b", "finetune", 29.2, {"8": 2.5, "10": 2.6}),
        ("c", "finetune+distill", 28.0, {"8": 4.0}),
        ("d", "frozen", 29.6, {"4": 2.4, "6": 2.6}),
    ):
        label = mode + (" (4-beam targets)" if mode.endswith("distill") else "")  # as the table shows it
        by_k = {k: {"mean_block_size": block} for k, block in by_k.items()}
        training = {"mode": mode, "k": 10}
        rows.append({"run": str(tmp_path / name), "mode": label, "training": training, "bleu": bleu, "by_k": by_k})
    assert table.ship(rows, tmp_path / "out", ["In the beginning"])["run"] == str(tmp_path / "d")
    assert installed["original_bleu"] == 30.0 and installed["bleu"] == 29.6 and installed["k"] == 10
    assert table.ship(rows[:3], tmp_path / "out", ["In the beginning"])["run"] == str(tmp_path / "b")
    with pytest.raises(ValueError, match="needs a frozen or distill run"):
        table.ship(rows[1:3], tmp_path / "out", ["In the beginning"])
