"""One tree by expected acceptance: every drafter's candidates ranked on one scale, their chance to
stand, and the tree's size chosen each call (issue 38).

Each candidate node carries a *source*: the drafter that proposed it, a key saying what kind of guess
it is (the heads' confidence bin, an n-gram match's length and whether it is the match's first token,
one key for any other drafter) and a prior chance that it stands if its parent does. Drafters offer
paths (`Scored`), or a lattice (`Lattice`: the heads' guesses at each depth, which do not hang on the
path before them, so they may follow any node one depth above, another drafter's too).

A node's chance p is its sources' best estimate, each the prior moved by this sequence's outcomes (a
Beta posterior per drafter and key, `Estimates`), capped by what its likelier siblings leave (at most
one of them stands; under a relaxed rule the cap bounds the chance that any does). A node's path
probability is the product of p down its path, so a child never outranks its parent and the N best
nodes always form a tree. The tree keeps the n best, where n maximises the expected tokens per second
of the call, (1 + the kept path probabilities' sum) / t(n + 1), t the machine's cost curve. After the
call every kept node whose parent stood is one trial of the source whose estimate placed it: a hit if
it stood under the acceptance rule decoded with (under topk:2, one of the model's two best there).

Exactness never depends on any of this: it decides only which candidates are verified."""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from blockdecode.core.tree import Tree
from blockdecode.decoding.estimates import DECAY, Estimates
from blockdecode.drafters.proposals import Lattice, Scored, Source, offered_by

CAP = 64  # the most candidates a ranked tree holds unless told fewer
OFFERED = 24  # paths a drafter offers a ranked tree: more than a call keeps of one drafter, for less work
_LEARN = 0.2  # how fast a drafter's measured time and yield follow the sequence
_RETRY = 0.995  # each call a drafter is not asked, its yield keeps this much of its distance from 1
_REACH_DECAY = 0.8  # each call, how much of a drafter's deepest kept node it is still asked past
FALLBACK_CALLS = 8  # calls a sequence's tree is judged against its parts before it may fall back to one
# how much faster a part alone must have been: a fallback on a closer call cost more than it saved (1.03-1.08x the
# default's total time without one, on the built-in model and Gemma 3 270M): a few calls' noise, and a text that
# turns, where the costlier drafters paid again
FALLBACK_MARGIN = 1.3
_RECENT = 0.8  # how much a chain fallen back to keeps of its past calls' tokens and time, each call
STANDS = 0.6  # a best candidate this likely is verified whatever the cost curve says: a wrong curve cannot make a
# decode greedy for good, and the calls it then times show the curve wrong
CHECK_CALLS = 8  # calls a greedy decode times (after its first) before it judges the cost curve it ranks with
OFF_BY = 2.0  # calls that took more than this many times the curve's t(q), or less than its inverse, disprove it


@dataclass(frozen=True)
class Ranking:
    """How a decode ranks its candidates: the machine's cost curve, (token count, seconds) pairs of one
    forward over a cached context, and the acceptance rates shipped with the model (`PRIORS`, by
    `source_name`), which replace the drafters' own priors where known. Each sequence ranks with its
    own `Ranker`, from these; it starts from what the last sequences ranked with them learnt of each
    drafter's time and yield and each source's chance (`learnt`), so a drafter that did not pay there is not asked
    at once again: a short decode would spend most of its calls learning that anew. Under sampling (`drafting`
    set) nothing is carried over, and the drafters' times are read from the cache, not measured: a seeded sampled
    run repeats, in this process and in another."""

    cost: tuple[tuple[int, float], ...]
    rates: tuple[tuple[str, float], ...] = ()
    # None: each drafter's time is measured as it proposes; else the seconds of those drafters read from the cache,
    # and any other drafter asked every call: what decides never hangs on this process's timings (sampling's seed)
    drafting: tuple[tuple[str, float], ...] | None = None
    measured: bool = False  # the curve was measured on this machine (`costs.cost_curve`): greedy decodes check it
    learnt: dict[str, dict[str, float]] = field(default_factory=dict, compare=False, repr=False)

    def start(self, decay: float | None = None) -> Ranker:
        if self.drafting is not None:  # nothing carried from earlier sequences: a seed repeats its run in-process too
            ranker = Ranker(dict(self.cost), dict(self.rates), DECAY if decay is None else decay)
            ranker.fixed = dict(self.drafting)
            return ranker
        cost = self.learnt.get("cost", self.cost)  # a curve a decode here measured again (`costs.remeasured`)
        ranker = Ranker(dict(cost), dict(self.rates), DECAY if decay is None else decay)
        ranker.clocked = [] if self.measured else None
        ranker.seconds_of.update(self.learnt.get("seconds", {}))
        ranker.yields.update(self.learnt.get("yields", {}))
        ranker.estimates.rates.update(self.learnt.get("rates", {}))
        return ranker

    def keep(self, ranker: Ranker) -> None:
        """What a finished sequence's ranker learnt of its drafters' time and yield and of its sources' chances, for
        the next one, which starts from them as priors (worth `PRIOR_WEIGHT` trials: its own text soon outweighs)."""
        self.learnt.update(seconds=dict(ranker.seconds_of), yields=dict(ranker.yields))
        self.learnt["rates"] = {**self.learnt.get("rates", {}), **ranker.estimates.believed()}


@dataclass
class Node:
    token: int
    parent: int  # index in the candidate trie; -1: the newest token
    sources: list[Source] = field(default_factory=list)


def _by_chance(entry: tuple) -> float:
    """Sort key: the likeliest first."""
    return -entry[0]


class Ranker:
    """One sequence's ranking: builds each call's tree from the drafters' scored paths and lattices,
    and learns from what stood. `cost` maps a call's token count (the newest token included) to its
    seconds; a measured curve is made non-decreasing (a call of more tokens never costs less)."""

    def __init__(self, cost: Mapping[int, float], rates: Mapping[str, float] | None = None, decay: float = DECAY):
        self.recost(cost)
        self.clocked: list[tuple[int, float]] | None = None  # where checked, this sequence's (tokens, seconds)
        self.estimates = Estimates(rates, decay)
        self._kept: list[tuple[int, Source]] = []  # the last tree's nodes: (parent in the tree, deciding source)
        self.sizes: list[int] = []  # each call's tree size
        self.seconds_of: dict[str, float] = {}  # each drafter's time to propose, lately
        self.fixed: dict[str, float] | None = None  # drafters' times read, not measured (`Ranking.drafting`)
        self.yields: dict[str, float] = {}  # each drafter's accepted proposals, lately, per token the others left
        self._asked: tuple[str, float, float] | None = None  # (drafter, expected tokens without it, most)
        self._reach: dict[str, float] = {}  # the deepest each drafter's nodes were kept, lately
        self._deepest: dict[str, int] = {}  # the last tree's deepest node of each drafter
        self._last: tuple[tuple, int, tuple] | None = None  # this call's last ranking: its candidates, cap, result
        # tokens, seconds (and calls): the trees' (None), each part's
        self.measured: dict[Part | None, list[float]] = {}
        self._parts: tuple[dict[Part, tuple[Tree, float]], float] | None = None  # this call's, to judge
        self.fallen_to: Part | None = None  # the part alone this sequence decodes with, once faster
        self.fell_at = 0  # the call it fell back at
        self.judged = 0  # calls judged so far
        self._tree_rate = 0.0  # the tree's tokens a second when this sequence fell back to a part
        self.news: list[str] = []  # what the decode should say of its falling back, not yet said

    def recost(self, cost: Mapping[int, float]) -> None:
        """Rank with cost curve `cost` from now on (made non-decreasing: timing noise never makes more cheaper)."""
        if not cost or any(q < 1 or not t > 0 for q, t in cost.items()):
            raise ValueError("the cost curve needs positive seconds for token counts >= 1")
        points = sorted(cost.items())
        floor = [min(t for _, t in points[i:]) for i in range(len(points))]
        self.points = [(q, t) for (q, _), t in zip(points, floor)]
        self._rates: list[float] = [0.0]  # _rates[n]: 1 / t(n), filled as far as a tree has needed
        self._last = None

    def clock(self, q: int, seconds: float) -> float | None:
        """One call of this sequence verified `q` tokens in `seconds` (verify and accept): once, after CHECK_CALLS
        calls past the first, how many times the curve's t(q) they took by median, where that is off by more than
        OFF_BY either way (the curve then wants measuring again); None otherwise."""
        if self.clocked is None:
            return None
        self.clocked.append((q, seconds))
        if len(self.clocked) <= CHECK_CALLS:
            return None
        calls, self.clocked = self.clocked[1:], None  # the first call warms up; judged once
        off = statistics.median(s / self.seconds(q) for q, s in calls)
        if 1 / OFF_BY <= off <= OFF_BY:
            return None
        self.clocked = calls  # what a new curve is checked against
        return off

    def seconds(self, q: int) -> float:
        """t(q), linear between the measured points: the first point's below them, proportional to q past them."""
        points = self.points
        if q <= points[0][0]:
            return points[0][1]
        for (q0, t0), (q1, t1) in zip(points, points[1:]):
            if q <= q1:
                return t0 + (t1 - t0) * (q - q0) / (q1 - q0)
        return points[-1][1] * q / points[-1][0]  # past the curve: as the last point, per token

    def rates(self, most: int) -> list[float]:
        """[0, 1 / t(1), ..., 1 / t(most)]: calls per second by token count, kept as far as asked."""
        while len(self._rates) <= most:
            self._rates.append(1.0 / self.seconds(len(self._rates)))
        return self._rates

    def chance(self, sources: Sequence[Source], memo: dict[Source, float]) -> float:
        """A node's chance to stand if its parent does: its best source's estimate (`memo` holds this
        call's, as many nodes share a source)."""
        best = 0.0
        for source in sources:
            p = memo.get(source)
            if p is None:
                p = memo[source] = self.estimates.chance(source)
            best = max(best, p)
        return best

    def tree(self, candidates: Sequence[Scored | Lattice], cap: int) -> Tree:
        """The tree of at most `cap` nodes whose expected tokens per second is the largest: nodes taken
        best path probability first, each a path's next token or a lattice's guess one depth down."""
        order, best, expected, memo = self._rank(candidates, cap)
        tree, self._kept, self._last = Tree(), [], None
        deepest = dict.fromkeys(map(offered_by, candidates), 0)
        for parent, token, sources, _ in order[:best]:
            decisive = max(sources, key=lambda source: memo.get(source, 0.0))  # whose estimate placed it
            tree.add(parent, token, decisive.drafter)
            self._kept.append((parent, decisive))
            deepest[decisive.drafter] = max(deepest.get(decisive.drafter, 0), tree.depths[-1])
        for drafter, depth in deepest.items():  # what this call's tree used of each drafter's offer
            self._reach[drafter] = max(depth, _REACH_DECAY * self._reach.get(drafter, depth))
        self._deepest = deepest
        self.sizes.append(len(tree))
        return tree

    def reach(self, drafter: str, depth: int) -> int:
        """How many tokens deep to ask `drafter` for this call: one past the deepest its nodes were kept
        lately, at most `depth` (all of it at first); twice that depth after a call that accepted it all,
        so a long match is followed at once, not a token a call. Trees seldom keep a lattice's long shots,
        and a drafter asked for fewer tokens may do less work (the heads read fewer weights)."""
        known = self._reach.get(drafter)
        return depth if known is None else min(depth, int(known) + 1)

    def worth_asking(self, drafter: str, candidates: Sequence[Scored | Lattice], depth: int, cap: int) -> bool:
        """Whether asking `drafter` for candidates besides `candidates` is expected to pay for its time
        this call: the tokens it would add, its yield (how many of its proposals stood lately, per token
        the others left: depth + 1 at most) times what they leave now, against its seconds (`timed`) as
        a share of the call. A drafter never timed is asked, and so is one whose time is not read where times are
        read rather than measured (`fixed`)."""
        seconds = self.seconds_of.get(drafter) if self.fixed is None else self.fixed.get(drafter)
        if seconds is None:
            return True
        _, best, expected, _ = self._rank(candidates, cap) if candidates else ([], 0, 1.0, {})
        self._asked = (drafter, expected, depth + 1.0)
        worth = self.yields.get(drafter, 1.0) * (depth + 1.0 - expected) / expected > seconds / self.seconds(best + 1)
        if not worth:  # a drafter not asked drifts back to the yield it started from, so it is tried again
            self._asked = None
            self.yields[drafter] = 1.0 - _RETRY * (1.0 - self.yields.get(drafter, 1.0))
        return worth

    def best_chain(self, chains: Sequence[Scored], cap: int) -> Scored:
        """Of several drafters' chains, the one whose best prefix is expected to gain the most tokens a second."""
        if len(chains) == 1:
            return chains[0]

        def rate(chain: Scored) -> float:
            _, best, expected, _ = self._rank([chain], cap)
            return expected / self.seconds(best + 1)

        return max(chains, key=rate)

    def gains(self, chain: Scored, most: int) -> list[float]:
        """The tokens a call is expected to gain verifying the first w of `chain`'s nodes, for w = 0 to
        `most` (or the chain's length): 1, then 1 plus the path probabilities so far."""
        memo: dict[Source, float] = {}
        gains, path = [1.0], 1.0
        for source in chain.sources[:most]:
            path *= self.chance([source], memo)
            gains.append(gains[-1] + path)
        return gains

    def take(self, chain: Scored, width: int) -> Tree:
        """The first `width` nodes of `chain` as this call's tree, each to learn for its own source."""
        tree, self._kept = Tree(), []
        for at, (token, source) in enumerate(zip(chain.tokens[:width], chain.sources)):
            tree.add(at, token, source.drafter)
            self._kept.append((at, source))
        self.sizes.append(len(tree))
        return tree

    def timed(self, drafter: str, seconds: float) -> None:
        """How long `drafter` took to propose this call: its cost in `worth_asking`."""
        self.seconds_of[drafter] = (1 - _LEARN) * self.seconds_of.get(drafter, seconds) + _LEARN * seconds

    def compare_parts(
        self,
        offered: Mapping[str, Sequence[Scored | Lattice]],
        spent: Mapping[str, float],
        size: int,
        cheapest: str,
        ranking: float = 0.0,
    ) -> None:
        """This call's tree (of `size` nodes) against `cheapest`, the part asked first every call, alone: `offered`,
        each drafter's candidates this call; `spent`, each drafter's seconds this call; `ranking`, the seconds spent
        choosing the tree besides (a part alone is not ranked: on a small model the ranking is a good share of a
        call). The part is judged as its chain (a path's tokens, a lattice's first guess at each depth) and, where it
        offers paths, as a tree of its own paths in their order, as many nodes as this call's tree; a call it offers
        nothing (no match yet) counts as one that gains the model's token alone. `observe` counts what each would have
        gained."""
        found = offered.get(cheapest, [])
        drafted = spent.get(cheapest, 0.0)
        parts = {Part(cheapest): (Tree.chain(chain_of(found)) if found else Tree(), drafted)}  # none: the model's token
        if not found or not isinstance(found[0], Lattice):
            parts[Part(cheapest, tree=True)] = (Tree.of_paths(found, size), drafted)
        self._parts = (parts, self.seconds(size + 1) + sum(spent.values()) + ranking)

    def alone(self, size: int, spent: float) -> None:
        """This call verifies the part fallen back to (`size` nodes, drafted in `spent` seconds): `observe` judges
        whether it still pays."""
        self._parts = ({}, self.seconds(size + 1) + spent)

    def _judge_parts(self, gained: Sequence[int]) -> None:
        """What the tree gained for its time, against what each part alone would have: its deepest path that greedy's
        tokens confirm (where one holds all of them, no more than they: a lower bound), plus the model's token, for a
        call of its size and its drafter's time. Once a part alone has gained `FALLBACK_MARGIN` times as much a
        second over `FALLBACK_CALLS` calls or more, this sequence decodes with that part alone (`fallen_to`); once
        it, over its recent calls, gains less a second than the tree did, the tree decodes again and is judged
        afresh (a loop ends, and the costlier drafters pay again)."""
        if self._parts is None:
            return
        parts, seconds = self._parts
        self._parts = None
        if self.fallen_to is not None:
            alone = self.measured.setdefault(self.fallen_to, [0.0, 0.0, 0])
            alone[0], alone[1] = _RECENT * alone[0] + len(gained), _RECENT * alone[1] + seconds
            self.judged += 1
            if self.judged - self.fell_at >= FALLBACK_CALLS and alone[0] / alone[1] < self._tree_rate:
                self.news.append(f"back to the tree from call {self.judged}: the {self.fallen_to} alone gained less")
                self.fallen_to, self.measured, self.judged = None, {}, 0
            return
        calls = self.measured.setdefault(None, [0.0, 0.0, 0])
        calls[0], calls[1] = calls[0] + len(gained), calls[1] + seconds
        for part, (tree, drafted) in parts.items():
            stood = tree.confirmed(gained)
            tokens = stood + 1 if stood < len(gained) else len(gained)
            measured = self.measured.setdefault(part, [0.0, 0.0, 0])
            measured[0], measured[1] = measured[0] + tokens, measured[1] + self.seconds(len(tree) + 1) + drafted
            measured[2] += 1
        self.judged += 1
        if self.judged < FALLBACK_CALLS:
            return
        rate = calls[0] / calls[1]
        faster = [(t / s, not part.tree, part) for part, (t, s, n) in self.measured.items()
                  if part is not None and n == self.judged and t / s > FALLBACK_MARGIN * rate]  # fmt: skip
        if faster:  # the fastest; of a chain and a tree as fast, the chain, which needs no ranking
            self.fallen_to, self.fell_at, self._tree_rate = max(faster)[2], self.judged, rate
            self.news.append(f"decoded with one part alone ({self.fallen_to}) from call {self.judged}, "
                             "faster for this sequence than the tree")  # fmt: skip

    def _rank(self, candidates: Sequence[Scored | Lattice], cap: int) -> tuple[list, int, float, dict]:
        """The candidate nodes best first, as (parent in the tree, token, sources, path probability); how
        many of them the tree keeps; the tokens it is expected to gain (1 + their path probabilities);
        and each source's chance this call. The same candidates ranked again within a call (asking a
        drafter was not worth it: the tree is what was ranked to decide) are the last ranking's."""
        last = self._last  # held, so no other object takes their ids
        if (
            last is None
            or last[1] != cap
            or len(last[0]) != len(candidates)
            or any(a is not b for a, b in zip(last[0], candidates))
        ):
            self._last = last = (tuple(candidates), cap, self._ranked(candidates, cap))
        return last[2]

    def _ranked(self, candidates: Sequence[Scored | Lattice], cap: int) -> tuple[list, int, float, dict]:
        trie: list[Node] = []
        index: dict[tuple[int, int], int] = {}
        guesses: tuple[list[dict], list[dict]] = ([], [])  # per depth, each lattice token's sources: aside, on
        tops: list[set[int]] = []  # per depth, the lattices' guesses
        for found in candidates:
            if isinstance(found, Lattice):
                for table, variant in zip(guesses, (found.aside, found.sources)):
                    table += [{} for _ in range(len(found.tokens) - len(table))]
                    for at, (tokens, sources) in enumerate(zip(found.tokens, variant)):
                        for token, source in zip(tokens, sources):
                            table[at].setdefault(token, []).append(source)
                tops += [set() for _ in range(len(found.tokens) - len(tops))]
                for at, tokens in enumerate(found.tokens):
                    tops[at].update(tokens)
                continue
            parent = -1
            for token, source in zip(found.tokens, found.sources):
                at = index.get((parent, token))
                if at is None:
                    at = index[(parent, token)] = len(trie)
                    trie.append(Node(token, parent))
                if source not in trie[at].sources:
                    trie[at].sources.append(source)
                parent = at
        explicit: dict[int, list[int]] = {}
        for i, node in enumerate(trie):
            explicit.setdefault(node.parent, []).append(i)
        memo: dict[Source, float] = {}
        ranked = [  # aside and on the lattices, per depth, their guesses best first: (chance, token, sources)
            [sorted(((self.chance(s, memo), t, s) for t, s in g.items()), key=_by_chance) for g in table]
            for table in guesses
        ]
        by_token = [[{entry[1]: entry for entry in entries} for entries in table] for table in ranked]
        shared: dict[tuple[int, bool], list] = {}  # the children of a node no path goes on from, by (depth, on)

        def children(at: int | None, depth: int, on: bool) -> list[tuple[float, int, list[Source], int | None, bool]]:
            """A node's children, best first, as (chance, token, sources, trie index, on the lattices):
            its paths' next tokens and its depth's lattice guesses, a token offered by both merged. A
            lattice's guesses after a node off it (another drafter's token, or one after such a node)
            stand less often: they have their own sources (`Lattice.aside`). At most one child stands
            (the parent's argmax), so each keeps its chance only up to what the better ones leave: a
            confident match is not diluted by the many long shots beside it."""
            own = explicit.get(at, []) if at is not None else []
            if not own and (depth, on) in shared:
                return shared[(depth, on)]
            lattice = ranked[on][depth] if depth < len(tops) else []
            found = [(p, t, s, None) for p, t, s in lattice]
            if own:
                tokens = {trie[i].token for i in own}
                found = [entry for entry in found if entry[1] not in tokens]
                for i in own:
                    node, guess = trie[i], by_token[on][depth].get(trie[i].token) if depth < len(tops) else None
                    sources = node.sources + [s for s in guess[2] if s not in node.sources] if guess else node.sources
                    found.append(
                        (max(self.chance(node.sources, memo), guess[0] if guess else 0.0), node.token, sources, i)
                    )
                found.sort(key=_by_chance)
            left, capped = 1.0, []
            for p, token, sources, i in found:
                capped.append((min(p, left), token, sources, i, on and depth < len(tops) and token in tops[depth]))
                left -= capped[-1][0]
            if not own:
                shared[(depth, on)] = capped
            return capped

        # best first: each heap entry is the next unplaced child of a placed node (its siblings follow lazily)
        heap: list[tuple[float, int, int, float, list, int]] = []  # (-path prob., tie, parent, its prob., children, i)
        order: list[tuple[int, int, list[Source], float]] = []  # (parent in the tree, token, sources, path prob.)
        depths, ties = [0], itertools.count()

        def offer(parent: int, probability: float, kids: list, i: int) -> None:
            if i < len(kids):
                heapq.heappush(heap, (-probability * kids[i][0], next(ties), parent, probability, kids, i))

        rates = self.rates(cap + 1)
        ends = [q - 1 for q, _ in self.points if 1 < q <= cap + 1] + [cap]  # where t(n + 1)'s slope changes
        best, total, rate = 0, 0.0, rates[1]
        offer(0, 1.0, children(-1, 0, True), 0)
        while heap and len(order) < cap:
            # Stop once no larger tree can pay: the next nodes are no likelier than the best left, and on
            # each straight piece of the cost curve the ratio is largest at one of its ends.
            n, next_best = len(order), -heap[0][0]
            if (n or next_best < STANDS) and all(
                (1.0 + total + (m - n) * next_best) * rates[m + 1] <= rate for m in ends if m > n
            ):
                break
            minus, _, parent, above, kids, i = heapq.heappop(heap)
            _, token, sources, at, on = kids[i]
            order.append((parent, token, sources, -minus))
            depths.append(depths[parent] + 1)
            offer(parent, above, kids, i + 1)
            offer(len(order), -minus, children(at, depths[-1], on), 0)
            total += -minus
            if (1.0 + total) * rates[n + 2] > rate or (n == 0 and total >= STANDS):
                best, rate = n + 1, (1.0 + total) * rates[n + 2]
        return order, best, rate / rates[best + 1], memo

    def observe(
        self,
        path: Sequence[int],
        chances: Sequence[float] | None = None,
        stood: Iterable[int] | None = None,
        gained: Sequence[int] | None = None,
    ) -> None:
        """The last tree's outcome: `path`, the accepted node indices from the root (0); `stood`, every node
        that stands with its whole path under the rule decoded with (default: the path's own; under topk:2 a
        sibling of the path may stand too, a hit for its source). `chances`, where known (under sampling:
        each node's p(x) at its parent, `decode.accept`), is what every node whose parent stood learns
        instead of whether it stood: its expected outcome, not one draw. `gained`: the tokens the call gained,
        greedy's own, against which each part of the tree is judged alone (`compare_parts`)."""
        stood = set(path if stood is None else stood)
        self._last = None  # estimates change: no ranking made before holds
        if gained is not None:
            self._judge_parts(gained)
        if self._asked is not None:  # what the drafter last asked added, of what the others left: its yield
            drafter, before, most = self._asked
            added = sum(self._kept[i - 1][1].drafter == drafter for i in path[1:]) / max(most - before, 1e-9)
            # from 1, a fifth of the way a call: one miss is no verdict
            self.yields[drafter] = (1 - _LEARN) * self.yields.get(drafter, 1.0) + _LEARN * added
            self._asked = None
        for drafter, depth in self._deepest.items():  # all it was asked for stood: ask it twice as deep
            if 0 < depth <= len(path) - 1:
                self._reach[drafter] = max(self._reach.get(drafter, 0.0), 2.0 * depth)
        self._deepest = {}
        self.estimates.forget()
        for i, (parent, source) in enumerate(self._kept, start=1):
            if parent in stood:  # one trial of the source whose estimate placed it: a long shot merged with
                outcome = chances[i - 1] if chances is not None else i in stood  # a sure match does not
                self.estimates.update(source, outcome)  # learn the match's rate
        self._kept = []  # a call that verifies no tree teaches nothing


@dataclass(frozen=True)
class Part:
    """One drafter of a ranked tree decoding alone: its chain, or (`tree`) a ranked tree of its candidates alone."""

    drafter: str
    tree: bool = False

    def __str__(self) -> str:
        return f"{self.drafter} {'tree' if self.tree else 'chain'}"


def chain_of(found: Sequence[Scored | Lattice]) -> list[int]:
    """A drafter's chain among its candidates: its best path, or its lattice's best guess at each depth."""
    first = found[0]
    return [row[0] for row in first.tokens if row] if isinstance(first, Lattice) else list(first.tokens)


def batch_width(rankers: Sequence[Ranker], chains: Sequence[Scored], most: int) -> int:
    """How many of each row's chain a batch verifies: one width for all rows, as a dense forward costs
    by its widest row; the width whose expected tokens, all rows' together, per second is the largest.
    A forward of B rows of w + 1 tokens is taken to cost what one row's of B(w + 1) tokens does (the
    same products and about the same attention): so a batch, costlier per position than one row, is
    verified shorter."""
    gains = [ranker.gains(chain, most) for ranker, chain in zip(rankers, chains)]
    seconds = rankers[0].seconds

    def rate(width: int) -> float:
        return sum(g[min(width, len(g) - 1)] for g in gains) / seconds(len(chains) * (width + 1))

    return max(range(most + 1), key=rate)
