"""A DFlash block drafter's shape and what it reads of its base, in z-lab's and the speculators layouts' configs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from blockdecode.core.hf import decoder_depth
from blockdecode.core.io import CheckpointError
from blockdecode.drafters.eagle3.config import SPECULATORS_VERSION, default_aux_layers
from blockdecode.drafters.eagle3.config import config_for as eagle3_config_for
from blockdecode.drafters.layered import check_base, layer_fields

CONFIG = "config.json"  # written last: what marks a saved drafter whole
WEIGHTS = "model.safetensors"


@dataclass
class DFlashConfig:
    """The drafter's shape, and what it reads of its base. `block_size` b: one pass drafts b - 1 tokens, from a
    block of the newest accepted token and b - 1 masks (`mask_token_id`, embedded by the base's own embedding)."""

    hidden_size: int  # the drafter's width: the base's embedding width, since the embedding is shared
    target_hidden_size: int  # the width of each base layer's features
    vocab_size: int  # the base's vocabulary
    draft_vocab_size: int
    target_layer_ids: tuple[int, ...]  # the layers whose inputs `fc` reads (vLLM's ids: 0 the embeddings)
    mask_token_id: int
    block_size: int = 16
    num_hidden_layers: int = 1
    shared_head: bool = False  # the base's own output layer over its whole vocabulary (z-lab's design), not its own
    num_target_layers: int = 0  # the base's layers (z-lab's config names them)
    intermediate_size: int = 0  # 0: 8/3 of hidden_size, rounded up to 64
    num_attention_heads: int = 0  # 0: hidden_size / 64
    num_key_value_heads: int = 0  # 0: num_attention_heads
    head_dim: int = 0  # 0: hidden_size / num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    verifier: dict = field(default_factory=dict)  # the base: name_or_path, architectures

    def __post_init__(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        ids = list(self.target_layer_ids)
        if not ids or min(ids) < 0 or ids != sorted(set(ids)):
            raise ValueError(f"target_layer_ids must be distinct layer ids >= 0, ascending, got {ids}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the newest token and at least one mask), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must lie in [0, {self.vocab_size}), got {self.mask_token_id}")
        if self.shared_head and self.draft_vocab_size != self.vocab_size:
            raise ValueError("a drafter sharing the base's output layer drafts over its whole vocabulary")
        if not 2 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must lie in [2, {self.vocab_size}], got {self.draft_vocab_size}")
        self.num_attention_heads = self.num_attention_heads or max(1, self.hidden_size // 64)
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.intermediate_size = self.intermediate_size or 64 * math.ceil(self.hidden_size * 8 / 3 / 64)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    def layer_config(self) -> dict:
        """The decoder layers' config, as a Qwen3 config (what both layouts describe the layers with)."""
        return {"model_type": "qwen3", **layer_fields(self, self.num_hidden_layers)}

    def speculators(self) -> dict:
        """The speculators format's config.json (`speculators_model_type: dflash`; vLLM reads it)."""
        return {
            "architectures": ["DFlashSpeculator"],
            "speculators_model_type": "dflash",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": self.layer_config(),
            "draft_vocab_size": self.draft_vocab_size,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "target_hidden_size": self.target_hidden_size,
            "aux_hidden_state_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
            # the block's layers attend without causal order: vLLM's reader makes every layer causal where this is
            # false, and speculators' own model reads true for layers without a sliding window
            "sliding_window_non_causal": True,
            "sample_from_anchor": False,
            "speculators_config": {
                "algorithm": "dflash",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.block_size - 1}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": None, "architectures": [], **self.verifier},
            },
        }

    def zlab(self) -> dict:
        """z-lab's config.json (`DFlashDraftModel`: the base's output layer; layers' outputs as ids, read as
        hidden_states[id + 1], so vLLM's id L is z-lab's L - 1, and the embeddings -1); one line where this
        drafter cannot be written so."""
        if not self.shared_head:
            raise ValueError(
                "z-lab's DFlash layout drafts through the base's output layer: this drafter has its own over a "
                "draft vocabulary (export it as speculators, or train it with --draft-vocab 0)"
            )
        ids = [i - 1 for i in self.target_layer_ids]
        return self.layer_config() | {
            "architectures": ["DFlashDraftModel"],
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"target_layer_ids": ids, "mask_token_id": self.mask_token_id},
        }

    @classmethod
    def from_json(cls, raw: dict, where: Path) -> DFlashConfig:
        """The config of either layout's config.json; one line naming the file for anything else."""
        try:
            if raw.get("speculators_model_type") == "dflash":
                layer, ids = raw["transformer_layer_config"], raw["aux_hidden_state_layer_ids"]
                shared, verifier = False, (raw.get("speculators_config") or {}).get("verifier") or {}
                extra = {"draft_vocab_size": raw["draft_vocab_size"], "mask_token_id": raw["mask_token_id"]}
                extra |= {"block_size": raw["block_size"], "num_target_layers": raw.get("num_target_layers", 0)}
                if raw.get("sample_from_anchor"):
                    raise CheckpointError(f"{where}: sample_from_anchor is set; blockdecode drafts from the masks")
            elif "DFlashDraftModel" in raw.get("architectures", []):
                layer, dflash, verifier, shared = raw, raw["dflash_config"], {}, True
                ids = [i + 1 for i in dflash["target_layer_ids"]]
                extra = {"draft_vocab_size": raw["vocab_size"], "mask_token_id": dflash["mask_token_id"]}
                extra |= {"block_size": raw["block_size"], "num_target_layers": raw.get("num_target_layers", 0)}
            else:
                raise KeyError("speculators_model_type (dflash) or architectures (DFlashDraftModel)")
            rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind != "default":
                raise CheckpointError(
                    f"{where}: its layers' rotary embedding is {kind!r}; blockdecode computes the default"
                )
            if "sliding_attention" in (layer.get("layer_types") or []):
                raise CheckpointError(
                    f"{where}: it has sliding-window layers, which blockdecode's DFlash does not compute"
                )
            return cls(
                hidden_size=layer["hidden_size"],
                target_hidden_size=raw.get("target_hidden_size") or layer["hidden_size"],
                vocab_size=layer["vocab_size"],
                target_layer_ids=tuple(ids),
                num_hidden_layers=layer["num_hidden_layers"],
                shared_head=shared,
                intermediate_size=layer["intermediate_size"],
                num_attention_heads=layer["num_attention_heads"],
                num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
                head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
                rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)),
                max_position_embeddings=layer.get("max_position_embeddings", 2048),
                verifier={k: v for k, v in verifier.items() if k in ("name_or_path", "architectures")},
                **extra,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{where} is not a DFlash drafter's config: {err}") from err


def config_for(
    base, draft_vocab: int, mask_token_id: int, block_size: int = 16, layers: int = 1, target_layer_ids=None, **shape
) -> DFlashConfig:
    """A DFlash drafter's shape for `base`: its width the base's embedding's, its attention heads and MLP the
    base's where it says them (as for EAGLE-3), reading the inputs of three of the base's layers by default
    (`default_aux_layers`, vLLM's ids)."""
    n_layers = decoder_depth(base)
    if n_layers is None:
        raise ValueError(f"{type(base).__name__}'s config names no num_hidden_layers: pass target_layer_ids")
    # EAGLE-3's layers, the embeddings aside where the base has more than one (DFlash reads layers' outputs); a
    # shallow base: fewer than three
    ids = tuple(sorted(set(target_layer_ids or (max(n_layers > 1, i) for i in default_aux_layers(n_layers)))))
    if min(ids) < 0 or max(ids) >= n_layers:
        raise ValueError(f"target layers must lie in [0, {n_layers - 1}] (the base has {n_layers}), got {list(ids)}")
    eagle3 = eagle3_config_for(base, draft_vocab, default_aux_layers(n_layers))
    return DFlashConfig(
        hidden_size=eagle3.hidden_size,
        target_hidden_size=eagle3.target_hidden_size,
        vocab_size=eagle3.vocab_size,
        draft_vocab_size=draft_vocab,
        target_layer_ids=ids,
        mask_token_id=mask_token_id,
        block_size=block_size,
        num_hidden_layers=layers,
        num_target_layers=n_layers,
        verifier=eagle3.verifier,
        **({k: getattr(eagle3, k) for k in SHAPE} | shape),
    )


SHAPE = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
         "max_position_embeddings")  # fmt: skip


def check_dflash(cfg: DFlashConfig, base, where: object = None) -> None:
    """Refuse, in one line naming `where`, a drafter built for another base (`layered.check_base`)."""
    check_base("the DFlash drafter", cfg, cfg.target_layer_ids, base, where)
