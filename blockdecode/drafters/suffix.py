"""Suffix lookup: draft from a suffix automaton over every token seen, with count-based chances.

`SuffixDrafter` finds the longest suffix of the sequence that occurred before, in this sequence, in a
model's remembered outputs or in a corpus (`blockdecode.drafters.sources`: suffix arrays), and proposes what
followed it: a trie of continuations, each node's chance its count over its siblings' total, so a path's
probability is the share of earlier occurrences that went on that way.

Why a suffix automaton: it takes one token at a time in amortised O(1) (a suffix array would be rebuilt
as the sequence grows), finds a context's longest occurring suffix in O(its length), and a state's
transitions are the continuations of every string it holds. Each state counts how often its strings
occur by a walk along suffix links at each append, kept to strings of at most `longest` tokens: that
walk grows with the text in a model's loops, and no query reads longer strings.

Measured (pure Python 3.11, one core of a shared 2-core AMD EPYC whose load moves timings by up to 2x; contexts
of 512 tokens the index has not seen; a lookup is the matches plus a 24-node trie of depth 8, or a chain
of 8):

- 1M random ids over a vocabulary of 8,192: 2.8-4.8 µs a token to index, 0.41 GB. 10M, measured: 50 s
  (5.0 µs a token) and 3.9 GB, so the issue's 60 s holds but memory (a dict of transitions per state)
  is what limits a corpus: past a few million tokens it needs the automaton in flat arrays (numpy or
  `array`), which would cut the memory but not the time, as appends stay sequential Python. Lookups
  (1-token matches with ~120 continuations each seen once, the worst case): 0.25 ms a trie (0.29 ms at
  p90), 0.05 ms a chain.
- 1M ids of the standard library's source under the built-in model's tokenizer: 2.6-5.2 µs a token,
  0.46 GB. Matches of 6 tokens (median; 2 at p10, 32 at p90); 0.14 ms a trie (0.40 ms at p90: short
  matches with hundreds of continuations), 0.03 ms a chain (0.05 ms at p90).
- A model's loop: 1.7 µs a token repeating 3 tokens, 3.9 µs repeating one (the capped walk); indexing
  a 2,000-token prompt at `start`: 1.0-1.8 ms.
"""

from __future__ import annotations

import copy
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from blockdecode.core.hf import as_integer, at_least
from blockdecode.drafters.base import BaseDrafter
from blockdecode.drafters.proposals import Scored, confidence_source, padded, with_loop
from blockdecode.drafters.sources import DEPTH, Memory, SuffixArray


class SuffixIndex:
    """A suffix automaton over token sequences (documents), appended one token at a time, each state with
    how often its strings occur and where they last ended. Counts and positions hold for strings of at
    most `longest` tokens, the only ones asked about."""

    def __init__(self, longest: int):
        self.longest = longest
        self.next: list[dict[int, int]] = [{}]  # state -> token -> state
        self.link = [-1]  # state -> the state of its strings' longest suffix held elsewhere
        self.length = [0]  # state -> its longest string's length
        self.count = [0]  # state -> how often its strings occur
        self.newest = [-1]  # state -> where its strings last ended (tokens appended before, all documents)
        self.size = 0  # tokens appended
        self.last = 0  # the state of the open document's whole text
        self.tail = (0, 0)  # the state of its newest min(longest, its length) tokens, and that length

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def close(self) -> None:
        """End the open document: the next token starts another, and no string runs across the two."""
        self.last, self.tail = 0, (0, 0)

    def append(self, token: int) -> None:
        nxt, link, length = self.next, self.link, self.length
        last = self.last
        q = nxt[last].get(token)
        if q is not None:  # this document so far is text an earlier one holds
            cur = q if length[q] == length[last] + 1 else self._split(last, q, token)
        else:
            cur, p = self._state(length[last] + 1, 0), last
            while p != -1 and token not in nxt[p]:
                nxt[p][token] = cur
                p = link[p]
            if p != -1:
                q = nxt[p][token]
                link[cur] = q if length[q] == length[p] + 1 else self._split(p, q, token)
        self.last = cur
        state, size = self.tail  # if it was just split, its copy has the same transitions
        state, size = nxt[state][token], size + 1
        if size > self.longest:
            size -= 1
            state = link[state] if length[link[state]] >= size else state
        self.tail = (state, size)
        count, newest, position = self.count, self.newest, self.size
        while state > 0:  # every suffix of the newest `longest` tokens occurs once more, here
            count[state] += 1
            newest[state] = position
            state = link[state]
        self.size += 1

    def match(self, context: Sequence[int], most: int) -> tuple[int, int]:
        """The state and length of the longest suffix of `context`, of at most `most` tokens, held here."""
        nxt, link, length = self.next, self.link, self.length
        state = size = 0
        for token in context[max(0, len(context) - most) :]:
            while state and token not in nxt[state]:
                state = link[state]
                size = length[state]
            if token in nxt[state]:
                state, size = nxt[state][token], size + 1
        return state, size

    def levels(self, state: int, size: int) -> list[tuple[int, int]]:
        """(length, state) of the suffixes of a match, longest first: each shorter one occurs more often."""
        found = []
        while state > 0:
            found.append((size, state))
            state = self.link[state]
            size = self.length[state]
        return found

    def finder(self, context: Sequence[int], most: int) -> tuple[int, Callable[[int], int | None]]:
        """The longest suffix of `context` (at most `most` tokens) held here, and a function giving the
        state holding the suffix of each length up to it."""
        found = self.levels(*self.match(context, most))[::-1]  # shortest first

        def node(size: int) -> int | None:
            return next((s for n, s in found if n >= size), None)

        return (found[-1][0] if found else 0), node

    def children(self, state: int) -> list[tuple[int, int, int, int]]:
        """What followed the state's strings: (token, how often, where it last ended, its state)."""
        count, newest = self.count, self.newest
        return [(t, count[c], newest[c], c) for t, c in self.next[state].items()]

    def went_on(self, state: int) -> int:
        """How many occurrences of the state's strings went on."""
        count = self.count
        return sum(count[c] for c in self.next[state].values())

    def _state(self, length: int, link: int, nxt: dict | None = None, count: int = 0, newest: int = -1) -> int:
        self.next.append({} if nxt is None else nxt)
        self.link.append(link)
        self.length.append(length)
        self.count.append(count)
        self.newest.append(newest)
        return len(self.length) - 1

    def _split(self, p: int, q: int, token: int) -> int:
        """State q with its strings of at most length[p] + 1 tokens moved to a state of their own, which
        p and its suffixes now reach on `token`: those strings are about to occur once more than q's longer
        ones."""
        nxt, link = self.next, self.link
        clone = self._state(self.length[p] + 1, link[q], dict(nxt[q]), self.count[q], self.newest[q])
        while p != -1 and nxt[p].get(token) == q:
            nxt[p][token] = clone
            p = link[p]
        link[q] = clone
        return clone


Lookup = SuffixIndex | SuffixArray  # a source: the sequence's automaton, or a corpus's or memory's suffix array
Place = list[tuple[Lookup, object]]  # one string's node in each source that holds it


class SuffixDrafter(BaseDrafter):
    """Proposes what followed the longest earlier occurrence of the sequence's suffix (at most `max_match`
    tokens), as a trie of continuations whose chances are counts; for a tree, shorter matches fill the
    budget the longest leaves. Three sources: this sequence; `memory`, a model's earlier outputs
    (`blockdecode.drafters.sources.Memory`, read as it stood when the decode began); and `corpus`, token sequences
    or `SuffixArray`s (`blockdecode.drafters.sources.corpus_index`: files a user names, tokenized).

    One rule ranks every source: match length first (the longest suffix whose earlier occurrences went on
    at least `min_count` times, in every source together), then the counts of those occurrences, pooled.
    So another source never outbids a longer match in this sequence, and where both match as long their
    occurrences count alike; on equal counts the newer occurrence comes first, this sequence's before the
    memory's (newest output first) and the memory's before the corpus's. A suffix array finds matches of
    at most `sources.LONGEST` tokens."""

    name = "suffix"

    def __init__(
        self,
        corpus: Iterable[Sequence[int] | SuffixArray] = (),
        max_match: int = 32,
        min_count: int = 1,
        memory: Memory | None = None,
    ):
        self.max_match = at_least(max_match, 1, "max_match must be an integer >= 1")
        self.min_count = at_least(min_count, 1, "min_count must be an integer >= 1")
        corpus = list(corpus)
        arrays = [c for c in corpus if isinstance(c, SuffixArray)]
        documents = [token_ids(c) for c in corpus if not isinstance(c, SuffixArray)]
        self.corpus: tuple[SuffixArray, ...] = (*arrays, *([SuffixArray.of(documents)] if documents else []))
        self.memory = memory
        self._view: tuple[SuffixArray, ...] | None = None  # the memory as a decode began; None outside one
        self._rows: list[tuple[list[int], SuffixIndex]] = []  # each row's tokens and their index
        self._loose: tuple[list[int], SuffixIndex] = ([], SuffixIndex(self.longest))  # outside a decode

    @property
    def longest(self) -> int:
        """The longest strings this sequence's index counts: a match and the continuation read after it."""
        return self.max_match + DEPTH

    def __repr__(self) -> str:
        corpus = f"{sum(c.size for c in self.corpus)} corpus tokens"
        memory = ", memory" if self.memory is not None else ""
        return f"SuffixDrafter({corpus}{memory}, max_match={self.max_match}, min_count={self.min_count})"

    def using(self, memory: Memory | None, corpus: Sequence[SuffixArray] = ()) -> SuffixDrafter:
        """A drafter as this one, reading `memory` (None: none) and `corpus` beside its own, with no decode
        under way: one for each decode, so that threads sharing a plan each keep their own rows."""
        drafter = copy.copy(self)
        drafter.memory, drafter.corpus = memory, (*self.corpus, *corpus)
        drafter._view, drafter._rows, drafter._loose = None, [], ([], SuffixIndex(self.longest))
        return drafter

    def start(self, prompts: list[list[int]]) -> None:
        self._view = self.memory.snapshot() if self.memory is not None else ()
        self._rows = [(list(p), SuffixIndex(self.longest)) for p in prompts]
        for tokens, index in self._rows:
            index.extend(tokens)

    def observe(self, row: int, accepted: list[int]) -> None:
        tokens, index = self._rows[row]
        tokens += accepted
        index.extend(accepted)

    def _local(self, seq: list[int], row: int | None) -> SuffixIndex:
        """This sequence's index: a decode's row, fed by `observe` (found by its tokens where the caller
        does not say which row); else one of its own, extended while later calls extend the sequence."""
        known = [self._rows[row]] if row is not None and row < len(self._rows) else self._rows
        for tokens, index in [*known, self._loose]:
            if tokens == seq:
                return index
        tokens, index = self._loose
        if seq[: len(tokens)] != tokens:
            tokens, index = [], SuffixIndex(self.longest)
        index.extend(seq[len(tokens) :])
        self._loose = (list(seq), index)
        return index

    def sources(self, seq: list[int], row: int | None = None) -> list[Lookup]:
        """Where matches are looked up, in the order ties are broken: this sequence, the memory (newest
        first: as the decode began, or as it stands outside one), the corpus."""
        memory = self._view if self._view is not None else self.memory.snapshot() if self.memory else ()
        return [self._local(seq, row), *memory, *self.corpus]

    def matches(self, seq: list[int], row: int | None = None) -> Iterator[tuple[int, Place]]:
        """The suffixes of `seq` (at most `max_match` tokens) whose earlier occurrences went on `min_count`
        times, all sources together, longest first, each one whose occurrences went on more often than the
        longer one's (a shorter suffix's occurrences hold the longer's): the length, and the node in each
        source where it went on."""
        sources = self.sources(seq, row)
        finders = [source.finder(seq, self.max_match) for source in sources]
        most = self.min_count - 1
        for size in range(max(longest for longest, _ in finders), 0, -1):
            place = []
            for source, (_, node) in zip(sources, finders):
                at = node(size)
                if at is not None and source.went_on(at):  # it occurs there, and went on
                    place.append((source, at))
            if (went := went_on(place)) > most:
                yield size, place
                most = went

    def continuations(
        self, seq: list[int], depth: int, budget: int, row: int | None = None
    ) -> list[tuple[list[int], list[float]]]:
        """At most `budget` continuations of at most `depth` tokens, as root-to-leaf paths with each node's
        chance: the longest match's likeliest (a path's probability: its nodes' chances multiplied), then,
        while the budget lasts, the next shorter match's (a node met again keeps its first chance), and so
        on until one adds nothing: a long match seen once is one path, and shorter ones offer what else may
        follow (on 10 held-out windows, the built-in model's calls fell from 147 to 135 at tree=16)."""
        depth = min(depth, DEPTH)
        nodes: list[tuple[int, int, float]] = []  # (parent, token, chance), parents before children
        known: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        ties = itertools.count()
        for _, place in self.matches(seq, row) if depth and budget > 0 else ():
            before = len(nodes)
            heap = [(-chance, next(ties), -1, token, chance, at, 1) for token, chance, at in ranked(place)]
            heapq.heapify(heap)
            while heap and len(nodes) < budget:
                minus, _, parent, token, chance, at, d = heapq.heappop(heap)
                node = known.setdefault((parent, token), len(nodes))
                if node == len(nodes):
                    nodes.append((parent, token, chance))
                if d < depth:
                    for t, c, a in ranked(at):
                        heapq.heappush(heap, (minus * c, next(ties), node, t, c, a, d + 1))
            if len(nodes) in (before, budget):  # full, or a shorter match that added nothing (a loop's)
                break
        paths, kids = [], [[] for _ in nodes]
        for i, (parent, _, _) in enumerate(nodes):
            (kids[parent] if parent >= 0 else paths).append(i)
        out, stack = [], [([], [], i) for i in reversed(paths)]
        while stack:  # depth first, each node's children in the order they came: the first path is the likeliest
            tokens, chances, i = stack.pop()
            tokens, chances = [*tokens, nodes[i][1]], [*chances, nodes[i][2]]
            if not kids[i]:
                out.append((tokens, chances))
            stack += [(tokens, chances, k) for k in reversed(kids[i])]
        return out

    def scored(self, seq: list[int], found: list[tuple[list[int], list[float]]], depth: int) -> list[Scored]:
        """Paths with each node's source its chance's bin (as the heads' probabilities are binned: how often a
        count's share stands is learnt per bin), each that runs into the present gone on with its loop."""
        depth = min(depth, DEPTH)
        return [with_loop(self.name, seq, path, [confidence_source(self.name, c) for c in chances], depth)
                for path, chances in found]  # fmt: skip

    def chain(self, seq: list[int], n: int, row: int | None = None) -> tuple[list[int], list[float]]:
        """The longest match's likeliest continuation token by token (the most frequent next token at each
        step), with each token's chance; shorter than `n` where the occurrences end."""
        _, place = next(self.matches(seq, row), (0, []))
        tokens, chances = [], []
        while len(tokens) < min(n, DEPTH) and (found := ranked(place)):
            token, chance, place = found[0]
            tokens.append(token)
            chances.append(chance)
        return tokens, chances

    def _chain_scored(self, seq: list[int], n: int, row: int | None) -> Scored:
        """`chain` gone on with its loop where it runs into the present, then padded to `n` by repeating its last
        token (the newest one's if none), which seldom stands."""
        chain = self.scored(seq, [self.chain(seq, n, row)], n)[0]
        return padded(self.name, chain.tokens, chain.sources, n, seq[-1])

    def chain_scored(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> Scored:
        return self._chain_scored(tokens[0].tolist(), n, None)

    def rows_scored(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> list[Scored]:
        return [self._chain_scored(t[0].tolist(), n, row) for t, row in zip(tokens, rows)]

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        return torch.tensor([self.chain_scored(tokens, hidden, n).tokens], dtype=torch.long, device=tokens.device)

    def propose_rows(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> torch.LongTensor:
        chains = [s.tokens for s in self.rows_scored(tokens, hidden, n, rows)]
        return torch.tensor(chains, dtype=torch.long, device=hidden.device)

    def propose_scored(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[Scored]:
        seq = tokens[0].tolist()
        return self.scored(seq, self.continuations(seq, depth, budget), depth)

    def propose_paths(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[list[int]]:
        return [path.tokens for path in self.propose_scored(tokens, hidden, depth, budget)]


def for_model(lm) -> SuffixDrafter:
    """drafter="suffix": suffix lookup reading a BlockwiseLM's remembered outputs (none without one);
    `generate` gives it the corpus it is passed, or takes the memory away (remember=False)."""
    return SuffixDrafter(memory=getattr(lm, "memory", None))


def ranked(place: Place) -> list[tuple[int, float, Place]]:
    """A string's continuations in every source holding it, counts pooled, the most frequent first (the
    newest on ties, source by source in their order), each with its chance, its count over all of theirs,
    and its place."""
    if len(place) == 1:  # the common case, and the costly one (a short match's many continuations): no pooling
        source, node = place[0]
        found = sorted(((n, newest, t, c) for t, n, newest, c in source.children(node)), reverse=True)
        total = sum(f[0] for f in found)
        return [(t, n / total, [(source, c)]) for n, _, t, c in found]
    pooled: dict[int, tuple[int, list[int], Place]] = {}
    for i, (source, node) in enumerate(place):
        for token, n, newest, child in source.children(node):
            count, when, at = pooled.setdefault(token, (0, [-1] * len(place), []))
            when[i] = newest
            pooled[token] = (count + n, when, [*at, (source, child)])
    found = sorted(((n, when, t, at) for t, (n, when, at) in pooled.items()), reverse=True)
    total = sum(f[0] for f in found)
    return [(t, n / total, at) for n, _, t, at in found]


def went_on(place: Place) -> int:
    """How many occurrences of a string went on, in every source holding it."""
    return sum(source.went_on(node) for source, node in place)


def token_ids(document: Sequence[int] | torch.Tensor) -> list[int]:
    """A corpus document's token ids; a clear error for anything but integers >= 0."""
    ids = [as_integer(t) for t in (document.tolist() if isinstance(document, torch.Tensor) else document)]
    if any(t is None or t < 0 for t in ids):
        raise ValueError("a corpus is a list of token id sequences (integers >= 0)")
    return ids
