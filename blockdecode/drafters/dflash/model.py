"""DFlash (Chen, Liang & Liu, 2026): a block drafter that guesses the whole block in one pass, in the design
z-lab's code, vLLM and SGLang load.

The context is the inputs of several base layers at every accepted position (vLLM's ids, as EAGLE-3 reads them),
concatenated, through `fc` and `hidden_norm`. The block is [the newest accepted token, mask, ..., mask] (b
positions, embedded by the base's own embedding) at its real positions. In each decoder layer the block's queries
attend, with no causal order among them, to the context's keys and values (that layer's projections of the
context, kept like a KV cache) and to the block's own. A final norm and an `lm_head` over a draft vocabulary (ids
mapped to the base's by `d2t`) give a guess at each mask: the paper's parallel heads, reading the network as
EAGLE-3 does.

Training (`DFlash.loss`) takes random anchors in each row, one block after each, all blocks in one pass with a
block-sparse mask, against the base's own greedy continuation from each anchor."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from blockdecode.core.io import read_tensors, saving_folder, write_text
from blockdecode.drafters.dflash.config import CONFIG, WEIGHTS, DFlashConfig
from blockdecode.drafters.eagle3.model import MLP, RMSNorm, rotary, rotate
from blockdecode.drafters.layered import DraftVocabulary, read_config


class Attention(nn.Module):
    """Qwen3's attention (a norm on each head's queries and keys), its keys and values over [context; block]."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        width, heads, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(width, heads * d, bias=False)
        self.k_proj = nn.Linear(width, kv * d, bias=False)
        self.v_proj = nn.Linear(width, kv * d, bias=False)
        self.o_proj = nn.Linear(heads * d, width, bias=False)
        self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.heads, self.kv, self.d = heads, kv, d
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.register_buffer("inv_freq", inv, persistent=False)

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kv, q, d] of x [B, q, H] at `positions` [B, q]."""
        b, q, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, q, self.kv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, q, self.kv, self.d).transpose(1, 2)
        cos, sin = rotary(positions, self.inv_freq, x.dtype)
        return rotate(k, cos, sin), v

    def forward(self, x, positions, context: tuple[torch.Tensor, torch.Tensor], mask=None) -> torch.Tensor:
        """The block x [B, b, H] attending to `context`'s keys and values [B, kv, n, d] and to its own, every
        block position to every other (`mask` [B or 1, 1, b, n + b] bool narrows that, for training)."""
        b, q, _ = x.shape
        query = self.q_norm(self.q_proj(x).view(b, q, self.heads, self.d)).transpose(1, 2)
        cos, sin = rotary(positions, self.inv_freq, x.dtype)
        k, v = self.keys(x, positions)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        out = F.scaled_dot_product_attention(rotate(query, cos, sin), k, v, attn_mask=mask,
                                             enable_gqa=self.heads != self.kv)  # fmt: skip
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, context, mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlash(DraftVocabulary):
    """The drafter's weights, named as z-lab's and the speculators layouts name them, and its one pass."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.shared_head:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.init_vocabulary(cfg.vocab_size, cfg.draft_vocab_size)

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values [B, kv, n, d] of the base's features [B, n, len(ids) * T] at `positions`."""
        hidden = self.hidden_norm(self.fc(features))
        return [layer.self_attn.keys(hidden, positions) for layer in self.layers]

    def forward(self, embeds, positions, context: list, mask=None, head: nn.Module | None = None) -> torch.Tensor:
        """The draft vocabulary's logits [B, b, V_draft] of blocks `embeds` [B, b, H] at `positions` [B, b], each
        layer attending to its `context` entry and the block; through `head`, the base's output layer, where the
        drafter shares it."""
        x = embeds
        for layer, entry in zip(self.layers, context):
            x = layer(x, positions, entry, mask)
        if self.config.shared_head and head is None:
            raise ValueError("this DFlash drafter shares its base's output layer: pass head=")
        return (head if self.config.shared_head else self.lm_head)(self.norm(x))

    def blocks(self, embed: nn.Module, tokens: torch.LongTensor, starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Blocks after `starts` [B, A] of rows `tokens` [B, L]: their embeddings [B, A * b, H] ([the token at the
        start, mask, ...]) and positions [B, A * b]."""
        b = self.config.block_size
        ids = torch.full((*starts.shape, b), self.config.mask_token_id, device=tokens.device)
        ids[..., 0] = tokens.gather(1, starts).clamp(min=0)
        positions = starts[..., None] + torch.arange(b, device=tokens.device)
        return embed(ids.flatten(1)).to(self.fc.weight.dtype), positions.flatten(1)

    def loss(
        self,
        base: nn.Module,
        features: torch.Tensor,
        tokens: torch.LongTensor,
        argmax: torch.LongTensor,
        anchors: int,
        gamma: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks after `anchors` random positions of each row `tokens` [B, L] (-1 past its end) of `base`, all in one
        pass, each seeing the base's features [B, L, len(ids) * T] before its anchor and itself. Position i of the
        block after anchor a learns the base's greedy continuation from a: `argmax` [B, L] (the base's next
        token at each position) at a + i - 1, where the row is that continuation from a + 1 to a + i - 1
        (distilled rows are, past their prompt), mapped into the draft vocabulary (ids outside it skipped),
        weighted exp(-(i - 1) / gamma). Returns the weighted summed cross-entropy over the weights' sum, and
        [b - 1, 2] (right, count) at each block position."""
        b, (rows, length) = self.config.block_size, tokens.shape
        device = tokens.device
        argmax = argmax.long().masked_fill(tokens < 0, -1)
        greedy = torch.zeros_like(tokens, dtype=torch.bool)  # the token at p is the base's argmax at p - 1
        greedy[:, 1:] = (tokens[:, 1:] == argmax[:, :-1]) & (tokens[:, 1:] >= 0)
        valid = (argmax >= 0).float()
        valid[:, -1] = 0  # an anchor needs its first target
        count = int(min(anchors, valid.sum(1).max().item()))
        if count == 0:
            raise ValueError("no row has a position to anchor a block at: rows of at least 2 tokens are needed")
        # A row shorter than `count` anchors (a short verse beside long ones) takes the rest where it has no
        # target, and they learn nothing: its blocks are not cut to the batch's shortest row.
        starts = torch.multinomial(valid + 1e-6, count, generator=generator).sort(dim=1).values  # [B, A]
        offsets = torch.arange(1, b, device=device)
        at = (starts[..., None] + offsets - 1).clamp(max=length - 1)  # where each position's target is read
        targets = argmax.gather(1, at.flatten(1)).view(rows, count, b - 1)
        inside = starts[..., None] + offsets - 1 < length
        onward = greedy.gather(1, (at + 1).clamp(max=length - 1).flatten(1)).view(rows, count, b - 1)
        chain = torch.cat([torch.ones_like(onward[..., :1]), onward[..., :-1]], dim=-1).cumprod(-1).bool()
        targets = torch.where(inside & chain & (targets >= 0), self.draft_ids(targets.clamp(min=0)), -1)
        embeds, positions = self.blocks(base.get_input_embeddings(), tokens, starts)
        context = self.context(features, torch.arange(length, device=device).expand(rows, -1))
        block = torch.arange(count, device=device).repeat_interleave(b)  # each block position's block
        sees_context = torch.arange(length, device=device) < starts.repeat_interleave(b, dim=1)[..., None]
        sees_block = (block[:, None] == block[None, :]).expand(rows, -1, -1)
        mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]  # [B, 1, A * b, L + A * b]
        logits = self(embeds, positions, context, mask, base.get_output_embeddings())
        logits = logits.view(rows, count, b, -1)[:, :, 1:].float()
        weights = torch.exp(-(offsets - 1).float() / gamma)
        losses = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), ignore_index=-1, reduction="none")
        losses = losses.view(rows, count, b - 1)
        known = (targets >= 0).float()
        loss = (losses * weights).sum() / (known * weights).sum().clamp(min=1e-9)
        right = ((logits.argmax(-1) == targets) & (targets >= 0)).sum((0, 1)).float()
        return loss, torch.stack([right, known.sum((0, 1))], dim=-1).detach().cpu()

    def files(self, layout: str | None = None, dtype: torch.dtype | None = None) -> tuple[dict, dict]:
        """The tensors and config.json of `layout`: "dflash" (z-lab's: no vocabulary map, the base's output layer)
        or "speculators" (`d2t`/`t2d` only for a draft vocabulary: vLLM's DFlash has no map for the base's own, and
        its loader refuses one); by default z-lab's where the drafter shares the base's output layer."""
        layout = layout or ("dflash" if self.config.shared_head else "speculators")
        config = self.config.zlab() if layout == "dflash" else self.config.speculators()
        whole_vocabulary = self.config.draft_vocab_size == self.config.vocab_size
        tensors = {}
        for name, t in self.state_dict().items():
            if (layout == "dflash" or whole_vocabulary) and name in ("d2t", "t2d"):
                continue
            t = t.detach().cpu()
            tensors[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
        return tensors, config

    def save(self, folder: str | Path, layout: str | None = None, dtype: torch.dtype | None = None) -> None:
        """config.json and model.safetensors in `layout` (`files`), written as a whole."""
        with saving_folder(Path(folder), CONFIG) as staging:
            tensors, config = self.files(layout, dtype)
            save_file(tensors, str(staging / WEIGHTS), metadata={"format": "pt"})
            write_text(staging / CONFIG, json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype | None = None) -> DFlash:
        """A drafter saved in either layout (`save`, z-lab's checkpoints, or speculators'); a missing or damaged
        file, a missing tensor or a wrong shape refused in one line naming the file."""
        folder = Path(folder)
        config_path, weights = folder / CONFIG, folder / WEIGHTS
        raw = read_config(folder, CONFIG, "a DFlash drafter")
        drafter = cls(DFlashConfig.from_json(raw, config_path))
        state = read_tensors(weights)
        if drafter.config.draft_vocab_size == drafter.config.vocab_size:  # the base's ids throughout: no map written
            state = {**state, "d2t": drafter.d2t, "t2d": drafter.t2d}
        state.pop("embed_tokens.weight", None)  # speculators' copy of the base's own, which is shared here
        drafter.load_checked(state, weights, "a DFlash drafter")
        return drafter.to(dtype) if dtype is not None else drafter
