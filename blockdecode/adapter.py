"""The base model behind the decode loop: the only code that calls a `transformers` model while
decoding.

The loop sees three operations, whatever the model is:
- `prefill(prompt)`: run the prompt, keep its cache, score its last position;
- `score(ids, positions, mask)`: run new tokens over the cache, return their logits and the
  decoder outputs the drafters read; a chain needs neither positions nor mask, a tree of
  candidates gives each node its depth as position and its ancestors as mask;
- `keep(indices)`: keep these cache positions and drop the rest; rolling back a rejected chain
  is the contiguous case, keeping a tree's accepted path the general one.

`CausalAdapter` serves decoder-only models. An encoder-decoder adapter fits the same three
calls: `prefill` runs the encoder once and holds its outputs, `score` runs the decoder, and
`keep` cuts the self-attention cache only (see docs/design.md)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from blockdecode.hf import cache_argument, decoder_output, make_cache


class CausalAdapter:
    """One sequence through a causal LM with a KV cache that can keep any subset of its positions."""

    def __init__(self, model: PreTrainedModel, cache_implementation: str = "dynamic", max_len: int = 0):
        """`max_len`: the most positions the cache will hold (a static cache allocates them)."""
        self.model = model
        self.cache = make_cache(model, cache_implementation, max_len)
        self.static = cache_implementation == "static"
        self.max_len = max_len
        self.cache_arg = cache_argument(model)
        self.length = 0  # positions in the cache
        self.calls = 0  # forward passes, prefill included

    def prefill(self, prompt: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt [B, T] -> logits [B, 1, V] and decoder output [B, 1, D] at its last position."""
        return self._forward(prompt, logits_to_keep=1)

    def score(
        self, ids: torch.LongTensor, positions: torch.LongTensor | None = None, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, q] after the cache -> logits [B, q, V] and decoder outputs [B, q, D].

        `positions` [q]: each token's position id (default: the cache length onwards, a chain).
        `mask` [q, q] bool: mask[i, j] says token i may see token j (its ancestors and itself);
        default causal. Every token sees the whole cache."""
        kwargs: dict = {"logits_to_keep": 0}
        if positions is not None:
            kwargs["position_ids"] = positions.view(1, -1).expand(ids.shape[0], -1)
        if mask is not None:
            kwargs["attention_mask"] = self._attention_mask(mask, ids.shape[0])
        return self._forward(ids, **kwargs)

    @torch.inference_mode()
    def keep(self, indices: Sequence[int]) -> None:
        """Keep the cache positions `indices` (ascending), packed to the front in that order, and
        drop the rest. A `range(n)` is a plain rollback to n positions and copies nothing."""
        n = len(indices)
        if isinstance(indices, range) and indices.start == 0 and indices.step == 1:
            if n > self.length:
                raise ValueError(f"cannot keep {n} positions of a cache holding {self.length}")
            if n < self.length:
                self.cache.crop(n - self.length)
                self.length = n
            return
        indices = list(indices)
        ascending = all(a < b for a, b in zip(indices, indices[1:]))
        if not ascending or (n and not 0 <= indices[0] <= indices[-1] < self.length):
            raise ValueError(f"keep() takes ascending cache positions in [0, {self.length}), got {indices}")
        fixed = next((i for i, p in enumerate(indices) if p != i), n)  # positions already in place
        if fixed == n:
            self.keep(range(n))
            return
        moved = torch.tensor(indices[fixed:], device=self.model.device)
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", True):
                continue
            if self.static:  # written by position: move the kept entries forward, then the write position
                layer.keys[:, :, fixed:n] = layer.keys.index_select(2, moved)
                layer.values[:, :, fixed:n] = layer.values.index_select(2, moved)
                layer.cumulative_length.fill_(n)
            else:
                layer.keys = torch.cat([layer.keys[..., :fixed, :], layer.keys.index_select(-2, moved)], dim=-2)
                layer.values = torch.cat([layer.values[..., :fixed, :], layer.values.index_select(-2, moved)], dim=-2)
        self.length = n

    def _attention_mask(self, mask: torch.Tensor, batch: int) -> torch.Tensor:
        """The [B, 1, q, kv] additive mask transformers takes as given: 0 where a token may attend,
        the dtype's minimum elsewhere (a bool mask is silently misread under eager attention)."""
        q = mask.shape[0]
        width = self.max_len if self.static else self.length + q
        dtype = self.model.dtype
        full = torch.full((batch, 1, q, width), torch.finfo(dtype).min, dtype=dtype, device=self.model.device)
        full[..., : self.length] = 0
        full[..., self.length : self.length + q].masked_fill_(mask.to(full.device), 0)
        return full

    @torch.inference_mode()
    def _forward(self, ids: torch.LongTensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        with decoder_output(self.model) as hidden:
            out = self.model(input_ids=ids, use_cache=True, **{self.cache_arg: self.cache}, **kwargs)
        self.calls += 1
        self.length += ids.shape[1]
        return out.logits, hidden[0]
