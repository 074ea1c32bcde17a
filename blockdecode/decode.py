"""Blockwise parallel decoding: predict, verify, accept (Stern et al., 2018, §3-4).

One call of the base model verifies a block and, from the same pass, yields the hidden
state the drafter proposes the next block from (the paper's merged scheme), so m tokens
cost about m / k̂ + 1 calls. Acceptance is exact by default, so the output equals greedy
decoding; the paper's relaxed rules (`blockdecode.acceptance`) are opt-in.
"""

from __future__ import annotations

import numbers
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from blockdecode.acceptance import Acceptance, parse_acceptance
from blockdecode.adapter import adapter_for
from blockdecode.drafters import Drafter, check_proposal
from blockdecode.hf import context_length, is_seq2seq, resolve_eos, vocab_size
from blockdecode.rules import greedy_rules
from blockdecode.tree import Tree


@dataclass
class DecodeStats:
    """What one generate call cost. `calls` counts base-model forward passes, prefill included;
    `block_sizes` holds the tokens gained by each call after the prefill, `verified` the tokens
    that call scored (the newest token and the proposals), `accepted_nodes` the proposals it
    accepted, as node indices (a chain's 1..a; a tree's in insertion order, so what a smaller
    budget would have gained is the part of the path within it). An encoder-decoder's `calls`
    are its decoder's; its encoder's one pass is `encoder_calls`."""

    calls: int = 0
    encoder_calls: int = 0
    block_sizes: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    accepted_nodes: list[list[int]] = field(default_factory=list)
    new_tokens: int = 0
    seconds: float = 0.0
    acceptance: str = "exact"  # anything else: the output is not the exact greedy output

    @property
    def exact(self) -> bool:
        return self.acceptance == "exact"

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
            total.acceptance = s.acceptance
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
            "exact": self.exact,
        }


@dataclass
class BlockwiseOutput:
    """Like transformers' generate output: `sequences` [1, T] holds the prompt and the new tokens."""

    sequences: torch.LongTensor
    stats: DecodeStats


def check_prompt(model: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int) -> torch.LongTensor:
    """A [1, T] LongTensor on the model's device that the model can extend by max_new_tokens (for an
    encoder-decoder: a source it can encode, with room for max_new_tokens in its decoder), or a
    clear error."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.LongTensor, got {type(input_ids).__name__}")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [1, T], got {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"input_ids has {input_ids.shape[0]} rows; blockwise decoding takes one sequence at a time for now"
        )
    what = "source" if is_seq2seq(model) else "prompt"
    if input_ids.shape[1] == 0:
        raise ValueError(f"the {what} is empty: give at least one token")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    vocab = model.get_input_embeddings().num_embeddings if is_seq2seq(model) else vocab_size(model)
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"the {what} holds token ids outside the model's vocabulary [0, {vocab})")
    limit = context_length(model)
    if is_seq2seq(model):
        if limit is not None and input_ids.shape[1] > limit:
            raise ValueError(f"the source ({input_ids.shape[1]} tokens) exceeds the encoder's {limit} positions")
        if limit is not None and 1 + max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens ({max_new_tokens}) + the start token exceeds the decoder's {limit} positions"
            )
    elif limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {limit} positions"
        )
    return input_ids.long().to(model.device)


def decoder_prompt(
    model: PreTrainedModel, input_ids: torch.LongTensor
) -> tuple[torch.LongTensor | None, torch.LongTensor]:
    """(source, the sequence the decoder extends): (None, the prompt) for a causal LM; for an
    encoder-decoder (the prompt, its decoder start token), as `generate` starts."""
    if not is_seq2seq(model):
        return None, input_ids
    cfg = model.generation_config  # as generate resolves it: the start token, else BOS
    start = cfg.decoder_start_token_id if cfg.decoder_start_token_id is not None else cfg.bos_token_id
    if isinstance(start, list | tuple):
        start = start[0] if len(start) == 1 else None
    if start is None:
        raise ValueError(
            f"{type(model).__name__} names neither a decoder_start_token_id nor a bos_token_id in its generation config"
        )
    return input_ids, input_ids.new_tensor([[int(start)]])


@torch.inference_mode()
def blockwise_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    drafter: Drafter | Sequence[Drafter],
    k: int,
    eos_token_id: int | Sequence[int] | None = None,
    cache_implementation: str = "dynamic",
    on_block: Callable[[list[int]], None] | None = None,
    acceptance: str | Acceptance | None = None,
    tree: int | None = None,
) -> BlockwiseOutput:
    """Greedy decoding of `model`, k tokens per call at best, proposals from `drafter`.

    `tree=None` verifies one chain of k-1 proposals a call; `tree=N` verifies a tree of up to N
    candidate tokens, at most k-1 deep, gathered from every drafter given (a list of drafters
    shares one budget, in order; see `blockdecode.tree`). `on_block`, if given, receives the
    tokens each call gains (the prefill's one included), in order: enough to stream text and to
    show the accepted blocks. `acceptance` other than exact (the default) relaxes verification:
    faster, no longer the greedy output."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k must be an integer >= 1 (the block size, head 1 included), got {k!r}")
    k = int(k)
    drafters = list(drafter) if isinstance(drafter, Sequence) else [drafter]
    if tree is not None and (not isinstance(tree, int) or isinstance(tree, bool) or tree < 1):
        raise ValueError(f"tree must be a node budget >= 1 (or None for a chain), got {tree!r}")
    if tree is None and len(drafters) != 1:
        raise ValueError(f"{len(drafters)} drafters need a tree to share: pass tree=N")
    source, input_ids = decoder_prompt(model, check_prompt(model, input_ids, max_new_tokens))
    max_new_tokens = int(max_new_tokens)
    if tree is not None and not takes_tree_masks(model):
        warnings.warn(
            f"{type(model).__name__} does not score a tree as given (custom attention mask and position ids, checked "
            f"on its logits): "
            f"decoding with one chain from {type(drafters[0]).__name__} instead of a tree",
            stacklevel=2,
        )
        tree, drafters = None, drafters[:1]
    eos = resolve_eos(model, eos_token_id)
    rules = greedy_rules(model, input_ids.shape[1], max_new_tokens, eos)
    vocab = vocab_size(model)
    rule = parse_acceptance(acceptance)
    rule.check(k, vocab)
    if tree is not None and rule.rule == "min-block":
        raise ValueError("min-block:L forces the first proposals of a chain; it does not apply to a tree")
    trusted = all(getattr(d, "in_vocabulary", False) for d in drafters)  # ids taken from the vocabulary
    prompt_len = input_ids.shape[1]
    total = prompt_len + max_new_tokens
    # The drafters read `seq` on the device; the output is built from `tokens`, which only this
    # loop writes, so a drafter that scribbles on what it is shown cannot change the result.
    seq = input_ids.new_empty((1, total))
    seq[:, :prompt_len] = input_ids
    tokens = input_ids[0].tolist()
    stats = DecodeStats(acceptance=rule.spec)
    start = time.perf_counter()

    # A tree's nodes are scored in cache slots past the sequence's end before all but one path is dropped.
    base = adapter_for(model, source, cache_implementation, total + (tree or 0))
    logits, h = base.prefill(input_ids)
    # fp32 scores: a CPU argmax over bf16 is slow.
    newest = rules.apply(logits[:, -1].float(), prompt_len).argmax(-1, keepdim=True)  # [1, 1]
    first = int(newest)
    seq[0, prompt_len] = first
    tokens.append(first)
    if on_block is not None:
        on_block([first])
    h_last = h[0, -1:]
    done = first in eos

    while not done and len(tokens) < total:
        length = len(tokens)  # the cache holds all of them but the newest
        # Predict: never deeper than k-1, nor than the budget can take.
        n = min(k - 1, total - length - 1)
        if tree is None:
            draft = drafters[0].propose(seq[:, :length], h_last, n) if n else seq.new_empty((1, 0))
            check_proposal(draft, n, vocab, bounds=not trusted)
            draft = draft.to(seq.device)
            # Verify: one pass scores the newest token and every proposal (causal masking).
            logits, h = base.score(torch.cat([newest, draft], dim=1))
            scores = rules.apply(logits[0].float(), length)  # what greedy would take the argmax of
            greedy = scores.argmax(-1)  # [n+1]: the base model's token after each prefix
            # Accept the longest prefix the rule agrees with, plus the base model's own next token
            # (exact: the agreeing proposals equal the base model's tokens). One host sync a call.
            accepted = rule.agree(draft[0], scores, greedy).long().cumprod(0).sum()
            proposed = torch.cat([draft[0], greedy[-1:]])  # position i holds proposal i (the last has none)
            block = torch.where(torch.arange(n + 1, device=greedy.device) < accepted, proposed, greedy)
            host = torch.cat([accepted.view(1), block]).tolist()
            path = list(range(host[0] + 1))  # block positions kept: the newest token, the accepted proposals
            gained = host[1 : host[0] + 2]
        else:
            candidates = draft_tree(drafters, seq[:, :length], h_last, tree, n, vocab, trusted)
            # Verify: one pass over the newest token and every node, each seeing its ancestors only.
            ids = torch.tensor([[0, *candidates.tokens]], device=seq.device)
            ids[:, :1] = newest
            depths = torch.tensor([0, *candidates.depths], device=seq.device)
            logits, h = base.score(ids, positions=depths + length - 1, mask=candidates.ancestry())
            scores = rules.apply(logits[0].float(), length, [0, *candidates.depths])
            greedy = scores.argmax(-1)  # [m+1]: the base model's token after each node
            # Accept the deepest path of nodes the rule agrees with (each against its parent's
            # scores), plus the base model's own token after its last node. One host sync a call.
            parents = torch.tensor([*candidates.parents, 0], device=seq.device)
            right = rule.agree(ids[0, 1:], scores[parents], greedy[parents])
            host = torch.cat([right.long(), greedy]).tolist()
            m = len(candidates)
            path = candidates.accepted_path(host[:m])
            gained = [candidates.tokens[i - 1] for i in path[1:]] + [host[m + path[-1]]]
            block = torch.tensor(gained, device=seq.device)
        if eos.intersection(gained):  # stop where greedy stops: nothing past the EOS
            gained, done = gained[: next(i for i, t in enumerate(gained) if t in eos) + 1], True
        seq[0, length : length + len(gained)] = block[: len(gained)]
        tokens += gained
        stats.block_sizes.append(len(gained))
        stats.verified.append(len(greedy))
        stats.accepted_nodes.append(path[1:])
        if on_block is not None:
            on_block(gained)
        last = path[-1]
        # Keep the cache entries of the accepted path (for a chain, a prefix of the block).
        base.keep(range(length + last) if tree is None else [*range(length - 1), *(length - 1 + i for i in path)])
        newest = greedy[last : last + 1].view(1, 1)  # the base model's own token after the path
        h_last = h[0, last : last + 1]

    stats.calls = base.calls
    stats.encoder_calls = int(source is not None)
    stats.new_tokens = len(tokens) - prompt_len
    stats.seconds = time.perf_counter() - start
    return BlockwiseOutput(sequences=torch.tensor([tokens], device=seq.device), stats=stats)


_TREE_MASK_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {attention: ok}


@torch.inference_mode()
def takes_tree_masks(model: PreTrainedModel) -> bool:
    """Whether the model applies a custom 4D attention mask as given, found from its logits once
    per model and attention implementation: two sibling candidates scored together must each
    score as they do alone. ALiBi models, and any that drop or rebuild the mask, fail it."""
    checked = _TREE_MASK_CHECKED.setdefault(model, {})
    key = str(getattr(model.config, "_attn_implementation", ""))
    if key not in checked:
        vocab = vocab_size(model)
        prompt = torch.tensor([[1 % vocab, 2 % vocab, 3 % vocab]], device=model.device)
        siblings = torch.tensor([[4 % vocab, 5 % vocab, 6 % vocab]], device=model.device)
        source = prompt if is_seq2seq(model) else None
        try:
            together = adapter_for(model, source, "dynamic", 8)
            together.prefill(prompt)
            mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
            logits, _ = together.score(siblings, positions=torch.tensor([3, 4, 4], device=model.device), mask=mask)
            alone = adapter_for(model, source, "dynamic", 8)
            alone.prefill(prompt)
            reference, _ = alone.score(siblings[:, [0, 2]])
            scale = reference.float().abs().max().clamp(min=1.0)
            ok = bool(((logits[0, 2].float() - reference[0, 1].float()).abs().max() / scale) < 1e-2)
        except Exception:  # a model that cannot take the mask or the positions at all says so by failing
            ok = False
        checked[key] = ok
    return checked[key]


def draft_tree(
    drafters: list[Drafter],
    tokens: torch.LongTensor,
    hidden: torch.Tensor,
    budget: int,
    depth: int,
    vocab: int,
    trusted: bool,
) -> Tree:
    """Every drafter's candidate paths merged into one tree of at most `budget` nodes and `depth`
    levels, in the drafters' order: a drafter with `propose_paths` offers several, best first;
    any other its one chain."""
    candidates = Tree()
    for drafter in drafters:
        if len(candidates) >= budget or depth == 0:
            break
        if hasattr(drafter, "propose_paths"):
            paths = drafter.propose_paths(tokens, hidden, depth, budget - len(candidates))
        else:
            chain = drafter.propose(tokens, hidden, depth)
            check_proposal(chain, depth, vocab, bounds=not trusted)
            paths = [chain[0].tolist()]
        for path in paths:
            candidates.add_path(path, budget, depth)
    return candidates


def decode_prompts(
    model: PreTrainedModel, prompts: Iterable[torch.LongTensor], max_new_tokens: int, drafter: Drafter, k: int, **kwargs
) -> tuple[list[BlockwiseOutput], DecodeStats]:
    """Decode each prompt blockwise; each output, and their stats pooled (every call's block size)."""
    outs = [blockwise_generate(model, ids, max_new_tokens, drafter, k, **kwargs) for ids in prompts]
    return outs, DecodeStats.pooled(o.stats for o in outs)
