"""Proposal heads p2..pk on the base model's decoder output.

Head 1 is the base model's own next-token prediction and is never modelled here: the
heads produce k-1 residual updates of the decoder output h, and the base model's own
output projection (shared, not copied) turns each into logits for the token 2..k ahead.
The paper's and Medusa's heads guess each position from h alone; Hydra's also see the tokens
before their own (the base's newest token and the earlier heads' guesses), so they run in turn.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from blockdecode.hf import at_least, integer

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
