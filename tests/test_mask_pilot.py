"""The mask pilot (benchmarks/mask_pilot.py): its scores, and a tiny run of the whole comparison."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import script

from blockdecode.core.io import read_jsonl
from blockdecode.core.loss import IGNORE


@pytest.fixture(scope="module")
def pilot():
    return script("mask_pilot")


def test_scores_count_anchors_whose_whole_block_lies_in_the_continuation(pilot):
    """Per offset the share of right guesses, and the block: 1 + the guesses right before the first
    wrong one; an anchor with a target past the row's end is left out of both."""
    targets = torch.tensor([[[5, 6, 7], [6, 7, 8], [7, 8, IGNORE]]])
    guesses = torch.tensor([[[5, 0, 7], [6, 7, 8], [7, 8, 9]]])
    found = pilot.scores(guesses, targets)
    assert found["anchors"] == 2
    assert found["accuracy"] == {"2": 1.0, "3": 0.5, "4": 1.0}
    assert found["mean_block"] == pytest.approx(1 + (1 + 3) / 2)


@pytest.mark.slow
def test_a_tiny_pilot_compares_everyone_on_the_same_anchors_and_resumes(pilot, tmp_path):
    """The built-in model's distilled rows, two steps of masks, the shipped heads and paper heads for the
    same CPU time, the verify calls' costs, the layouts benchmark on the masks trained; then --resume
    with one step more continues the masks' run."""
    args = ["--out", str(tmp_path), "--max-files", "60", "--train-rows", "8", "--eval-rows", "2", "--prompt-len", "8",
            "--new-tokens", "24", "--batch-size", "2", "--eval-every", "1", "--checkpoint-every", "1",
            "--cost-reps", "2"]  # fmt: skip
    report = pilot.main([*args, "--steps", "2", "--paper-heads"])
    found = [report[name]["heldout"] for name in ("masks", "shipped_heads", "paper_heads")]
    assert all(list(f["accuracy"]) == [str(d) for d in range(2, 9)] for f in found)
    assert len({f["anchors"] for f in found}) == 1 and found[0]["anchors"] > 0
    assert report["masks"]["steps"] == 2 and report["masks"]["cpu_s"] > 0
    assert report["paper_heads"]["steps"] >= 1 and report["call_cost"]["dtype"] == "bf16"
    assert {"1", "chain 8", "chain 8 + masks (fp32 LoRA)", "chain 8 + masks (bf16 LoRA)", "plain 15"} <= set(
        report["call_cost"]["ms"]
    )
    assert json.loads((tmp_path / "mask_pilot.json").read_text())["masks"]["heldout"] == found[0]
    assert (tmp_path / "mask_pilot.png").stat().st_size > 0
    layouts = script("mask_layouts").main(["--pilot", str(tmp_path), "--out", str(tmp_path), "--reps", "2"])
    assert set(layouts["tokens_per_one_token_call"]) == {"4", "6", "8"}  # the layouts of the masks just trained
    assert layouts["call_cost"]["positions"]["k=8 groups after all"] == 64
    assert (tmp_path / "mask_layouts.png").stat().st_size > 0
    again = pilot.main([*args, "--steps", "3", "--resume"])
    assert again["masks"]["steps"] == 3
    assert [r["step"] for r in read_jsonl(tmp_path / "masks" / "metrics.jsonl") if "loss" in r] == [
        2,
        3,
    ]  # logged at the end of each run
