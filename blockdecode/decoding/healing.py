"""Token healing: a prompt that ends mid-token is continued from its text, not from its last token.

A BPE tokenizer writes text in the longest pieces it knows, so where code goes on, a newline travels with
the next line's indent ("\\n   " + " def") and a space with the word after it (" x"). A prompt that ends in
a bare "\\n" or " " ends in a token the model met almost only where nothing could extend it, and the model
continues as from there: junk, or an immediate EOS. Healing backs off by one token and lets the model
write that token's text again, in the pieces it would have used.

The specification, which `Healing.prefix_allowed_tokens_fn` hands to `transformers`' own
`generate(prefix_allowed_tokens_fn=...)` as the reference blockwise decoding is tested against:

- A token's *spelling* is its vocabulary string (`convert_ids_to_tokens`: bytes for a byte-level BPE, "▁"
  pieces for SentencePiece), so a token holding part of a UTF-8 character compares by its bytes. Added
  tokens (EOS, BOS, ...) take no part: never dropped, never allowed while a row heals.
- A row *ends mid-token* when its last token is an ordinary one that a longer token's spelling starts
  with, and an ordinary token comes before it. Such a row loses its last token; any other row is kept.
- Until the new tokens have spelled the dropped token out, the next one keeps them consistent with it:
  with `rest` the part not yet spelled, it starts with `rest`, or `rest` starts with it. Then decoding
  is free. The shorter tokens matter: a prompt that ends in a newline and a whole indent ends in
  "\\n    ", which the model writes as "\\n   " + " def", so the constraint may last past the first new
  token. The new tokens count against `max_new_tokens`."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockdecode.core.hf import is_seq2seq


class Vocabulary:
    """A tokenizer's ordinary tokens (its added tokens left out) by spelling, sorted, so that the tokens
    whose spelling starts with a text lie in one run."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        added = set(tokenizer.added_tokens_decoder)
        self.ids = {s: i for s, i in tokenizer.get_vocab().items() if i not in added}
        self.spelling = {i: s for s, i in self.ids.items()}
        self.sorted = sorted(self.ids)
        self.decode = tokenizer.decode

    def starting_with(self, text: str) -> list[int]:
        """The ids of the tokens whose spelling starts with `text`."""
        first = end = bisect.bisect_left(self.sorted, text)
        while end < len(self.sorted) and self.sorted[end].startswith(text):
            end += 1
        return [self.ids[s] for s in self.sorted[first:end]]

    def consistent(self, rest: str) -> list[int]:
        """The ids of the tokens that may come next while `rest` is still to be spelled: those that start
        with it, and those it starts with."""
        shorter = [self.ids[rest[:n]] for n in range(1, len(rest)) if rest[:n] in self.ids]
        return self.starting_with(rest) + shorter

    def ends_mid_token(self, row: Sequence[int]) -> bool:
        """Whether a prompt's tokens end mid-token (see the module's docstring)."""
        last = self.spelling.get(row[-1]) if row else None
        if last is None or not any(t in self.spelling for t in row[:-1]):
            return False
        after = bisect.bisect_left(self.sorted, last) + 1  # `last` itself sorts first among its extensions
        return after < len(self.sorted) and self.sorted[after].startswith(last)


@dataclass(frozen=True)
class Healing:
    """Prompts with the last token of each row that ends mid-token dropped, and what the new tokens must
    spell out in its place. Decode `input_ids` with `attention_mask` and this healing."""

    input_ids: torch.LongTensor  # [B, T']: rows that lost a token are padded on the left again if others did not
    attention_mask: torch.LongTensor | None  # None: no padding
    dropped: tuple[int | None, ...]  # each row's dropped token; None: the row is kept as it was
    vocabulary: Vocabulary

    @property
    def healed(self) -> bool:
        return any(token is not None for token in self.dropped)

    def allowed(self, row: int, new: Sequence[int]) -> list[int] | None:
        """The ids `row`'s next token may take after its new tokens `new`; None when any may: the row was
        kept, or `new` has spelled its dropped token out (or left it: only a token the generation config
        forces, such as an EOS at the budget's end, can)."""
        token = self.dropped[row]
        rest = "" if token is None else self.vocabulary.spelling[token]
        for spelled in (self.vocabulary.spelling.get(t) for t in new):
            if not rest or spelled is None or not rest.startswith(spelled):
                return None
            rest = rest[len(spelled) :]
        return self.vocabulary.consistent(rest) if rest else None

    def prefix_allowed_tokens_fn(self, vocab_size: int) -> Callable[[int, torch.Tensor], Sequence[int]]:
        """The same constraint for `transformers`' `generate(self.input_ids, attention_mask=...,
        prefix_allowed_tokens_fn=...)`, every id of a `vocab_size` model where a row is free: the reference."""
        width, every = self.input_ids.shape[1], torch.arange(vocab_size)

        def allowed(row: int, sequence: torch.Tensor) -> Sequence[int]:
            ids = self.allowed(row, sequence[width:].tolist())
            return every if ids is None else ids

        return allowed

    def note(self, row: int = 0) -> str:
        """One line that says what healing did to a healed row."""
        token = self.dropped[row]
        return (
            f"token healing: the prompt ends mid-token, in {self.vocabulary.decode([token])!r}; decoding resumes "
            f"before that token, its text to be written again by one of the {len(self.allowed(row, []))} tokens "
            "that fit it"
        )


def heal_prompts(
    tokenizer: PreTrainedTokenizerBase, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None
) -> Healing:
    """`input_ids` [B, T] (padded on the left where `attention_mask` is 0) healed with `tokenizer`'s
    vocabulary: each row that ends mid-token loses its last token, the rest are kept."""
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(
            f"token healing takes the model's tokenizer (heal=tokenizer, as load() returns it), got "
            f"{type(tokenizer).__name__} {tokenizer!r}"
        )
    vocabulary = Vocabulary(tokenizer)
    ids = input_ids.view(-1, input_ids.shape[-1])
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.view(ids.shape).long()
    rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
    dropped = tuple(row[-1] if vocabulary.ends_mid_token(row) else None for row in rows)
    if not any(token is not None for token in dropped):
        return Healing(ids, None if bool(mask.all()) else mask, dropped, vocabulary)
    kept = [row[:-1] if token is not None else row for row, token in zip(rows, dropped)]
    width = max(map(len, kept))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    healed, mask = ids.new_full((len(kept), width), pad), ids.new_zeros((len(kept), width))
    for i, row in enumerate(kept):
        healed[i, width - len(row) :], mask[i, width - len(row) :] = ids.new_tensor(row), 1
    return Healing(healed, None if bool(mask.all()) else mask, dropped, vocabulary)


def check_healing(
    model: PreTrainedModel, healing: Healing, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None
) -> None:
    """A clear error for healing an encoder-decoder's source, or for decoding prompts other than the
    healed ones (`attention_mask` as `adapter.check_attention_mask` returns it: None without padding)."""
    if is_seq2seq(model):
        raise ValueError(
            f"token healing continues a prompt's text; {type(model).__name__} is an encoder-decoder, whose "
            "output does not continue its source: decode without healing"
        )
    if not (same(healing.input_ids, input_ids) and same(healing.attention_mask, attention_mask)):
        raise ValueError(
            "healing was made for other prompts: decode its own input_ids and attention_mask "
            "(heal_prompts(tokenizer, ids).input_ids)"
        )


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two tensors (or Nones) hold the same values, wherever they are."""
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and torch.equal(a.to(b), b)
