"""Where a row ends: at an EOS id, or at the token that completes a stop string.

A call gains several tokens at once, but `transformers`' generate checks its stopping criteria after each
token, so a row ends at the first gained token that would have stopped it there, and keeps that token. Stop
strings are judged by `transformers`' own `StopStringCriteria` over the row's tokens up to each gained one (the
prompt's tail included, as generate sees it), so a decode stops exactly where `generate(stop_strings=...)` does."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from transformers import PreTrainedTokenizerBase, StopStringCriteria


class StopStrings:
    """`generate(stop_strings=..., tokenizer=...)`'s criterion, asked token by token."""

    def __init__(self, strings: str | Sequence[str], tokenizer: PreTrainedTokenizerBase):
        strings = [strings] if isinstance(strings, str) else list(strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings takes non-empty strings, got {strings!r}")
        self.strings = strings
        self.criteria = StopStringCriteria(tokenizer, strings)
        self.window = self.criteria.maximum_token_len  # the most tokens it reads back from the end

    def first(self, before: Sequence[int], gained: Sequence[int]) -> int | None:
        """The index in `gained` of the first token that completes a stop string, after the row's `before`."""
        tokens = [*before[-self.window :], *gained]
        for i in range(len(gained)):
            end = len(tokens) - len(gained) + i + 1
            ids = torch.tensor([tokens[max(0, end - self.window) : end]])
            if bool(self.criteria(ids, None)[0]):
                return i
        return None


def first_stop(
    gained: Sequence[int], eos: Collection[int], before: Sequence[int], strings: StopStrings | None
) -> int | None:
    """The index in `gained` of the first token that ends the row (an EOS id, or the token that completes a stop
    string after `before`, the row's tokens so far), or None."""
    stop = next((i for i, t in enumerate(gained) if t in eos), None)
    if strings is not None:
        found = strings.first(before, gained if stop is None else gained[: stop + 1])
        stop = found if found is not None else stop
    return stop
