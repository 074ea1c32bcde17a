"""Drafting with an EAGLE-3 drafter: its own cache over the context's features, a chain that stops where its
guesses grow unlikely, or a beam for trees."""

from __future__ import annotations

import copy
import statistics
import time
import weakref

import torch
from torch import nn

from blockdecode.core.hf import weights_key
from blockdecode.drafters.base import RowChains
from blockdecode.drafters.eagle3.model import Eagle3, Entries
from blockdecode.drafters.proposals import Scored, confidence_source, padded


class _Row:
    """One sequence's drafting state: the drafter's entries over its context, the features not yet read, and
    the context's last output (what the first guess comes from)."""

    def __init__(self):
        self.entries = Entries()
        self.pending: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None  # [1, 1, H]


_FASTEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> (key, what drafts for it)


@torch.no_grad()  # not inference mode: the copy must be usable outside it
def fastest(model: Eagle3) -> Eagle3:
    """The drafter to draft with: `model`, or an fp32 copy of it where its weights are half precision on a CPU
    and the copy's steps run faster (a step reads every weight once, and some CPUs multiply one bf16 row more
    slowly than an fp32 one); timed once per set of weights and thread count."""
    weight = model.fc.weight
    if weight.device.type != "cpu" or weight.dtype == torch.float32:
        return model
    key = (weights_key(list(model.parameters())), torch.get_num_threads())
    known = _FASTEST.get(model)
    if known is None or known[0] != key:
        copy32 = copy.deepcopy(model).float().requires_grad_(False)
        _FASTEST[model] = known = (key, min([model, copy32], key=step_seconds))
    return known[1]


def step_seconds(model: Eagle3, context: int = 64, reps: int = 5) -> float:
    """The median seconds of one drafting step of `model`: a pass over one token after `context` entries, and its
    logits."""
    cfg, dtype = model.config, model.fc.weight.dtype
    rows = torch.randn(1, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    past = torch.zeros(1, cfg.num_key_value_heads, context, cfg.head_dim, dtype=dtype)
    samples = []
    for _ in range(reps + 1):
        entries = Entries(past, past, context)
        start = time.perf_counter()
        model.logits(model(rows, rows, torch.full((1, 1), context), entries)).argmax(-1)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


MIN_PROB = 0.3
"""Where a chain stops drafting: below this probability a step's expected gain no longer pays for its pass (on the
built-in model, chains stopping at 0.3 ran 1.15x those stopping at 0.02, and 1.03x those at 0.5; docs/results.md)."""


class Eagle3Drafter(RowChains):
    """Proposals from an EAGLE-3 drafter: it reads the base's features at the positions each call keeps
    (`see`), extends its own cache over them, then guesses autoregressively: a chain of its argmax, or a beam
    of its `width` best paths for a tree, each node's source the drafter's probability for it given its
    parent. A chain stops early once its probability falls below `min_prob` (each step costs a pass of the
    layer; the rest is padding, which seldom stands)."""

    name = "eagle3"
    decoder_only = True

    def __init__(self, model: Eagle3, embeddings: nn.Module, width: int = 4, min_prob: float = MIN_PROB):
        self.model = fastest(model)
        self.embed = getattr(self.model, "embed_tokens", embeddings)  # its own, where its checkpoint has one
        self.layers = model.config.aux_layers
        self.width, self.min_prob = width, min_prob
        self._rows: list[_Row] = []

    def __repr__(self) -> str:
        return f"Eagle3Drafter(aux_layers={list(self.layers)})"

    def start(self, prompts: list[list[int]]) -> None:
        self._rows = [_Row() for _ in prompts]

    def see(self, row: int, features: torch.Tensor) -> None:
        self._rows += [_Row() for _ in range(row + 1 - len(self._rows))]
        self._rows[row].pending.append(features)

    @torch.inference_mode()
    def _context(self, row: int, tokens: torch.LongTensor) -> _Row:
        """Row `row`'s state with the features it was handed read into its cache (each entry p: the features
        at p and the token at p + 1)."""
        state = self._rows[row] if row < len(self._rows) else None
        total = tokens.shape[1] - 1  # positions whose next token is known: every one before the newest
        have = 0 if state is None else state.entries.length + sum(len(f) for f in state.pending)
        if have != total:
            raise ValueError(
                f"the eagle3 drafter reads the base's layers as blockdecode decodes: it was handed features for "
                f"{have} positions, the sequence has {total} before its newest token (propose inside a decode)"
            )
        if state.pending:
            model, dtype = self.model, self.model.fc.weight.dtype
            features = torch.cat(state.pending).to(dtype)[None]
            state.pending = []
            start, m = state.entries.length, features.shape[1]
            ids = tokens[:, start + 1 : start + 1 + m]
            positions = torch.arange(start, start + m, device=tokens.device)[None]
            out = model(self.embed(ids).to(dtype), model.fc(features), positions, state.entries)
            state.last = out[:, -1:]
        return state

    @torch.inference_mode()
    def _beam(self, row: int, tokens: torch.LongTensor, depth: int, width: int, min_prob: float = 0.0):
        """Up to `width` paths a depth, each extended by the drafter run along it; every node met, as (log
        probability of its path, the path's ids, each node's probability given its parent)."""
        state = self._context(row, tokens)
        model, dtype = self.model, self.model.fc.weight.dtype
        position = tokens.shape[1] - 1  # where the first guess's own entry sits
        out = state.last  # [b, 1, H]
        score = torch.zeros(1, device=out.device)
        paths: list[tuple[list[int], list[float]]] = [([], [])]
        context = state.entries.length
        # A chain writes its entries after the context's, in place, and drops them after; a beam's paths each
        # have their own, in a copy.
        cache = state.entries if width == 1 else Entries(*state.entries.view(), context)
        nodes = []
        for step in range(depth):
            logp = model.logits(out)[:, -1].float().log_softmax(-1)  # [b, V_draft]
            top, index = logp.topk(min(width, logp.shape[-1]), dim=-1)
            total = (score[:, None] + top).flatten()
            keep = total.topk(min(width, total.numel())).indices
            parent, score = keep // top.shape[1], total[keep]
            chosen = model.target_ids(index.flatten()[keep])
            chances = top.flatten()[keep].exp().tolist()
            paths = [
                (paths[p][0] + [t], paths[p][1] + [c]) for p, t, c in zip(parent.tolist(), chosen.tolist(), chances)
            ]
            nodes += [(s, *path) for s, path in zip(score.tolist(), paths)]
            if step == depth - 1 or score.max().exp() < min_prob:
                break
            if width > 1:
                cache.select(parent)
            positions = torch.full((len(keep), 1), position + step, device=out.device)
            out = model(self.embed(chosen[:, None]).to(dtype), out[parent] if width > 1 else out, positions, cache)
        state.entries.length = context
        return nodes

    def _chain(self, row: int, tokens: torch.LongTensor, n: int) -> Scored:
        """The drafter's argmax chain, padded (by its last guess) past where its probability fell below
        `min_prob`."""
        if n == 0:
            return Scored([], [])
        *_, guess, chances = self._beam(row, tokens, n, 1, self.min_prob)[-1]
        sources = [confidence_source(self.name, c) for c in chances]
        return padded(self.name, guess, sources, n, int(tokens[0, -1]), prior=0.05)

    def propose_scored(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[Scored]:
        """The `budget` most probable nodes of the beam (a child never more than its parent, so they form a
        tree), as root-to-leaf paths, the most probable first."""
        if depth == 0:
            return []
        nodes = self._beam(0, tokens, depth, max(1, min(self.width, budget)))
        chosen = sorted(nodes, key=lambda node: (-node[0], len(node[1])))[:budget]
        inner = {tuple(path[:j]) for _, path, _ in chosen for j in range(1, len(path))}
        return [
            Scored(path, [confidence_source(self.name, c) for c in chances])
            for _, path, chances in chosen
            if tuple(path) not in inner
        ]

    def propose_paths(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[list[int]]:
        return [scored.tokens for scored in self.propose_scored(tokens, hidden, depth, budget)]
