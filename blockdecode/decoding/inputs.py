"""What a decode is given, checked before anything runs: the prompt rows, their padding and the token budget, each
refused in one line that names what is wrong."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from blockdecode.core.hf import at_least, check_model, context_length, is_seq2seq, special_ids, vocab_size


def token_budget(max_new_tokens: object) -> int:
    """max_new_tokens as an int >= 1 (any integral type), or a clear error."""
    return at_least(max_new_tokens, 1, "max_new_tokens must be a positive integer")


def check_prompt(
    model: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None
) -> torch.LongTensor:
    """A [B, T] LongTensor on the model's device that the model can extend by max_new_tokens (for an
    encoder-decoder: sources it can encode, with room for max_new_tokens in its decoder), each row
    holding text, its padding (`attention_mask`, checked by `check_attention_mask`) aside; or a clear
    error. A 1-D prompt is one row."""
    check_model(model)
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.LongTensor, got {type(input_ids).__name__}")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must have shape [B, T] with B >= 1, got {tuple(input_ids.shape)}")
    seq2seq = is_seq2seq(model)
    what = "source" if seq2seq else "prompt"
    if input_ids.shape[1] == 0:
        raise ValueError(f"the {what} is empty: give at least one token")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    max_new_tokens = token_budget(max_new_tokens)
    vocab = model.get_input_embeddings().num_embeddings if seq2seq else vocab_size(model)
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"the {what} holds token ids outside the model's vocabulary [0, {vocab})")
    limit = context_length(model)
    if seq2seq:
        if limit is not None and input_ids.shape[1] > limit:
            raise ValueError(f"the source ({input_ids.shape[1]} tokens) exceeds the encoder's {limit} positions")
        if limit is not None and 1 + max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens ({max_new_tokens}) + the start token exceeds the decoder's {limit} positions"
            )
    elif limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {limit} positions"
        )
    ids = input_ids.long().to(model.device)
    specials = special_ids(model)
    for row, tokens in enumerate(row_tokens(ids, check_attention_mask(model, ids, attention_mask))):
        if set(tokens) <= specials:  # "" as a tokenizer that adds EOS or BOS encodes it
            where = f" in row {row}" if len(ids) > 1 else ""
            raise ValueError(f"the {what}{where} is empty: it holds only special tokens {tokens}, no text")
    return ids


def row_tokens(ids: torch.LongTensor, mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's tokens without its padding (`mask`'s 0s; None: no padding)."""
    return ids.tolist() if mask is None else [r[m.bool()].tolist() for r, m in zip(ids, mask)]


def check_attention_mask(
    model: PreTrainedModel, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None
) -> torch.LongTensor | None:
    """The attention mask of a checked `input_ids` [B, T], on the model's device: 1 on tokens, 0 on
    padding; None when there is no padding. A decoder-only model's rows are padded on the left, as
    `generate` expects (an encoder's on either side); every row holds at least one token."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
    mask = attention_mask.unsqueeze(0) if attention_mask.dim() == 1 else attention_mask
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; it must match input_ids {tuple(input_ids.shape)}"
        )
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold 1 for tokens and 0 for padding, nothing else")
    mask = mask.long().to(model.device)
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"row {empty[0]} of attention_mask is all padding: every row needs at least one token")
    if not is_seq2seq(model) and bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask has padding after a token: a decoder-only model's rows must be padded on the left "
            "(tokenizer.padding_side = 'left'), as transformers' generate expects"
        )
    return None if bool(mask.all()) else mask
