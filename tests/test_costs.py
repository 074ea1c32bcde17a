"""The machine's cost curve: measured once per base and machine, never stored with an impossible shape, and replaced
when a decode's own calls disprove it (issue 71)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_prompt

from blockdecode import BlockwiseLM
from blockdecode.core.toy import toy_model
from blockdecode.decoding import costs, stored
from blockdecode.decoding.ranking import CHECK_CALLS, Ranker, Ranking
from blockdecode.drafters.proposals import Scored, Source


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    stored._CACHE.clear()
    return tmp_path / "cache" / "blockdecode" / "calibration.json"


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every measurement of a cost curve, counted (one however many tries its shape took on a busy machine)."""
    calls = []
    real = costs.measure

    def counted(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(costs, "measure", counted)
    return calls


def looping(vocab: int = 512, period: int = 7, repeats: int = 6) -> torch.LongTensor:
    """A prompt that repeats itself: lookup drafters find proposals in it from the first call."""
    return (torch.arange(period) * 37 % (vocab - 2) + 2).repeat(repeats).view(1, -1)


def new_process() -> None:
    """What a new process starts from: the cache file on disk, nothing in memory."""
    stored._CACHE.clear()
    costs._RANKINGS.clear()
    costs._REMEASURED.clear()


def curve_entry(cache: Path) -> tuple[str, dict[int, float]]:
    [(key, entry)] = [(k, v) for k, v in json.loads(cache.read_text()).items() if k.startswith("cost|")]
    return key, {int(q): t for q, t in entry["cost"].items()}


def test_a_plain_model_measures_its_curve_once_whatever_its_heads_and_weights(cache: Path, timed: list) -> None:
    """A plain model gets fresh untrained heads at every load: the curve hangs on the base's shapes and the machine,
    so a second load, in another process, with other heads or other weights of the same shapes, reads it."""
    ids = looping()
    for seed in (1, 1, 2):
        new_process()
        lm = BlockwiseLM.from_base(toy_model("llama", seed=seed), k=4)
        lm.generate(ids, 8, eos_token_id=NO_EOS, drafter="ngram")
    assert len(timed) == 1
    new_process()
    wider = BlockwiseLM.from_base(toy_model("llama", seed=1, width=96), k=4)
    wider.generate(ids, 8, eos_token_id=NO_EOS, drafter="ngram")
    assert len(timed) == 2  # other shapes cost otherwise: measured anew


def test_an_absurd_cached_curve_is_replaced_and_the_next_decode_offers_candidates_again(
    cache: Path, timed: list, capsys: pytest.CaptureFixture
) -> None:
    """A curve timed on a busy machine (t(2) = 16 t(1)) once sized every tree to nothing for good: read again,
    its shape is impossible, so it is measured again and replaced, and the decode verifies proposals."""
    model = toy_model("llama", seed=3)
    ids = looping()
    BlockwiseLM.from_base(model, k=4).generate(ids, 8, eos_token_id=NO_EOS, drafter="ngram")
    key, curve = curve_entry(cache)
    poisoned = {str(q): curve[1] * (1 if q == 1 else 16) for q in curve}
    cache.write_text(json.dumps({key: {"key": key, "cost": poisoned}}))
    new_process()
    capsys.readouterr()
    out = BlockwiseLM.from_base(model, k=4).generate(ids, 24, eos_token_id=NO_EOS, drafter="ngram")
    err = capsys.readouterr().err
    assert f"{cache} entry for the cost curve t(2) = 16.00 t(1); measuring again" in err
    assert len(timed) >= 2 and not costs.insane(curve_entry(cache)[1])  # more where its calls disproved it again
    assert max(out.stats.verified) > 1 and out.stats.mean_block_size > 1
    assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 24, eos_token_id=NO_EOS))


def test_a_curve_the_decodes_own_calls_disprove_is_measured_again_mid_decode(
    cache: Path, timed: list, capsys: pytest.CaptureFixture
) -> None:
    """A curve of possible shape but fifty times too slow (timed while the machine was busy) is what the decode's
    calls disprove: after CHECK_CALLS calls it is measured again, replaced in the cache, and ranked with."""
    model = toy_model("llama", seed=4)
    ids = make_prompt(24, 512, seed=4)
    lm = BlockwiseLM.from_base(model, k=4)  # untrained heads: few proposals stand, so a call gains about a token
    lm.generate(ids, 8, eos_token_id=NO_EOS, drafter="heads")
    key, curve = curve_entry(cache)
    slow = {str(q): 50 * t for q, t in curve.items()}
    cache.write_text(json.dumps({key: {"key": key, "cost": slow}}))
    new_process()
    capsys.readouterr()
    out = lm.generate(ids, 4 * CHECK_CALLS, eos_token_id=NO_EOS, drafter="heads")
    err = capsys.readouterr().err
    assert "this decode's calls took" in err and "measuring it again" in err, err
    assert "the cost curve was measured again" in out.stats.note and len(timed) == 2
    replaced = json.loads(cache.read_text())[key]["cost"] != slow
    assert replaced or "not cached" in err  # kept where the new curve agrees with the calls (a quiet machine)
    assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 4 * CHECK_CALLS, eos_token_id=NO_EOS))


def test_a_curve_of_impossible_shape_is_measured_again_and_never_stored(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    tries = []

    def busy(model, context, points, reps, cache_implementation, quantile):
        tries.append(quantile)
        return {q: 1e-3 * (1 if q == 1 else 16) for q in points}

    monkeypatch.setattr(costs, "forward_cost", busy)
    curve = costs.cost_curve(toy_model("llama", seed=5), looping())
    assert len(tries) == costs.ATTEMPTS and not cache.exists()
    assert not costs.insane(curve)  # ranked with a curve brought within the possible
    assert "the cost curve measured here is off (t(2) = 16.00 t(1))" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("curve", "why"),
    [
        ({1: 1.0, 2: 1.1, 8: 1.5}, ""),
        ({1: 1.0, 2: 16.0}, "t(2) = 16.00 t(1)"),
        ({1: 1.0, 2: 1.0, 8: 0.5}, "t(8) = 0.50 t(1)"),
        ({1: 1.0, 2: -1.0}, "its times are not positive seconds"),
        ({1: 1.0, 2: 2.1, 4: 0.91, 8: 2.15}, "t(4) = 0.91 t(1), below a shorter call's 2.10"),  # timed while busy
    ],
)
def test_what_shape_a_cost_curve_may_have(curve: dict[int, float], why: str) -> None:
    assert costs.insane(curve) == why


def test_a_likely_candidate_is_verified_whatever_the_curve_and_an_unlikely_one_is_not() -> None:
    """A ranked tree never shrinks to nothing on a cost curve alone: where a proposal is likelier than STANDS to
    stand, it and the newest token are verified; where not, a steep curve leaves the newest token alone."""
    steep = {1: 1.0, 2: 16.0, 64: 1000.0}

    def tree_size(prior: float) -> int:
        ranker = Ranker(steep)
        return len(ranker.tree([Scored([5, 6, 7], [Source("ngram", ("any",), prior)] * 3)], 16))

    assert tree_size(0.9) == 1
    assert tree_size(0.3) == 0


def test_only_a_measured_curve_is_checked_by_the_calls_and_only_in_greedy_decoding() -> None:
    ranking = Ranking(((1, 1.0), (8, 1.0)))
    assert ranking.start().clocked is None  # a curve given by the caller is theirs
    measured = Ranking(((1, 1.0), (8, 1.0)), measured=True)
    ranker = measured.start()
    assert [ranker.clock(2, 1.0) for _ in range(CHECK_CALLS + 1)] == [None] * (CHECK_CALLS + 1)  # agrees
    ranker = measured.start()
    verdicts = [ranker.clock(2, 0.01) for _ in range(CHECK_CALLS + 1)]
    assert verdicts[:-1] == [None] * CHECK_CALLS and verdicts[-1] == pytest.approx(0.01)
    assr = Ranking(((1, 1.0), (8, 1.0)), drafting=(), measured=True).start()
    assert assr.clocked is None  # sampling: nothing timed decides, so a seed repeats


def test_a_seed_repeats_on_a_plain_model_in_another_process(tiny_base, tmp_path: Path) -> None:
    """A plain folder gets fresh heads at every load; its sampled decode still repeats its seed in a new process,
    since its cost curve is read from the cache, keyed by its shapes, not measured afresh."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "blockdecode.cli", "--threads", "1", "generate", "--model", str(tiny_base.dir),
               "--prompt", "alpha beta", "--sample", "--seed", "5", "--max-new-tokens", "24"]  # fmt: skip
    runs = [subprocess.run(command, env=env, capture_output=True, text=True, check=True) for _ in range(3)]
    assert runs[0].stdout == runs[1].stdout == runs[2].stdout
    entries = json.loads((tmp_path / "blockdecode" / "calibration.json").read_text())
    assert sum(key.startswith("cost|") for key in entries) == 1


def test_a_second_disproof_in_a_process_scales_the_curve_to_the_calls_without_timing_again(
    cache: Path, timed: list, capsys: pytest.CaptureFixture
) -> None:
    """A machine whose load comes and goes disproves its curve again and again: measuring a 0.5B model's curve
    takes seconds, so after once a process the curve is scaled to what the calls took, unstored."""
    model = toy_model("llama", seed=4)
    ids = make_prompt(24, 512, seed=4)
    lm = BlockwiseLM.from_base(model, k=4)  # untrained heads: about a token a call, so the check comes
    lm.generate(ids, 8, eos_token_id=NO_EOS, drafter="heads")
    key, curve = curve_entry(cache)
    new_process()
    for slower in (50, 0.01):  # the same process: the cached curve too slow, then too fast
        costs._RANKINGS.clear()
        stored.entries()[key] = {"key": key, "cost": {str(q): slower * t for q, t in curve.items()}}
        out = lm.generate(ids, 4 * CHECK_CALLS, eos_token_id=NO_EOS, drafter="heads")
        assert "the cost curve was measured again" in out.stats.note
        assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 4 * CHECK_CALLS, eos_token_id=NO_EOS))
    assert len(timed) == 2  # the first measurement and the one re-timing; the second disproof only scaled
    assert capsys.readouterr().err.count("measuring it again") == 1
