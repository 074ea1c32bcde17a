"""What the drafters that read the base's layers share (EAGLE-3, DFlash): an output layer over a draft vocabulary
as the speculators format keeps it, loading a checkpoint checked tensor by tensor, the check against a base, and
the decoder layers' config the serving formats describe them with."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from blockdecode.core.hf import decoder_depth
from blockdecode.core.io import CheckpointError


class DraftVocabulary(nn.Module):
    """A module whose output layer scores a draft vocabulary: draft id i is the base's id i + d2t[i], and t2d
    marks the base's ids it covers (the speculators format's buffers)."""

    def init_vocabulary(self, vocab_size: int, draft_vocab_size: int) -> None:
        ids = torch.arange(draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ids, True))

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

    def load_checked(self, state: dict[str, torch.Tensor], weights: Path, what: str) -> None:
        """Load `state`, read from `weights`, refused in one line naming the file if a tensor is missing, of
        another shape, not one `what` holds, not finite, or if d2t maps outside the base's vocabulary."""
        expected = self.state_dict()
        for name, t in expected.items():
            if name not in state:
                raise CheckpointError(f"{weights} lacks the tensor {name}")
            if state[name].shape != t.shape:
                raise CheckpointError(
                    f"{weights}: {name} has shape {list(state[name].shape)}, its config says {list(t.shape)}"
                )
        extra = sorted(set(state) - set(expected))
        if extra:
            raise CheckpointError(f"{weights} holds tensors {what} does not: {', '.join(extra[:3])}")
        if not all(bool(t.isfinite().all()) for t in state.values() if t.is_floating_point()):
            raise CheckpointError(f"{weights} holds weights that are not finite (NaN or inf)")
        d2t = state["d2t"].long()
        targets = torch.arange(len(d2t)) + d2t
        if targets.min() < 0 or targets.max() >= len(self.t2d):
            raise CheckpointError(f"{weights}: d2t maps draft ids outside the base's vocabulary")
        self.load_state_dict({**state, "d2t": d2t, "t2d": state["t2d"].bool()})


def read_config(folder: Path, config: str, what: str) -> dict:
    """The config.json of a saved drafter (`what`: "an EAGLE-3 drafter"), refused in one line naming the file where
    `folder` is not a folder, or the file is missing or not JSON."""
    path = folder / config
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder} is a file: {what} is saved as a folder of {config} and its weights")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} is missing: not {what} saved whole") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is corrupt: {err}") from err


def check_base(what: str, cfg, layer_ids, base, where: object = None) -> None:
    """Refuse, in one line naming `where`, `what` (a drafter whose config is `cfg`, reading `layer_ids`) built for
    another base: its vocabulary, the width of the features it reads or of the embedding it shares, or layers the
    base does not have."""
    text = base.config.get_text_config(decoder=True)
    name = f"{where}: " if where is not None else ""
    width = base.get_input_embeddings().weight.shape[1]
    layers = decoder_depth(base) or 0
    found = [
        ("a vocabulary", cfg.vocab_size, base.get_output_embeddings().weight.shape[0]),
        ("an embedding width", cfg.hidden_size, width),
        ("a hidden size", cfg.target_hidden_size, getattr(text, "hidden_size", width)),
    ]
    for kind, built, has in found:
        if built != has:
            raise CheckpointError(f"{name}{what} was built for {kind} of {built}, the base's is {has}")
    if max(layer_ids) >= layers:
        raise CheckpointError(f"{name}{what} reads layers {list(layer_ids)}, and the base has {layers}")


def layer_fields(cfg, layers: int) -> dict:
    """The decoder layers' fields in a transformers config, from a drafter config's shape."""
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
