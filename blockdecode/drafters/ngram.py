"""n-gram lookup (prompt lookup): proposals copied from where the newest tokens occurred before in the sequence,
ranked by how much context each occurrence shares; no training, no weights."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from blockdecode.core.hf import as_integer, at_least
from blockdecode.drafters.base import (
    BaseDrafter,
)
from blockdecode.drafters.proposals import Scored, Source, padded, with_loop


class ContextNgram:
    """An interpolated trigram model of the tokens decoded so far (Witten-Bell style, add-one
    unigrams): how likely `token` is to follow the context and then `path`. `update` counts only
    what is appended, so a drafter keeps one model through a generation."""

    def __init__(self, seq: list[int], order: int = 3):
        self.seq: list[int] = []
        self.order = order
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}  # history -> following token -> count
        self.totals: dict[tuple[int, ...], int] = {}  # history -> count
        self._memo: dict[tuple[tuple[int, ...], int], float] = {}
        self.extend(seq)

    def extend(self, tokens: list[int]) -> None:
        """Count `tokens`, appended to the sequence."""
        seq = self.seq
        for token in tokens:
            seq.append(token)
            i = len(seq) - 1
            for n in range(min(self.order, i + 1)):
                history = tuple(seq[i - n : i])
                following = self.counts.setdefault(history, {})
                following[token] = following.get(token, 0) + 1
                self.totals[history] = self.totals.get(history, 0) + 1
        self._memo = {}

    def prob(self, path: tuple[int, ...], token: int) -> float:
        keep = self.order - 1
        if len(path) >= keep:
            history = path[len(path) - keep :]
        else:
            history = tuple(self.seq[len(self.seq) - keep + len(path) :]) + path
        known = self._memo.get((history, token))
        if known is not None:
            return known
        unigrams = self.counts.get((), {})
        p = (unigrams.get(token, 0) + 1) / (len(self.seq) + len(unigrams) + 1)
        for n in range(1, len(history) + 1):
            suffix = history[len(history) - n :]
            seen = self.counts.get(suffix)
            if seen:  # mass for the unseen in proportion to how many kinds of token followed
                p = (seen.get(token, 0) + len(seen) * p) / (self.totals[suffix] + len(seen))
        self._memo[(history, token)] = p
        return p


OCCURRENCES = 8  # the newest occurrences of a suffix that n-gram lookup compares by their context


CONTEXT = 32  # how far back it compares them


def shared_context(seq: list[int], start: int, end: int) -> int:
    """How many tokens before `start` equal those before `end` (at most CONTEXT)."""
    n = 0
    while n < CONTEXT and start - n > 0 and seq[start - n - 1] == seq[end - n - 1]:
        n += 1
    return n


class NgramDrafter(BaseDrafter):
    """Prompt lookup: find the newest earlier occurrence of the last `max_ngram`..`min_ngram`
    tokens and propose what followed it; for a tree, up to `max_paths` distinct continuations of
    several occurrences. Needs no training; strong on repetitive text and code."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_paths: int = 4):
        low, high = as_integer(min_ngram), as_integer(max_ngram)
        if low is None or high is None or not 1 <= low <= high:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram (integers), got {min_ngram!r}, {max_ngram!r}")
        self.max_ngram, self.min_ngram = high, low
        self.max_paths = at_least(max_paths, 1, "max_paths must be an integer >= 1")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NgramDrafter) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((self.max_ngram, self.min_ngram, self.max_paths))

    name = "ngram"

    def __repr__(self) -> str:
        return f"NgramDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram}, max_paths={self.max_paths})"

    def continuations(self, seq: list[int], depth: int) -> Iterator[list[int]]:
        """What followed each earlier occurrence of the sequence's suffix: longest suffix first,
        then newest occurrence first."""
        for _, path in self.matches(seq, depth):
            yield path

    def matches(self, seq: list[int], depth: int) -> Iterator[tuple[int, list[int]]]:
        """`continuations`, each with the length of the suffix it matched. Of one suffix's newest
        `OCCURRENCES` occurrences, the one whose earlier context goes on matching the sequence's the
        longest comes first (up to `CONTEXT` tokens; the newest first on ties): where text repeats with
        variations (a loop that alternates two lines), that occurrence is the one being repeated, where
        the newest would be the other variant."""
        last = seq[-1] if seq else None
        ends = [j for j in range(len(seq) - 2, -1, -1) if seq[j] == last]  # where any match ends, newest first
        for size in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail, end = seq[-size:], len(seq) - size
            found = []
            for start in (j - size + 1 for j in ends if j >= size - 1):
                if seq[start : start + size] == tail:
                    found.append((start, shared_context(seq, start, end)))
                    if len(found) == OCCURRENCES:
                        break
            for start, _ in sorted(found, key=lambda occurrence: -occurrence[1]):
                yield size, seq[start + size : start + size + depth]

    def propose_scored(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[Scored]:
        """`propose_paths`, each node's source keyed by its match's length and its place: the match's
        first token, a fork (earlier occurrences went on differently from here: each branch stands
        less often), or the copied text going on, which often does; this sequence's hit rates say how
        often."""
        seq = tokens[0].tolist()
        paths: list[tuple[int, list[int]]] = []
        for size, path in self.matches(seq, depth):
            if all(path != p for _, p in paths):
                paths.append((size, path))
                if len(paths) == self.max_paths:
                    break
        following: dict[tuple[int, ...], list[int]] = {}  # after each prefix, the tokens offered, the first first
        for _, path in paths:
            for at in range(len(path)):
                offered = following.setdefault(tuple(path[:at]), [])
                offered += [path[at]] if path[at] not in offered else []
        return [
            with_loop(self.name, seq, path, [self._source(size, at, following[tuple(path[:at])], t)
                                             for at, t in enumerate(path)], depth)
            for size, path in paths
        ]  # fmt: skip

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        return torch.tensor([self.chain_scored(tokens, hidden, n).tokens], dtype=torch.long, device=tokens.device)

    def rows_scored(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> list[Scored]:
        """Row by row: each row's match is found in its own tokens."""
        return [self.chain_scored(t, hidden[i : i + 1], n) for i, t in enumerate(tokens)]

    def chain_scored(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> Scored:
        """The newest match's continuation, keyed by the match's length, gone on with its loop where it ran into
        the present, then padding, which seldom stands: a short or missing match is padded by repeating the newest
        token (any guess is safe to verify)."""
        seq = tokens[0].tolist()
        size, guess = next(self.matches(seq, n), (0, []))
        chain = with_loop(self.name, seq, guess, [self._source(size, at) for at in range(len(guess))], n)
        return padded(self.name, chain.tokens, chain.sources, n, seq[-1])

    def _source(self, size: int, at: int, offered: list[int] = (), token: int = -1) -> Source:
        """The source of index `at` of a `size`-token match's continuation, `token`. At a fork, where the
        occurrences `offered` different tokens (the first `matches` yields first), its branch ("fork") and
        the others ("fork", "other") learn their own rates."""
        if len(offered) > 1:
            return Source(self.name, ("match", size, "fork") + (() if offered[0] == token else ("other",)), 0.5)
        return Source(self.name, ("match", size, "then" if at else "first"), 0.5)

    def propose_paths(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[list[int]]:
        return [scored.tokens for scored in self.propose_scored(tokens, hidden, depth, budget)]
