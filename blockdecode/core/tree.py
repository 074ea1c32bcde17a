"""A tree of candidate continuations, verified in one pass (Medusa's tree attention, with
candidates from every drafter at once).

Node 0 is the newest token, already decoded; every other node is a proposed token whose parent
is the token it would follow. The base model scores all nodes in one forward: each node sees the
cache and its own ancestors, at the position its depth gives it. Node i's argmax is greedy's
token after the path to i, so a child is right when it equals its parent's argmax. The call gains
the deepest path of right nodes, plus the base model's own token after its last node. Shared
prefixes are merged, so each is scored once."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Tree:
    """tokens[i] and parents[i] of nodes 1..n (node 0, the newest token, is implicit)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # each < its own index; 0 is the root
    depths: list[int] = field(default_factory=list)  # the root's children have depth 1
    owners: list[str] = field(default_factory=list)  # the drafter that proposed each node first
    _children: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, owner: str = "") -> int:
        """The node for `token` after `parent` (0: the root), made if new (proposed by `owner`); its
        index (1-based)."""
        key = (parent, token)
        if key not in self._children:
            self.tokens.append(token)
            self.parents.append(parent)
            self.owners.append(owner)
            self.depths.append(1 if parent == 0 else self.depths[parent - 1] + 1)
            self._children[key] = len(self.tokens)
        return self._children[key]

    def add_path(self, path: Sequence[int], budget: int, max_depth: int, owner: str = "") -> None:
        """Insert a chain of tokens from the root (proposed by `owner`), sharing what is already
        there, until the tree holds `budget` nodes or the chain is `max_depth` deep."""
        node = 0
        for token in path[:max_depth]:
            if len(self) >= budget and (node, token) not in self._children:
                return
            node = self.add(node, int(token), owner)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> Tree:
        """One path of `tokens` from the root."""
        tree = cls()
        tree.add_path(tokens, len(tokens), len(tokens))
        return tree

    @classmethod
    def of_paths(cls, paths: Sequence, budget: int) -> Tree:
        """Scored `paths` (tokens, and sources naming their drafter) merged in their order into a tree of at most
        `budget` nodes, as an unranked tree takes them."""
        tree = cls()
        for path in paths:
            tree.add_path(path.tokens, budget, len(path.tokens), path.sources[0].drafter if path.sources else "")
        return tree

    def confirmed(self, tokens: Sequence[int]) -> int:
        """How deep a path from the root follows `tokens`: what of this tree stands where they are the model's."""
        node = 0
        for depth, token in enumerate(tokens):
            node = self._children.get((node, token))
            if node is None:
                return depth
        return len(tokens)

    def is_chain(self) -> bool:
        """Whether the nodes form one path from the root, each the child of the one before."""
        return all(parent == i for i, parent in enumerate(self.parents))

    def ancestry(self) -> torch.Tensor:
        """mask [n+1, n+1] bool over the root and the nodes: mask[i, j] when j is i or an ancestor."""
        n = len(self) + 1
        above: list[list[int]] = [[0]]  # each node's ancestors and itself, as indices
        for i, parent in enumerate(self.parents, start=1):
            above.append([*above[parent], i])
        mask = torch.zeros(n * n, dtype=torch.bool)
        mask[[i * n + j for i, row in enumerate(above) for j in row]] = True  # one write, not a tensor op a node
        return mask.view(n, n)

    def standing(self, right: Sequence[bool]) -> list[bool]:
        """Whether each node, the root first, stands: it and every node above it are right (right[i-1]
        for node i). Under exact acceptance they form one path; a relaxed rule may let siblings stand."""
        ok = [True]  # the root
        for i, parent in enumerate(self.parents, start=1):
            ok.append(ok[parent] and bool(right[i - 1]))
        return ok

    def accepted_path(self, right: Sequence[bool]) -> list[int]:
        """The deepest node whose whole path is right (right[i-1] for node i), as the list of node
        indices from the root (0) down to it; [0] when no child of the root is right."""
        ok = self.standing(right)
        best = max(range(len(ok)), key=lambda i: (ok[i] and (self.depths[i - 1] if i else 0), -i))
        path = []
        while best:
            path.append(best)
            best = self.parents[best - 1]
        return [0, *reversed(path)]


def lattice_paths(
    probs: torch.Tensor,
    tokens: torch.Tensor,
    budget: int,
    factor: Callable[[tuple[int, ...], int], float] | None = None,
) -> Iterable[tuple[list[int], float]]:
    """The most probable paths through a lattice of per-position candidates, best first: position
    d offers tokens[d, :] with probabilities probs[d, :], independently of each other (the heads'
    top-N guesses); a path's score is the product of its tokens' probabilities, each times
    `factor(tokens before it on the path, token)` if given (a language model's rescoring, Kim et
    al. 2024; at most 1, so a path never outscores its prefix). Yields at most `budget` paths, each
    one node longer than a path already yielded or of length 1, so that inserting them in order
    builds the `budget` most probable nodes of the tree."""
    depth, width = probs.shape
    p, t = probs.tolist(), tokens.tolist()

    def extend(score: float, path: tuple[int, ...], d: int, j: int) -> float:
        return score * p[d][j] * (factor(path, t[d][j]) if factor else 1.0)

    heap = [(-extend(1.0, (), 0, j), (j,)) for j in range(width)]
    heapq.heapify(heap)
    for _ in range(budget):
        if not heap:
            return
        score, choice = heapq.heappop(heap)
        path = [t[d][j] for d, j in enumerate(choice)]
        yield path, -score
        if len(choice) < depth:
            for j in range(width):
                heapq.heappush(heap, (-extend(-score, tuple(path), len(choice), j), (*choice, j)))


def best_path(
    probs: torch.Tensor, tokens: torch.Tensor, factor: Callable[[tuple[int, ...], int], float], beam: int = 4
) -> list[int]:
    """The best full-depth path through the lattice of `lattice_paths` under the same score, by a
    beam search of `beam` paths: the chain a rescored drafter proposes."""
    p, t = probs.tolist(), tokens.tolist()
    beams: list[tuple[float, list[int]]] = [(1.0, [])]
    for d in range(len(p)):
        grown = [
            (score * p[d][j] * factor(tuple(path), t[d][j]), [*path, t[d][j]])
            for score, path in beams
            for j in range(len(p[d]))
        ]
        beams = heapq.nlargest(beam, grown, key=lambda c: c[0])
    return beams[0][1]


def windowed(full: torch.Tensor, mask: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """The additive mask `full` [B, 1, q, kv] of a tree scored after `length` cached entries (`mask`
    [B, q, q]: each node's ancestors and itself), cut to a sliding window as a chain would see it: a
    node at depth d sits where the chain puts it, `length + d`, and sees only what lies fewer than
    `window` tokens back. A custom mask is taken as given by every layer, so the window must be in it."""
    q = mask.shape[-1]
    depth = mask.sum(-1) - 1  # [B, q]
    slots = torch.arange(length, device=full.device)
    back = torch.cat([(length + depth)[..., None] - slots, depth[..., :, None] - depth[..., None, :]], dim=-1)
    out = full.clone()
    out[..., : length + q].masked_fill_((back >= window)[:, None], torch.finfo(full.dtype).min)
    return out
