"""Installing a trained run as a built-in model (blockdecode.builtin.install)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from blockdecode import BlockwiseLM
from blockdecode.builtin import install
from blockdecode.corpus import train_tokenizer
from tests.conftest import make_prompt, perturb_heads, script, toy_model


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A saved run: a toy Llama with trained-looking heads and its tokenizer."""
    path = tmp_path_factory.mktemp("run") / "run"
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n" * 50], vocab_size=300)
    lm = perturb_heads(BlockwiseLM.from_base(toy_model("llama", vocab=len(tokenizer)), k=3))
    lm.save_pretrained(path, training={"mode": "distill", "steps": 5}, tokenizer=tokenizer)
    return path


def test_install_writes_a_whole_bf16_model_with_its_record_and_prompts(run, tmp_path):
    target = tmp_path / "builtin"
    target.mkdir()
    (target / "stale.txt").write_text("from the model shipped before")
    install(run, target, {"mode": "distill", "steps": 5, "mean_block_size": {"8": 2.5}}, ["def main():\\n"])
    assert not (target / "stale.txt").exists() and not target.with_name("builtin.new").exists()
    assert json.loads((target / "prompts.json").read_text()) == ["def main():\\n"]
    assert json.loads((target / "blockdecode.json").read_text())["training"]["mean_block_size"] == {"8": 2.5}
    weights_files = sorted(target.glob("*.safetensors"))
    assert [f.name for f in weights_files] == ["heads.safetensors", "model.safetensors"]
    for weights in weights_files:
        with safe_open(weights, "pt") as f:
            assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}, weights.name
    shipped, original = BlockwiseLM.from_pretrained(target), BlockwiseLM.from_pretrained(run)
    ids = make_prompt(6, shipped.base.config.vocab_size)
    assert torch.equal(shipped.to(torch.float32).generate(ids, 8).sequences, original.generate(ids, 8).sequences)


def test_translation_ship_passes_over_a_base_that_lost_bleu(monkeypatch, tmp_path):
    """The fastest set at k=8 loses 2 BLEU against the frozen base's and is passed over; a set
    trained at k=6 competes with its k=6 block; k=10 is never the measure."""
    table = script("translation_table")
    installed = {}
    monkeypatch.setattr(table, "install", lambda run, directory, training, sources: installed.update(training))
    rows = []
    for name, mode, bleu, by_k in (
        ("a", "distill (4-beam targets)", 30.0, {"8": 1.5, "10": 9.9}),
        ("b", "finetune", 29.2, {"8": 2.5, "10": 2.6}),
        ("c", "finetune+distill (4-beam targets)", 28.0, {"8": 4.0}),
        ("d", "frozen", 29.6, {"4": 2.4, "6": 2.6}),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "blockdecode.json").write_text(json.dumps({"training": {"mode": mode, "k": 10}}))
        by_k = {k: {"mean_block_size": block} for k, block in by_k.items()}
        rows.append({"run": str(tmp_path / name), "mode": mode, "bleu": bleu, "by_k": by_k})
    assert table.ship(rows, tmp_path / "out", ["In the beginning"])["run"] == str(tmp_path / "d")
    assert installed["original_bleu"] == 30.0 and installed["bleu"] == 29.6 and installed["k"] == 10
    assert table.ship(rows[:3], tmp_path / "out", ["In the beginning"])["run"] == str(tmp_path / "b")
    with pytest.raises(ValueError, match="needs a frozen or distill run"):
        table.ship(rows[1:3], tmp_path / "out", ["In the beginning"])
