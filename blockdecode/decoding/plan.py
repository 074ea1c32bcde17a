"""The decode plan: every setting of a decode, resolved and checked once, before the first model call.

`generate()`, the CLI, the demo, the benchmark and calibration all build a `DecodePlan` and decode
through it (`blockdecode.decoding.loop.decode`), so a setting means the same everywhere and a bad one
fails before anything runs. Choosing settings by measurement ("auto") happens above this module,
in `blockdecode.decoding.calibrate`; a plan holds only what was chosen."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

from transformers import PreTrainedModel

from blockdecode.core.hf import (
    CACHE_IMPLEMENTATIONS,
    as_integer,
    at_least,
    check_model,
    context_length,
    integer,
    is_seq2seq,
    resolve_eos,
    vocab_size,
)
from blockdecode.decoding.acceptance import Acceptance, parse_acceptance
from blockdecode.decoding.adapter import takes_tree_masks
from blockdecode.decoding.ranking import Ranking
from blockdecode.decoding.sampling import Sampling
from blockdecode.drafters.base import BaseDrafter, Drafter, as_drafters
from blockdecode.drafters.heads import HeadsDrafter
from blockdecode.drafters.registry import DRAFTERS, drafter_names

MAX_TREE = 1024
"""The most candidate tokens a tree may hold: a call gains at most k tokens, and past this a tree's
forward costs far more than a chain's while its masks grow with the square of its nodes."""
TREE = "tree must be a node budget >= 1 (or None for a chain)"


@dataclass(frozen=True)
class DecodePlan:
    """What one decode does: who proposes, how far ahead, how many candidates a call, which proposals
    stand (greedy's argmax, or speculative sampling when `sampling` is set), where it stops, and which
    cache holds the context. `note` says where the plan decodes otherwise than asked, and why."""

    drafters: tuple[BaseDrafter, ...]  # the first alone proposes a chain; all share a tree
    k: int  # tokens a call at best: the newest token's successor and k-1 proposals
    tree: int | None = None  # None: one chain a call; N: a tree of up to N candidate tokens
    acceptance: Acceptance = Acceptance()
    eos: frozenset[int] = frozenset()
    cache_implementation: str = "dynamic"
    sampling: Sampling | None = None  # None: greedy
    ranking: Ranking | None = None  # set: each call's tree ranked by expected acceptance, up to `tree` nodes
    note: str = ""

    def __post_init__(self) -> None:
        """A plan built by hand is checked as make_plan checks one (what needs the model aside)."""
        object.__setattr__(self, "drafters", as_drafters(self.drafters))
        heads = [d.k for d in self.drafters if isinstance(d, HeadsDrafter) and d.k is not None]
        alone = len(heads) == len(self.drafters)  # beside another drafter, k may pass the heads' (they guess k-1)
        object.__setattr__(self, "k", block_size(self.k, min(heads) if heads and alone else None))
        if self.tree is not None:
            object.__setattr__(self, "tree", at_least(self.tree, 1, TREE))
            if self.tree > MAX_TREE:
                raise ValueError(f"tree={self.tree} exceeds MAX_TREE={MAX_TREE}, the most candidates a plan verifies")
        elif len(self.drafters) != 1 and self.ranking is None:  # a ranked chain picks one drafter's a call
            raise ValueError(f"{len(self.drafters)} drafters need a tree to share: pass tree=N")
        if self.ranking is not None and self.tree is not None and self.sampling is not None:
            raise ValueError("sampling verifies one chain: a ranking under sampling chooses its length, not a tree")
        object.__setattr__(self, "acceptance", parse_acceptance(self.acceptance))
        object.__setattr__(self, "eos", frozenset(integer(t, "eos_token_id") for t in self.eos))
        check_cache(self.cache_implementation)

    @property
    def drafter_name(self) -> str:
        """The drafters as the CLI names them: "heads", "ngram+heads", or a drafter's class name."""
        return "+".join(d.name for d in self.drafters)

    @property
    def setting(self) -> str:
        if self.ranking is not None:
            return f"ranked trees of up to {self.tree}" if self.tree else "ranked chain"
        return f"trees of {self.tree}" if self.tree else "chain"


def max_tree(model: PreTrainedModel) -> int:
    """The largest tree budget `model` takes: MAX_TREE, or its context if shorter (one forward scores
    no more tokens than the model attends over)."""
    return min(MAX_TREE, context_length(model) or MAX_TREE)


def check_cache(implementation: str) -> None:
    if implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"unknown cache implementation {implementation!r}: choose one of {', '.join(CACHE_IMPLEMENTATIONS)}"
        )


def block_size(k: object, heads_k: int | None = None) -> int:
    """k as an int >= 1, and where the heads propose, at most their block size."""
    if heads_k is None:
        return at_least(k, 1, "k must be an integer >= 1 (the block size, head 1 included)")
    n = as_integer(k)
    if n is None or not 1 <= n <= heads_k:
        raise ValueError(f"k must be between 1 and the heads' block size {heads_k}, got {k!r}")
    return n


def check_settings(
    model: PreTrainedModel,
    k: int,
    tree: int | None,
    acceptance: str | Acceptance | None,
    eos_token_id: int | Sequence[int] | None,
    cache_implementation: str,
) -> tuple[int, int | None, Acceptance, frozenset[int]]:
    """The settings that need no drafter, checked without calling the model: the model itself (`check_model`),
    k, the tree budget, the acceptance rule, EOS and the cache."""
    check_model(model)
    k = block_size(k)
    if tree is not None:
        tree = at_least(tree, 1, TREE)
        if tree > max_tree(model):
            raise ValueError(
                f"tree={tree} exceeds the {max_tree(model)} candidate tokens one forward of {type(model).__name__} "
                f"may score (blockdecode.decoding.plan.MAX_TREE, or the model's context if shorter)"
            )
    check_cache(cache_implementation)
    rule = parse_acceptance(acceptance)
    rule.check(k, vocab_size(model))
    if tree is not None and rule.rule == "min-block":
        raise ValueError("min-block:L forces the first proposals of a chain; it does not apply to a tree")
    return k, tree, rule, frozenset(resolve_eos(model, eos_token_id))


def make_plan(
    model: PreTrainedModel,
    drafter: str | Drafter | Sequence[Drafter],
    k: int,
    tree: int | None = None,
    acceptance: str | Acceptance | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    cache_implementation: str = "dynamic",
    lm=None,
    sampling: Sampling | None = None,
    ranking: Ranking | None = None,
) -> DecodePlan:
    """The plan for decoding `model` (a BlockwiseLM's base when `lm` is given): `drafter` a name
    ("heads", "ngram", "heads+ngram", "heads-rescored"; the heads need `lm`), a drafter or a list of
    them; `tree=None` a chain, N a budget of candidate tokens; `sampling` (`blockdecode.decoding.sampling`)
    samples instead of decoding greedily. Every setting is checked here. A model that cannot score a
    tree (ALiBi, T5's relative positions), or a tree under sampling, gets the first drafter's chain,
    with a warning and a note."""
    if isinstance(drafter, str):
        names = drafter_names(drafter)
        if lm is None and any(name.startswith("heads") for name in names):
            raise ValueError(f"drafter {drafter!r} needs a BlockwiseLM's heads: decode with lm.generate")
        drafters = tuple(DRAFTERS[name](lm) for name in names)
    else:
        drafters = as_drafters(drafter)
    if lm is not None and all(isinstance(d, HeadsDrafter) and d.heads is lm.heads for d in drafters):
        k = block_size(k, lm.k)  # beside another drafter, k may pass the heads' block (they guess k-1 at most)
    readers = [d for d in drafters if d.decoder_only]
    if readers and is_seq2seq(model):
        raise ValueError(
            f"{readers[0].name} reads a decoder-only base's layers, as the serving engines run it; "
            f"{type(model).__name__} is an encoder-decoder: decode it with its heads, dflash or n-gram lookup"
        )
    k, tree, rule, eos = check_settings(model, k, tree, acceptance, eos_token_id, cache_implementation)
    if sampling is not None and rule.rule != "exact":
        raise ValueError(
            f"acceptance {rule.spec} is approximate and has no exact meaning under sampling: sample with exact "
            "acceptance (the default), or decode greedily"
        )
    if tree is None and len(drafters) != 1 and ranking is None:  # a ranked chain picks one drafter's a call
        if sampling is not None:
            raise ValueError(
                f"{len(drafters)} drafters share a tree, and sampling verifies one chain: pass one drafter"
            )
        raise ValueError(f"{len(drafters)} drafters need a tree to share: pass tree=N")
    note = ""
    if tree is not None and sampling is not None:
        note = "sampling verifies one chain (speculative sampling), not a tree"
    elif tree is not None and not takes_tree_masks(model):
        note = (
            f"{type(model).__name__} does not score a tree as given (custom attention mask and position ids, checked "
            "on its logits)"
        )
    if note and ranking is not None:
        warnings.warn(f"{note}: decoding with a ranked chain, each call's from the likeliest drafter", stacklevel=2)
        tree = None
    elif note:
        warnings.warn(f"{note}: decoding with one chain from {drafters[0]!r} instead of a tree", stacklevel=2)
        tree, drafters = None, drafters[:1]
    if ranking is not None and rule.rule == "min-block":  # the ranking learns what stands under any other rule
        raise ValueError(
            f"{rule.spec} forces a chain's first proposals, and a ranking chooses how many to verify: decode "
            "min-block with tree=None"
        )
    return DecodePlan(drafters, k, tree, rule, eos, cache_implementation, sampling, ranking, note)


def plan_for_rows(plan: DecodePlan, rows: int) -> DecodePlan:
    """The plan a batch of `rows` decodes with: as it is for one row; for several, one chain a row, a
    tree asked for replaced by the first drafter's chain, with a warning and a note."""
    if rows == 1 or plan.tree is None:
        return plan
    ranked = plan.ranking is not None  # then each row takes its likeliest drafter's chain, all rows one width
    drafters = plan.drafters if ranked else plan.drafters[:1]
    whose = "each row's likeliest drafter" if ranked else repr(plan.drafters[0])
    note = f"a batch verifies one chain a row, not a tree: decoding with one chain from {whose}"
    warnings.warn(note, stacklevel=3)
    return replace(plan, tree=None, drafters=drafters, note="; ".join(filter(None, [plan.note, note])))
