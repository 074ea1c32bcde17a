"""Plain greedy decoding with transformers, and where another output departs from it.

Every exactness claim (tests, CLI --compare, demo, bench) is checked against this."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from blockdecode.core.hf import generate_length, resolve_eos
from blockdecode.decoding.adapter import sequence_logits


@torch.inference_mode()
def greedy_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    **generate_kwargs,
) -> torch.LongTensor:
    """transformers' own greedy generate [B, T] (for an encoder-decoder: the decoder's tokens, start
    token first), EOS resolved as blockdecode resolves it, `attention_mask` 0 on a batch's padding,
    with the rules of the checkpoint's generation config that greedy applies (forced BOS/EOS, banned
    tokens: `blockdecode.decoding.rules`).
    `generate_kwargs` reach generate as they are: num_beams for distillation,
    prompt_lookup_num_tokens or assistant_model for the benchmark's peers."""
    eos = sorted(resolve_eos(model, eos_token_id))
    pad = model.generation_config.pad_token_id
    kwargs = {"do_sample": False, "num_beams": 1, **generate_kwargs}
    return model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids) if attention_mask is None else attention_mask,
        **generate_length(model, input_ids.shape[1], max_new_tokens),
        eos_token_id=eos or None,
        pad_token_id=pad if pad is not None else eos[0] if eos else 0,
        **kwargs,
    )


def near_tie(gap: float, top_logit: float, dtype: torch.dtype) -> bool:
    """Whether a top-2 logit gap is within what `dtype`'s rounding can flip, so that another pass (other
    shapes, another summation order) may choose the runner-up: a few units in the last place of the top
    logit, and never below fp32's 1e-4, the tests' tolerance."""
    return gap < max(1e-4, 4 * torch.finfo(dtype).eps * abs(top_logit))


@dataclass
class Divergence:
    """The first position where two outputs differ, and how close the reference's call was there."""

    position: int  # index into the sequence (prompt included)
    top2_gap: float  # reference logit gap between its best and second-best token at that position
    top_logit: float = float("nan")  # the reference's best logit there: the scale rounding works at

    def near_tie(self, dtype: torch.dtype) -> bool:
        """Whether the reference's call there was a near tie in `dtype` (`near_tie`)."""
        return near_tie(self.top2_gap, self.top_logit, dtype)

    def __str__(self) -> str:
        return f"first differing token at position {self.position}; reference top-2 logit gap there {self.top2_gap:.3g}"


@torch.inference_mode()
def first_divergence(
    model: PreTrainedModel,
    reference: torch.LongTensor,
    other: torch.LongTensor,
    source: torch.LongTensor | None = None,
) -> Divergence | None:
    """None if the sequences are equal, else where they part and the reference's top-2 gap there
    (`source`: an encoder-decoder's input, whose decoder tokens the sequences are).

    A tiny gap means float non-associativity (a k-token pass against a 1-token pass, bf16)
    can flip the argmax: a near-tie, not a decoding bug."""
    a, b = reference[0].tolist(), other[0].tolist()
    if a == b:
        return None
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if pos == 0 or pos >= len(a):
        return Divergence(pos, float("inf"))
    logits = sequence_logits(model, reference[:, :pos], source)[0, -1].float()
    top = logits.topk(2).values
    return Divergence(pos, float(top[0] - top[1]), float(top[0]))
