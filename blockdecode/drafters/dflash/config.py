"""A DFlash block drafter's shape and what it reads of its base, in z-lab's and the speculators layouts' configs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from blockdecode.drafters.eagle3.config import config_for as eagle3_config_for
from blockdecode.drafters.eagle3.config import default_aux_layers

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


def config_for(
    base, draft_vocab: int, mask_token_id: int, block_size: int = 16, layers: int = 1, target_layer_ids=None, **shape
) -> DFlashConfig:
    """A DFlash drafter's shape for `base`: its width the base's embedding's, its attention heads and MLP the
    base's where it says them (as for EAGLE-3), reading the inputs of three of the base's layers by default
    (`default_aux_layers`, vLLM's ids)."""
    text = base.config.get_text_config(decoder=True)
    n_layers = getattr(text, "num_hidden_layers", None)
    if n_layers is None:
        raise ValueError(f"{type(base).__name__}'s config names no num_hidden_layers: pass target_layer_ids")
    ids = tuple(sorted(set(target_layer_ids or default_aux_layers(n_layers))))  # a shallow base: fewer than three
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
        verifier=eagle3.verifier,
        **({k: getattr(eagle3, k) for k in SHAPE} | shape),
    )


SHAPE = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
         "max_position_embeddings")  # fmt: skip
