"""Drafting with a DFlash drafter: each row's context entries (every layer's keys and values of the features the
loop hands it), then one pass over [the newest token, mask, ...] that guesses the whole block."""

from __future__ import annotations

import torch
from torch import nn

from blockdecode.core.tree import lattice_paths
from blockdecode.drafters.base import RowChains
from blockdecode.drafters.dflash.model import DFlash
from blockdecode.drafters.eagle3.model import Entries
from blockdecode.drafters.proposals import CONFIDENCE_BINS, Lattice, Scored, confidence_source, padded


class _Row:
    """One sequence's drafting state: each layer's entries over its context, and the features not yet read."""

    def __init__(self, layers: int):
        self.entries = [Entries() for _ in range(layers)]
        self.pending: list[torch.Tensor] = []


class DFlashDrafter(RowChains):
    """Proposals from a DFlash drafter: it reads the base's features at the positions each call keeps (`see`),
    then guesses every depth of the block in one pass. A depth's guesses do not hang on the path before them (the
    masks are guessed together), so its proposals are a lattice, as the heads' are: its argmax chain, or its
    `width` best tokens at each depth for a tree, each with the drafter's probability for it. Past the block's
    b - 1 guesses a chain is padded, which seldom stands."""

    name = "dflash"

    def __init__(self, model: DFlash, base: nn.Module, width: int = 4):
        self.model, self.width = model, width
        self.embed, self.head = base.get_input_embeddings(), base.get_output_embeddings()
        self.layers = model.config.target_layer_ids
        self._rows: list[_Row] = []

    def __repr__(self) -> str:
        cfg = self.model.config
        return f"DFlashDrafter(block_size={cfg.block_size}, target_layer_ids={list(self.layers)})"

    def start(self, prompts: list[list[int]]) -> None:
        self._rows = [_Row(len(self.model.layers)) for _ in prompts]

    def see(self, row: int, features: torch.Tensor) -> None:
        self._rows += [_Row(len(self.model.layers)) for _ in range(row + 1 - len(self._rows))]
        self._rows[row].pending.append(features)

    @torch.inference_mode()
    def _logits(self, row: int, tokens: torch.LongTensor) -> torch.Tensor:
        """The draft vocabulary's log-probabilities [b - 1, V_draft] of the block after row `row`'s newest token,
        the features it was handed read into its context entries first."""
        state = self._rows[row] if row < len(self._rows) else None
        total = tokens.shape[1] - 1  # the positions the base has read: every one before the newest
        have = 0 if state is None else state.entries[0].length + sum(len(f) for f in state.pending)
        if have != total:
            raise ValueError(
                f"the dflash drafter reads the base's layers as blockdecode decodes: it was handed features for "
                f"{have} positions, the sequence has {total} before its newest token (propose inside a decode)"
            )
        model, dtype = self.model, self.model.fc.weight.dtype
        if state.pending:
            features = torch.cat(state.pending).to(dtype)[None]
            state.pending = []
            start = state.entries[0].length
            positions = torch.arange(start, start + features.shape[1], device=tokens.device)[None]
            for entries, (k, v) in zip(state.entries, model.context(features, positions)):
                entries.extend(k, v)
        embeds, positions = model.blocks(self.embed, tokens, tokens.new_tensor([[total]]))
        logits = model(embeds, positions, [entries.view() for entries in state.entries], head=self.head)
        return logits[0, 1:].float().log_softmax(-1)

    def _chain(self, row: int, tokens: torch.LongTensor, n: int) -> Scored:
        if n == 0:
            return Scored([], [])
        best, index = self._logits(row, tokens)[:n].max(-1)
        guess = self.model.target_ids(index).tolist()
        sources = [confidence_source(self.name, p) for p in best.exp().tolist()]
        return padded(self.name, guess, sources, n, int(tokens[0, -1]), prior=0.05)

    def propose_scored(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list:
        """The block's lattice: the `width` likeliest tokens at each depth, each with its probability (its prior,
        and the bin its acceptance is learnt in); a ranked tree may hang a guess under any node one depth above."""
        if depth == 0:
            return []
        top, index = self._logits(0, tokens)[:depth].topk(max(1, min(self.width, budget)), dim=-1)
        bins = (top.exp() * CONFIDENCE_BINS).int().clamp(max=CONFIDENCE_BINS - 1).tolist()
        on, aside = (
            [confidence_source(self.name, (b + 0.5) / CONFIDENCE_BINS, a) for b in range(CONFIDENCE_BINS)]
            for a in (False, True)
        )
        ids = self.model.target_ids(index).tolist()
        return [Lattice(ids, [[on[b] for b in row] for row in bins], [[aside[b] for b in row] for row in bins])]

    def propose_paths(self, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, budget: int) -> list[list[int]]:
        """A fixed tree's paths: the `budget` most probable nodes of the block's lattice."""
        if depth == 0:
            return []
        top, index = self._logits(0, tokens)[:depth].topk(max(1, min(self.width, budget)), dim=-1)
        return [path for path, _ in lattice_paths(top.exp(), self.model.target_ids(index), budget)]
