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
    """Replace the timing with fixed tables (a tree of 16 fastest), recording each calibration."""
    calls = []

    def fake_predict(lm, prompts, drafter, k, **kw):
        calls.append((drafter, k))
        return {b: 100.0 + (50.0 if b == 16 else b / 2) for b in range(1, calibrate.LARGEST + 1)}

    monkeypatch.setattr(calibrate, "predict_budgets", fake_predict)
    monkeypatch.setattr(
        calibrate, "measure_budgets", lambda lm, p, d, k, budgets, **kw: {b: 100.0 + b for b in budgets}
    )
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
    monkeypatch.setattr(calibrate, "measure_budgets", lambda lm, p, d, k, budgets, **kw: {0: 200.0, budgets[1]: 100.0})
    model = toy_model("qwen2", seed=4)
    ids = make_prompt(6, 512, seed=5)
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4))
    out = lm.generate(ids, 24, eos_token_id=NO_EOS, tree="auto")
    assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 24, eos_token_id=NO_EOS))
    assert max(out.stats.verified) <= 4  # the chain was chosen
    with pytest.raises(ValueError, match="tree must be a node budget >= 1, 'auto' or None"):
        lm.generate(ids, 4, tree="automatic")


def test_prediction_gains_the_path_within_the_budget_and_pays_t_of_the_tokens_scored() -> None:
    """Two calls: one accepted nodes 1, 3 and 9 of a 20-node tree, the other nothing. A budget of
    3 keeps nodes 1 and 3 of the first path; t(q) = q ms, each call took 2 ms beyond it."""
    t = {1: 1e-3, 4: 4e-3, 21: 21e-3}
    speeds = calibrate.predict([[1, 3, 9], []], [21, 21], [23e-3, 23e-3], t)
    assert set(speeds) == set(range(1, calibrate.LARGEST + 1))
    assert speeds[3] == pytest.approx(((1 + 2) + 1) / 2 / (2e-3 + 4e-3))
    assert speeds[9] == pytest.approx(((1 + 3) + 1) / 2 / (2e-3 + 10e-3))
    assert speeds[64] == pytest.approx(speeds[20])  # past the tree's 20 nodes a budget buys nothing


def test_real_calibration_predicts_every_budget_and_measures_the_best_against_the_chain(cache: Path) -> None:
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=3)
    result = calibrate.calibrate(lm, [make_prompt(4, 512)], "heads")
    assert set(map(int, result.predicted)) == set(range(1, calibrate.LARGEST + 1))
    assert all(s > 0 for s in result.predicted.values())
    best = max(result.predicted, key=result.predicted.get)
    assert set(result.measured) == {"0", best} and result.budget in (0, int(best))
    shared = calibrate.measure_budgets(lm, [make_prompt(4, 512)], "heads+ngram", 3, [0, 4], new_tokens=6)
    assert set(shared) == {4}  # shared drafters need a tree


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
