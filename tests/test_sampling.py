"""Sampling: exact in distribution against transformers' own sampling, greedy at top_k=1, seeded runs,
the tree fallback, and the settings refused.

The distribution tests compare the joint law of the first three sampled tokens of a tiny model (a
vocabulary of 8) with transformers' batched sampling under the same settings, by a chi-square test
of homogeneity; the same test must reject acceptance rules that are subtly wrong, or it proves
nothing."""

from __future__ import annotations

import functools
import importlib
import os
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import NO_EOS, hf_greedy, make_prompt, perturb_heads, tiny, vocab_size
from transformers import GenerationConfig

from blockdecode import BaseDrafter, BlockwiseLM, NgramDrafter, blockwise_generate, decode, make_plan
from blockdecode.core.toy import toy_model
from blockdecode.decoding.calibrate import calibrate
from blockdecode.decoding.ranking import Ranking
from blockdecode.decoding.sampling import DEFAULTS, Sampling, residual, sampling_settings, speculative_sample

PROMPT = torch.tensor([[3, 5, 2, 7]])
SHOWN = 3  # sampled tokens compared: the first comes from the prefill, the next two from the drafts
SETTINGS = {"t0.7": dict(temperature=0.7), "t1.3-k5-p0.8": dict(temperature=1.3, top_k=5, top_p=0.8)}
# Tokens decoded per run (k=3): 3 puts one proposal and the bonus token after it in view, 4 a chain of
# two proposals (the bonus falls beyond the tokens compared).
BUDGET = {"t0.7": SHOWN, "t1.3-k5-p0.8": SHOWN + 1}
RUNS = 600  # blockdecode samples per case: each costs a few forwards of the tiny model
REFERENCE = 50_000  # transformers' samples, one batched generate


def small() -> torch.nn.Module:
    return tiny("llama", vocab=8, width=32, layers=1)


class GreedyTable(BaseDrafter):
    """Often right: proposes the model's argmax after each context it was shown (the prompt and up to
    SHOWN tokens), looked up in a table made by batched forwards."""

    def __init__(self, model: torch.nn.Module, prompt: torch.LongTensor):
        vocab, self.best = vocab_size(model), {}
        contexts = [prompt[0].tolist()]
        with torch.inference_mode():
            for _ in range(SHOWN + 1):
                argmax = model(torch.tensor(contexts)).logits[:, -1].argmax(-1).tolist()
                self.best |= {tuple(c): t for c, t in zip(contexts, argmax)}
                contexts = [[*c, t] for c in contexts for t in range(vocab)]

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        seq = tokens[0].tolist()
        for _ in range(n):
            seq.append(self.best.get(tuple(seq), 2))
        return torch.tensor([seq[len(seq) - n :]])


class RandomDrafter(BaseDrafter):
    """Often wrong: uniform guesses, from a generator of its own."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, torch.Generator().manual_seed(seed)

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        return torch.randint(self.vocab, (1, n), generator=self.rng)


DRAFTERS = {"greedy-table": lambda m: GreedyTable(m, PROMPT), "random": lambda m: RandomDrafter(vocab_size(m))}


@functools.cache
def reference(setting: str) -> Counter:
    """transformers' sampling: the first SHOWN new tokens of REFERENCE rows (pad 1 after an EOS)."""
    model = small()
    torch.manual_seed(0)
    ids = PROMPT.expand(REFERENCE, -1)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=SHOWN, **SETTINGS[setting]
        )
    return Counter(map(tuple, out[:, PROMPT.shape[1] :].tolist()))


def ours(setting: str, drafter: str, runs: int = RUNS, seed: int = 0, ranking: Ranking | None = None) -> Counter:
    """blockdecode's sampling, k=3, the first SHOWN new tokens of `runs` runs (pad 1 after an EOS); with
    `ranking`, each call's chain as long as the ranking chooses."""
    model = small()
    sampling = sampling_settings(model, True, **SETTINGS[setting])
    plan = make_plan(model, DRAFTERS[drafter](model), k=3, sampling=sampling, ranking=ranking)
    generator, samples = torch.Generator().manual_seed(seed), Counter()
    for _ in range(runs):
        new = decode(model, PROMPT, BUDGET[setting], plan, generator=generator).sequences[0, PROMPT.shape[1] :].tolist()
        samples[tuple((new + [1] * SHOWN)[:SHOWN])] += 1  # as transformers pads a finished row
    return samples


def homogeneity(a: Counter, b: Counter, least: float = 5.0) -> float:
    """The p-value of a chi-square test that samples `a` and `b` come from one distribution; cells
    where `a` expects fewer than `least` counts (by `b`'s frequencies) are pooled into one."""
    na, nb = sum(a.values()), sum(b.values())
    big = [c for c in b if b[c] * na / nb >= least]
    rest = (na - sum(a[c] for c in big), nb - sum(b[c] for c in big))
    cells = [(a[c], b[c]) for c in big] + ([rest] if sum(rest) else [])
    ra, rb = (nb / na) ** 0.5, (na / nb) ** 0.5
    stat = sum((x * ra - y * rb) ** 2 / (x + y) for x, y in cells if x + y)
    return float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampling_matches_transformers_in_distribution(setting: str, drafter: str) -> None:
    """Not rejected at p < 0.001 (the seeds are fixed, so the outcome is too): the wrong rules below
    score below 1e-6 on half as many runs."""
    assert homogeneity(ours(setting, drafter), reference(setting)) > 1e-3


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_a_ranked_chain_samples_as_transformers_does(drafter: str) -> None:
    """A chain whose length follows what stood (a node costs a fifth of a call: the random drafter's
    chains shrink, the table's grow) samples the same distribution."""
    steep = Ranking(((1, 1.0), (2, 1.2), (64, 13.6)))
    setting = "t1.3-k5-p0.8"
    assert homogeneity(ours(setting, drafter, ranking=steep), reference(setting)) > 1e-3


def always_accept(probs, draft, q, generator=None):
    """Every proposal kept, and the bonus token drawn after them."""
    kept, _ = speculative_sample(probs, draft, q, generator)
    return torch.ones_like(kept), torch.multinomial(probs[-1], 1, generator=generator)[0]


def redraw_from_p(probs, draft, q, generator=None):
    """A rejected position drawn from p itself instead of the residual: the proposal counts twice."""
    kept, _ = speculative_sample(probs, draft, q, generator)
    stop = torch.cat([kept, kept.new_zeros(1)]).to(torch.uint8).argmin()
    return kept, torch.multinomial(probs[stop], 1, generator=generator)[0]


def bonus_from_the_parent(probs, draft, q, generator=None):
    """After a chain kept whole, the bonus token drawn from the last proposal's distribution, not its own."""
    kept, after = speculative_sample(probs, draft, q, generator)
    if not len(draft) or not kept.all():  # the prefill, or a rejection: drawn where it should be
        return kept, after
    return kept, torch.multinomial(probs[-2], 1, generator=generator)[0]


def judged_by_the_first(probs, draft, q, generator=None):
    """Every proposal judged by the distribution at the newest token, not its own position's."""
    return speculative_sample(probs[:1].expand_as(probs), draft, q, generator)


@pytest.mark.parametrize(
    "wrong, setting",
    [
        (always_accept, "t1.3-k5-p0.8"),
        (redraw_from_p, "t1.3-k5-p0.8"),
        (bonus_from_the_parent, "t0.7"),  # the bonus token in view
        (judged_by_the_first, "t1.3-k5-p0.8"),  # two proposals deep
    ],
)
def test_the_distribution_test_rejects_a_wrong_acceptance(wrong, setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each slip of the acceptance step, on the drafter that is often right, fails the test above."""
    loop = importlib.import_module("blockdecode.decoding.loop")  # the module, not the function the package exports
    monkeypatch.setattr(loop, "speculative_sample", wrong)
    assert homogeneity(ours(setting, "greedy-table", runs=RUNS // 2), reference(setting)) < 1e-6


def test_residual_of_a_certain_guess_is_p_without_it() -> None:
    p = torch.tensor([0.1, 0.6, 0.3, 0.0])
    q = torch.nn.functional.one_hot(torch.tensor(1), 4).float()
    assert torch.allclose(residual(p, q), torch.tensor([0.25, 0.0, 0.75, 0.0]))


def test_residual_of_a_spread_guess() -> None:
    p, q = torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.2, 0.5, 0.1, 0.2])
    assert torch.allclose(residual(p, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))
    assert torch.equal(residual(p, p), p)  # nothing is ever rejected: any distribution will do


def test_acceptance_and_residual_together_give_p() -> None:
    """The identity speculative sampling rests on, exactly: q(y) min(1, p(y)/q(y)) + P(reject) r(y) = p(y)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        p, q = torch.rand(2, 6, generator=gen).softmax(-1) * torch.tensor([1, 1, 1, 1, 1, 0.0])
        p, q = p / p.sum(), q / q.sum()
        kept = q * torch.minimum(torch.ones(6), p / q.clamp(min=1e-30))
        assert torch.allclose(kept + (1 - kept.sum()) * residual(p, q), p, atol=1e-6)


def test_draw_follows_each_rows_distribution_and_never_draws_a_token_without_mass(monkeypatch) -> None:
    """The inverse of the running sum, one uniform a row: the frequencies follow p, and the leading and trailing
    tokens of no mass (top-k's, top-p's) are never drawn, even at a uniform of 0 or one that rounds up to 1."""
    from blockdecode.decoding.sampling import draw

    p = torch.tensor([[0.0, 0.1, 0.0, 0.2, 0.3, 0.4, 0.0], [0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]])
    n, gen = 100_000, torch.Generator().manual_seed(0)
    out = draw(p.repeat(n, 1), gen).view(n, 2)
    for row in range(2):
        assert (out[:, row].bincount(minlength=7) / n - p[row]).abs().max() < 0.006  # about 5 standard errors
    for edge in (0.0, 1.0):
        monkeypatch.setattr(torch, "rand", lambda *shape, edge=edge, **kw: torch.full((2, 1), edge, dtype=kw["dtype"]))
        assert draw(p).tolist() == ([1, 3] if edge == 0.0 else [5, 4])


@pytest.mark.parametrize(
    "q", [[0.0, 1.0, 0.0, 0.0], [0.4, 0.1, 0.1, 0.4], None], ids=["one-hot", "spread", "certain (q=None)"]
)
def test_speculative_sample_draws_from_p(q: list[float] | None) -> None:
    """30,000 proposals from q, each kept or replaced: the tokens that come out follow p. q=None: every proposal
    the same certain guess, as a drafter's (token 1 here), without a one-hot q built."""
    n, gen = 30_000, torch.Generator().manual_seed(0)
    p, given = torch.tensor([0.1, 0.2, 0.3, 0.4]), q
    q = torch.tensor(q if q is not None else [0.0, 1.0, 0.0, 0.0])
    draft = torch.multinomial(q, n, replacement=True, generator=gen)
    out, kept = [], 0
    for x in draft.view(-1, 1):
        stands, after = speculative_sample(p.expand(2, -1), x, None if given is None else q.expand(1, -1), gen)
        out.append(x.item() if stands.item() else after.item())
        kept += stands.item()
    assert (torch.tensor(out).bincount(minlength=4) / n - p).abs().max() < 0.012  # about 5 standard errors
    assert kept / n == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.012)


def test_only_the_token_after_what_stands_is_drawn() -> None:
    """A chain stops at its first rejection: the token there comes from that position's residual, a chain kept
    whole gets its bonus from the distribution after it, and the rows past a rejection are never read."""
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    seen = set()
    for seed in range(200):
        kept, after = speculative_sample(probs, torch.tensor([1, 3]), None, torch.Generator().manual_seed(seed))
        if not kept[0]:
            assert after.item() == 2  # p at the newest token without the guess 1
        else:
            assert kept[1] and after.item() == 0  # p(3) = 1 after it stands, and the bonus is certain
        seen.add(kept[0].item())
    assert seen == {True, False}
    unread = torch.cat([probs[:1], torch.full((1, 4), torch.nan)])  # the guess 0 has no mass: row 1 is never read
    kept, after = speculative_sample(unread, torch.tensor([0]), None, torch.Generator())
    assert not kept[0] and after.item() in (1, 2)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_top_k_1_is_greedy(arch: str) -> None:
    """One token left at each position: sampling is greedy decoding, whatever the temperature."""
    model = tiny(arch)
    ids = make_prompt(5, vocab_size(model))
    ref = hf_greedy(model, ids, 24, eos_token_id=NO_EOS)
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4))
    for drafter in ("heads", NgramDrafter()):
        out = lm.generate(ids, 24, drafter=drafter, eos_token_id=NO_EOS, do_sample=True, temperature=0.3, top_k=1)
        assert torch.equal(out.sequences, ref)
        assert out.stats.sampling and not out.stats.exact


def test_a_seed_gives_the_same_tokens() -> None:
    model = tiny("llama")
    lm, ids = BlockwiseLM.from_base(model, k=4), make_prompt(5, vocab_size(model))

    def sample(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return lm.generate(ids, 20, drafter=NgramDrafter(), eos_token_id=NO_EOS, do_sample=True, generator=gen)

    runs = [sample(seed).sequences[0].tolist() for seed in (0, 0, 1, 2)]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs}) == 3


def test_a_ranked_chain_drops_its_proposals_where_drafting_does_not_pay() -> None:
    """Sampling with tree="expected": where no proposal pays for its share of the call, each call is one
    token's, as `transformers`' own sampling is."""
    model = small()
    steep = Ranking(((1, 1.0), (2, 1.5), (64, 32.5)))  # a proposal costs half a call: a random guess never pays
    sampling = sampling_settings(model, True, **SETTINGS["t0.7"])
    plan = make_plan(model, RandomDrafter(vocab_size(model)), 3, eos_token_id=NO_EOS, sampling=sampling, ranking=steep)
    out = decode(model, PROMPT, 40, plan, generator=torch.Generator().manual_seed(0))
    assert out.stats.verified[-10:] == [1] * 10  # the newest token alone: one-token steps


def test_a_tree_under_sampling_decodes_a_chain_and_says_so() -> None:
    model = tiny("llama")
    lm, ids = BlockwiseLM.from_base(model, k=4), make_prompt(5, vocab_size(model))
    with pytest.warns(UserWarning, match="sampling verifies one chain.*not a tree"):
        plan = lm.plan("heads+ngram", tree=8, do_sample=True)
    assert plan.tree is None and plan.drafter_name == "ngram"
    out = lm.generate(ids, 12, plan=plan, generator=torch.Generator().manual_seed(0))
    assert "not a tree" in out.stats.note and out.stats.to_dict()["note"] == out.stats.note
    assert all(len(nodes) == 0 or nodes == list(range(1, len(nodes) + 1)) for nodes in out.stats.accepted_nodes)


def test_auto_under_sampling_is_the_calibrations_fastest_chain_without_a_warning(
    recwarn: pytest.WarningsRecorder,
) -> None:
    lm = BlockwiseLM.from_base(tiny("llama"), k=4)
    lm.heads_trained = True  # else "auto" is suffix lookup alone, with nothing to calibrate
    prompts = [make_prompt(6, vocab_size(lm.base))]
    plan = lm.plan(tree="auto", do_sample=True, temperature=0.7, prompts=prompts)
    fastest = calibrate(lm, prompts, "auto", 4).best_chain()
    assert (plan.drafter_name, plan.tree, plan.note) == (fastest, None, "")
    assert not [w for w in recwarn if "chain" in str(w.message)]
    with pytest.raises(ValueError, match="measures this machine on prompts, and the model ships none"):
        lm.plan(tree="auto", do_sample=True)
    assert lm.plan("auto", tree=None, do_sample=True).drafter_name == "heads"


def test_stats_say_the_output_is_sampled() -> None:
    model = tiny("llama")
    lm, ids = BlockwiseLM.from_base(model, k=4), make_prompt(5, vocab_size(model))
    stats = lm.generate(ids, 8, tree=None, do_sample=True, temperature=0.7, top_p=0.9).stats
    assert stats.sampling == "temperature=0.7, top_k=50, top_p=0.9"
    assert stats.acceptance == "exact" and not stats.exact
    assert stats.to_dict()["sampling"] == stats.sampling and not stats.to_dict()["exact"]
    assert lm.generate(ids, 8, tree=None).stats.exact


def test_settings_default_to_the_generation_configs_then_transformers() -> None:
    defaults = GenerationConfig._get_default_generation_params()
    assert DEFAULTS == {name: defaults[name] for name in DEFAULTS}
    model = toy_model("llama", vocab=64)
    assert sampling_settings(model, True) == Sampling(1.0, 50, 1.0)
    model.generation_config.temperature, model.generation_config.top_p = 0.6, 0.9
    assert sampling_settings(model, True) == Sampling(0.6, 50, 0.9)
    assert sampling_settings(model, True, temperature=1.5, top_k=0) == Sampling(1.5, 0, 0.9)
    assert sampling_settings(model, False) is None


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(temperature=0.0), "temperature must be a number > 0"),
        (dict(temperature=-1.0), "temperature must be a number > 0"),
        (dict(temperature=float("nan")), "temperature must be a number > 0"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(top_k=2.5), "top_k must be an integer >= 0"),
        (dict(top_k=True), "top_k must be an integer >= 0"),
        (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
        (dict(do_sample=False, temperature=0.7), "temperature=0.7 applies only when sampling"),
        (dict(acceptance="topk:2"), "approximate and has no exact meaning under sampling"),
        (dict(drafter="heads+ngram"), "2 drafters share a tree, and sampling verifies one chain: pass one drafter"),
    ],
)
def test_bad_settings_are_named(settings: dict, match: str) -> None:
    model = tiny("llama")
    lm, ids = BlockwiseLM.from_base(model, k=4), make_prompt(5, vocab_size(model))
    with pytest.raises(ValueError, match=match):
        lm.generate(ids, 8, tree=None, **{"do_sample": True, **settings})


def test_a_generation_config_warper_not_modelled_is_refused() -> None:
    model = toy_model("llama", vocab=64)
    model.generation_config.min_p = 0.1
    with pytest.raises(ValueError, match="min_p=0.1.*model.generation_config.min_p = None"):
        BlockwiseLM.from_base(model, k=4).plan("heads", tree=None, do_sample=True)


@pytest.mark.parametrize(
    "generator, error, match",
    [
        (3, TypeError, "generator must be a torch.Generator \\(or None\\), got int"),
        (np.random.default_rng(0), TypeError, "generator must be a torch.Generator \\(or None\\), got Generator"),
        ("0", TypeError, "got str"),
    ],
)
def test_a_generator_that_is_not_one_is_refused_before_the_model_is_called(generator, error, match) -> None:
    model = toy_model("llama")
    lm, ids = BlockwiseLM.from_base(model, k=4), make_prompt(5, vocab_size(model))
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    plan = make_plan(model, NgramDrafter(), 4, sampling=Sampling())
    for run in (
        lambda: lm.generate(ids, 8, drafter="ngram", do_sample=True, generator=generator),
        lambda: lm.generate(ids, 8, generator=generator),  # greedy, tree="auto": before calibration runs the model
        lambda: blockwise_generate(model, ids, 8, NgramDrafter(), 4, tree=4, do_sample=True, generator=generator),
        lambda: decode(model, ids, 8, plan, generator=generator),
    ):
        with pytest.raises(error, match=match):
            run()
    assert not calls


def test_a_generator_on_another_device_than_the_models_is_refused() -> None:
    from blockdecode.decoding.sampling import check_generator

    check_generator(None, torch.device("cpu"))
    check_generator(torch.Generator(), torch.device("cpu"))
    with pytest.raises(
        ValueError, match=r"generator is on cpu, the model on cuda:0: .*torch.Generator\(device='cuda:0'\)"
    ):
        check_generator(torch.Generator(), torch.device("cuda", 0))


def test_a_seed_repeats_the_default_ranked_chain_in_another_process(tmp_path) -> None:
    """Sampling by default ranks a chain from the cost curve and the heads' cost cached with the calibration: no
    timing of its own process decides what it drafts or verifies, so a seed gives the same tokens in a second
    process."""
    import subprocess
    import sys

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "blockdecode.cli", "--threads", "1", "generate", "--prompt", "def add(a, b):",
               "--sample", "--seed", "3", "--max-new-tokens", "32"]  # fmt: skip
    runs = [subprocess.run(command, env=env, capture_output=True, text=True, check=True) for _ in range(2)]
    assert "ranked chain" in runs[0].stderr and "--seed 3" in runs[0].stderr
    assert runs[0].stdout == runs[1].stdout


def test_a_certain_guess_the_model_is_sure_of_always_stands_and_its_fallback_is_still_a_token() -> None:
    """p(x) = 1: nothing is left beside x, so the row a rejection would draw from is p itself, never empty."""
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    for seed in range(20):
        kept, after = speculative_sample(probs, torch.tensor([1]), None, torch.Generator().manual_seed(seed))
        assert kept.tolist() == [True] and 0 <= after.item() < 3
    alone = torch.tensor([[0.0, 0.5, 0.0], [0.2, 0.3, 0.5]])  # x holds all the row's mass, yet a rounding can reject it
    rejected = 0
    for seed in range(20):
        kept, after = speculative_sample(alone, torch.tensor([1]), None, torch.Generator().manual_seed(seed))
        rejected += not kept[0]
        assert after.item() == 1 if not kept[0] else 0 <= after.item() < 3
    assert rejected
