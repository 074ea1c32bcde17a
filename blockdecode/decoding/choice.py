"""Which drafters and tree a decode uses when it is not told exactly: `drafter="auto"` and `tree="default"`,
`"expected"` (each call's candidates ranked by their chance to stand) or `"auto"` (the calibrated choice),
resolved for one model into a `DecodePlan`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from blockdecode.core.hf import check_loaded
from blockdecode.decoding import ranking
from blockdecode.decoding.acceptance import Acceptance, parse_acceptance
from blockdecode.decoding.adapter import takes_tree_masks
from blockdecode.decoding.calibrate import calibrate
from blockdecode.decoding.costs import heads_cost, model_ranking
from blockdecode.decoding.plan import DecodePlan, block_size, check_settings, make_plan, max_tree
from blockdecode.decoding.sampling import sampling_settings
from blockdecode.drafters.base import Drafter
from blockdecode.drafters.registry import LOOKUPS, drafter_names

DEFAULT_DRAFTERS = "heads+ngram"
"""What drafter="auto" decodes with in ranked trees and chains (tree="expected", the default), unless the model
names its own (`BlockwiseLM.default_drafters`, saved with drafters measured on it: benchmarks/real.py)."""

LOOKUP_DEFAULT = "suffix"
"""drafter="auto" where the heads are untrained (a plain transformers model, a GGUF) and no EAGLE-3 drafter is
attached: suffix lookup alone. Untrained heads rarely guess right, and on a large vocabulary each guess scores its
rows."""

LOOKUP_DEPTH = 16
"""The block a plain model is loaded with (`BlockwiseLM.from_pretrained`): a call of 16 tokens costs about what one
does on a 270M model with a 262k vocabulary in bf16, and long lookup matches are common (benchmarks/real.py). Also
the block of a ranked default's chains (sampling, a batch) whose drafters hold a lookup, when k is not given."""

TREE_DEPTH = 32
"""How deep a lookup drafts in the ranked default's greedy trees, when k is not given (the heads their own k-1):
each call's tree keeps only the depth its chances pay for, so a loop or a long match is taken 31 tokens a call
where 16 stop at 15 (by median 1.07x / 1.05x the default at 16 on unseen code, 64 / 300-token prompts; on Gemma 3
270M, whose positions cost 262k rows each, 0.99x on code and 1.09x on prose: docs/results.md). Under
sampling a chain this deep ran slower (1.48x against 1.58x `transformers`' sampling at 0.7): chains keep
`LOOKUP_DEPTH`."""


def default_drafters(lm) -> str:
    """The drafters drafter="auto" ranks on `lm`: suffix lookup alone where nothing trained drafts, else the model's
    own measured choice or `DEFAULT_DRAFTERS`."""
    if not lm.heads_trained and lm.eagle3 is None and lm.dflash is None:
        return LOOKUP_DEFAULT
    return lm.default_drafters or DEFAULT_DRAFTERS


def reading_corpus(lm) -> tuple[str, str]:
    """The default's drafters when a corpus is given, which suffix lookup alone reads: with suffix lookup added where
    they hold none; and the note that says so ("" where nothing was added)."""
    names = default_drafters(lm)
    if "suffix" in names.split("+"):
        return names, ""
    return f"{names}+suffix", f"corpus= is read by suffix lookup, which joins the default's drafters: {names}+suffix"


def choose_plan(
    lm,
    drafter: str | Drafter | Sequence[Drafter] | None = "auto",
    k: int | None = None,
    tree: int | str | None = "default",
    acceptance: str | Acceptance | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    cache_implementation: str = "dynamic",
    prompts: Sequence[torch.LongTensor] = (),
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    rows: int = 1,
    corpus: bool = False,
) -> DecodePlan:
    """`BlockwiseLM.plan`: every setting of a decode on `lm`, resolved and checked once (see
    `BlockwiseLM.generate` for their meaning). `corpus`: the decode is given one, which suffix lookup alone
    reads: the default's drafters take it in (`reading_corpus`), as the plan's note says."""
    note = ""
    if corpus and drafter in ("auto", None):
        drafter, note = reading_corpus(lm)
    settings = (acceptance, eos_token_id, cache_implementation, prompts, do_sample, temperature, top_k, top_p, rows)
    plan = _resolved(lm, drafter, k, tree, *settings)
    return replace(plan, note="; ".join(filter(None, [plan.note, note])))


def _resolved(lm, drafter, k, tree, acceptance, eos_token_id, cache_implementation, prompts, do_sample, temperature,
              top_k, top_p, rows) -> DecodePlan:  # fmt: skip
    """choose_plan's settings resolved into a plan.

    `drafter="auto"` with `tree="auto"` takes the drafters and budget predicted fastest for this
    model, dtype and machine (`blockdecode.decoding.calibrate`: about a second the first time, then cached;
    `prompts` are what it times on, by default the model's own: `lm.prompts`); "auto" with any other
    tree is the heads. `tree="default"` is "expected" for named drafters (each call's candidates ranked
    by their chance to stand under the acceptance rule decoded with: `decoding.choice`; under sampling, a chain
    ranked so, sized by the cost curve cached with the calibration and asking every drafter, so that a seed
    repeats its run in another process), but "auto" under min-block:L, which forces a chain's first proposals
    (there: the heads' chain); it is the drafter's own chain for a drafter object. `tree="auto"` calibrates
    under the acceptance rule decoded with. With `tree="auto"`, sampling verifies one chain a call, and so does
    each row of a batch (`rows` > 1): there "auto" is the drafter whose chain the calibration predicts fastest
    (it measures greedy's acceptance, which a draw at a low temperature mostly follows). Every setting is checked
    before anything is measured."""
    if drafter in ("auto", None) and default_drafters(lm) == LOOKUP_DEFAULT:
        drafter = LOOKUP_DEFAULT
    given = k is not None
    if k is None:  # the heads' block, or the depth the EAGLE-3 drafter was trained to draft when it drafts alone
        k = lm.eagle3.config.speculative_tokens + 1 if drafter == "eagle3" and lm.eagle3 is not None else lm.k
    drafter = "auto" if drafter is None else drafter
    prompts = list(prompts) or [ids.to(lm.base.device) for ids in lm.prompts]  # the folder's prompts.json
    sampling = sampling_settings(lm.base, do_sample, temperature, top_k, top_p)
    if tree == "default":  # ranked each call: a ranking learns what stands under any rule but min-block
        ranked = parse_acceptance(acceptance).rule != "min-block"
        tree = ("expected" if ranked else "auto") if isinstance(drafter, str) else None
    if tree == "expected":  # every drafter's candidates ranked by their chance to stand, the size chosen each call
        settings = (acceptance, eos_token_id, cache_implementation)
        return ranked_plan(lm, drafter, k, *settings, prompts, sampling, rows, deeper=not given)
    if isinstance(tree, str) and tree != "auto":
        raise ValueError(f"tree must be a node budget >= 1, 'auto', 'expected' or None, got {tree!r}")
    if tree == "auto" and parse_acceptance(acceptance).rule == "min-block":
        tree = None  # min-block forces a chain's first proposals
    if tree == "auto" or drafter == "auto":
        uses_heads = drafter == "auto" or (isinstance(drafter, str) and "heads" in drafter)
        k = block_size(k, lm.k if uses_heads else None)
        check_settings(lm.base, k, None, acceptance, eos_token_id, cache_implementation)
    if tree == "auto":
        if not prompts:
            raise _no_prompts("auto")
        chosen = calibrate(lm, prompts, drafter, k, acceptance=parse_acceptance(acceptance))
        chains = rows > 1 or sampling is not None
        if isinstance(drafter, str):
            drafter = chosen.best_chain() if chains else chosen.drafter
        tree = None if chains else chosen.tree
    elif drafter == "auto":
        drafter = "heads"
    return make_plan(
        lm.base, drafter, k, tree, acceptance, eos_token_id, cache_implementation, lm=lm, sampling=sampling
    )


def ranked_plan(lm, drafter, k, acceptance, eos_token_id, cache_implementation, prompts, sampling, rows, deeper=False):
    """tree="expected": n-gram lookup and the heads ("auto") or the drafters given, in one tree of up to
    `ranking.CAP` nodes ranked by their chance to stand, its size chosen each call from the machine's
    cost curve (measured on the first prompt). Sampling verifies a chain, each call's from the drafter
    whose chain is expected to gain the most, its length chosen so; a batch, each row's chain from its
    likeliest drafter, all of one length chosen so (`ranking.batch_width`). `deeper` (k not given): a lookup
    among the drafters drafts `TREE_DEPTH` deep in a tree, `LOOKUP_DEPTH` in a chain."""
    if not prompts:
        raise _no_prompts("expected")
    drafter = default_drafters(lm) if drafter == "auto" else drafter
    names = drafter_names(drafter) if isinstance(drafter, str) else []  # an unknown name: refused
    if deeper and any(n in LOOKUPS for n in names):
        k = max(k, LOOKUP_DEPTH if sampling is not None or rows > 1 else TREE_DEPTH)
    check_settings(lm.base, k, None, acceptance, eos_token_id, cache_implementation)  # before anything is timed
    if names and all(n.startswith("heads") for n in names):
        block_size(k, lm.k)  # no deeper than the heads, unless another drafter guesses past them
    check_loaded(lm, "the BlockwiseLM")
    ranked = model_ranking(lm, prompts[0], cache_implementation)
    if sampling is not None:  # the heads weighed by their cached cost, every other drafter asked: a seed repeats
        cost = (("heads", heads_cost(lm, prompts[0], k)),) if "heads" in names and lm.heads_trained else ()
        ranked = replace(ranked, drafting=cost)
    chains = sampling is not None or rows > 1 or not takes_tree_masks(lm.base)  # no warning: a chain ranks too
    tree = None if chains else min(ranking.CAP, max_tree(lm.base))
    return make_plan(lm.base, drafter, k, tree, acceptance, eos_token_id, cache_implementation, lm=lm,
                     sampling=sampling, ranking=ranked)  # fmt: skip


def _no_prompts(tree: str) -> ValueError:
    return ValueError(
        f"tree={tree!r} measures this machine on prompts, and the model ships none (prompts.json in its folder): pass "
        "prompts=[input_ids], or a fixed tree (tree=N, or tree=None for a chain)"
    )
