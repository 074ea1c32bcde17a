"""The decode plan: settings resolved and checked once, before any model call."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_prompt, tiny

from blockdecode import BlockwiseLM, NgramDrafter, ScriptedDrafter
from blockdecode.decoding.acceptance import parse_acceptance
from blockdecode.decoding.plan import DecodePlan, make_plan
from blockdecode.drafters.base import ChainDrafter
from blockdecode.drafters.heads import HeadsDrafter


@pytest.fixture
def lm() -> BlockwiseLM:
    return BlockwiseLM.from_base(tiny("llama"), k=4)


class Plain:
    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        return tokens[:, -1:].repeat(1, n)


class Counting:
    """Counts the base model's forward calls, which a bad setting must never reach; its hook leaves the
    model (often the shared `tiny` one) with the `with` block."""

    def __init__(self, model: torch.nn.Module):
        self.calls = 0
        self.model = model

    def __enter__(self) -> Counting:
        self.hook = self.model.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))
        return self

    def __exit__(self, *_) -> None:
        self.hook.remove()


def test_a_plan_resolved_twice_from_the_same_inputs_is_equal(lm: BlockwiseLM) -> None:
    for drafter, tree in (("heads", None), ("heads+ngram", 8), ("ngram", 3), ("heads-rescored", None)):
        first = make_plan(lm.base, drafter, 3, tree, "topk:2" if tree is None else None, [1, 2], lm=lm)
        assert first == make_plan(lm.base, drafter, 3, tree, "topk:2" if tree is None else None, [1, 2], lm=lm)
        assert hash(first) == hash(
            make_plan(lm.base, drafter, 3, tree, parse_acceptance("topk:2") if tree is None else None, [2, 1], lm=lm)
        )
    ngram_first = make_plan(lm.base, "heads+ngram", 4, 8, lm=lm)
    assert [type(d) for d in ngram_first.drafters] == [NgramDrafter, HeadsDrafter]  # n-gram fills a tree first
    assert ngram_first.drafter_name == "ngram+heads" and ngram_first.setting == "trees of 8"
    suffix_first = make_plan(lm.base, "heads+suffix", 4, 8, lm=lm)  # a lookup is cheap: asked before the heads
    assert [type(d).__name__ for d in suffix_first.drafters] == ["SuffixDrafter", "HeadsDrafter"]
    assert make_plan(lm.base, "heads", 4, lm=lm) != make_plan(lm.base, "heads", 3, lm=lm)
    assert lm.plan("heads", tree=None) == make_plan(lm.base, "heads", 4, lm=lm)
    script = ScriptedDrafter(torch.arange(10), 512)
    assert make_plan(lm.base, script, 2) == make_plan(lm.base, script, 2)  # the same object: the same plan
    plain = Plain()  # a drafter of the protocol alone is wrapped, its abilities declared
    assert make_plan(lm.base, plain, 2).drafters == (ChainDrafter(plain),)
    assert make_plan(lm.base, plain, 2) != make_plan(lm.base, Plain(), 2)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (dict(drafter="ngram", k=0), "k must be an integer >= 1"),
        (dict(drafter="heads", k=0), "heads' block size 4, got 0"),
        (dict(drafter="heads", k=5), "heads' block size 4"),
        (dict(drafter="heads", k=2, tree=0), "tree must be a node budget >= 1"),
        (dict(drafter="heads", k=2, tree="8"), "tree must be a node budget >= 1"),
        (dict(drafter="heads+ngram", k=2), "2 drafters need a tree"),
        (dict(drafter="bigram", k=2), "unknown drafter 'bigram'"),
        (dict(drafter="heads", k=2, acceptance="topk:0"), "topk:N"),
        (dict(drafter="heads", k=2, acceptance="min-block:3"), "more tokens per call than the block size"),
        (dict(drafter="heads", k=3, tree=4, acceptance="min-block:2"), "does not apply to a tree"),
        (dict(drafter="heads", k=2, eos_token_id="12"), "eos_token_id must be an integer"),
        (dict(drafter="heads", k=2, cache_implementation="paged"), "unknown cache implementation"),
        (dict(drafter=[], k=2), "no drafter given"),
        (dict(drafter=object(), k=2), "needs a propose"),
    ],
)
def test_a_bad_setting_fails_before_any_model_call(lm: BlockwiseLM, settings: dict, match: str) -> None:
    with Counting(lm.base) as counting:
        with pytest.raises((ValueError, TypeError), match=match):
            make_plan(lm.base, lm=lm, **settings)
        if "need a tree" not in match:  # under tree="auto" the drafters get a tree
            with pytest.raises((ValueError, TypeError), match=match):  # before anything is measured
                lm.generate(make_prompt(4, 512), 8, **{"tree": "auto", **settings})
    assert counting.calls == 0


def test_named_heads_need_a_blockwise_lm() -> None:
    with pytest.raises(ValueError, match="needs a BlockwiseLM's heads"):
        make_plan(tiny("llama"), "heads", 3)
    plan = make_plan(tiny("llama"), "ngram", 3, tree=4)
    assert isinstance(plan, DecodePlan) and plan.drafters == (NgramDrafter(),)


@pytest.mark.parametrize(
    "settings",
    [
        dict(do_sample=True, temperature=0.5),
        dict(drafter="ngram"),
        dict(k=2),
        dict(tree=4),
        dict(acceptance="topk:2"),
        dict(eos_token_id=[]),
        dict(cache_implementation="static"),
        dict(top_k=5),
        dict(top_p=0.9),
    ],
)
def test_a_setting_given_beside_a_plan_is_refused_by_name(settings: dict) -> None:
    """A plan replaces every decode setting: one given beside it would be dropped silently (a plan's greedy
    decode for do_sample=True), so it is refused, before the model is called."""
    lm = BlockwiseLM.from_base(tiny("llama"), k=4)
    plan = lm.plan("heads", tree=None)
    named = ", ".join(f"{name}={value!r}" for name, value in settings.items())
    with Counting(lm.base) as counting:
        with pytest.raises(
            ValueError, match=re.escape(f"plan= replaces every decode setting, so {named} would be ignored")
        ):
            lm.generate(make_prompt(4, 512), 8, plan=plan, **settings)
    assert counting.calls == 0
    defaults = dict(drafter="auto", tree="default", cache_implementation="dynamic", do_sample=False, k=None)
    assert lm.generate(make_prompt(4, 512), 8, plan=plan, **defaults).stats.new_tokens > 0  # defaults spelled out


def test_a_hand_built_plan_refuses_a_k_beyond_the_heads(lm: BlockwiseLM) -> None:
    """Checked with the plan, naming both ks, not mid-decode as a fault of the heads' proposals."""
    with pytest.raises(ValueError, match=r"^k must be between 1 and the heads' block size 4, got 30$"):
        DecodePlan((lm.drafter(),), 30)
    assert DecodePlan((lm.drafter(),), 4).k == 4 and DecodePlan((NgramDrafter(),), 30).k == 30
    assert DecodePlan((NgramDrafter(), lm.drafter()), 5, tree=8).k == 5  # a lookup guesses past the heads' k-1
