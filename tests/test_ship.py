"""Installing a trained run as a built-in model (benchmarks/ship.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from blockdecode import BlockwiseLM
from blockdecode.pretraining.corpus import train_tokenizer
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
    install = script("ship").install
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
