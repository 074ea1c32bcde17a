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

import copy
import json
import math
import statistics
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from blockdecode.drafters import BaseDrafter
from blockdecode.expected import Scored, Source, confidence_source
from blockdecode.hf import weights_key
from blockdecode.io import CheckpointError, read_tensors, saving_folder, write_text

SPECULATORS_VERSION = "0.3.0"
CONFIG = "config.json"  # written last: what marks a saved drafter whole
WEIGHTS = "model.safetensors"
LAYOUTS = ("speculators", "eagle3")  # layers.0.* (vLLM's speculators format), midlayer.* (the original's)


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """The layers whose inputs `fc` reads: vLLM's (2, N/2, N-3) where those are three distinct layers; a
    shallower base, where they are not (the built-in 4-layer model's would be (2, 2, 1)), reads (1, N/2, N-1),
    then (0, 1, 2), then its layers repeated."""
    for ids in ((2, n_layers // 2, n_layers - 3), (1, n_layers // 2, n_layers - 1), (0, 1, 2)):
        if len(set(ids)) == 3 and all(0 <= i < n_layers for i in ids):
            return tuple(sorted(ids))
    return tuple(min(i, n_layers - 1) for i in range(3))


@dataclass
class Eagle3Config:
    """The drafter's shape, and what it reads of its base; saved as the speculators format's config."""

    hidden_size: int  # the drafter's width: the base's embedding width, since the embedding is shared
    target_hidden_size: int  # the width of each base layer's features
    vocab_size: int  # the base's vocabulary
    draft_vocab_size: int
    aux_layers: tuple[int, int, int]
    intermediate_size: int = 0  # 0: 8/3 of hidden_size, rounded up to 64
    num_attention_heads: int = 0  # 0: hidden_size / 64
    num_key_value_heads: int = 0  # 0: num_attention_heads
    head_dim: int = 0  # 0: hidden_size / num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    own_embedding: bool = False  # a checkpoint with its own embed_tokens (else the base's is shared)
    speculative_tokens: int = 7  # the chain a serving engine drafts by default (k - 1)
    verifier: dict = field(default_factory=dict)  # the base: name_or_path, architectures

    def __post_init__(self) -> None:
        self.aux_layers = tuple(int(i) for i in self.aux_layers)
        if len(self.aux_layers) != 3 or min(self.aux_layers) < 0 or list(self.aux_layers) != sorted(self.aux_layers):
            raise ValueError(f"aux_layers must be three layer ids >= 0, ascending, got {list(self.aux_layers)}")
        if self.num_attention_heads == 0:
            self.num_attention_heads = max(1, self.hidden_size // 64)
        if self.num_key_value_heads == 0:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size == 0:
            self.intermediate_size = 64 * math.ceil(self.hidden_size * 8 / 3 / 64)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 2 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must lie in [2, {self.vocab_size}], got {self.draft_vocab_size}")

    def parameters(self) -> int:
        """How many parameters the drafter holds (its buffers d2t and t2d aside)."""
        h, t, heads, kv, hd = (
            self.hidden_size,
            self.target_hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        )
        attention = 2 * h * (heads + 2 * kv) * hd + heads * hd * h
        embedding = self.vocab_size * h if self.own_embedding else 0
        return 3 * t * h + attention + 3 * h * self.intermediate_size + 4 * h + self.draft_vocab_size * h + embedding

    def layer_config(self) -> dict:
        """The decoder layer's config, as a Llama config (`transformer_layer_config`)."""
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        }

    def speculators(self) -> dict:
        """The speculators format's config.json (vLLM reads it; `from_speculators` reads it back)."""
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": self.layer_config(),
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": self.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.speculative_tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": None, "architectures": [], **self.verifier},
            },
        }

    def eagle3(self) -> dict:
        """The original layout's config.json (`LlamaForCausalLMEagle3`: SGLang, llama.cpp and vLLM read it)."""
        flat = self.layer_config() | {
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": self.norm_before_residual,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)},
        }
        return flat

    @classmethod
    def from_json(cls, raw: dict, where: Path) -> Eagle3Config:
        """The config of either layout's config.json; one line naming the file for anything else."""
        try:
            if raw.get("speculators_model_type") == "eagle3":
                layer, ids = raw["transformer_layer_config"], raw["eagle_aux_hidden_state_layer_ids"]
                proposal = raw.get("speculators_config", {}).get("proposal_methods") or [{}]
                tokens = proposal[0].get("speculative_tokens", 7)
                verifier = raw.get("speculators_config", {}).get("verifier") or {}
            elif "LlamaForCausalLMEagle3" in raw.get("architectures", []):
                layer, ids = raw, (raw.get("eagle_config") or {})["eagle_aux_hidden_state_layer_ids"]
                tokens, verifier = 7, {}
            else:
                raise KeyError("speculators_model_type (eagle3) or architectures (LlamaForCausalLMEagle3)")
            rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind != "default":
                raise CheckpointError(
                    f"{where}: its layer's rotary embedding is {kind!r}; blockdecode computes the default"
                )
            for flag in ("norm_before_fc", "fc_norm", "norm_output"):
                if raw.get(flag):
                    raise CheckpointError(
                        f"{where}: {flag} is set, a variant blockdecode's EAGLE-3 layer does not compute"
                    )
            return cls(
                hidden_size=layer["hidden_size"],
                target_hidden_size=raw.get("target_hidden_size") or layer["hidden_size"],
                vocab_size=layer["vocab_size"],
                draft_vocab_size=raw["draft_vocab_size"],
                aux_layers=tuple(ids),
                intermediate_size=layer["intermediate_size"],
                num_attention_heads=layer["num_attention_heads"],
                num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
                head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
                rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)),
                max_position_embeddings=layer.get("max_position_embeddings", 2048),
                norm_before_residual=bool(raw.get("norm_before_residual", False)),
                speculative_tokens=tokens,
                verifier={k: v for k, v in verifier.items() if k in ("name_or_path", "architectures")},
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{where} is not an EAGLE-3 drafter's config: {err}") from err


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


class Eagle3(nn.Module):
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
        ids = torch.arange(cfg.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True))

    def set_vocabulary(self, token_map: torch.LongTensor) -> None:
        """The draft vocabulary: the base's ids `token_map`, ascending (draft id i is token_map[i])."""
        token_map = token_map.sort().values.to(self.d2t.device)
        self.d2t.copy_(token_map - torch.arange(len(token_map), device=token_map.device))
        self.t2d.zero_()[token_map] = True

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Each base id's draft id, -1 for ids outside the draft vocabulary."""
        index = self.t2d.long().cumsum(0) - 1
        return torch.where(self.t2d[target_ids], index[target_ids], -1)

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
        try:
            raw = json.loads(config_path.read_text())
        except FileNotFoundError as err:
            raise CheckpointError(f"{config_path} is missing: not a saved EAGLE-3 drafter") from err
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{config_path} is corrupt: {err}") from err
        state = {name.replace("midlayer.", "layers.0."): t for name, t in read_tensors(weights).items()}
        cfg = replace(Eagle3Config.from_json(raw, config_path), own_embedding="embed_tokens.weight" in state)
        drafter = cls(cfg)
        expected = drafter.state_dict()
        for name, t in expected.items():
            if name not in state:
                raise CheckpointError(f"{weights} lacks the tensor {name}")
            if state[name].shape != t.shape:
                raise CheckpointError(
                    f"{weights}: {name} has shape {list(state[name].shape)}, its config says {list(t.shape)}"
                )
        extra = sorted(set(state) - set(expected))
        if extra:
            raise CheckpointError(f"{weights} holds tensors an EAGLE-3 drafter does not: {', '.join(extra[:3])}")
        d2t = state["d2t"].long()
        targets = torch.arange(len(d2t)) + d2t
        if targets.min() < 0 or targets.max() >= drafter.config.vocab_size:
            raise CheckpointError(f"{weights}: d2t maps draft ids outside the base's vocabulary")
        drafter.load_state_dict({**state, "d2t": d2t, "t2d": state["t2d"].bool()})
        return drafter.to(dtype) if dtype is not None else drafter


def config_for(base, draft_vocab: int, aux_layers: tuple[int, ...] | None = None, k: int = 8, **shape) -> Eagle3Config:
    """An EAGLE-3 drafter's shape for `base`: its width the base's embedding's, its attention heads and MLP
    the base's where it says them, its features read at `aux_layers` (default: `default_aux_layers`)."""
    text = base.config.get_text_config(decoder=True)
    layers = getattr(text, "num_hidden_layers", None)
    if layers is None:
        raise ValueError(f"{type(base).__name__}'s config names no num_hidden_layers: pass aux_layers")
    ids = tuple(sorted(aux_layers)) if aux_layers else default_aux_layers(layers)
    if len(ids) != 3 or min(ids) < 0 or max(ids) >= layers:
        raise ValueError(f"--aux-layers needs three layer ids in [0, {layers - 1}] (the base has {layers}), got {ids}")
    width = base.get_input_embeddings().weight.shape[1]
    heads = getattr(text, "num_attention_heads", None)
    defaults = {
        "intermediate_size": getattr(text, "intermediate_size", None) or 0,
        "num_attention_heads": heads if heads and width % heads == 0 else 0,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or 0,
        "rms_norm_eps": getattr(text, "rms_norm_eps", None) or 1e-6,
        "max_position_embeddings": getattr(text, "max_position_embeddings", None) or 2048,
    }
    defaults["num_key_value_heads"] = defaults["num_key_value_heads"] if defaults["num_attention_heads"] else 0
    defaults["head_dim"] = width // defaults["num_attention_heads"] if defaults["num_attention_heads"] else 0
    return Eagle3Config(
        hidden_size=width,
        target_hidden_size=getattr(text, "hidden_size", width),
        vocab_size=base.get_output_embeddings().weight.shape[0],
        draft_vocab_size=draft_vocab,
        aux_layers=ids,
        speculative_tokens=k - 1,
        verifier={
            "name_or_path": getattr(base, "name_or_path", None) or None,
            "architectures": list(base.config.architectures or []),
        },
        **(defaults | shape),
    )


def check_eagle3(cfg: Eagle3Config, base, where: object = None) -> None:
    """Refuse, in one line naming `where`, a drafter built for another base: its vocabulary, the width of the
    features it reads or of the embedding it shares, or layers the base does not have."""
    text = base.config.get_text_config(decoder=True)
    name = f"{where}: " if where is not None else ""
    vocab = base.get_output_embeddings().weight.shape[0]
    width = base.get_input_embeddings().weight.shape[1]
    layers = getattr(text, "num_hidden_layers", 0)
    found = [
        ("vocabulary", cfg.vocab_size, vocab),
        ("embedding width", cfg.hidden_size, width),
        ("hidden size", cfg.target_hidden_size, getattr(text, "hidden_size", width)),
    ]
    for what, built, has in found:
        if built != has:
            raise CheckpointError(f"{name}the EAGLE-3 drafter was built for a {what} of {built}, the base's is {has}")
    if max(cfg.aux_layers) >= layers:
        raise CheckpointError(
            f"{name}the EAGLE-3 drafter reads layers {list(cfg.aux_layers)}, and the base has {layers}"
        )


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


class Eagle3Drafter(BaseDrafter):
    """Proposals from an EAGLE-3 drafter: it reads the base's features at the positions each call keeps
    (`see`), extends its own cache over them, then guesses autoregressively: a chain of its argmax, or a beam
    of its `width` best paths for a tree, each node's source the drafter's probability for it given its
    parent. A chain stops early once its probability falls below `min_prob` (each step costs a pass of the
    layer; the rest is padding, which seldom stands)."""

    name = "eagle3"

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

    def chain_scored(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> Scored:
        return self._chain(0, tokens, n)

    def _chain(self, row: int, tokens: torch.LongTensor, n: int) -> Scored:
        """The drafter's argmax chain, padded (by its last guess) past where its probability fell below
        `min_prob`."""
        if n == 0:
            return Scored([], [])
        *_, guess, chances = self._beam(row, tokens, n, 1, self.min_prob)[-1]
        sources = [confidence_source(self.name, c) for c in chances]
        pad = n - len(guess)
        return Scored(guess + guess[-1:] * pad, sources + [Source(self.name, ("padding",), 0.05)] * pad)

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        return torch.tensor([self._chain(0, tokens, n).tokens], dtype=torch.long, device=tokens.device)

    def rows_scored(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> list[Scored]:
        return [self._chain(row, t, n) for t, row in zip(tokens, rows)]

    def propose_rows(
        self, tokens: list[torch.LongTensor], hidden: torch.Tensor, n: int, rows: list[int]
    ) -> torch.LongTensor:
        chains = [self._chain(row, t, n).tokens for t, row in zip(tokens, rows)]
        return torch.tensor(chains, dtype=torch.long, device=tokens[0].device).view(len(rows), n)

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
