"""Where proposals come from: the trained heads, n-gram lookup, or a scripted reference.

Any object with `propose(tokens, hidden, n)` is a drafter; exactness never depends on it,
only speed does, since every proposal is verified by the base model. The drafters here derive from
`BaseDrafter` and declare what more they can do: offer several paths for a tree, draw their ids from
the vocabulary (so the loop need not check them), observe the tokens a decode accepts. Any other
drafter is wrapped by `as_drafter` and offers its one chain. `DRAFTERS` names the built-in ones.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from blockdecode.core.hf import as_integer, at_least
from blockdecode.drafters.proposals import Scored, Source


@runtime_checkable
class Drafter(Protocol):
    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        """tokens [1, T]: everything decoded so far, ending with the base model's newest token;
        hidden [1, D]: the base model's final hidden state at the position that produced that token;
        returns [1, n]: guesses for the n tokens that follow."""
        ...


class BaseDrafter:
    """A drafter's abilities, with what a drafter that declares none does: one chain for a tree,
    nothing to observe."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        raise NotImplementedError

    def propose_rows(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> torch.LongTensor:
        """A chain for each row of a batch: tokens[i] [1, T_i] is row rows[i]'s sequence (no padding),
        hidden [N, D] the rows' hidden states; returns [N, n]. Here: `propose`, row by row, each
        row's answer checked for its shape (the caller checks the ids)."""
        chains = [self.propose(t, hidden[i : i + 1], n) for i, t in enumerate(tokens)]
        for chain in chains:
            check_proposal(chain, n)
        return torch.cat(chains)

    def propose_paths(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[list[int]]:
        """Candidate paths for a tree, best first: here the one chain."""
        return check_proposal(self.propose(tokens, hidden, depth), depth)

    def propose_scored(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[Scored]:
        """`propose_paths`, each node with its source for ranking (`blockdecode.decoding.ranking`): one key for
        every node, its prior an even chance, so this sequence's hit rate decides; a node's chance given
        its parent's, so the first nodes' outcomes speak for the deeper ones too."""
        paths = check_paths(self.propose_paths(tokens, hidden, depth, budget), depth, None)
        return [Scored(path, [Source(self.name, ("any",), 0.5)] * len(path)) for path in paths]

    def chain_scored(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> Scored:
        """`propose`'s chain, each node with its source for ranking: as `propose_scored`'s."""
        return self.rows_scored([tokens], hidden, n, [0])[0]

    def rows_scored(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> list[Scored]:
        """`propose_rows`' chains, each node with its source for ranking: as `propose_scored`'s."""
        chains = check_proposal(self.propose_rows(tokens, hidden, n, rows), n, len(tokens))
        return [Scored(chain, [Source(self.name, ("any",), 0.5)] * n) for chain in chains]

    def start(self, prompts: list[list[int]]) -> None:
        """A decode begins from `prompts`, one a row (the sequences the decoder extends)."""

    def observe(self, row: int, accepted: list[int]) -> None:
        """A call gained `accepted` for row `row`: the tokens now at that sequence's end."""

    deepest: int | None = None  # the most tokens ahead it guesses (None: as many as asked; past it, a chain pads)

    def depth_for(self, n: int) -> int:
        """How deep it guesses when asked for n: n, or `deepest` if fewer."""
        return n if self.deepest is None else min(n, self.deepest)

    layers: tuple[int, ...] = ()  # decoder layers whose inputs the drafter reads (EAGLE-3's), handed to `see`
    decoder_only = False  # whether it drafts for decoder-only bases alone (EAGLE-3: its training is theirs)

    def see(self, row: int, features: torch.Tensor) -> None:
        """The base's features [m, F] at the next m positions of row `row` (those the decode keeps), read at
        `layers`: called after each forward, before the row's tokens are observed."""


class RowChains(BaseDrafter):
    """A drafter whose proposals are each row's own chain, scored node by node (`_chain`): one row or a batch."""

    def _chain(self, row: int, tokens: torch.LongTensor, n: int) -> Scored:
        raise NotImplementedError

    def chain_scored(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> Scored:
        return self._chain(0, tokens, n)

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        return torch.tensor([self._chain(0, tokens, n).tokens], dtype=torch.long, device=tokens.device)

    def rows_scored(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> list[Scored]:
        return [self._chain(row, t, n) for t, row in zip(tokens, rows)]

    def propose_rows(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> torch.LongTensor:
        chains = [self._chain(row, t, n).tokens for t, row in zip(tokens, rows)]
        return torch.tensor(chains, dtype=torch.long, device=tokens[0].device).view(len(rows), n)


class ChainDrafter(BaseDrafter):
    """Any object with `propose(tokens, hidden, n)`, decoded as it is: its one chain, its ids checked."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        return self.drafter.propose(tokens, hidden, n)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChainDrafter) and other.drafter is self.drafter

    def __hash__(self) -> int:
        return id(self.drafter)

    @property
    def name(self) -> str:
        return type(self.drafter).__name__

    def __repr__(self) -> str:
        return self.name


def as_drafter(drafter: object) -> BaseDrafter:
    """`drafter` with its abilities declared: as it is if it derives from BaseDrafter, else wrapped."""
    if isinstance(drafter, BaseDrafter):
        return drafter
    if not callable(getattr(drafter, "propose", None)):
        raise TypeError(f"a drafter needs a propose(tokens, hidden, n) method; {type(drafter).__name__} has none")
    return ChainDrafter(drafter)


def as_drafters(drafter: object) -> tuple[BaseDrafter, ...]:
    """A drafter, or a list of them, as the tuple a plan holds; a clear error for anything else."""
    given = list(drafter) if isinstance(drafter, Sequence) and not isinstance(drafter, str | bytes) else [drafter]
    if not given:
        raise ValueError("no drafter given: pass a drafter, a list of them, or a name")
    names = [d for d in given if isinstance(d, str)]
    if names:  # generate and model.plan take names, in one string
        raise TypeError(
            f"{reprlib.repr(drafter)}: a list of drafters, or a DecodePlan's, holds Drafter objects, not names: "
            f"name drafters in one string, {'+'.join(names)!r}, for generate or model.plan"
        )
    return tuple(as_drafter(d) for d in given)


def check_proposal(draft: object, n: int, rows: int = 1) -> list[list[int]]:
    """The ids of a drafter's chains, which must be a LongTensor [rows, n]; a clear error otherwise
    (the caller checks the ids against the vocabulary, `check_ids`)."""
    if not isinstance(draft, torch.Tensor):
        raise TypeError(
            f"the drafter returned {type(draft).__name__}; it must return a LongTensor of shape [{rows}, {n}]"
        )
    if tuple(draft.shape) != (rows, n):
        raise ValueError(f"the drafter returned shape {tuple(draft.shape)}; expected [{rows}, {n}]")
    if draft.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"the drafter returned dtype {draft.dtype}; token ids must be integers")
    return draft.tolist()


def check_paths(paths: object, depth: int, vocab_size: int | None) -> list[list[int]]:
    """A drafter's paths for a tree, each cut to `depth`, as lists of ids of the vocabulary; a clear
    error for anything else (a tensor [P, L] is P paths)."""
    if isinstance(paths, torch.Tensor) and paths.dim() == 2:
        paths = list(paths)
    if not isinstance(paths, Sequence) or isinstance(paths, str | bytes):
        raise TypeError(f"propose_paths returned {type(paths).__name__}; it must return a list of lists of token ids")
    if vocab_size is None:  # the caller checks the ids
        return [path_ids(path)[:depth] for path in paths]
    return [check_ids(path_ids(path)[:depth], vocab_size) for path in paths]


def path_ids(path: object) -> list[int]:
    """One path's token ids as ints: a list (or tuple) of integers, or a 1-D integer tensor."""
    if isinstance(path, torch.Tensor) and path.dim() == 1 and path.dtype in (torch.int64, torch.int32):
        return path.tolist()
    if isinstance(path, Sequence) and not isinstance(path, str | bytes):
        ids = [t if type(t) is int else as_integer(t) for t in path]
        if None not in ids:
            return ids
    raise TypeError(f"propose_paths returned the path {reprlib.repr(path)}; a path must be a list of integer token ids")


def check_ids(ids: list[int], vocab_size: int) -> list[int]:
    """`ids`, if every one is a token of the vocabulary [0, vocab_size); the one error for a chain or a tree."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"the drafter proposed token ids outside the vocabulary [0, {vocab_size})")
    return ids


class ScriptedDrafter(BaseDrafter):
    """Proposes a known continuation (e.g. the greedy reference), each token right with
    probability `accuracy` and replaced by another id otherwise: every acceptance length
    can be exercised, and accuracy=1 gives the ceiling a perfect drafter reaches. A sequence of
    accuracies gives each depth its own (the last for any deeper): a real drafter's profile, whose
    deeper guesses stand less often."""

    def __init__(
        self, reference: torch.LongTensor, vocab_size: int, accuracy: float | Sequence[float] = 1.0, seed: int = 0
    ):
        if not isinstance(reference, torch.Tensor) or reference.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"reference must be a LongTensor of token ids (e.g. greedy's output sequences), got "
                f"{type(reference).__name__} {reprlib.repr(reference)}"
            )
        rates = [accuracy] if isinstance(accuracy, (int, float)) else list(accuracy)
        if not rates or not all(isinstance(a, (int, float)) and 0.0 <= a <= 1.0 for a in rates):
            raise ValueError(f"accuracy must lie in [0, 1] (or be a list of such, one a depth), got {accuracy}")
        self.reference = reference.reshape(-1).tolist()
        self.rates = rates
        self.vocab_size = at_least(vocab_size, 1, "vocab_size must be an integer >= 1")
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        start = tokens.shape[1]
        truth = self.reference[start : start + n]
        truth += [0] * (n - len(truth))
        draws = torch.rand(n, generator=self.rng).tolist()
        wrong = [draw >= self.rates[min(d, len(self.rates) - 1)] for d, draw in enumerate(draws)]
        guess = [(t + 1) % self.vocab_size if bad else t for t, bad in zip(truth, wrong)]
        return torch.tensor([guess], dtype=torch.long, device=tokens.device)
