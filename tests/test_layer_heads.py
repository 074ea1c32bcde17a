"""Heads that read several layers (benchmarks/layer_heads.py): a tiny run of the whole comparison, its
evaluation against the pilot's, and its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import script

from blockdecode.model import BlockwiseLM
from blockdecode.training import loop as training


@pytest.fixture(scope="module")
def layer_heads():
    return script("layer_heads")


TINY = ["--k", "4", "--head-hidden", "8", "--draft-vocab", "64", "--batch-size", "2", "--prompt-len", "8",
        "--new-tokens", "24", "--train-rows", "8", "--eval-rows", "2", "--cost-reps", "3",
        "--precision", "no"]  # fmt: skip


def test_a_tiny_run_starts_both_arms_alike_and_writes_its_report(layer_heads, tiny_base, tmp_path):
    """Three steps of each arm on a toy base's distilled rows: the fused arm (W zero) scores exactly
    as the heads on h alone before training, then both are scored on the same anchors at every
    evaluation; the report and its plot are written."""
    out = tmp_path / "out"
    report = layer_heads.main(["--out", str(out), "--model", str(tiny_base.dir), "--max-files", "20",
                               "--layers", "0,1", "--steps", "3", "--eval-every", "2", *TINY])  # fmt: skip
    final, fused = report["arms"]["final"], report["arms"]["fused"]
    assert [r["step"] for r in final["curve"]] == [r["step"] for r in fused["curve"]] == [0, 2, 3]
    start = ({k: r[k] for k in ("block", "accuracy")} for r in (final["curve"][0], fused["curve"][0]))
    assert next(start) == next(start)
    assert list(fused["heldout"]["accuracy"]) == ["2", "3", "4"] and report["data"]["heldout_anchors"] > 0
    assert fused["params_added"] == 2 * 64 * 64 and final["params_added"] == 0
    assert set(fused["proposal_ms"]) == {"fp32", "bf16"} and fused["cpu_s_per_step"] > 0
    assert json.loads((out / "layer_heads.json").read_text())["arms"]["fused"]["heldout"] == fused["heldout"]
    assert (out / "layer_heads.png").stat().st_size > 0


def test_the_heads_on_h_are_scored_as_the_pilot_scores_the_shipped_heads(layer_heads, tiny_base):
    """`guesses` on cached features picks what the decoder's drafter proposes (mask_pilot's
    `heads_guesses`) for the same heads, at the same anchors."""
    lm = BlockwiseLM.from_base(layer_heads.load(str(tiny_base.dir))[0].base, k=4, head_hidden_size=8, draft_vocab=64)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in lm.heads.parameters():
            p.normal_(0.0, 0.3)
        lm.heads.token_map.copy_(torch.randperm(tiny_base.vocab)[:64].sort().values)
    rows = tiny_base.sequences[:3, :40]
    feats = layer_heads.features(lm.base, rows, [1], training.Precision("no", lm.base.device), torch.float32)
    projection = layer_heads.short_projection(lm.base.get_output_embeddings(), lm.heads.token_map)
    found = layer_heads.guesses(layer_heads.LayerHeads(lm.heads, 0), feats, rows, 4, 8, projection, lm.heads.token_map)
    expected = script("mask_pilot").heads_guesses(lm, rows, 8, 4)
    assert torch.equal(found[1], expected[1]) and torch.equal(found[0], expected[0])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layers", "1,x"], "--layers must be layer numbers separated by commas, e.g. 1,2, got '1,x'"),
        (["--layers", "1,1"], "--layers must be distinct layer numbers >= 0, got 1,1"),
        (["--steps", "0"], "--steps must be a positive integer, got 0"),
        (["--layers", "2"], "--layers must lie in 0..1 (the base has 2 layers: its last one's output is h), got 2"),
    ],
)
def test_bad_arguments_are_one_clear_line(layer_heads, tiny_base, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        layer_heads.main(["--out", str(tmp_path), "--model", str(tiny_base.dir), *args])
    said = str(exit_info.value.code) if isinstance(exit_info.value.code, str) else capsys.readouterr().err
    assert said.strip().splitlines()[-1].endswith(message)
    assert not (tmp_path / "layer_heads.json").exists()
