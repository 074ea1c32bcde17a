"""`tree="auto"`: the budget measured fastest, cached per model and setting, never another's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_prompt, perturb_heads

from blockdecode import BlockwiseLM, calibrate
from blockdecode.hf import weights_digest
from blockdecode.toy import toy_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "blockdecode" / "calibration.json"


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace the timing with a fixed table (tree of 16 fastest), recording each measurement."""
    calls = []

    def fake(lm, prompts, drafter, k, budgets=calibrate.BUDGETS, **kw):
        calls.append((drafter, k))
        return {b: 100.0 + (50.0 if b == 16 else b / 2) for b in budgets}

    monkeypatch.setattr(calibrate, "measure_budgets", fake)
    return calls


def test_measured_once_then_served_from_the_cache(cache: Path, measured: list) -> None:
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=4)
    prompts = [make_prompt(5, 512)]
    first = calibrate.calibrate(lm, prompts, "heads+ngram")
    assert first.budget == 16 and first.tree == 16 and len(measured) == 1
    assert calibrate.calibrate(lm, prompts, "heads+ngram").budget == 16 and len(measured) == 1
    assert json.loads(cache.read_text())[first.key]["budget"] == 16
    calibrate.calibrate(lm, prompts, "heads+ngram", refresh=True)
    assert len(measured) == 2


def test_another_model_dtype_or_drafter_is_measured_anew(cache: Path, measured: list) -> None:
    prompts = [make_prompt(5, 512)]
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=4)
    key = calibrate.calibrate(lm, prompts, "heads").key
    other = BlockwiseLM.from_base(toy_model("llama", seed=3), k=4)  # same shapes, other weights
    assert calibrate.calibrate(other, prompts, "heads").key != key
    assert calibrate.calibrate(lm, prompts, "ngram").key != key
    assert calibrate.calibrate(lm.to(torch.bfloat16), prompts, "heads").key != key
    assert len(measured) == 4
    cache.write_text("{not json")  # a damaged cache is measured again, never trusted
    calibrate.calibrate(lm, prompts, "heads")
    assert len(measured) == 5


def test_the_chain_can_win_and_auto_stays_exact(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate, "measure_budgets", lambda lm, p, d, k, **kw: {0: 200.0, 4: 100.0})
    model = toy_model("qwen2", seed=4)
    ids = make_prompt(6, 512, seed=5)
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4))
    out = lm.generate(ids, 24, eos_token_id=NO_EOS, tree="auto")
    assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 24, eos_token_id=NO_EOS))
    assert max(out.stats.verified) <= 4  # the chain was chosen
    with pytest.raises(ValueError, match="tree must be a node budget >= 1, 'auto' or None"):
        lm.generate(ids, 4, tree="automatic")


def test_real_measurement_tries_every_budget(cache: Path) -> None:
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=3)
    speeds = calibrate.measure_budgets(lm, [make_prompt(4, 512)], "heads+ngram", 3, budgets=(0, 2, 4), new_tokens=6)
    assert set(speeds) == {2, 4} and all(s > 0 for s in speeds.values())  # shared drafters need a tree


def test_the_fingerprint_follows_the_weights() -> None:
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=3)
    first = calibrate.fingerprint(lm)
    assert calibrate.fingerprint(lm) == first  # served from memory while nothing changed
    with torch.no_grad():
        next(lm.base.parameters()).add_(1.0)  # an in-place change, as training makes
    assert calibrate.fingerprint(lm) != first


def test_the_weights_digest_is_exact_and_ignores_the_thread_count() -> None:
    """A float sum of the weights changes with the threads that reduce it; the digest must not,
    or a cache keyed by it (distillation, calibration) is lost when --threads changes."""
    model = toy_model("llama", seed=2, width=256)
    threads = torch.get_num_threads()
    try:
        digests = set()
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            digests.add(weights_digest(model))
    finally:
        torch.set_num_threads(threads)
    assert len(digests) == 1
    with torch.no_grad():
        w = next(model.parameters())
        w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(float("inf")))  # one ulp
    assert weights_digest(model) not in digests
