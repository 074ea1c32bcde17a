"""The "Both" curve (benchmarks/both_curve.py): each run's evaluations against the tokens it saw, the
quality rule's rise, the best point, and a plot."""

from __future__ import annotations

import json

import pytest
from conftest import script


def run_folder(tmp_path, name: str, blocks: list[float], losses: list[float], ended: bool):
    run = tmp_path / name
    run.mkdir()
    cfg = {"mode": "finetune+distill", "batch_size": 4, "seq_len": 256, "distill_prompt_len": 8,
           "distill_new_tokens": 24, "distill_sources": None}  # fmt: skip
    (run / "train_config.json").write_text(json.dumps(cfg))
    lines = [
        json.dumps(r)
        for i, (b, loss) in enumerate(zip(blocks, losses))
        for r in ({"step": 10 * i, "loss": 3.0}, {"step": 10 * i, "eval_mean_block_size": b, "eval_base_loss": loss})
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if ended:
        steps = 10 * (len(blocks) - 1)
        (run / "blockdecode.json").write_text(json.dumps({"training": {"tokens_seen": 100 * steps, "steps": steps}}))
    return run


def test_each_run_is_its_evaluations_against_tokens_seen_with_the_rise_of_the_base_loss(tmp_path):
    both = script("both_curve")
    ended = run_folder(tmp_path, "ended", [1.8, 2.1, 1.9], [2.0, 2.02, 2.05], ended=True)
    going = run_folder(tmp_path, "going", [1.8, 1.9], [2.0, 1.99], ended=False)
    report = both.main([str(ended), str(going), "--out", str(tmp_path / "curve")])
    first, second = report["curves"]
    assert [p["tokens"] for p in first["points"]] == [0, 1000, 2000]  # its record: 100 tokens a step
    assert [p["tokens"] for p in second["points"]] == [0, 1280]  # 4 distilled rows of 8 + 24 tokens a step
    assert first["best"]["block"] == 2.1 and first["points"][2]["loss_rise"] == pytest.approx(0.025)
    assert json.loads((tmp_path / "curve.json").read_text())["rule"] == 0.02
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_a_run_without_evaluations_is_named(tmp_path):
    run = run_folder(tmp_path, "empty", [], [], ended=False)
    with pytest.raises(ValueError, match="metrics.jsonl holds no evaluation"):
        script("both_curve").main([str(run), "--out", str(tmp_path / "curve")])


def test_a_run_that_goes_on_from_a_both_set_counts_its_tokens_and_its_original_base(tmp_path):
    both = script("both_curve")
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    record = {"training": {"mode": "finetune+distill", "tokens_seen": 5000, "original_base_heldout_loss": 1.0}}
    (shipped / "blockdecode.json").write_text(json.dumps(record))
    run = run_folder(tmp_path, "on", [1.6, 1.7], [1.1, 1.2], ended=True)
    cfg = json.loads((run / "train_config.json").read_text())
    (run / "train_config.json").write_text(json.dumps({**cfg, "base": str(shipped), "init_heads": str(shipped)}))
    (c,) = both.main([str(run), "--out", str(tmp_path / "curve")])["curves"]
    assert [p["tokens"] for p in c["points"]] == [5000, 6000]
    assert [p["loss_rise"] for p in c["points"]] == [pytest.approx(0.1), pytest.approx(0.2)]  # against 1.0, not 1.1


def test_the_plateau_is_the_first_doubling_of_tokens_that_grew_the_best_block_too_little():
    both = script("both_curve")
    points = [{"step": i, "tokens": 1000 * i, "block": b} for i, b in enumerate([1.8, 2.0, 2.1, 2.12, 2.13])]
    # at 3,000 tokens the first half holds two evaluations only; at 4,000 the best grew 2.10 -> 2.13
    assert both.plateau(points, 0.05) == {"tokens": 4000, "step": 4, "grew": pytest.approx(0.03)}
    assert both.plateau(points, 0.02) is None
