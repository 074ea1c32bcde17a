"""An EAGLE-3 drafter's shape and what it reads of its base, in the speculators and the original layouts' configs;
checked against a base in one line."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from blockdecode.core.hf import decoder_depth
from blockdecode.core.io import CheckpointError
from blockdecode.drafters.layered import check_base, layer_fields

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
            **layer_fields(self, 1),
            "mlp_bias": False,
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


def config_for(base, draft_vocab: int, aux_layers: tuple[int, ...] | None = None, k: int = 8, **shape) -> Eagle3Config:
    """An EAGLE-3 drafter's shape for `base`: its width the base's embedding's, its attention heads and MLP
    the base's where it says them, its features read at `aux_layers` (default: `default_aux_layers`)."""
    text = base.config.get_text_config(decoder=True)
    layers = decoder_depth(base)
    if layers is None:
        raise ValueError(f"{type(base).__name__}'s config names no num_hidden_layers: pass aux_layers")
    ids = tuple(sorted(aux_layers)) if aux_layers else default_aux_layers(layers)
    if len(ids) != 3 or min(ids) < 0 or max(ids) >= layers:
        raise ValueError(f"--aux-layers needs three layer ids in [0, {layers - 1}] (the base has {layers}), got {ids}")
    if layers >= 3 and len(set(ids)) < 3:  # a repeat reads the same features twice: only a shallower base needs one
        raise ValueError(f"--aux-layers needs three distinct layers where the base has {layers}, got {list(ids)}")
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
    """Refuse, in one line naming `where`, a drafter built for another base (`layered.check_base`)."""
    check_base("the EAGLE-3 drafter", cfg, cfg.aux_layers, base, where)
