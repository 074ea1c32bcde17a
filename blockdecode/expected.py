"""One tree by expected acceptance: every drafter's candidates ranked on one scale, their chance to
stand, and the tree's size chosen each call (issue 38).

Each candidate node carries a *source*: the drafter that proposed it, a key saying what kind of
guess it is (the heads' confidence bin, an n-gram match's length, one key for any other drafter) and a
prior chance that it
stands if its parent does. A node's chance p is its sources' best estimate, each the prior moved by
this sequence's outcomes (a Beta posterior per drafter and key, `Estimates`). A node's path
probability is the product of p down its path, so a child never outranks its parent and the N best
nodes always form a tree. The tree keeps the n best, where n maximises the expected tokens per
second of the call, (1 + the kept path probabilities' sum) / t(n + 1), t the machine's cost curve.
After the call every kept node whose parent stood is one trial of its sources: a hit if it stood.

Exactness never depends on any of this: it decides only which candidates are verified."""

from __future__ import annotations

import functools
import heapq
import sys
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockdecode.hf import same_weights, weights_key, weights_signature
from blockdecode.io import read_json
from blockdecode.timing import forward_cost
from blockdecode.tree import Tree

CAP = 64  # the most candidates a ranked tree holds unless told fewer
OFFERED = 24  # paths a drafter offers a ranked tree: more than a call keeps of one drafter, for less work
COST_POINTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 65)  # t(q) is measured here and interpolated between
DECAY = 0.93  # every call, past outcomes count this much less: a drafter dropped for a while is tried again
PRIOR_WEIGHT = 4.0  # trials a prior counts for: a few dozen calls of outcomes outweigh it
CONFIDENCE_BINS = 10  # the heads' probabilities, mapped to acceptance by a curve learnt per bin


@dataclass(frozen=True)
class Source:
    """Who proposed a node and what kind of guess it is: estimates are kept per (drafter, key)."""

    drafter: str
    key: tuple
    prior: float  # its chance to stand if its parent stands, before this sequence says otherwise


@dataclass(frozen=True)
class Ranking:
    """How a decode ranks its candidates: the machine's cost curve, (token count, seconds) pairs of one
    forward over a cached context, and the acceptance rates shipped with the model (`PRIORS`, by
    `source_name`), which replace the drafters' own priors where known. Each sequence ranks with its
    own `Ranker`, from these."""

    cost: tuple[tuple[int, float], ...]
    rates: tuple[tuple[str, float], ...] = ()

    def start(self, decay: float | None = None) -> Ranker:
        return Ranker(dict(self.cost), dict(self.rates), DECAY if decay is None else decay)


def source_name(drafter: str, key: tuple) -> str:
    """A source's name in a priors file: "heads confidence 3", "ngram match 2"."""
    return " ".join(map(str, (drafter, *key)))


PRIORS = "ranking.json"  # beside a saved model: its drafters' acceptance rates, by source


def shipped_rates(folder: str | Path | None, signature: list[float]) -> dict[str, float]:
    """The acceptance rates saved beside a model (`calibrate.record_rates`) if they are for these weights
    (`hf.weights_signature`); none otherwise. A damaged file is one line on stderr, then ignored: the
    drafters' own priors serve, and the sequence teaches the rest."""
    path = Path(folder) / PRIORS if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        saved = read_json(path)
        rates = saved.get("rates") if isinstance(saved, dict) else None
        if not isinstance(rates, dict) or not all(isinstance(v, float) and 0 <= v <= 1 for v in rates.values()):
            raise ValueError(f"{path} holds no acceptance rates between 0 and 1")
    except ValueError as err:
        print(f"blockdecode: {err}; ranking from the drafters' own priors", file=sys.stderr)
        return {}
    found = saved.get("signature")
    return rates if isinstance(found, list) and same_weights(found, signature) else {}


def own_prior(drafter: str, key: tuple) -> float:
    """The prior the drafters here give a source of this key: a confidence bin's middle, 0.1 for an
    n-gram's padding, an even chance otherwise."""
    if key[0] == "confidence":
        return _confidence_source(drafter, key[1]).prior
    return 0.1 if key[0] == "padding" else 0.5


_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # BlockwiseLM -> (key, Ranking)


def model_ranking(lm, context: torch.LongTensor, cache_implementation: str = "dynamic") -> Ranking:
    """The ranking for BlockwiseLM `lm` on this machine: its base's cost curve over `context` (the prompt)
    and the rates shipped beside it (`shipped_rates`), found once per set of weights, thread count and
    cache kind in a process (about half a second), not at every `generate`."""
    key = (weights_key(lm.parameters()), torch.get_num_threads(), cache_implementation)
    known = _MEASURED.get(lm)
    if known is None or known[0] != key:
        cost = forward_cost(lm.base, context[:1], COST_POINTS, reps=3, cache_implementation=cache_implementation)
        rates = shipped_rates(lm.base_location, weights_signature(lm))
        _MEASURED[lm] = known = (key, Ranking(tuple(sorted(cost.items())), tuple(sorted(rates.items()))))
    return known[1]


@dataclass
class Scored:
    """A drafter's candidate path from the newest token, with a source for each of its nodes."""

    tokens: list[int]
    sources: list[Source]


def confidence_source(drafter: str, probability: float) -> Source:
    """The source of a guess its drafter gave `probability`: its bin (acceptance is learnt per bin),
    whose middle is the prior. One object a bin, so ranking compares sources by identity."""
    return _confidence_source(drafter, min(CONFIDENCE_BINS - 1, int(probability * CONFIDENCE_BINS)))


@functools.cache
def _confidence_source(drafter: str, bin: int) -> Source:
    return Source(drafter, ("confidence", bin), (bin + 0.5) / CONFIDENCE_BINS)


class Estimates:
    """Per (drafter, key), hits and trials of this sequence on top of the prior (a Beta posterior
    whose prior counts `PRIOR_WEIGHT` trials): the rate shipped with the model for that source if
    `rates` holds it, else the drafter's own prior."""

    def __init__(self, rates: Mapping[str, float] | None = None, decay: float = DECAY) -> None:
        self.counts: dict[tuple[str, tuple], list[float]] = {}
        self.rates = dict(rates or {})
        self.decay = decay

    def prior(self, source: Source) -> float:
        return self.rates.get(source_name(source.drafter, source.key), source.prior)

    def chance(self, source: Source) -> float:
        hits, trials = self.counts.get((source.drafter, source.key), (0.0, 0.0))
        return (self.prior(source) * PRIOR_WEIGHT + hits) / (PRIOR_WEIGHT + trials)

    def update(self, source: Source, stood: bool) -> None:
        counts = self.counts.setdefault((source.drafter, source.key), [0.0, 0.0])
        counts[0] += stood
        counts[1] += 1

    def forget(self) -> None:
        """Every outcome so far counts DECAY as much: estimates follow a sequence whose text changes,
        and one whose nodes were dropped drifts back to its prior, to be tried again."""
        for counts in self.counts.values():
            counts[0] *= self.decay
            counts[1] *= self.decay

    def rates_seen(self, least: float = 5.0) -> dict[str, float]:
        """The hit rate of every source with at least `least` trials, by `source_name`."""
        return {source_name(*k): h / t for k, (h, t) in sorted(self.counts.items()) if t >= least}


@dataclass
class Node:
    token: int
    parent: int  # index in the candidate trie; -1: the newest token
    sources: list[Source] = field(default_factory=list)


class Ranker:
    """One sequence's ranking: builds each call's tree from the drafters' scored paths, and learns
    from what stood. `cost` maps a call's token count (the newest token included) to its seconds."""

    def __init__(self, cost: Mapping[int, float], rates: Mapping[str, float] | None = None, decay: float = DECAY):
        if not cost or any(q < 1 or not t > 0 for q, t in cost.items()):
            raise ValueError("the cost curve needs positive seconds for token counts >= 1")
        self.points = sorted(cost.items())
        self.estimates = Estimates(rates, decay)
        self._kept: list[tuple[int, list[Source]]] = []  # the last tree's nodes: (parent in the tree, sources)
        self.sizes: list[int] = []  # each call's tree size

    def seconds(self, q: int) -> float:
        """t(q), linear between the measured points: the first point's below them, proportional to q past them."""
        points = self.points
        if q <= points[0][0]:
            return points[0][1]
        for (q0, t0), (q1, t1) in zip(points, points[1:]):
            if q <= q1:
                return t0 + (t1 - t0) * (q - q0) / (q1 - q0)
        return points[-1][1] * q / points[-1][0]  # past the curve: as the last point, per token

    def chance(self, node: Node, memo: dict[Source, float]) -> float:
        """The node's chance to stand if its parent does: its best source's estimate (`memo` holds this
        call's, as many nodes share a source)."""
        best = 0.0
        for source in node.sources:
            p = memo.get(source)
            if p is None:
                p = memo[source] = self.estimates.chance(source)
            best = max(best, p)
        return best

    def tree(self, candidates: Sequence[Scored], cap: int) -> Tree:
        """The tree of at most `cap` nodes whose expected tokens per second is the largest."""
        trie: list[Node] = []
        index: dict[tuple[int, int], int] = {}
        for path in candidates:
            parent = -1
            for token, source in zip(path.tokens, path.sources):
                at = index.get((parent, token))
                if at is None:
                    at = index[(parent, token)] = len(trie)
                    trie.append(Node(token, parent))
                if source not in trie[at].sources:
                    trie[at].sources.append(source)
                parent = at
        children: dict[int, list[int]] = {}
        for i, node in enumerate(trie):
            children.setdefault(node.parent, []).append(i)
        memo: dict[Source, float] = {}

        def siblings(parent: int) -> list[tuple[int, float]]:
            """A node's children and their chances, scaled to sum to at most 1: at most one of them
            stands (the parent's argmax), whatever each source says alone."""
            found = [(i, self.chance(trie[i], memo)) for i in children.get(parent, [])]
            total = max(1.0, sum(p for _, p in found))
            return [(i, p / total) for i, p in found]

        heap = [(-p, i) for i, p in siblings(-1)]
        heapq.heapify(heap)
        order: list[tuple[int, float]] = []  # (trie index, path probability), best first
        while heap and len(order) < cap:
            minus, i = heapq.heappop(heap)
            order.append((i, -minus))
            for child, p in siblings(i):
                heapq.heappush(heap, (minus * p, child))
        best, total = 0, 0.0
        rate = 1.0 / self.seconds(1)
        for n, (_, probability) in enumerate(order, start=1):
            total += probability
            if (1.0 + total) / self.seconds(n + 1) > rate:
                best, rate = n, (1.0 + total) / self.seconds(n + 1)
        tree, placed = Tree(), {-1: 0}
        self._kept = []
        for i, _ in order[:best]:
            node = trie[i]
            placed[i] = tree.add(placed[node.parent], node.token, node.sources[0].drafter)
            self._kept.append((placed[node.parent], node.sources))
        self.sizes.append(len(tree))
        return tree

    def observe(self, path: Sequence[int]) -> None:
        """The last tree's outcome: `path`, the accepted node indices from the root (0)."""
        stood = set(path)
        self.estimates.forget()
        for i, (parent, sources) in enumerate(self._kept, start=1):
            if parent in stood:
                for source in sources:
                    self.estimates.update(source, i in stood)
        self._kept = []  # a call that verifies no tree teaches nothing
