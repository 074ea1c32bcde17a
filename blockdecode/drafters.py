"""Where proposals come from: the trained heads, n-gram lookup, or a scripted reference.

Any object with `propose(tokens, hidden, n)` is a drafter; exactness never depends on it,
only speed does, since every proposal is verified by the base model. The drafters here derive from
`BaseDrafter` and declare what more they can do: offer several paths for a tree, draw their ids from
the vocabulary (so the loop need not check them), observe the tokens a decode accepts. Any other
drafter is wrapped by `as_drafter` and offers its one chain. `DRAFTERS` names the built-in ones.
"""

from __future__ import annotations

import copy
import reprlib
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from blockdecode.expected import CONFIDENCE_BINS, Lattice, Scored, Source, confidence_source
from blockdecode.heads import short_projection
from blockdecode.hf import as_integer, at_least, weights_key
from blockdecode.tree import best_path, lattice_paths


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
        """`propose_paths`, each node with its source for ranking (`blockdecode.expected`): one key for
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

    layers: tuple[int, ...] = ()  # decoder layers whose inputs the drafter reads (EAGLE-3's), handed to `see`

    def see(self, row: int, features: torch.Tensor) -> None:
        """The base's features [m, F] at the next m positions of row `row` (those the decode keeps), read at
        `layers`: called after each forward, before the row's tokens are observed."""


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


class HeadsDrafter(BaseDrafter):
    """The paper's proposals: argmax of heads p2..p(n+1) at the newest position; for a tree, the
    most probable paths through each head's top guesses (the product of the heads' probabilities).

    `rescore` > 0 ranks those paths by the heads' probabilities times an n-gram model of the
    context to the power `rescore` (Kim et al., 2024, "Exploring and Improving Drafts in Blockwise
    Parallel Decoding"): the heads guess each position alone, and the n-gram model prefers paths
    that read on from one token to the next; the chain is then the best such path.

    On a CPU without native bf16 the heads' k-1 rows through the vocabulary cost several times
    more in bf16 than in fp32, as much as a forward of the base; the heads then run on fp32
    copies when a measurement says they are faster (`fastest_copies`). Proposals only: the
    verification, and so the output, is the base model's own in its own dtype.

    Sequential (hydra) heads propose in turn, each fed the embedding of the token before its own
    (`embeddings`: the base's input embedding); for a tree, each node's children come from the heads
    run along that node's own path (a beam of `width` paths a depth, the most probable nodes kept)."""

    def __init__(
        self,
        heads: torch.nn.Module,
        output_projection: torch.nn.Module,
        width: int = 8,
        rescore: float = 0.0,
        token_map: torch.LongTensor | None = None,
        embeddings: torch.nn.Module | None = None,
    ):
        """`token_map`: the draft vocabulary, the only ids the heads score (None: all of them)."""
        if not rescore >= 0:
            raise ValueError(f"rescore must be >= 0, got {rescore}")
        self.sequential = getattr(heads, "takes_tokens", False)
        if self.sequential and embeddings is None:
            raise ValueError("hydra heads need the base's input embeddings to propose")
        if self.sequential and rescore:
            raise ValueError("rescoring ranks the guesses of independent heads; hydra heads already see their path")
        self.heads, self.project, self.token_map, self.embed = heads, output_projection, token_map, embeddings
        short = short_rows(output_projection, token_map) if token_map is not None else output_projection
        self._run = fastest_copies(heads, short)  # what computes the proposals
        self.width = at_least(width, 1, "width must be an integer >= 1")  # guesses per head considered for a tree
        self.rescore = rescore
        self._contexts: list[ContextNgram] = []  # rescoring's model of each row's context, fed what it accepts

    def __eq__(self, other: object) -> bool:  # the same heads proposing the same way
        return (
            isinstance(other, HeadsDrafter)
            and (other.heads, other.project) == (self.heads, self.project)
            and (other.width, other.rescore) == (self.width, self.rescore)
        )

    def __hash__(self) -> int:
        return hash((id(self.heads), self.width, self.rescore))

    @property
    def name(self) -> str:
        return "heads-rescored" if self.rescore else "heads"

    @property
    def k(self) -> int | None:
        """The heads' block size: they propose at most k-1 tokens (None: heads that do not say)."""
        return getattr(self.heads, "k", None)

    def __repr__(self) -> str:
        return f"HeadsDrafter(rescore={self.rescore:g})" if self.rescore else "HeadsDrafter()"

    def start(self, prompts: list[list[int]]) -> None:
        if self.rescore:
            self._contexts = [ContextNgram(p) for p in prompts]

    def observe(self, row: int, accepted: list[int]) -> None:
        if self.rescore:
            self._contexts[row].extend(accepted)

    def _logits(self, hidden: torch.Tensor, n: int) -> torch.Tensor:
        heads, project = self._run
        # The first n heads' states alone, computed so (not sliced after: a slice's batch stride sends the
        # projection through a batched matmul copying its whole weight each call, 3x slower in bf16).
        return project(heads(hidden.to(project.weight.dtype), None, n))

    def _ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of positions in the scored vocabulary."""
        return indices if self.token_map is None else self.token_map.to(indices.device)[indices]

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        return self.propose_rows([tokens], hidden, n, [0])

    def propose_rows(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> torch.LongTensor:
        """Every row's chain from one pass of the heads over hidden [N, D]; rescoring ranks each
        row's paths by that row's own context."""
        if self.sequential:
            return self._chain(torch.cat([t[:, -1] for t in tokens]), hidden, n)
        if not self.rescore or not n:
            return self._ids(self._logits(hidden, n).argmax(-1))  # [N, n]
        values, ids = self._top(hidden, n, self.width)
        paths = [best_path(v, i, self._factor(t, r)) for v, i, t, r in zip(values, ids, tokens, rows)]
        return torch.tensor(paths, dtype=torch.long, device=hidden.device)

    def propose_paths(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[list[int]]:
        if self.sequential:
            return self._beam(tokens, hidden, depth, budget)
        values, ids = self._top(hidden, depth, min(self.width, budget))
        values, ids = values[0], ids[0]
        factor = self._factor(tokens, 0) if self.rescore else None
        return [path for path, _ in lattice_paths(values, ids, budget, factor)]

    def propose_scored(
        self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int
    ) -> list[Scored | Lattice]:
        """The heads' lattice, each guess's source its own probability (its prior, and the bin its
        acceptance is learnt in): a head's guess does not hang on the path before it, so a ranked tree
        may hang it under any node one depth above. Sequential heads, whose guesses do hang on the path,
        and rescored heads, propose paths."""
        if self.sequential or self.rescore:
            return super().propose_scored(tokens, hidden, depth, budget)
        values, ids = self._top(hidden, depth, min(self.width, budget))
        bins = (values[0] * CONFIDENCE_BINS).int().clamp(max=CONFIDENCE_BINS - 1).tolist()
        on, aside = (
            [confidence_source(self.name, (b + 0.5) / CONFIDENCE_BINS, a) for b in range(CONFIDENCE_BINS)]
            for a in (False, True)
        )
        return [
            Lattice(ids[0].tolist(), [[on[b] for b in row] for row in bins], [[aside[b] for b in row] for row in bins])
        ]

    def rows_scored(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> list[Scored]:
        """Every row's argmax chain from one pass of the heads, each node's source the heads' probability
        for it (sequential and rescored heads' chains hang on the path: one source, as any drafter's)."""
        if self.sequential or self.rescore:
            return super().rows_scored(tokens, hidden, n, rows)
        best, index = self._logits(hidden, n).float().softmax(-1).max(-1)
        return [
            Scored(chain, [self._source(p) for p in chances])
            for chain, chances in zip(self._ids(index).tolist(), best.tolist())
        ]

    def _source(self, probability: float) -> Source:
        return confidence_source(self.name, probability)

    def _chain(self, last: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        """Sequential heads' chains [N, n] after each row's newest token `last` [N]: each head's
        argmax, fed to the next."""
        heads, project = self._run
        state, chain = hidden.to(project.weight.dtype), []
        for i in range(n):
            state = heads.step(i, state, self.embed(last).to(state.dtype))
            last = self._ids(project(state).argmax(-1))
            chain.append(last)
        return torch.stack(chain, dim=1) if chain else last.new_empty((last.shape[0], 0))

    def _beam(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[list[int]]:
        """Sequential heads' tree: a beam of `width` paths a depth, each extended by the heads run along
        it; of all the nodes met, the `budget` most probable (a child never more than its parent, so they
        form a tree), returned as root-to-leaf paths, the most probable first."""
        heads, project = self._run
        beam = max(1, min(self.width, budget))
        state, last = hidden.to(project.weight.dtype), tokens[:, -1]
        score = torch.zeros(1, device=hidden.device)  # log-probability of each path in the beam
        paths: list[tuple[int, ...]] = [()]
        nodes: list[tuple[float, tuple[int, ...]]] = []
        for i in range(depth):
            state = heads.step(i, state, self.embed(last).to(state.dtype))
            logp = project(state).float().log_softmax(-1)  # [beam, V] (V: the draft vocabulary's)
            top, index = logp.topk(min(beam, logp.shape[-1]), dim=-1)
            total = (score[:, None] + top).flatten()
            keep = total.topk(min(beam, total.numel())).indices
            parent, score = keep // top.shape[1], total[keep]
            last, state = self._ids(index.flatten()[keep]), state[parent]
            paths = [paths[p] + (t,) for p, t in zip(parent.tolist(), last.tolist())]
            nodes += zip(score.tolist(), paths)
        chosen = [path for _, path in sorted(nodes, key=lambda node: (-node[0], len(node[1])))[:budget]]
        inner = {path[:j] for path in chosen for j in range(1, len(path))}
        return [list(path) for path in chosen if path not in inner]

    def _top(self, hidden: torch.Tensor, depth: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's heads' `width` most probable tokens: probabilities and ids, [N, depth, width] each."""
        probs = self._logits(hidden, depth).float().softmax(-1)  # [N, depth, V] (V: the draft vocabulary's)
        values, indices = probs.topk(min(width, probs.shape[-1]), dim=-1)
        return values, self._ids(indices)

    def _factor(self, tokens: torch.LongTensor, row: int) -> Callable[[tuple[int, ...], int], float]:
        """Row `row`'s rescoring factor, its context model rebuilt from `tokens` [1, T] when proposing
        outside a decode that keeps it informed."""
        self._contexts += [ContextNgram([]) for _ in range(row + 1 - len(self._contexts))]
        if len(self._contexts[row].seq) != tokens.shape[1]:
            self._contexts[row] = ContextNgram(tokens[0].tolist())
        lm, power = self._contexts[row], self.rescore
        return lambda path, token: lm.prob(path, token) ** power


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


_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # projection -> (key, heads, projection)
_SHORT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # projection -> (key, its draft-vocabulary rows)


def short_rows(projection: torch.nn.Module, token_map: torch.LongTensor) -> torch.nn.Module:
    """The projection's rows of the draft vocabulary, made once per set of weights and map (`weights_key`:
    2-3 ms a drafter for the built-in model's 1,024 rows otherwise)."""
    key = weights_key([*projection.parameters(), token_map])
    known = _SHORT.get(projection)
    if known is None or known[0] != key:
        _SHORT[projection] = known = (key, short_projection(projection, token_map))
    return known[1]


@torch.no_grad()  # not inference mode: the copies must be usable outside it
def fastest_copies(heads: torch.nn.Module, projection: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The heads and output projection to propose with: these, or fp32 copies of them where the
    weights are half precision on a CPU and the copies run the heads' rows faster (timed once per
    set of weights and thread count; a weight changed in place is timed and copied again)."""
    weight = projection.weight
    if weight.device.type != "cpu" or weight.dtype == torch.float32 or not isinstance(projection, torch.nn.Linear):
        return heads, projection
    key = (weights_key([*heads.parameters(), *projection.parameters()]), torch.get_num_threads())
    known = _COPIES.get(projection)
    if known is None or known[0] != key:
        fp32 = tuple(copy.deepcopy(m).float().requires_grad_(False) for m in (heads, projection))
        rows = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0))
        fastest = min([(heads, projection), fp32], key=lambda pair: _seconds(pair, rows))
        _COPIES[projection] = known = (key, *fastest)
    return known[1], known[2]


def _seconds(pair: tuple[torch.nn.Module, torch.nn.Module], rows: torch.Tensor, reps: int = 5) -> float:
    heads, projection = pair
    rows = rows.to(projection.weight.dtype)
    embeds = None
    if getattr(heads, "takes_tokens", False):  # the embeddings of the tokens before each head's own
        embeds = rows.new_zeros(*rows.shape[:-1], len(heads.up), heads.embed_size)
    samples = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        projection(heads(rows, embeds)).argmax(-1)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


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
        paths: list[tuple[int, list[int]]] = []
        for size, path in self.matches(tokens[0].tolist(), depth):
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
            Scored(path, [self._source(size, at, following[tuple(path[:at])], t) for at, t in enumerate(path)])
            for size, path in paths
        ]

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        return torch.tensor([self.chain_scored(tokens, hidden, n).tokens], dtype=torch.long, device=tokens.device)

    def rows_scored(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> list[Scored]:
        """Row by row: each row's match is found in its own tokens."""
        return [self.chain_scored(t, hidden[i : i + 1], n) for i, t in enumerate(tokens)]

    def chain_scored(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> Scored:
        """The newest match's continuation, keyed by the match's length, then padding, which seldom
        stands: a short or missing match is padded by repeating the newest token (any guess is safe to
        verify)."""
        seq = tokens[0].tolist()
        size, guess = next(self.matches(seq, n), (0, []))
        sources = [self._source(size, at) for at in range(len(guess))]
        pad = n - len(guess)
        guess += [guess[-1] if guess else seq[-1]] * pad
        return Scored(guess, sources + [Source(self.name, ("padding",), 0.1)] * pad)

    def _source(self, size: int, at: int, offered: list[int] = (), token: int = -1) -> Source:
        """The source of index `at` of a `size`-token match's continuation, `token`. At a fork, where the
        occurrences `offered` different tokens (the first `matches` yields first), its branch ("fork") and
        the others ("fork", "other") learn their own rates."""
        if len(offered) > 1:
            return Source(self.name, ("match", size, "fork") + (() if offered[0] == token else ("other",)), 0.5)
        return Source(self.name, ("match", size, "then" if at else "first"), 0.5)

    def propose_paths(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[list[int]]:
        return [scored.tokens for scored in self.propose_scored(tokens, hidden, depth, budget)]


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
