"""The base model behind the decode loop: the only code that calls a `transformers` model while
decoding.

The loop sees three operations, whatever the model is:
- `prefill(prompt)`: run the prompt, keep its cache, score its last position;
- `score(ids, positions, mask)`: run new tokens over the cache, return their logits and the
  decoder outputs the drafters read; a chain needs neither positions nor mask, a tree of
  candidates gives each node its depth as position and its ancestors as mask;
- `keep(indices)`: keep these cache positions and drop the rest; rolling back a rejected chain
  is the contiguous case, keeping a tree's accepted path the general one;
- `keep_paths(paths)`: after a batch's call, each row keeps its own accepted nodes. Rows that keep
  different nodes leave masked entries in the cache: a per-row validity mask (left padding and
  rejected entries are 0) hides them from later calls, and every row gets its own position ids
  (its count of valid entries), so each row computes what it would alone;
- `select_rows(rows)`: keep these rows of the batch (the others have finished).

`CausalAdapter` serves decoder-only models. `Seq2seqAdapter` serves encoder-decoder models with the
same three calls: the encoder runs once, before the decoder's prefill, and its outputs (and the
cross-attention cache) stay as they are; `score` runs the decoder, and `keep` cuts the
self-attention cache only (see docs/design.md)."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from transformers import PreTrainedModel

from blockdecode.core.hf import (
    cache_argument,
    decoder_output,
    eval_mode,
    is_seq2seq,
    layer_inputs,
    make_cache,
    own_thread_hook,
    vocab_size,
)
from blockdecode.core.tree import windowed


class CausalAdapter:
    """A batch of sequences through a causal LM with a KV cache that can keep any subset of each
    row's positions."""

    takes_positions = True  # score() can give tokens their own position ids (a tree, a batch need it)

    def __init__(self, model: PreTrainedModel, cache_implementation: str = "dynamic", max_len: int = 0):
        """`max_len`: the most positions the cache will hold (a static cache allocates them)."""
        self.model = model
        self.cache = make_cache(model, cache_implementation, max_len)
        self.layers = getattr(self.cache, "layers", None)  # the self-attention layers, which keep() edits
        self.static = cache_implementation == "static"
        self.max_len = max_len
        self.cache_arg = cache_argument(model)
        self.length = 0  # positions in the cache
        self.scored = 0  # tokens the last forward appended
        self.valid: torch.Tensor | None = None  # [B, length] bool, which entries each row sees; None: all
        text = model.config.get_text_config(decoder=True)
        kinds = set(getattr(text, "layer_types", None) or ("sliding_attention",))
        self.window = getattr(text, "sliding_window", None) if "sliding_attention" in kinds else None
        self.mixed = "full_attention" in kinds  # then a tree's masks go by layer kind, as transformers names them
        self.calls = 0  # forward passes, prefill included
        self.encoder_calls = 0
        self.read_layers: tuple[int, ...] = ()  # layers whose inputs the drafters read (`features`)
        self.features: torch.Tensor | None = None  # the last forward's, [B, q, 3D], at every token it ran

    def prefill(self, prompt: torch.LongTensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt [B, T] -> logits [B, 1, V] and decoder output [B, 1, D] at its last position.
        `mask` [B, T]: 0 on left padding (None: none), with the position ids `generate` gives it."""
        if mask is None:
            return self._forward(prompt, logits_to_keep=1)
        self.valid = mask.bool()
        positions = (mask.long().cumsum(-1) - 1).masked_fill_(mask == 0, 1)
        return self._forward(prompt, logits_to_keep=1, attention_mask=mask.long(), position_ids=positions)

    def score(
        self, ids: torch.LongTensor, positions: torch.LongTensor | None = None, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, q] after the cache -> logits [B, q, V] and decoder outputs [B, q, D].

        `positions` [q] or [B, q]: each token's position id (default: each row's count of valid
        entries onwards, a chain). `mask` [q, q] or [B, q, q] bool: mask[i, j] says token i may see
        token j (its ancestors and itself); default causal. Every token sees its row's valid cache."""
        batch, q = ids.shape
        if self.static and self.valid is not None and self.length + q > self.max_len:
            self.compact()  # masked entries would leave no room
        kwargs: dict = {"logits_to_keep": 0}
        if positions is None and self.valid is not None and self.takes_positions:
            positions = self.valid.sum(-1, keepdim=True) + torch.arange(q, device=ids.device)
        if positions is not None:
            kwargs["position_ids"] = positions.view(-1, q).expand(batch, -1)
        if mask is not None:
            kwargs["attention_mask"] = self._attention_mask(mask.view(-1, q, q).expand(batch, -1, -1))
        elif self.valid is not None:  # padding and rejected entries: a 2-D mask, made causal by the model
            kwargs["attention_mask"] = self._padding_mask(q)
        out = self._forward(ids, **kwargs)
        if self.valid is not None:
            self.valid = torch.cat([self.valid, self.valid.new_ones(batch, q)], dim=1)
        return out

    @property
    def contiguous(self) -> bool:
        """Whether attention reads where a key sits in the cache, not only the mask (relative
        positions, a sliding window): then each row's valid entries stay contiguous and last."""
        return bool(self.window) or not self.takes_positions

    @torch.inference_mode()
    def keep_paths(self, paths: Sequence[Sequence[int]]) -> None:
        """Of the tokens the last `score` appended (node 0: the newest token), row r keeps the nodes
        `paths[r]` (ascending, 0 first). Rows that keep the same nodes cut the cache as `keep` does;
        others mask what they drop, and the tail no row kept is cut."""
        start = self.length - self.scored
        if all(list(p) == list(paths[0]) for p in paths):
            path = list(paths[0])
            self.keep(
                range(start + len(path)) if path[-1] == len(path) - 1 else [*range(start), *(start + i for i in path)]
            )
            return
        if self.valid is None:
            self.valid = torch.ones(len(paths), self.length, dtype=torch.bool, device=self.model.device)
        self.valid[:, start:] = False
        for row, path in enumerate(paths):
            self.valid[row, [start + i for i in path]] = True
        self.keep(range(start + max(p[-1] for p in paths) + 1))
        counts = self.valid.sum(-1)
        if self.contiguous or 4 * (self.length - int(counts.max())) > self.length:
            self.compact()

    @torch.inference_mode()
    def compact(self) -> None:
        """Move each row's valid entries, in order, to the end of the cache (left padding before
        them), as long as the longest row: no gaps, and no column that no row sees."""
        slots = torch.arange(self.length, device=self.model.device).expand_as(self.valid)
        order = torch.where(self.valid, slots, -1).sort(dim=-1).values  # the invalid (-1) first
        n = int(self.valid.sum(-1).max())
        order = order[:, self.length - n :]
        self.valid, index = order >= 0, order.clamp(min=0)
        for layer in self.layers:
            if not getattr(layer, "is_initialized", True):
                continue
            for name in ("keys", "values"):
                kv = getattr(layer, name)
                moved = kv.gather(2, index[:, None, :, None].expand(-1, kv.shape[1], -1, kv.shape[-1]))
                if self.static:
                    kv[:, :, :n] = moved
                else:
                    setattr(layer, name, moved)
            if self.static:
                layer.cumulative_length.fill_(n)
        self.length = n
        if bool(self.valid.all()):
            self.valid = None

    @torch.inference_mode()
    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep the batch's rows `rows` (in this order) and drop the others, finished."""
        index = torch.tensor(list(rows), device=self.model.device)
        for layer in self._all_layers():
            if getattr(layer, "is_initialized", True) and getattr(layer, "keys", None) is not None:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        if self.valid is not None:
            self.valid = self.valid[index]

    def _all_layers(self) -> list:
        return list(self.layers)

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
                self.valid = self.valid[:, :n] if self.valid is not None else None
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
        if self.valid is not None:
            self.valid = torch.cat([self.valid[:, :fixed], self.valid[:, moved]], dim=1)
        self.length = n

    def _attention_mask(self, mask: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """The [B, 1, q, kv] additive mask transformers takes as given, from mask [B, q, q]: 0 where a
        token may attend, the dtype's minimum elsewhere (a bool mask is silently misread under eager
        attention). With sliding-window layers: their own, cut to the window (`windowed`)."""
        batch, q = mask.shape[:2]
        width = self.max_len if self.static else self.length + q
        dtype = self.model.dtype
        full = torch.full((batch, 1, q, width), torch.finfo(dtype).min, dtype=dtype, device=self.model.device)
        if self.valid is None:
            full[..., : self.length] = 0
        else:
            full[..., : self.length].masked_fill_(self.valid[:, None, None, :], 0)
        full[..., self.length : self.length + q].masked_fill_(mask[:, None].to(full.device), 0)
        if not self.window:
            return full
        sliding = windowed(full, mask.to(full.device), self.length, self.window)
        return {"full_attention": full, "sliding_attention": sliding} if self.mixed else sliding

    def _padding_mask(self, q: int) -> torch.Tensor:
        """The [B, kv] mask of which keys each row sees (its valid cache and the q new tokens), 0 past
        them in a static cache."""
        width = self.max_len if self.static else self.length + q
        mask = torch.zeros(self.valid.shape[0], width, dtype=torch.long, device=self.model.device)
        mask[:, : self.length] = self.valid
        mask[:, self.length : self.length + q] = 1
        return mask

    @torch.inference_mode()
    def _forward(self, ids: torch.LongTensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        reading = layer_inputs(self.model, self.read_layers) if self.read_layers else nullcontext([])
        with decoder_output(self.model) as hidden, reading as features:
            out = self._run(ids, use_cache=True, **{self.cache_arg: self.cache}, **kwargs)
        self.features = features[0] if features else None
        self.calls += 1
        self.length += ids.shape[1]
        self.scored = ids.shape[1]
        return out.logits, hidden[0]

    def _run(self, ids: torch.LongTensor, **kwargs):
        return self.model(input_ids=ids, **kwargs)


class Seq2seqAdapter(CausalAdapter):
    """The decoder of an encoder-decoder model over a batch of source sequences, encoded once."""

    def __init__(
        self,
        model: PreTrainedModel,
        source: torch.LongTensor,
        cache_implementation: str = "dynamic",
        max_len: int = 0,
        source_mask: torch.Tensor | None = None,
    ):
        """`source` [B, S]: the encoder's input, `source_mask` [B, S] 0 on its padding (None: none);
        the decoder's tokens go through prefill and score."""
        super().__init__(model, cache_implementation, max_len)
        self.source = source
        self.source_mask = source_mask.long() if source_mask is not None else torch.ones_like(source)
        self.encoded = None
        self.layers = self.cache.self_attention_cache.layers
        self.position_arg = "decoder_position_ids" in inspect.signature(model.forward).parameters
        # Marian, BART, mBART and Pegasus take no position ids, but their decoders hand their own to
        # the positional embedding, by keyword: a tree's, or a batch's, replace them there for one call.
        embed = getattr(model.get_decoder(), "embed_positions", None)
        takes = embed is not None and "position_ids" in inspect.signature(embed.forward).parameters
        self.embed_positions = embed if takes and not self.position_arg else None
        self.takes_positions = self.position_arg or self.embed_positions is not None

    def prefill(self, prompt: torch.LongTensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt [B, T]: the decoder's first tokens (its start token); the encoder runs first."""
        with torch.inference_mode():
            self.encoded = self.model.get_encoder()(input_ids=self.source, attention_mask=self.source_mask)
        self.encoder_calls += 1
        return super().prefill(prompt, mask)

    def select_rows(self, rows: Sequence[int]) -> None:
        super().select_rows(rows)
        index = torch.tensor(list(rows), device=self.model.device)
        self.source, self.source_mask = self.source[index], self.source_mask[index]
        self.encoded["last_hidden_state"] = self.encoded.last_hidden_state[index]

    def _all_layers(self) -> list:
        return [*self.layers, *self.cache.cross_attention_cache.layers]

    def _run(self, ids: torch.LongTensor, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        if position_ids is not None and not self.takes_positions:
            raise ValueError(f"{type(self.model).__name__} takes no decoder position ids: it cannot score a tree")
        if position_ids is not None and self.position_arg:
            kwargs["decoder_position_ids"] = position_ids
        given = position_ids is not None and self.embed_positions is not None

        def given_positions(module, args, module_kwargs, _output):
            # The decoder's own position ids are one row for the whole batch: embed each row's.
            rows = [module.forward(*args, **{**module_kwargs, "position_ids": p}) for p in position_ids]
            return torch.stack([r.reshape(r.shape[-2:]) for r in rows])

        hooked = own_thread_hook(self.embed_positions, given_positions, with_kwargs=True, after=True)
        with hooked if given else nullcontext():
            out = self.model(
                encoder_outputs=self.encoded,
                attention_mask=self.source_mask,
                decoder_input_ids=ids,
                decoder_attention_mask=attention_mask,
                **kwargs,
            )
        if logits_to_keep:  # seq2seq heads score every position; keep what a causal LM would
            out.logits = out.logits[:, -logits_to_keep:]
        return out


def decoder_prompt(
    model: PreTrainedModel, prompt: torch.LongTensor
) -> tuple[torch.LongTensor | None, torch.LongTensor]:
    """(source, the sequence the decoder extends): (None, the prompt) for a causal LM; for an
    encoder-decoder (the prompt, its decoder start token), as `generate` starts: decoder_start_token_id,
    else BOS."""
    if not is_seq2seq(model):
        return None, prompt
    cfg = model.generation_config
    start = cfg.decoder_start_token_id if cfg.decoder_start_token_id is not None else cfg.bos_token_id
    if isinstance(start, list | tuple):
        start = start[0] if len(start) == 1 else None
    if start is None:
        raise ValueError(
            f"{type(model).__name__} names neither a decoder_start_token_id nor a bos_token_id in its generation config"
        )
    return prompt, prompt.new_full((prompt.shape[0], 1), int(start))


def open_decoder(
    model: PreTrainedModel,
    prompt: torch.LongTensor,
    cache_implementation: str = "dynamic",
    room: int = 0,
    mask: torch.Tensor | None = None,
) -> tuple[CausalAdapter, torch.LongTensor]:
    """The adapter that decodes from `prompt` (an encoder-decoder's source, `mask` its padding), with
    cache room for `room` positions past the decoder's start; and that start, the sequences the
    decoder extends."""
    source, start = decoder_prompt(model, prompt)
    return adapter_for(
        model, source, cache_implementation, start.shape[1] + room, mask if source is not None else None
    ), start


def sequence_logits(
    model: PreTrainedModel,
    ids: torch.LongTensor,
    source: torch.LongTensor | None = None,
    source_mask: torch.LongTensor | None = None,
) -> torch.Tensor:
    """Logits [B, T, V] of every position of `ids` in one teacher-forced pass: a causal LM's tokens,
    or an encoder-decoder's decoder tokens given its `source` (`source_mask`: 0 on padding)."""
    if is_seq2seq(model):
        mask = source_mask if source_mask is not None else torch.ones_like(source)
        return model(input_ids=source, attention_mask=mask, decoder_input_ids=ids, use_cache=False).logits
    return model(input_ids=ids, use_cache=False).logits


_TREE_MASK_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {attention: ok}


@torch.inference_mode()
def takes_tree_masks(model: PreTrainedModel) -> bool:
    """Whether the model applies a custom 4D attention mask as given, found from its logits once
    per model and attention implementation: two sibling candidates scored together must each
    score as they do alone. ALiBi models, and any that drop or rebuild the mask, fail it."""
    checked = _TREE_MASK_CHECKED.setdefault(model, {})
    key = str(getattr(model.config, "_attn_implementation", ""))
    if key not in checked:
        vocab = vocab_size(model)
        prompt = torch.tensor([[1 % vocab, 2 % vocab, 3 % vocab]], device=model.device)
        siblings = torch.tensor([[4 % vocab, 5 % vocab, 6 % vocab]], device=model.device)
        source = prompt if is_seq2seq(model) else None
        try:
            with eval_mode(model):  # dropout would part the two scores of one candidate
                together = adapter_for(model, source, "dynamic", 8)
                together.prefill(prompt)
                mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
                positions = torch.tensor([3, 4, 4], device=model.device)
                logits, _ = together.score(siblings, positions=positions, mask=mask)
                alone = adapter_for(model, source, "dynamic", 8)
                alone.prefill(prompt)
                reference, _ = alone.score(siblings[:, [0, 2]])
            scale = reference.float().abs().max().clamp(min=1.0)
            ok = bool(((logits[0, 2].float() - reference[0, 1].float()).abs().max() / scale) < 1e-2)
        except Exception:  # a model that cannot take the mask or the positions at all says so by failing
            ok = False
        checked[key] = ok
    return checked[key]


def adapter_for(
    model: PreTrainedModel,
    source: torch.LongTensor | None,
    cache_implementation: str = "dynamic",
    max_len: int = 0,
    source_mask: torch.Tensor | None = None,
) -> CausalAdapter:
    """The adapter for this model: `source` is an encoder-decoder's encoder input (None otherwise),
    `source_mask` its padding."""
    if is_seq2seq(model):
        if source is None:
            raise ValueError(f"{type(model).__name__} is an encoder-decoder model: it needs the source to translate")
        return Seq2seqAdapter(model, source, cache_implementation, max_len, source_mask)
    return CausalAdapter(model, cache_implementation, max_len)
