"""`tree="auto"`: the setting predicted fastest, cached per model and setting, never another's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_prompt, perturb_heads

from blockdecode import BlockwiseLM, NgramDrafter
from blockdecode.core.hf import weights_digest
from blockdecode.core.toy import toy_model
from blockdecode.decoding import calibrate, stored
from blockdecode.decoding.acceptance import parse_acceptance


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "blockdecode" / "calibration.json"


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace the measurements with fixed tables (a tree of 16 fastest), recording each prediction."""
    calls = []

    def fake_predict(stats, t, loop_tree, loop_chain):
        calls.append(stats)
        return {b: 100.0 + (50.0 if b == 16 else b / 2) for b in range(0, calibrate.LARGEST + 1)}

    monkeypatch.setattr(calibrate, "predict", fake_predict)
    monkeypatch.setattr(
        calibrate, "acceptance_statistics", lambda lm, p, spec, k, trees, rule: {"spec": str(spec), "rule": rule.spec}
    )
    monkeypatch.setattr(calibrate, "loop_seconds", lambda *a: 1e-3)
    monkeypatch.setattr(calibrate, "cost_curve", lambda base, context: {1: 1e-3})
    return calls


def test_measured_once_then_served_from_the_cache(cache: Path, measured: list) -> None:
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=4)
    prompts = [make_prompt(5, 512)]
    first = calibrate.calibrate(lm, prompts, "heads+ngram")
    assert first.budget == 16 and first.tree == 16 and first.drafter == "heads+ngram" and len(measured) == 1
    assert calibrate.calibrate(lm, prompts, "heads+ngram").budget == 16 and len(measured) == 1
    assert json.loads(cache.read_text())[first.key]["budget"] == 16
    calibrate.calibrate(lm, prompts, "heads+ngram", refresh=True)
    assert len(measured) == 2


def test_the_cache_is_read_once_per_process_and_bounded(
    cache: Path, measured: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=4)
    prompts = [make_prompt(5, 512)]
    calibrate.calibrate(lm, prompts, "heads")
    cache.write_text("{}")  # what is on disk is not read again in this process
    calibrate.calibrate(lm, prompts, "heads")
    assert len(measured) == 1
    monkeypatch.setattr(stored, "CACHE_ENTRIES", 3)
    for k in (1, 2, 3, 4):
        calibrate.calibrate(lm, prompts, "heads", k)
    kept = json.loads(cache.read_text())
    assert len(kept) == 3 and all(key.endswith(f"k={k}") for key, k in zip(kept, (2, 3, 4)))  # oldest dropped


def test_another_model_dtype_or_drafter_is_measured_anew(
    cache: Path, measured: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [make_prompt(5, 512)]
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=4)
    key = calibrate.calibrate(lm, prompts, "heads").key
    other = BlockwiseLM.from_base(toy_model("llama", seed=3), k=4)  # same shapes, other weights
    assert calibrate.calibrate(other, prompts, "heads").key != key
    assert calibrate.calibrate(lm, prompts, "ngram").key != key
    assert calibrate.calibrate(lm.to(torch.bfloat16), prompts, "heads").key != key
    assert len(measured) == 4
    stored._CACHE.clear()  # a new process
    cache.write_text("{not json")  # a damaged cache is measured again, never trusted
    calibrate.calibrate(lm, prompts, "heads")
    assert len(measured) == 5
    auto = calibrate.calibration_key(lm, "auto", 4)
    monkeypatch.setattr(calibrate, "CHOICES", (*calibrate.CHOICES, "heads-rescored"))
    assert calibrate.calibration_key(lm, "auto", 4) != auto  # "auto" chosen among other sources: measured anew


def test_auto_under_a_relaxed_rule_is_measured_under_it_and_cached_apart(
    cache: Path, measured: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47: `tree="auto"` under topk:2 measures what stands under topk:2, never the exact statistics a
    model ships, and keeps its choice under a key of its own, apart from exact's."""
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=4)
    prompts = [make_prompt(5, 512)]
    monkeypatch.setattr(calibrate, "shipped_statistics", lambda *a: pytest.fail("exact's shipped statistics read"))
    plan = lm.plan("heads", tree="auto", acceptance="topk:2", prompts=prompts)
    assert plan.tree == 16 and plan.acceptance.spec == "topk:2" and measured[-1]["rule"] == "topk:2"
    relaxed = calibrate.calibrate(lm, prompts, "heads", acceptance=parse_acceptance("topk:2"))
    assert len(measured) == 1 and "acceptance=topk:2" in relaxed.key  # served from the cache: the same rule
    assert calibrate.calibrate(lm, prompts, "heads", acceptance=parse_acceptance("topk:3")).key != relaxed.key
    values = [float(i % 7) for i in range(512)]
    maps = [parse_acceptance("distance:1", values=v) for v in (values, values[::-1])]
    assert len({calibrate.calibration_key(lm, "heads", 4, rule) for rule in maps}) == 2  # two value maps, two rules
    with pytest.raises(ValueError, match="min-block:2 forces a chain's first proposals"):
        calibrate.calibrate(lm, prompts, "heads", acceptance=parse_acceptance("min-block:2"))


def test_the_chain_can_win_and_auto_stays_exact(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        calibrate, "predict", lambda stats, t, lt, lc: {b: 200.0 if b == 0 else 100.0 for b in range(0, 65)}
    )
    model = toy_model("qwen2", seed=4)
    ids = make_prompt(6, 512, seed=5)
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4))
    out = lm.generate(ids, 24, eos_token_id=NO_EOS, drafter="heads", tree="auto")
    assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 24, eos_token_id=NO_EOS))
    assert max(out.stats.verified) <= 4  # the chain was chosen
    with pytest.raises(ValueError, match="tree must be a node budget >= 1, 'auto', 'expected' or None"):
        lm.generate(ids, 4, tree="automatic")


def test_prediction_gains_the_path_within_the_budget_and_pays_t_of_the_tokens_scored() -> None:
    """Two tree calls: one accepted nodes 1, 3 and 9 of a 20-node tree, the other nothing. A budget
    of 3 keeps nodes 1 and 3 of the first path; t(q) = q ms, each call takes 2 ms beyond it. The
    chain gained 3 and 1 tokens verifying 4 each, 1 ms beyond t(4)."""
    t = {1: 1e-3, 4: 4e-3, 21: 21e-3}
    stats = {"tree": {"paths": [[1, 3, 9], []], "verified": [21, 21]}, "chain": {"gained": [3, 1], "verified": [4, 4]}}
    speeds = calibrate.predict(stats, t, 2e-3, 1e-3)
    assert set(speeds) == set(range(0, calibrate.LARGEST + 1))
    assert speeds[0] == pytest.approx(2 / (1e-3 + 4e-3))
    assert speeds[3] == pytest.approx(((1 + 2) + 1) / 2 / (2e-3 + 4e-3))
    assert speeds[9] == pytest.approx(((1 + 3) + 1) / 2 / (2e-3 + 10e-3))
    assert speeds[64] == pytest.approx(speeds[20])  # past the tree's 20 nodes a budget buys nothing


def test_real_calibration_predicts_the_chain_and_every_budget(cache: Path) -> None:
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=3)
    result = calibrate.calibrate(lm, [make_prompt(4, 512)], "heads", show=False)
    assert set(result.predicted) == {"heads"}
    assert set(map(int, result.predicted["heads"])) == set(range(0, calibrate.LARGEST + 1))
    assert all(s > 0 for s in result.predicted["heads"].values())
    best = max(result.predicted["heads"], key=result.predicted["heads"].get)
    assert result.budget == int(best) and result.statistics == "measured"


def test_shipped_statistics_spare_the_decodes_and_match_the_measured(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Statistics recorded beside the model are used for its weights and k, and for no others."""
    lm = perturb_heads(BlockwiseLM.from_base(toy_model("llama", seed=2), k=3))
    lm.base_location = str(tmp_path)
    prompts = [make_prompt(8, 512, seed=s) for s in (1, 2)]
    recorded = calibrate.record_statistics(lm, prompts, tmp_path)
    assert (
        set(recorded) == set(calibrate.CHOICES)
        and "chain" not in recorded["heads+ngram"]
        or not (recorded["heads+ngram"]["chain"]["gained"])
    )
    measured = calibrate.acceptance_statistics(lm, prompts, "heads", 3, True)
    assert measured == recorded["heads"]  # the same decodes: machine-independent
    decoded = []
    monkeypatch.setattr(calibrate, "acceptance_statistics", lambda *a: decoded.append(a) or measured)
    result = calibrate.calibrate(lm, prompts, "auto", show=False)
    assert result.statistics == "shipped" and not decoded
    other = BlockwiseLM.from_base(toy_model("llama", seed=3), k=3)
    other.base_location = str(tmp_path)  # another model's statistics in its folder: not used
    calibrate.calibrate(other, prompts, "heads", show=False)
    assert decoded


def test_tree_auto_chooses_the_drafters_too_and_decoding_stays_exact(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """drafter="auto" with tree="auto": every source is predicted, chain and trees; the fastest (here
    n-gram trees of 8) is what generate() then uses."""
    best = {"heads": 100.0, "ngram": 300.0, "heads+ngram": 200.0}
    seen = []

    def fake_predict(stats, t, loop_tree, loop_chain):
        seen.append(stats["name"])
        return {b: best[stats["name"]] - abs(b - 8) for b in range(0, 65)}

    monkeypatch.setattr(calibrate, "acceptance_statistics", lambda lm, p, spec, k, trees, rule: {"name": spec})
    monkeypatch.setattr(calibrate, "predict", fake_predict)
    model = toy_model("llama", seed=6)
    ids = make_prompt(12, 512, seed=1)
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4))
    out = lm.generate(ids, 30, eos_token_id=NO_EOS, tree="auto")
    assert sorted(seen) == sorted(calibrate.CHOICES)
    assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 30, eos_token_id=NO_EOS))
    found = calibrate.calibrate(lm, [ids], "auto", 4)
    assert (found.drafter, found.tree) == ("ngram", 8)
    assert lm.plan(tree="auto", prompts=[ids]) == lm.plan(tree="auto", prompts=[ids])  # the same inputs: equal
    assert lm.plan(prompts=[ids]).ranking is not None and not seen[3:]  # the default ranks: nothing predicted


def test_a_drafter_object_decodes_as_given_unless_auto_is_asked_for(cache: Path) -> None:
    model = toy_model("llama", seed=6)
    ids = make_prompt(12, 512, seed=1)
    lm = BlockwiseLM.from_base(model, k=4)
    out = lm.generate(ids, 12, eos_token_id=NO_EOS, drafter=NgramDrafter())
    assert max(out.stats.verified) <= 4 and not cache.exists()  # its chain, nothing measured
    out = lm.generate(ids, 12, eos_token_id=NO_EOS, drafter=NgramDrafter(), tree="auto")
    assert cache.exists() and any("NgramDrafter" in key or "ngram" in key for key in json.loads(cache.read_text()))
    assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 12, eos_token_id=NO_EOS))


def test_a_context_too_short_to_calibrate_in_decodes_with_the_chain(cache: Path) -> None:
    model = toy_model("llama", seed=2, context=64)
    ids = make_prompt(10, 512)
    lm = BlockwiseLM.from_base(model, k=4)
    out = lm.generate(ids, 20, eos_token_id=NO_EOS, tree="auto")
    assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 20, eos_token_id=NO_EOS))
    assert max(out.stats.verified) <= 4 and not cache.exists()
    out = lm.generate(ids, 20, eos_token_id=NO_EOS)  # ranked by default: the cost curve fits the context too
    assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 20, eos_token_id=NO_EOS))


def test_a_bad_request_fails_before_any_calibration(cache: Path) -> None:
    lm = perturb_heads(BlockwiseLM.from_base(toy_model("llama", seed=2), k=4))  # trained: the default asks them
    for kwargs, match in (
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long), max_new_tokens=5), "the prompt is empty"),
        (dict(input_ids=make_prompt(4, 512), max_new_tokens=0), "max_new_tokens must be a positive integer"),
        (dict(input_ids=make_prompt(4, 512), max_new_tokens=5, eos_token_id="12"), "eos"),
        (dict(input_ids=make_prompt(4, 512), max_new_tokens=5, drafter="heads", k=9), "heads' block size 4"),
        (dict(input_ids=make_prompt(4, 512), max_new_tokens=5, acceptance="topk:0"), "topk:N"),
        (dict(input_ids=make_prompt(4, 512), max_new_tokens=5, cache_implementation="paged"), "cache implementation"),
        (dict(input_ids=make_prompt(4, 512), max_new_tokens=5, drafter="bigram"), "unknown drafter"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            lm.generate(**kwargs)
    assert not cache.exists()


def test_the_fingerprint_follows_the_weights() -> None:
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=3)
    first = calibrate.fingerprint(lm)
    assert calibrate.fingerprint(lm) == first  # served from memory while nothing changed
    with torch.no_grad():
        next(lm.base.parameters()).add_(1.0)  # an in-place change, as training makes
    assert calibrate.fingerprint(lm) != first


def test_the_fingerprint_of_a_model_made_under_inference_mode_is_that_of_its_weights() -> None:
    """Inference tensors track no version: a model loaded or cast under torch.inference_mode is fingerprinted
    (and so calibrated) as the same weights made outside it, and a weight replaced is seen."""
    with torch.inference_mode():
        lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=3).to(torch.bfloat16)
    assert all(p.is_inference() for p in lm.parameters())
    same = BlockwiseLM.from_base(toy_model("llama", seed=2), k=3).to(torch.bfloat16)
    assert calibrate.fingerprint(lm) == calibrate.fingerprint(same)
    assert calibrate.calibration_key(lm, "heads", 3) == calibrate.calibration_key(same, "heads", 3)
    with torch.inference_mode():
        lm.base.lm_head.weight = torch.nn.Parameter(lm.base.lm_head.weight * 2)
    assert calibrate.fingerprint(lm) != calibrate.fingerprint(same)


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


def entry_for(lm: BlockwiseLM, k: int, **values) -> dict:
    """A cache holding one entry under the right key for `lm`'s heads at k, with `values` in it."""
    key = calibrate.calibration_key(lm, "heads", k)
    good = {"key": key, "drafter": "heads", "budget": 16, "predicted": {"heads": {"16": 150.0}}, "seconds": 1.0}
    return {key: {**good, "statistics": "measured", **values}}


DAMAGED = {
    "not UTF-8": lambda lm: b'{"\xff\xfe": 1}',
    "a list": lambda lm: b"[]",
    "null": lambda lm: b"null",
    "deeply nested": lambda lm: b"[" * 100_000 + b"]" * 100_000,
    "an unknown drafter and a negative budget": lambda lm: entry_for(lm, 4, budget=-5, drafter="nonsense"),
    "a budget as text": lambda lm: entry_for(lm, 4, budget="7"),
    "a budget past what a forward scores": lambda lm: entry_for(lm, 4, budget=100_000),
    "a chain for drafters that share a tree": lambda lm: entry_for(lm, 4, budget=0, drafter="heads+ngram"),
    "a bool budget": lambda lm: entry_for(lm, 4, budget=True),
    "predictions that are not numbers": lambda lm: entry_for(lm, 4, predicted={"heads": {"16": "fast"}}),
    "an entry that is a list": lambda lm: {calibrate.calibration_key(lm, "heads", 4): [1]},
}


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_cache_is_noted_once_naming_the_file_and_measured_again(
    damage: str, cache: Path, measured: list, capsys: pytest.CaptureFixture
) -> None:
    """Whatever the file holds, calibrate and generate decode: what is not a valid choice for this
    setting is measured again, with one line naming the file, and the file is whole again after."""
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=4)
    content = DAMAGED[damage](lm)
    cache.parent.mkdir(parents=True)
    cache.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    stored._CACHE.clear()  # a new process
    ids = make_prompt(5, 512)
    found = calibrate.calibrate(lm, [ids], "heads", show=False)
    assert (found.drafter, found.budget, len(measured)) == ("heads", 16, 1)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"blockdecode: {cache} ") and "measuring again" in err[0], err
    assert json.loads(cache.read_text())[found.key]["budget"] == 16
    stored._CACHE.clear()
    out = lm.generate(ids, 12, eos_token_id=NO_EOS, drafter="heads", tree="auto")
    assert_greedy_equal(lm.base, ids, out.sequences, hf_greedy(lm.base, ids, 12, eos_token_id=NO_EOS))
    assert len(measured) == 1 and not capsys.readouterr().err  # served from the repaired file


@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe", b"[]", b"null", b"[" * 100_000, b'{"k": 4, "signature": "abc", "sources": {}}'],
)
def test_damaged_shipped_statistics_are_noted_and_measured(
    content: bytes, cache: Path, measured: list, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=4)
    lm.base_location = str(tmp_path)
    (tmp_path / calibrate.STATISTICS).write_bytes(content)
    found = calibrate.calibrate(lm, [make_prompt(5, 512)], "heads", show=False)
    assert found.statistics == "measured" and found.budget == 16 and len(measured) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"blockdecode: {tmp_path / calibrate.STATISTICS} "), err


RACER = """
import sys, time
from pathlib import Path
import torch
from blockdecode import BlockwiseLM
from blockdecode.decoding import calibrate, stored
from blockdecode.core.toy import toy_model

k, ready = int(sys.argv[1]), Path(sys.argv[2])
calibrate.predict = lambda stats, t, lt, lc: {b: 100.0 + b for b in range(calibrate.LARGEST + 1)}
calibrate.acceptance_statistics = lambda *a: {}
calibrate.loop_seconds = lambda *a: 1e-3
calibrate.cost_curve = lambda *a, **kw: {1: 1e-3}
lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=4)
stored.entries()  # each reads the cache before either stores: the race of two `calibrate` runs
(ready / str(k)).touch()
while len(list(ready.iterdir())) < 2:
    time.sleep(0.02)
calibrate.calibrate(lm, [torch.randint(2, 512, (1, 5))], "heads", k, show=False)
"""


def test_two_calibrations_at_once_both_stay_in_the_cache(cache: Path, tmp_path: Path) -> None:
    """Two processes, k=3 and k=4, each holding the cache as it was before either stored: both
    choices are in the file after, with the entry already there."""
    import os
    import subprocess
    import sys

    lm = BlockwiseLM.from_base(toy_model("llama", seed=2), k=4)
    earlier = entry_for(lm, 2)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps(earlier))
    ready = tmp_path / "ready"
    ready.mkdir()
    threads = str(torch.get_num_threads())  # the keys name the threads: the racers run as this process does
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parents[1]), "OMP_NUM_THREADS": threads}
    root = Path(__file__).parents[1]
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(k), str(ready)], env=env, cwd=root) for k in (3, 4)]
    assert [p.wait(timeout=300) for p in racers] == [0, 0]
    kept = json.loads(cache.read_text())
    assert sorted(key[-3:] for key in kept) == ["k=2", "k=3", "k=4"]
    assert all(kept[calibrate.calibration_key(lm, "heads", k)]["drafter"] == "heads" for k in (3, 4))


def test_a_read_only_cache_still_decodes_and_warns_once(
    cache: Path, measured: list, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The cache folder is read-only: generate decodes greedy's output with what it measured, says
    once that the choice could not be stored, and keeps it for this process. Root writes through
    a read-only mode, so there the write fails as it would for anyone else."""
    import errno
    import os

    cache.parent.mkdir(parents=True)
    cache.parent.chmod(0o555)
    if os.geteuid() == 0:

        def read_only(path: Path, data: object) -> None:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        monkeypatch.setattr(stored, "write_json", read_only)
    try:
        model = toy_model("llama", seed=6)
        lm = BlockwiseLM.from_base(model, k=4)
        ids = make_prompt(8, 512, seed=2)
        for k in (3, 4, 4):
            out = lm.generate(ids, 12, eos_token_id=NO_EOS, drafter="heads", k=k, tree="auto")
            assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 12, eos_token_id=NO_EOS))
    finally:
        cache.parent.chmod(0o755)
    assert len(measured) == 2 and not cache.exists()  # k=4 measured once, then kept in memory
    warnings = [line for line in capsys.readouterr().err.splitlines() if "cannot be written" in line]
    assert len(warnings) == 1 and str(cache) in warnings[0] and "decoding with this choice anyway" in warnings[0]


def test_calibrate_in_a_context_too_short_says_the_chain_is_used_and_caches_nothing(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture
) -> None:
    from blockdecode.cli import main
    from blockdecode.pretraining.corpus import train_tokenizer

    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n" * 40], vocab_size=300)
    model = toy_model("llama", vocab=len(tokenizer), context=64)
    BlockwiseLM.from_base(model, k=4).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    main(["calibrate", "--model", str(tmp_path / "m"), "--dtype", "fp32"])
    out, err = capsys.readouterr()
    assert "cached in" not in out + err and not cache.exists()
    assert "--tree auto decodes with heads, the chain: the model's context of 64 tokens is too short" in out
    ids = make_prompt(10, len(tokenizer))
    lm = BlockwiseLM.from_base(model, k=4)
    out = lm.generate(ids, 20, eos_token_id=NO_EOS, drafter="heads+ngram")  # shared drafters: an unmeasured tree
    assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 20, eos_token_id=NO_EOS))
