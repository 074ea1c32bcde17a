"""The base model behind the decode loop: the only code that calls a `transformers` model while
decoding.

The loop sees three operations, whatever the model is:
- `prefill(prompt)`: run the prompt, keep its cache, score its last position;
- `score(ids, positions, mask)`: run new tokens over the cache, return their logits and the
  decoder outputs the drafters read; a chain needs neither positions nor mask, a tree of
  candidates gives each node its depth as position and its ancestors as mask;
- `keep(indices)`: keep these cache positions and drop the rest; rolling back a rejected chain
  is the contiguous case, keeping a tree's accepted path the general one.

`CausalAdapter` serves decoder-only models. `Seq2seqAdapter` serves encoder-decoder models with the
same three calls: the encoder runs once, before the decoder's prefill, and its outputs (and the
cross-attention cache) stay as they are; `score` runs the decoder, and `keep` cuts the
self-attention cache only (see docs/design.md)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from blockdecode.hf import cache_argument, decoder_output, is_seq2seq, make_cache


class CausalAdapter:
    """One sequence through a causal LM with a KV cache that can keep any subset of its positions."""

    takes_positions = True  # score() can give tokens their own position ids (a tree needs it)

    def __init__(self, model: PreTrainedModel, cache_implementation: str = "dynamic", max_len: int = 0):
        """`max_len`: the most positions the cache will hold (a static cache allocates them)."""
        self.model = model
        self.cache = make_cache(model, cache_implementation, max_len)
        self.layers = getattr(self.cache, "layers", None)  # the self-attention layers, which keep() edits
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
        for layer in self.layers:
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
            out = self._run(ids, use_cache=True, **{self.cache_arg: self.cache}, **kwargs)
        self.calls += 1
        self.length += ids.shape[1]
        return out.logits, hidden[0]

    def _run(self, ids: torch.LongTensor, **kwargs):
        return self.model(input_ids=ids, **kwargs)


class Seq2seqAdapter(CausalAdapter):
    """The decoder of an encoder-decoder model over one source sequence, encoded once."""

    def __init__(
        self, model: PreTrainedModel, source: torch.LongTensor, cache_implementation: str = "dynamic", max_len: int = 0
    ):
        """`source` [1, S]: the encoder's input; the decoder's tokens go through prefill and score."""
        super().__init__(model, cache_implementation, max_len)
        self.source = source
        self.encoded = None
        self.layers = self.cache.self_attention_cache.layers
        self.position_arg = "decoder_position_ids" in inspect.signature(model.forward).parameters
        # Marian, BART, mBART and Pegasus take no position ids, but their decoders hand their own to
        # the positional embedding, by keyword: a tree's replace them there for one call.
        embed = getattr(model.get_decoder(), "embed_positions", None)
        takes = embed is not None and "position_ids" in inspect.signature(embed.forward).parameters
        self.embed_positions = embed if takes and not self.position_arg else None
        self.takes_positions = self.position_arg or self.embed_positions is not None

    def prefill(self, prompt: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt [B, T]: the decoder's first tokens (its start token); the encoder runs first."""
        with torch.inference_mode():
            self.encoded = self.model.get_encoder()(input_ids=self.source, attention_mask=torch.ones_like(self.source))
        return super().prefill(prompt)

    def _run(self, ids: torch.LongTensor, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        if position_ids is not None and not self.takes_positions:
            raise ValueError(f"{type(self.model).__name__} takes no decoder position ids: it cannot score a tree")
        if position_ids is not None and self.position_arg:
            kwargs["decoder_position_ids"] = position_ids
        hook = None
        if position_ids is not None and self.embed_positions is not None:

            def given_positions(_module, args, module_kwargs):
                return args, {**module_kwargs, "position_ids": position_ids[0]}  # the decoder's own are 1-D

            hook = self.embed_positions.register_forward_pre_hook(given_positions, with_kwargs=True)
        try:
            out = self.model(
                encoder_outputs=self.encoded,
                attention_mask=torch.ones_like(self.source),
                decoder_input_ids=ids,
                decoder_attention_mask=attention_mask,
                **kwargs,
            )
        finally:
            if hook is not None:
                hook.remove()
        if logits_to_keep:  # seq2seq heads score every position; keep what a causal LM would
            out.logits = out.logits[:, -logits_to_keep:]
        return out


def adapter_for(
    model: PreTrainedModel,
    source: torch.LongTensor | None,
    cache_implementation: str = "dynamic",
    max_len: int = 0,
) -> CausalAdapter:
    """The adapter for this model: `source` is an encoder-decoder's encoder input (None otherwise)."""
    if is_seq2seq(model):
        if source is None:
            raise ValueError(f"{type(model).__name__} is an encoder-decoder model: it needs the source to translate")
        return Seq2seqAdapter(model, source, cache_implementation, max_len)
    return CausalAdapter(model, cache_implementation, max_len)
