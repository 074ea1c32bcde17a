"""Proposal heads p2..pk on the base model's decoder output.

Head 1 is the base model's own next-token prediction and is never modelled here: the
heads produce k-1 residual updates of the decoder output h, and the base model's own
output projection (shared, not copied) turns each into logits for the token 2..k ahead.
The paper's and Medusa's heads guess each position from h alone; Hydra's also see the tokens
before their own (the base's newest token and the earlier heads' guesses), so they run in turn.
"""

from __future__ import annotations

import copy
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from blockdecode.core.hf import at_least, integer, weights_key
from blockdecode.core.tree import best_path, lattice_paths
from blockdecode.drafters.base import BaseDrafter
from blockdecode.drafters.ngram import ContextNgram
from blockdecode.drafters.proposals import CONFIDENCE_BINS, Lattice, Scored, Source, confidence_source, padded

HEAD_TYPES = ("paper", "medusa", "hydra")


@dataclass
class HeadsConfig:
    """Shape of the proposal heads; saved beside their weights."""

    k: int = 8
    head_type: str = "paper"
    hidden_size: int = 0  # the base model's d_model (size of h)
    head_hidden_size: int = 0  # per-head width of the paper's hidden layer; 0 means hidden_size
    vocab_size: int = 0  # the base model's vocabulary, checked against its output projection
    draft_vocab: int = 0  # > 0: the heads score only this many tokens (`token_map`), 0: the whole vocabulary
    embed_size: int = 0  # hydra: the width of the base's input embeddings; 0 means hidden_size

    def __post_init__(self) -> None:
        self.k = at_least(self.k, 1, "k must be an integer >= 1 (the block size, head 1 included)")
        for name in ("hidden_size", "head_hidden_size", "vocab_size", "draft_vocab", "embed_size"):
            setattr(self, name, integer(getattr(self, name), name))
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"unknown head_type {self.head_type!r}: choose one of {', '.join(HEAD_TYPES)}")
        if self.hidden_size < 1:
            raise ValueError(f"hidden_size must be positive, got {self.hidden_size}")
        if self.head_hidden_size < 0:
            raise ValueError(f"head_hidden_size must be positive (or 0 for hidden_size), got {self.head_hidden_size}")
        if self.head_hidden_size == 0:
            self.head_hidden_size = self.hidden_size
        if self.embed_size < 0:
            raise ValueError(f"embed_size must be positive (or 0 for hidden_size), got {self.embed_size}")
        if self.embed_size == 0:
            self.embed_size = self.hidden_size
        if not 0 <= self.draft_vocab <= max(self.vocab_size, 0) or (self.draft_vocab and not self.vocab_size):
            raise ValueError(f"draft_vocab must lie in [0, vocab_size={self.vocab_size}], got {self.draft_vocab}")

    def to_dict(self) -> dict:
        return asdict(self)

    def parameters(self) -> int:
        """How many parameters these heads hold, known before any is allocated."""
        n, d, w = self.k - 1, self.hidden_size, self.head_hidden_size
        if self.head_type == "medusa":
            return n * (d * d + d)
        if self.head_type == "hydra":
            return n * ((d + self.embed_size) * w + w + w * d + d)
        return d * n * w + n * w + n * w * n * d + n * d


class PaperHeads(nn.Module):
    """Stern et al. (2018): one feed-forward layer of width (k-1)·d_hidden with ReLU whose
    (k-1)·d_model outputs are added back to h, one slice per head."""

    def __init__(self, cfg: HeadsConfig):
        super().__init__()
        n, d = cfg.k - 1, cfg.hidden_size
        self.n, self.d, self.k = n, d, cfg.k
        self.up = nn.Linear(d, n * cfg.head_hidden_size)
        self.down = nn.Linear(n * cfg.head_hidden_size, n * d)
        # Zero output: untrained heads leave h unchanged, so each proposes the base model's
        # next token (finite, well-shaped, and what training starts from).
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    takes_tokens = False

    def forward(self, h: torch.Tensor, embeds: torch.Tensor | None = None, n: int | None = None) -> torch.Tensor:
        """h [..., d] -> per-head hidden states [..., k-1, d] (`embeds`, the tokens' embeddings, unused);
        `n`: the first n heads' alone, from the first rows of `down` (its weight is most of the heads' bytes,
        read from memory each call: a drafter asked for fewer tokens reads fewer)."""
        n = self.n if n is None else n
        rows = slice(0, n * self.d)
        delta = nn.functional.linear(torch.relu(self.up(h)), self.down.weight[rows], self.down.bias[rows])
        return h.unsqueeze(-2) + delta.unflatten(-1, (n, self.d))


class MedusaHeads(nn.Module):
    """Medusa's form: an independent residual block x + SiLU(W x) per head, the layout
    serving engines load."""

    def __init__(self, cfg: HeadsConfig):
        super().__init__()
        self.k = cfg.k
        self.blocks = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.k - 1))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    takes_tokens = False

    def forward(self, h: torch.Tensor, embeds: torch.Tensor | None = None, n: int | None = None) -> torch.Tensor:
        """h [..., d] -> per-head hidden states [..., k-1, d] (`embeds`, the tokens' embeddings, unused);
        `n`: the first n heads' alone."""
        blocks = self.blocks[:n]
        if not blocks:
            return h.unsqueeze(-2)[..., :0, :]
        return torch.stack([h + nn.functional.silu(block(h)) for block in blocks], dim=-2)


class HydraHeads(nn.Module):
    """Sequential heads (Hydra, Ankner et al. 2024) in recurrent form: head i sees h and the tokens
    before its own, the base's newest token and the guesses of heads 2..i-1, through a state each
    head hands the next: s_1 = h, s_i = s_(i-1) + down_i(ReLU(up_i([s_(i-1); e(x_(i-1))]))), where e
    is the base's own input embedding (shared, not copied) and x_(i-1) the token before head i's.
    Independent heads must guess token i+1 without knowing which token i the chain holds; these
    know it, so each is right more often after its predecessor was, which is all a chain accepts."""

    takes_tokens = True

    def __init__(self, cfg: HeadsConfig):
        super().__init__()
        d, w, n = cfg.hidden_size, cfg.head_hidden_size, cfg.k - 1
        self.embed_size, self.k = cfg.embed_size, cfg.k
        self.up = nn.ModuleList(nn.Linear(d + cfg.embed_size, w) for _ in range(n))
        self.down = nn.ModuleList(nn.Linear(w, d) for _ in range(n))
        for layer in self.down:  # zero output: every state is h, every head proposes the base's next token
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def step(self, i: int, state: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """Head i+2's state from head i+1's (h for the first) and the embedding of the token before its own."""
        return state + self.down[i](torch.relu(self.up[i](torch.cat([state, embed], dim=-1))))

    def forward(self, h: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """h [..., d] and embeds [..., k-1, e] (head i's previous token at i-2: teacher forcing, or
        the guesses so far) -> per-head hidden states [..., k-1, d]."""
        if embeds is None:
            raise ValueError("hydra heads need the embeddings of the tokens before each head's own")
        states, state = [], h
        for i in range(len(self.up)):
            state = self.step(i, state, embeds[..., i, :])
            states.append(state)
        return torch.stack(states, dim=-2) if states else h.unsqueeze(-2)[..., :0, :]


def path_tokens(newest: torch.LongTensor, ids: torch.LongTensor, k: int) -> torch.LongTensor:
    """[B, L, k-1]: at each position t, the tokens hydra head i sees before its own under teacher
    forcing: the base's newest token (`newest`, its argmax at t, as decoding has it) and then the
    data's tokens t+2..t+i-1 (0 past the end, where no head has a target)."""
    b, length = ids.shape
    out = ids.new_zeros(b, length, max(k - 1, 0))
    if k > 1:
        out[..., 0] = newest
    for j in range(1, k - 1):
        out[:, : max(0, length - 1 - j), j] = ids[:, 1 + j :].clamp(min=0)
    return out


def build_heads(cfg: HeadsConfig) -> nn.Module:
    """The head module for cfg.head_type, its `k` the block size its k-1 heads serve; with a draft vocabulary,
    its `token_map` buffer (saved with the weights): the ids the heads score, the most frequent targets once
    training has set them."""
    heads = {"paper": PaperHeads, "medusa": MedusaHeads, "hydra": HydraHeads}[cfg.head_type](cfg)
    if cfg.draft_vocab:
        heads.register_buffer("token_map", torch.arange(cfg.draft_vocab))
    return heads


def most_frequent(tokens: torch.Tensor, vocab_size: int, n: int) -> tuple[torch.LongTensor, float]:
    """The `n` ids most frequent in `tokens` (ids < 0 skipped), ascending, and the share of the
    tokens they cover: a draft vocabulary and what it can propose."""
    tokens = tokens.reshape(-1)
    counts = torch.bincount(tokens[tokens >= 0], minlength=vocab_size)
    top = counts.topk(n).indices.sort().values
    return top, float(counts[top].sum() / counts.sum().clamp(min=1))


def short_projection(projection: nn.Module, token_map: torch.LongTensor) -> nn.Linear:
    """The output projection restricted to the rows of `token_map`: logits of the draft vocabulary
    alone, a fraction of the full projection's work (the verification keeps the full vocabulary)."""
    rows = nn.Linear(projection.weight.shape[1], len(token_map), bias=projection.bias is not None)
    rows = rows.to(device=projection.weight.device, dtype=projection.weight.dtype)
    with torch.no_grad():
        rows.weight.copy_(projection.weight[token_map])
        if projection.bias is not None:
            rows.bias.copy_(projection.bias[token_map])
    return rows.requires_grad_(False)


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

    @property
    def deepest(self) -> int | None:
        """k-1: a plan drafting deeper with another drafter (a lookup's long match) asks the heads no further."""
        return None if self.k is None else self.k - 1

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
        row's paths by that row's own context. Past the heads' k-1 guesses a chain repeats its last."""
        m = self.depth_for(n)
        if self.sequential:
            chains = self._chain(torch.cat([t[:, -1] for t in tokens]), hidden, m)
        elif not self.rescore or not m:
            chains = self._ids(self._logits(hidden, m).argmax(-1))  # [N, m]
        else:
            values, ids = self._top(hidden, m, self.width)
            paths = [best_path(v, i, self._factor(t, r)) for v, i, t, r in zip(values, ids, tokens, rows)]
            chains = torch.tensor(paths, dtype=torch.long, device=hidden.device)
        if m == n:
            return chains
        last = chains[:, -1:] if m else torch.cat([t[:, -1:] for t in tokens]).to(hidden.device)
        return torch.cat([chains, last.expand(-1, n - m)], dim=1)

    def propose_paths(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[list[int]]:
        depth = self.depth_for(depth)
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
        depth = self.depth_for(depth)
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
        best, index = self._logits(hidden, self.depth_for(n)).float().softmax(-1).max(-1)
        return [  # past the heads' k-1 guesses, padded: a chain of the batch's width
            padded(self.name, chain, [self._source(p) for p in chances], n, int(t[0, -1]))
            for chain, chances, t in zip(self._ids(index).tolist(), best.tolist(), tokens)
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
