"""EAGLE-3 (Li et al., 2025): a one-layer drafter reading three of the base's layers, in the design
vLLM, SGLang and llama.cpp load.

`fc` maps the residual streams entering three of the base's layers (vLLM's ids: L is the input of layer L,
0 the embeddings), concatenated in ascending order, to the model width. One Llama decoder layer follows, its
attention reading [norm(embedding of the next token); norm(hidden)]; then a final norm and an `lm_head` over a
draft vocabulary, whose ids map to the base's through `d2t` (target = draft + d2t[draft]). The base's input
embedding is shared, not copied.

Context entry p reads the base's features at p and the token at p + 1, at position p, and predicts the token
at p + 2. Each later draft step reads the drafter's own output before its final norm and the token it just
guessed, one position on: so the drafter keeps its own KV cache over the context and drafts autoregressively.
Training runs those later steps on its own outputs too ("training-time test", `Eagle3.loss`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from blockdecode.core.hf import weights_key
from blockdecode.core.io import read_tensors, saving_folder, write_text
from blockdecode.drafters.eagle3.config import (
    CONFIG,
    LAYOUTS,
    WEIGHTS,
    Eagle3Config,
)
from blockdecode.drafters.layered import DraftVocabulary, read_config


def ttt_loss(sums: torch.Tensor, counts: torch.Tensor, decay: float = 0.8) -> torch.Tensor:
    """The training-time test's loss: each draft step's mean cross-entropy (`sums` over `counts` targets, a
    global batch's under several processes), the later steps weighted less, decay**step, as EAGLE-3 does."""
    weights = decay ** torch.arange(len(sums), device=sums.device, dtype=sums.dtype)
    return (weights * sums / counts.to(sums.device).clamp(min=1)).sum()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in fp32, scaled in the input's dtype."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotary(positions: torch.Tensor, inv: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, q, d] of `positions` [B, q] at the frequencies `inv` [d/2] (Llama's halves convention)."""
    angles = positions.float()[:, None, :, None] * inv
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, q, d]."""
    d = x.shape[-1]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * sin


def fused(module: nn.Module, names: tuple[str, ...]) -> torch.Tensor:
    """The weights of `module`'s linear layers `names`, stacked into one (one matmul instead of several when
    drafting, where each call's overhead is most of its cost); made again when any of them changes."""
    weights = [getattr(module, name).weight for name in names]
    key = weights_key(weights)
    known = module.__dict__.get("_fused")
    if known is None or known[0] != key:
        module.__dict__["_fused"] = known = (key, torch.cat(weights).detach())
    return known[1]


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        width, heads, kv, d = 2 * cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(width, heads * d, bias=False)
        self.k_proj = nn.Linear(width, kv * d, bias=False)
        self.v_proj = nn.Linear(width, kv * d, bias=False)
        self.o_proj = nn.Linear(heads * d, cfg.hidden_size, bias=False)
        self.heads, self.kv, self.d = heads, kv, d
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.register_buffer("inv_freq", inv, persistent=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of x [B, q, 2H], each [B, q, heads * d]: fused when no gradient is asked."""
        if torch.is_grad_enabled():
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        w = fused(self, ("q_proj", "k_proj", "v_proj"))
        return F.linear(x, w).split([self.heads * self.d, self.kv * self.d, self.kv * self.d], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, fused(self, ("gate_proj", "up_proj"))).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [norm(embedding); norm(hidden)], then Llama's MLP."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Queries, keys and values [B, heads, q, d] of the inputs, and the residual they add to."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        a, (b, q, _) = self.self_attn, x.shape
        split = [t.view(b, q, -1, a.d).transpose(1, 2) for t in a.project(x)]
        cos, sin = rotary(positions, a.inv_freq, x.dtype)
        return rotate(split[0], cos, sin), rotate(split[1], cos, sin), split[2], residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The attention's output [B, heads, q, d] through o_proj and the MLP: the layer's output before the
        final norm, which the next draft step reads."""
        b, _, q, _ = attended.shape
        h = self.self_attn.o_proj(attended.transpose(1, 2).reshape(b, q, -1)) + residual
        return self.mlp(self.post_attention_layernorm(h)) + h


class Eagle3(DraftVocabulary):
    """The drafter's weights, named as the speculators format names them, and the two passes it runs."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Layer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if cfg.own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.init_vocabulary(cfg.vocab_size, cfg.draft_vocab_size)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: Entries | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pass of the layer over q entries: embeds [B, q, H] (the next tokens'), hidden [B, q, H] (`fc` of
        the base's features, or the drafter's own output), positions [B, q]; `cache`: the entries before these,
        which these join; `mask` [q, P + q] bool, what each entry sees (default: the cache and itself
        causally). Returns the output before the final norm [B, q, H]."""
        layer = self.layers[0]
        q, k, v, residual = layer.qkv(embeds, hidden, positions)
        if cache is not None:
            k, v = cache.extend(k, v)
        if mask is None and q.shape[2] > 1:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
        grouped = layer.self_attn.heads != layer.self_attn.kv
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)
        return layer.finish(attended, residual)

    def unroll(
        self, embed: nn.Module, features: torch.Tensor, tokens: torch.LongTensor, steps: int, own: bool = False
    ) -> Iterator[torch.Tensor]:
        """Each draft step's logits [B, L, V_draft] at every position t of rows `tokens` [B, L] (-1 past their
        end), from the base's features [B, L, 3T] there. Step 0 reads the features at t and the token at t + 1;
        step j the drafter's own output at t and the token at t + 1 + j, at position t + j, seeing the context up
        to t and its own earlier steps at t alone: the attention drafting from t has at depth j, for every t in
        one pass. That token is the row's (`own` False: the training-time test, teacher-forced) or the drafter's
        guess at step j - 1 (`own`: what drafting from t proposes, every t at once)."""
        b, length, _ = features.shape
        positions = torch.arange(length, device=tokens.device).expand(b, -1)
        hidden = self.fc(features)
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
        own_k: list[torch.Tensor] = []  # each later step's keys and values at every t
        own_v: list[torch.Tensor] = []
        layer, guess = self.layers[0], None
        for step in range(steps):
            shift = step + 1  # entry t reads the token at t + shift and predicts the one after it
            if own and guess is not None:
                inputs = guess
            else:
                inputs = torch.zeros_like(tokens)
                inputs[:, : length - shift] = tokens[:, shift:].clamp(min=0)
            q, k, v, residual = layer.qkv(embed(inputs).to(hidden.dtype), hidden, positions + step)
            if step == 0:
                context_k, context_v = k, v
                attended = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=causal, enable_gqa=layer.self_attn.heads != layer.self_attn.kv
                )
            else:
                own_k.append(k)
                own_v.append(v)
                attended = self._ttt_attention(q, context_k, context_v, own_k, own_v, causal)
            hidden = layer.finish(attended, residual)
            logits = self.logits(hidden)
            if own:
                guess = self.target_ids(logits.argmax(-1))
            yield logits

    def loss(
        self, embed: nn.Module, features: torch.Tensor, tokens: torch.LongTensor, targets: torch.LongTensor, steps: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The training-time test over `steps` draft steps (`unroll`, teacher-forced), against targets [B, L]: the
        base's own next token at each position (-1: none), mapped into the draft vocabulary (those outside it
        skipped). Returns each step's summed cross-entropy [steps] and [steps, 2] (right, count): `ttt_loss`
        weighs them."""
        length = tokens.shape[1]
        sums, tallies = [], torch.zeros(steps, 2)
        for step, logits in enumerate(self.unroll(embed, features, tokens, steps)):
            shift = step + 1
            want = torch.full_like(tokens, -1)
            want[:, : length - shift] = targets[:, shift:]
            want = torch.where(want >= 0, self.draft_ids(want.clamp(min=0)), -1)
            logits = logits.float()
            sums.append(F.cross_entropy(logits.flatten(0, 1), want.flatten(), ignore_index=-1, reduction="sum"))
            right = ((logits.argmax(-1) == want) & (want >= 0)).sum()
            tallies[step] = torch.stack([right, (want >= 0).sum()]).detach().float().cpu()
        return torch.stack(sums), tallies

    @torch.no_grad()
    def guesses(self, embed: nn.Module, features: torch.Tensor, tokens: torch.LongTensor, steps: int) -> torch.Tensor:
        """The chain drafting proposes from every position t at once [B, L, steps] (base ids): at t, its guesses
        for the tokens t + 2 .. t + 1 + steps."""
        return torch.stack(
            [self.target_ids(x.argmax(-1)) for x in self.unroll(embed, features, tokens, steps, True)], -1
        )

    @staticmethod
    def _ttt_attention(q, context_k, context_v, own_k, own_v, causal) -> torch.Tensor:
        """Attention of each position's query to the context before it and to its own later-step entries
        alone (the diagonal): [B, heads, L, d]."""
        groups = q.shape[1] // context_k.shape[1]

        def widen(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(groups, dim=1) if groups > 1 else t

        scale = q.shape[-1] ** -0.5
        context = (q @ widen(context_k).transpose(-1, -2)) * scale
        context = context.masked_fill(~causal, float("-inf"))
        own = torch.stack([(q * widen(k)).sum(-1) * scale for k in own_k], dim=-1)  # [B, heads, L, S]
        weights = torch.cat([context, own], dim=-1).float().softmax(-1).to(q.dtype)
        length = context.shape[-1]
        out = weights[..., :length] @ widen(context_v)
        for s, v in enumerate(own_v):
            out = out + weights[..., length + s, None] * widen(v)
        return out

    def files(self, layout: str = "speculators", dtype: torch.dtype | None = None) -> tuple[dict, dict]:
        """The tensors and the config.json of `layout`: the same tensors under the names each format gives them."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown EAGLE-3 layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
        tensors = {}
        for name, t in self.state_dict().items():
            t = t.detach().cpu()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[name.replace("layers.0.", "midlayer.") if layout == "eagle3" else name] = t.contiguous()
        return tensors, self.config.speculators() if layout == "speculators" else self.config.eagle3()

    def write(self, folder: Path, layout: str = "speculators", dtype: torch.dtype | None = None) -> None:
        """`files` written into `folder` as they are, config.json last (the caller replaces folders whole)."""
        tensors, config = self.files(layout, dtype)
        save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
        write_text(folder / CONFIG, json.dumps(config, indent=2) + "\n")

    def save(self, folder: str | Path, layout: str = "speculators", dtype: torch.dtype | None = None) -> None:
        """config.json and model.safetensors in `layout`, written as a whole (a reader sees the old folder or
        the new one)."""
        with saving_folder(Path(folder), CONFIG) as staging:
            self.write(staging, layout, dtype)

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype | None = None) -> Eagle3:
        """A drafter saved in either layout (`save`, or a speculators or SpecForge checkpoint); a missing or
        damaged file, a missing tensor or a wrong shape refused in one line naming the file."""
        folder = Path(folder)
        config_path, weights = folder / CONFIG, folder / WEIGHTS
        raw = read_config(folder, CONFIG, "an EAGLE-3 drafter")
        state = {name.replace("midlayer.", "layers.0."): t for name, t in read_tensors(weights).items()}
        cfg = replace(Eagle3Config.from_json(raw, config_path), own_embedding="embed_tokens.weight" in state)
        drafter = cls(cfg)
        drafter.load_checked(state, weights, "an EAGLE-3 drafter")
        return drafter.to(dtype) if dtype is not None else drafter


class Entries:
    """The keys and values [B, kv, n, d] a pass attends to, in a buffer that grows in place (its room doubles, so
    an entry costs O(1)); `length` entries are in use, so dropping the newest is setting it back."""

    def __init__(self, k: torch.Tensor | None = None, v: torch.Tensor | None = None, length: int = 0):
        self.k, self.v, self.length = k, v, length

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add entries [B, kv, q, d] after the ones in use; all of them, as views."""
        n = self.length + k.shape[2]
        if self.k is None or n > self.k.shape[2] or self.k.shape[0] != k.shape[0]:
            grown = [t.new_empty(t.shape[0], t.shape[1], max(2 * n, 64), t.shape[3]) for t in (k, v)]
            if self.k is not None:  # a one-row context widens to a beam's rows here
                for new, old in zip(grown, self.view()):
                    new[:, :, : self.length] = old
            self.k, self.v = grown
        self.k[:, :, self.length : n], self.v[:, :, self.length : n] = k, v
        self.length = n
        return self.view()

    def select(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` (a beam's parents), in that order."""
        self.k, self.v = self.k[rows], self.v[rows]
