"""What a drafter hands the loop: candidate paths (`Scored`) or a lattice of guesses by depth (`Lattice`), each node
with its `Source`, the drafter and kind of guess whose chance to stand the ranking learns
(`blockdecode.decoding.ranking`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

CONFIDENCE_BINS = 10  # the heads' probabilities, mapped to acceptance by a curve learnt per bin


@dataclass(frozen=True)
class Source:
    """Who proposed a node and what kind of guess it is: estimates are kept per (drafter, key)."""

    drafter: str
    key: tuple
    prior: float  # its chance to stand if its parent stands, before this sequence says otherwise


@dataclass
class Scored:
    """A drafter's candidate path from the newest token, with a source for each of its nodes."""

    tokens: list[int]
    sources: list[Source]


def confidence_source(drafter: str, probability: float, aside: bool = False) -> Source:
    """The source of a guess its drafter gave `probability` (`aside`: after a node off the drafter's
    lattice): its bin (acceptance is learnt per bin), whose middle is the prior. One object a bin, so
    ranking compares sources by identity."""
    return _confidence_source(drafter, min(CONFIDENCE_BINS - 1, int(probability * CONFIDENCE_BINS)), aside)


@functools.cache
def _confidence_source(drafter: str, bin: int, aside: bool = False) -> Source:
    key = ("confidence", bin, "aside") if aside else ("confidence", bin)
    return Source(drafter, key, (bin + 0.5) / CONFIDENCE_BINS / (2 if aside else 1))


@dataclass
class Lattice:
    """Guesses at each depth that do not hang on the path before them (the heads' top tokens at each
    offset, from one hidden state): so they may follow any node one depth above, another drafter's too,
    though they stand less often after a node off the lattice (a token it did not guess there).
    tokens[d], sources[d] and aside[d]: the guesses for depth d + 1."""

    tokens: list[list[int]]  # each depth's guesses, the lattice's best first
    sources: list[list[Source]]
    aside: list[list[Source]]  # the same guesses' sources after a node off the lattice


LOOP_PRIOR = 0.8  # a loop's next period: how often it stands before this sequence says otherwise
PADDING_PRIOR = 0.1  # a chain's padding, the last token repeated: how often it stands before this sequence says


@functools.cache
def loop_source(drafter: str) -> Source:
    """The source of a node that goes on a loop past the present (`looped`): its own rate, learnt apart from the
    matches', since a loop ends where no earlier occurrence said so."""
    return Source(drafter, ("loop",), LOOP_PRIOR)


def looped(seq: Sequence[int], tokens: list[int], depth: int) -> list[int]:
    """What follows `tokens` to `depth` if the text loops: where a continuation is the sequence's own last d tokens
    (its occurrence ran into the present), the text repeats with period d, and a lookup that stops at the present
    would offer a long loop one period a call. Nothing otherwise."""
    d = len(tokens)
    if not 0 < d < depth or list(seq[-d:]) != tokens:
        return []
    return [tokens[j % d] for j in range(d, depth)]


def with_loop(drafter: str, seq: Sequence[int], tokens: list[int], sources: list[Source], depth: int) -> Scored:
    """A lookup's path, `tokens` with their `sources`, gone on to `depth` with its loop where it ran into the present
    (`looped`), each node past the present from the loop's own source."""
    loop = looped(seq, tokens, depth)
    return Scored(tokens + loop, sources + [loop_source(drafter)] * len(loop))


def padded(
    drafter: str, tokens: list[int], sources: list[Source], n: int, newest: int, prior: float = PADDING_PRIOR
) -> Scored:
    """A chain of n: `tokens` (each with its source), then its last token repeated (the newest one where it has
    none), which seldom stands, each such node with `prior` as its chance: every row of a batch verifies one width."""
    pad = n - len(tokens)
    return Scored(
        tokens + [tokens[-1] if tokens else newest] * pad, sources + [Source(drafter, ("padding",), prior)] * pad
    )


def offered_by(found: Scored | Lattice) -> str:
    """The drafter that offered a path or a lattice."""
    sources = found.sources[0] if isinstance(found, Lattice) and found.sources else found.sources
    return sources[0].drafter if sources else ""
