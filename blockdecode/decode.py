"""Blockwise parallel decoding: predict, verify, accept (Stern et al., 2018, §3-4).

One call of the base model verifies a block and, from the same pass, yields the hidden
state the drafter proposes the next block from (the paper's merged scheme), so m tokens
cost about m / k̂ + 1 calls. Acceptance is exact by default, so the output equals greedy
decoding; the paper's relaxed rules (`blockdecode.acceptance`) are opt-in.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from blockdecode.acceptance import Acceptance, parse_acceptance
from blockdecode.drafters import Drafter, check_proposal

CACHE_IMPLEMENTATIONS = ("dynamic", "static")


@dataclass
class DecodeStats:
    """What one generate call cost. `calls` counts base-model forward passes, prefill included;
    `block_sizes` holds the tokens gained by each call after the prefill."""

    calls: int = 0
    block_sizes: list[int] = field(default_factory=list)
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

    def to_dict(self) -> dict:
        return {
            "calls": self.calls,
            "new_tokens": self.new_tokens,
            "mean_block_size": self.mean_block_size,
            "block_sizes": list(self.block_sizes),
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


def context_length(model: PreTrainedModel) -> int | None:
    """The longest sequence the base model can attend over, if its config names one."""
    cfg = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_eos(model: PreTrainedModel, eos_token_id: int | Sequence[int] | None) -> set[int]:
    """EOS ids as transformers' generate resolves them: the argument, else the generation config."""
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def check_prompt(model: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int) -> torch.LongTensor:
    """A [1, T] LongTensor the model can extend by max_new_tokens, or a clear error."""
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
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    vocab = model.get_output_embeddings().weight.shape[0]
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"the prompt holds token ids outside the model's vocabulary [0, {vocab})")
    limit = context_length(model)
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {limit} positions"
        )
    return input_ids.long()


@contextmanager
def capture_decoder_output(model: PreTrainedModel) -> Iterator[list[torch.Tensor]]:
    """Record the input of the model's output projection: the decoder output h the heads read.

    A hook on the projection works for every architecture (final norms, OPT's project_out,
    NeoX's embed_out) without re-implementing any model's forward."""
    box: list[torch.Tensor] = []

    def hook(_module: torch.nn.Module, args: tuple) -> None:
        box[:] = [args[0]]

    handle = model.get_output_embeddings().register_forward_pre_hook(hook)
    try:
        yield box
    finally:
        handle.remove()


def make_cache(model: PreTrainedModel, impl: str, max_len: int):
    """A transformers KV cache that `crop(-n)` rolls back: `dynamic` trims its tensors,
    `static` (preallocated, written by position) only moves its write position."""
    if impl not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"unknown cache implementation {impl!r}: choose one of {', '.join(CACHE_IMPLEMENTATIONS)}")
    if impl == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        if impl == "static":
            raise ValueError("a static cache cannot roll back sliding-window layers: use the dynamic cache")
        # A sliding layer keeps only its window and cannot roll back past it; full layers
        # can, and the model's own mask still limits attention to the window.
        cache = DynamicCache()
    if not all(getattr(layer, "is_croppable", False) and hasattr(layer, "crop") for layer in cache.layers):
        raise ValueError(
            f"{type(model).__name__} keeps state that this transformers version cannot roll back (recurrent or "
            f"linear-attention layers, or a {impl} cache without crop): blockwise decoding needs a croppable cache"
        )
    return cache


def cache_argument(model: PreTrainedModel) -> str:
    """transformers renamed `past_key_values` to `cache` during 5.x: the name this model takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Verifier:
    """The base model over a growing sequence: score new tokens, drop rejected ones."""

    def __init__(self, model: PreTrainedModel, hidden: list[torch.Tensor], cache_impl: str, max_len: int):
        self.model = model
        self.hidden = hidden
        self.cache = make_cache(model, cache_impl, max_len)
        self.calls = 0
        self.cache_arg = cache_argument(model)

    def __call__(self, ids: torch.LongTensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [1, q] -> logits [q', V] and decoder outputs [q', D] (q' = 1 if last_only)."""
        kwargs = {self.cache_arg: self.cache, "use_cache": True, "logits_to_keep": 1 if last_only else 0}
        out = self.model(input_ids=ids, **kwargs)
        self.calls += 1
        return out.logits[0], self.hidden[0][0]

    def rollback(self, n: int) -> None:
        if n:
            self.cache.crop(-n)


@torch.inference_mode()
def blockwise_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    drafter: Drafter,
    k: int,
    eos_token_id: int | Sequence[int] | None = None,
    cache_implementation: str = "dynamic",
    on_block: Callable[[list[int]], None] | None = None,
    acceptance: str | Acceptance | None = None,
) -> BlockwiseOutput:
    """Greedy decoding of `model`, k tokens per call at best, proposals from `drafter`.

    `on_block`, if given, receives the tokens each call gains (the prefill's one included),
    in order: enough to stream text and to show the accepted blocks. `acceptance` other than
    exact (the default) relaxes verification: faster, no longer the greedy output."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1 (the block size, head 1 included), got {k!r}")
    input_ids = check_prompt(model, input_ids, max_new_tokens)
    eos = resolve_eos(model, eos_token_id)
    vocab = model.get_output_embeddings().weight.shape[0]
    rule = parse_acceptance(acceptance)
    rule.check(k, vocab)
    prompt_len = input_ids.shape[1]
    seq = input_ids.new_empty((1, prompt_len + max_new_tokens))
    seq[:, :prompt_len] = input_ids
    length = prompt_len
    stats = DecodeStats(acceptance=rule.spec)
    start = time.perf_counter()

    with capture_decoder_output(model) as hidden:
        verify = Verifier(model, hidden, cache_implementation, prompt_len + max_new_tokens)
        logits, h = verify(input_ids, last_only=True)
        first = int(logits[-1].float().argmax())
        seq[0, length] = first
        length += 1
        if on_block is not None:
            on_block([first])
        h_last = h[-1:]
        done = first in eos

        while not done and length < prompt_len + max_new_tokens:
            # Predict: at most k-1 proposals, and never more than the budget can take.
            n = min(k - 1, prompt_len + max_new_tokens - length - 1)
            # A copy: a drafter must not be able to change what has been decoded.
            draft = drafter.propose(seq[:, :length].clone(), h_last, n) if n else seq.new_empty((1, 0))
            check_proposal(draft, n, vocab)
            draft = draft.to(seq.device)

            # Verify: one pass scores the newest token and every proposal (causal masking).
            logits, h = verify(torch.cat([seq[:, length - 1 : length], draft], dim=1))
            greedy = logits.float().argmax(-1)  # fp32: CPU argmax over bf16 is several times slower

            # Accept the longest prefix the rule agrees with, plus the base model's own next token.
            # (Exact: the agreeing proposals equal the base model's tokens.)
            greedy = greedy.to(seq.device)
            accepted = rule.accepted(draft[0], logits, greedy)
            block = torch.cat([draft[0, :accepted], greedy[accepted : accepted + 1]])
            gained = block.tolist()
            if eos.intersection(gained):  # stop where greedy stops: nothing past the EOS
                gained, done = gained[: next(i for i, t in enumerate(gained) if t in eos) + 1], True
            seq[0, length : length + len(gained)] = block[: len(gained)]
            length += len(gained)
            stats.block_sizes.append(len(gained))
            if on_block is not None:
                on_block(gained)
            verify.rollback(n - accepted)
            h_last = h[accepted : accepted + 1]

    stats.calls = verify.calls
    stats.new_tokens = length - prompt_len
    stats.seconds = time.perf_counter() - start
    return BlockwiseOutput(sequences=seq[:, :length].clone(), stats=stats)
