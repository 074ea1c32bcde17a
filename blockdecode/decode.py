"""Blockwise parallel decoding: predict, verify, accept (Stern et al., 2018, §3-4).

One call of the base model verifies a block and, from the same pass, yields the hidden
state the drafter proposes the next block from (the paper's merged scheme), so m tokens
cost about m / k̂ + 1 calls. Acceptance is exact by default, so the output equals greedy
decoding; the paper's relaxed rules (`blockdecode.acceptance`) are opt-in. Under sampling the
acceptance step is speculative sampling (`blockdecode.sampling`), so the output has exactly the
distribution of `transformers`' sampling.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from blockdecode.acceptance import Acceptance
from blockdecode.adapter import check_prompt, open_decoder, token_budget
from blockdecode.drafters import Drafter, check_ids, check_paths, check_proposal
from blockdecode.hf import vocab_size
from blockdecode.plan import DecodePlan, make_plan
from blockdecode.rules import greedy_rules
from blockdecode.sampling import sampling_settings, speculative_sample
from blockdecode.tree import Tree


@dataclass
class DecodeStats:
    """What one generate call cost. `calls` counts base-model forward passes, prefill included;
    `block_sizes` holds the tokens gained by each call after the prefill, `verified` the tokens
    that call scored (the newest token and the proposals), `accepted_nodes` the proposals it
    accepted, as node indices (a chain's 1..a; a tree's in insertion order, so what a smaller
    budget would have gained is the part of the path within it). An encoder-decoder's `calls`
    are its decoder's; its encoder's one pass is `encoder_calls`. `sampling` holds the settings of a
    sampled output ("" for greedy); `note` says where the decode differs from what was asked."""

    calls: int = 0
    encoder_calls: int = 0
    block_sizes: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    accepted_nodes: list[list[int]] = field(default_factory=list)
    new_tokens: int = 0
    seconds: float = 0.0
    acceptance: str = "exact"  # anything else: the output is not the exact greedy output
    sampling: str = ""  # set: sampled, exact in distribution, not greedy's output
    note: str = ""

    @property
    def exact(self) -> bool:
        """Whether the output is greedy decoding's own."""
        return self.acceptance == "exact" and not self.sampling

    @property
    def mean_block_size(self) -> float:
        return sum(self.block_sizes) / len(self.block_sizes) if self.block_sizes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def pooled(cls, stats: Iterable[DecodeStats]) -> DecodeStats:
        """Several calls' stats as one: counts and times added, block sizes concatenated."""
        total = cls()
        for s in stats:
            total.calls += s.calls
            total.encoder_calls += s.encoder_calls
            total.block_sizes += s.block_sizes
            total.verified += s.verified
            total.accepted_nodes += s.accepted_nodes
            total.new_tokens += s.new_tokens
            total.seconds += s.seconds
            total.acceptance, total.sampling, total.note = s.acceptance, s.sampling, s.note
        return total

    def to_dict(self) -> dict:
        return {
            "calls": self.calls,
            "encoder_calls": self.encoder_calls,
            "new_tokens": self.new_tokens,
            "mean_block_size": self.mean_block_size,
            "block_sizes": list(self.block_sizes),
            "verified": list(self.verified),
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "acceptance": self.acceptance,
            "sampling": self.sampling,
            "exact": self.exact,
            "note": self.note,
        }


@dataclass
class BlockwiseOutput:
    """Like transformers' generate output: `sequences` [1, T] holds the prompt and the new tokens."""

    sequences: torch.LongTensor
    stats: DecodeStats


@torch.inference_mode()
def decode(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    plan: DecodePlan,
    on_block: Callable[[list[int]], None] | None = None,
    generator: torch.Generator | None = None,
) -> BlockwiseOutput:
    """Greedy decoding of `model` as `plan` says (or sampling, if the plan samples), up to k tokens a
    call: predict, verify, accept.

    `on_block`, if given, receives the tokens each call gains (the prefill's one included), in order:
    enough to stream text and to show the accepted blocks. `generator`: where sampling draws its
    randomness (default: torch's global one), so that a seed gives the same tokens."""
    prompt, max_new_tokens = check_prompt(model, input_ids, max_new_tokens), token_budget(max_new_tokens)
    base, start = open_decoder(model, prompt, plan.cache_implementation, max_new_tokens + (plan.tree or 0))
    run = Run(model, plan, start, max_new_tokens, on_block)
    logits, h = base.prefill(start)
    _, first, _ = accept(plan, Tree(), run.rules.apply(logits[:, -1].float(), run.length), generator)
    run.gain(first, [0])
    newest, h_last = start.new_tensor([run.tokens[-1:]]), h[0, -1:]  # not a view a drafter can write to
    while not run.done:
        depth = min(plan.k - 1, run.total - run.length - 1)  # never deeper than k-1, nor past the budget
        candidates = predict(plan, run.seq[:, : run.length], h_last, depth, run.vocab)
        scores, h = verify(base, run, newest, candidates)
        path, gained, after = accept(plan, candidates, scores, generator)
        base.keep(cache_kept(run.length, path))  # the context, the newest token and the accepted path
        run.gain(gained, path, verified=len(candidates) + 1)
        newest, h_last = after[path[-1]].view(1, 1), h[0, path[-1] : path[-1] + 1]
    return run.output(base)


def predict(plan: DecodePlan, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, vocab: int) -> Tree:
    """The candidates this call verifies: the first drafter's chain, or every drafter's paths merged
    into one tree of at most `plan.tree` nodes, in the drafters' order."""
    candidates = Tree()
    if depth == 0:
        return candidates
    if plan.tree is None:
        chain = check_proposal(plan.drafters[0].propose(tokens, hidden, depth), depth)
        candidates.add_path(check_ids(chain, vocab), depth, depth)
        return candidates
    for drafter in plan.drafters:
        if len(candidates) >= plan.tree:
            break
        paths = drafter.propose_paths(tokens, hidden, depth, plan.tree - len(candidates))
        for path in check_paths(paths, depth, vocab):
            candidates.add_path(path, plan.tree, depth)
    return candidates


def verify(base, run: Run, newest: torch.LongTensor, candidates: Tree) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over the newest token and every candidate, each seeing the context and its own
    ancestors (a chain: plain causal attention, the fast path); the scores after the generation
    config's rules at each (what greedy takes the argmax of, and sampling warps), and the decoder
    outputs."""
    ids = torch.cat([newest, newest.new_tensor([candidates.tokens])], dim=1)
    if candidates.is_chain():
        logits, h = base.score(ids)
    else:
        depths = torch.tensor([0, *candidates.depths], device=ids.device)
        logits, h = base.score(ids, positions=depths + run.length - 1, mask=candidates.ancestry())
    return run.rules.apply(logits[0].float(), run.length, [0, *candidates.depths]), h


def accept(
    plan: DecodePlan, candidates: Tree, scores: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], list[int], torch.Tensor]:
    """The deepest path of candidates that stands, as node indices from the newest token (0); the
    tokens it gains, ending with the model's own token after the path; and the token the model takes
    after every node. Greedy: a candidate stands when the rule agrees with its parent's scores, and
    the model's token is the argmax. Sampling (a chain): speculative sampling, and the model's token
    a draw. One host sync a call."""
    ids = torch.tensor(candidates.tokens, dtype=torch.long, device=scores.device)
    if plan.sampling is None:
        after = scores.argmax(-1)  # [m+1]
        parents = torch.tensor([*candidates.parents, 0], device=scores.device)  # one row more, as agree() takes
        right = plan.acceptance.agree(ids, scores[parents], after[parents])
    else:
        one_hot = torch.nn.functional.one_hot(ids, scores.shape[-1]).float()  # a drafter's guess is certain
        right, after = speculative_sample(plan.sampling.probs(scores), ids, one_hot, generator)
    host = torch.cat([right.long(), after]).tolist()
    m = len(candidates)
    path = candidates.accepted_path(host[:m])
    return path, [candidates.tokens[i - 1] for i in path[1:]] + [host[m + path[-1]]], after


def cache_kept(length: int, path: list[int]) -> Sequence[int]:
    """The cache positions a call keeps: the context before the newest token, then the path's nodes
    (scored in positions length-1 onwards); a range when the path is a prefix, which copies nothing."""
    if path[-1] == len(path) - 1:
        return range(length + path[-1])
    return [*range(length - 1), *(length - 1 + i for i in path)]


class Run:
    """The sequence one decode builds, and what it cost. The drafters read `seq` on the device; the
    output is built from `tokens`, which only the loop writes, so a drafter that scribbles on what it
    is shown cannot change the result."""

    def __init__(self, model, plan: DecodePlan, start: torch.LongTensor, max_new_tokens: int, on_block):
        self.plan, self.on_block, self.prompt_len = plan, on_block, start.shape[1]
        self.total = self.prompt_len + max_new_tokens
        self.rules = greedy_rules(model, self.prompt_len, max_new_tokens, set(plan.eos))
        self.vocab = vocab_size(model)
        self.seq = start.new_empty((1, self.total))
        self.seq[:, : self.prompt_len] = start
        self.tokens = start[0].tolist()
        sampling = plan.sampling.spec if plan.sampling else ""
        self.stats = DecodeStats(acceptance=plan.acceptance.spec, sampling=sampling, note=plan.note)
        self.done = False
        self.begun = time.perf_counter()
        for drafter in plan.drafters:
            drafter.start(self.tokens)

    @property
    def length(self) -> int:  # tokens decoded so far; the cache holds all but the newest
        return len(self.tokens)

    def gain(self, gained: list[int], path: list[int], verified: int = 0) -> None:
        """Append what a call gained, up to and including an EOS (generate stops there)."""
        stop = next((i for i, t in enumerate(gained) if t in self.plan.eos), None)
        if stop is not None:
            gained, self.done = gained[: stop + 1], True
        self.seq[0, self.length : self.length + len(gained)] = torch.tensor(gained)
        self.tokens += gained
        self.done = self.done or self.length >= self.total
        if verified:  # not the prefill's token
            self.stats.block_sizes.append(len(gained))
            self.stats.verified.append(verified)
            self.stats.accepted_nodes.append(path[1:])
        for drafter in self.plan.drafters:
            drafter.observe(gained)
        if self.on_block is not None:
            self.on_block(gained)

    def output(self, base) -> BlockwiseOutput:
        self.stats.calls, self.stats.encoder_calls = base.calls, base.encoder_calls
        self.stats.new_tokens = self.length - self.prompt_len
        self.stats.seconds = time.perf_counter() - self.begun
        return BlockwiseOutput(sequences=torch.tensor([self.tokens], device=self.seq.device), stats=self.stats)


def blockwise_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    drafter: Drafter | Sequence[Drafter] | str,
    k: int,
    eos_token_id: int | Sequence[int] | None = None,
    cache_implementation: str = "dynamic",
    on_block: Callable[[list[int]], None] | None = None,
    acceptance: str | Acceptance | None = None,
    tree: int | None = None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> BlockwiseOutput:
    """Greedy decoding of any `transformers` model with proposals from `drafter` (a Drafter, a list of
    them sharing a tree, or "ngram"): the plan made from these settings (`blockdecode.plan.make_plan`),
    then decoded. `tree=None` verifies one chain of k-1 proposals a call, `tree=N` a tree of up to N
    candidates. `acceptance` other than exact (the default) is faster and no longer greedy's output.
    `do_sample=True` samples as `model.generate(do_sample=True, temperature, top_k, top_p)` does (see
    `BlockwiseLM.generate`), drawing from `generator`."""
    check_prompt(model, input_ids, max_new_tokens)  # a bad prompt fails before any planning
    sampling = sampling_settings(model, do_sample, temperature, top_k, top_p)
    plan = make_plan(model, drafter, k, tree, acceptance, eos_token_id, cache_implementation, sampling=sampling)
    return decode(model, input_ids, max_new_tokens, plan, on_block, generator)


def decode_prompts(
    model: PreTrainedModel, prompts: Iterable[torch.LongTensor], max_new_tokens: int, plan: DecodePlan
) -> tuple[list[BlockwiseOutput], DecodeStats]:
    """Decode each prompt as `plan` says; each output, and their stats pooled (every call's block size)."""
    outs = [decode(model, ids, max_new_tokens, plan) for ids in prompts]
    return outs, DecodeStats.pooled(o.stats for o in outs)
