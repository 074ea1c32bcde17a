"""The Table 1 script's comparisons that read training folders (benchmarks/paper_table.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockdecode.io import append_jsonl
from tests.conftest import script


@pytest.fixture(scope="module")
def paper_table():
    return script("paper_table")


def training_folder(path: Path, width: int, tokens_per_s: float, blocks: dict[int, float]) -> Path:
    path.mkdir()
    (path / "train_config.json").write_text(json.dumps({"head_hidden_size": width}))
    for step, block in blocks.items():
        append_jsonl(path / "metrics.jsonl", {"step": step, "tokens_per_s": tokens_per_s if step else None})
        append_jsonl(path / "metrics.jsonl", {"step": step, "eval_mean_block_size": block, "eval_base_loss": 3.0})
    return path


def test_widths_are_compared_at_equal_time_not_equal_steps(paper_table, tmp_path):
    """The wide heads lead at equal steps, but run at half the speed: at equal time they trail."""
    narrow = training_folder(tmp_path / "narrow", 128, 200.0, {0: 1.0, 100: 1.4, 200: 1.6, 400: 1.8})
    wide = training_folder(tmp_path / "wide", 256, 100.0, {0: 1.0, 100: 1.5, 200: 1.7})
    result = paper_table.widths([narrow, wide], tmp_path / "widths.png")
    assert result["compared_at_time"] == 400  # the wide run's 200 steps took as long as 400 narrow steps
    assert result["runs"]["wide"]["mean_block_at_equal_time"] == pytest.approx(1.7)
    assert result["runs"]["narrow"]["mean_block_at_equal_time"] == pytest.approx(1.8)
    assert result["better"] == "narrow"
    assert (tmp_path / "widths.png").stat().st_size > 0
    assert json.loads((tmp_path / "widths.json").read_text())["better"] == "narrow"
