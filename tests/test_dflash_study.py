"""The DFlash study (benchmarks/dflash_study.py): a short run on the built-in model writes every part and the plot."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import torch
from conftest import script

from blockdecode import DEFAULT_MODEL, BlockwiseLM
from blockdecode.core.hardware import auto_dtype
from blockdecode.core.hf import dtype_name
from blockdecode.drafters.dflash.config import config_for
from blockdecode.drafters.dflash.model import DFlash


def test_a_short_run_writes_every_part_and_the_plot(tmp_path) -> None:
    lm = BlockwiseLM.from_pretrained(DEFAULT_MODEL)
    vocab = lm.base.config.vocab_size
    torch.manual_seed(0)
    for name, block in (("dflash", 8), ("variant", 4)):  # untrained: exact all the same
        DFlash(config_for(lm.base, vocab, vocab - 1, block_size=block, shared_head=True)).save(tmp_path / name)
    text = Path(sysconfig.get_paths()["stdlib"], "bisect.py").read_text()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    np.save(corpus / "heldout.npy", np.asarray(lm.tokenizer(text).input_ids, dtype=np.uint16))
    out = tmp_path / "study.json"
    report = script("dflash_study").main([
        "--corpus", str(corpus), "--dflash", str(tmp_path / "dflash"), "--variant", f"short={tmp_path / 'variant'}",
        "--ks", "4,8", "--prompts", "2", "--prompt-len", "32", "--new-tokens", "12", "--speed-prompts", "1",
        "--threads", "1", "--out", str(out),
    ])  # fmt: skip
    for entry in report["blocks"].values():
        assert entry["windows"] == 2 and set(entry["drafters"]) == {"heads", "eagle3", "dflash"}
        assert entry["drafters"]["dflash"]["8"]["identical_to_greedy"] and 1 <= entry["drafters"]["dflash"]["8"][
            "mean_block_size"] <= 8  # fmt: skip
    assert set(report["variants"]["short"]["blocks"]) == set(report["blocks"])
    cost = report["cost"]["dflash"]
    assert cost["block_size"] == 8 and cost["pass_ms"] > 0 and cost["pass_against_block_call"] > 0
    speed = report["speed"]
    assert report["dtype"] == speed["dtype"] == report["cost"]["dtype"] == dtype_name(auto_dtype())  # timed as `auto`
    assert speed["median_against_greedy"]["greedy"] == 1.0 and speed["windows"] == 2
    assert {"default", "dflash chain, block 8", "dflash+ngram ranked"} <= set(speed["tokens_per_s"])
    assert json.loads(out.read_text())["speed"] == speed and out.with_suffix(".png").stat().st_size > 0
