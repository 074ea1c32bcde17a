"""Proposal heads p2..pk on the base model's decoder output.

Head 1 is the base model's own next-token prediction and is never modelled here: the
heads produce k-1 residual updates of the decoder output h, and the base model's own
output projection (shared, not copied) turns each into logits for the token 2..k ahead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

HEAD_TYPES = ("paper", "medusa")


@dataclass
class HeadsConfig:
    """Shape of the proposal heads; saved beside their weights."""

    k: int = 8
    head_type: str = "paper"
    hidden_size: int = 0  # the base model's d_model (size of h)
    head_hidden_size: int = 0  # per-head width of the paper's hidden layer; 0 means hidden_size
    vocab_size: int = 0  # the base model's vocabulary, checked against its output projection
    draft_vocab: int = 0  # > 0: the heads score only this many tokens (`token_map`), 0: the whole vocabulary

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an integer >= 1 (the block size, head 1 included), got {self.k!r}")
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"unknown head_type {self.head_type!r}: choose one of {', '.join(HEAD_TYPES)}")
        if self.hidden_size < 1:
            raise ValueError(f"hidden_size must be positive, got {self.hidden_size}")
        if self.head_hidden_size < 0:
            raise ValueError(f"head_hidden_size must be positive (or 0 for hidden_size), got {self.head_hidden_size}")
        if self.head_hidden_size == 0:
            self.head_hidden_size = self.hidden_size
        if not 0 <= self.draft_vocab <= max(self.vocab_size, 0) or (self.draft_vocab and not self.vocab_size):
            raise ValueError(f"draft_vocab must lie in [0, vocab_size={self.vocab_size}], got {self.draft_vocab}")

    def to_dict(self) -> dict:
        return asdict(self)

    def parameters(self) -> int:
        """How many parameters these heads hold, known before any is allocated."""
        n, d, w = self.k - 1, self.hidden_size, self.head_hidden_size
        if self.head_type == "medusa":
            return n * (d * d + d)
        return d * n * w + n * w + n * w * n * d + n * d


class PaperHeads(nn.Module):
    """Stern et al. (2018): one feed-forward layer of width (k-1)·d_hidden with ReLU whose
    (k-1)·d_model outputs are added back to h, one slice per head."""

    def __init__(self, cfg: HeadsConfig):
        super().__init__()
        n, d = cfg.k - 1, cfg.hidden_size
        self.n, self.d = n, d
        self.up = nn.Linear(d, n * cfg.head_hidden_size)
        self.down = nn.Linear(n * cfg.head_hidden_size, n * d)
        # Zero output: untrained heads leave h unchanged, so each proposes the base model's
        # next token (finite, well-shaped, and what training starts from).
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> per-head hidden states [..., k-1, d]."""
        delta = self.down(torch.relu(self.up(h))).unflatten(-1, (self.n, self.d))
        return h.unsqueeze(-2) + delta


class MedusaHeads(nn.Module):
    """Medusa's form: an independent residual block x + SiLU(W x) per head, the layout
    serving engines load."""

    def __init__(self, cfg: HeadsConfig):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.k - 1))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> per-head hidden states [..., k-1, d]."""
        if not self.blocks:
            return h.unsqueeze(-2)[..., :0, :]
        return torch.stack([h + nn.functional.silu(block(h)) for block in self.blocks], dim=-2)


def build_heads(cfg: HeadsConfig) -> nn.Module:
    """The head module for cfg.head_type; with a draft vocabulary, its `token_map` buffer (saved with
    the weights): the ids the heads score, the most frequent targets once training has set them."""
    heads = {"paper": PaperHeads, "medusa": MedusaHeads}[cfg.head_type](cfg)
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
