"""The rules a checkpoint's generation config makes greedy decoding obey, applied at every
verified position exactly as `transformers`' greedy `generate` applies them.

Translation checkpoints depend on them: Marian forces EOS at the length limit and bans its pad
token, mBART forces the target language as the first token. Greedy applies each rule to the
scores of one position, knowing only how long the sequence is there; a blockwise call scores
several positions at once, so each row gets the rules of its own length (a tree node's: the
newest token's plus its depth). A rule whose effect depends on more than the length (repetition
penalties, n-gram bans, banned sequences longer than one token) is refused, never ignored."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

# Settings that change greedy's tokens in ways these rules do not model, with the values at which
# greedy leaves them out (None always is).
REFUSED = {
    "repetition_penalty": (1.0,),
    "encoder_repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "sequence_bias": (),
    "exponential_decay_length_penalty": (),
    "guidance_scale": (1, 1.0),
    "watermarking_config": (),
}


def _ids(value: int | Sequence[int] | torch.Tensor | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist()
    return [int(v) for v in value] if isinstance(value, Sequence) else [int(value)]


@dataclass
class GreedyRules:
    """What greedy does to the scores at a position of sequence length `cur_len` (tokens before
    the one being chosen; the decoder's tokens for an encoder-decoder, start token included)."""

    bad: list[int] = field(default_factory=list)  # bad_words_ids of one token
    suppress: list[int] = field(default_factory=list)  # suppress_tokens, applied after the forced tokens
    eos: list[int] = field(default_factory=list)
    min_length: int = 0  # EOS banned while cur_len < min_length
    min_new_tokens: int = 0  # EOS banned while cur_len - prompt_len < min_new_tokens
    prompt_len: int = 0
    forced_bos: int | None = None  # the only token allowed at cur_len == 1
    forced_eos: list[int] = field(default_factory=list)  # the only tokens allowed at cur_len == max_length - 1
    max_length: int = 0
    begin_suppress: list[int] = field(default_factory=list)  # banned at cur_len == begin_index
    begin_index: int = -1
    remove_invalid: bool = False  # NaN to 0 and infinities to the dtype's extremes, as greedy's option does

    @property
    def active(self) -> bool:
        return bool(
            self.bad
            or self.suppress
            or (self.eos and (self.min_length or self.min_new_tokens))
            or self.forced_bos is not None
            or self.forced_eos
            or self.begin_suppress
            or self.remove_invalid
        )

    def apply(
        self,
        logits: torch.Tensor,
        cur_len: int,
        depths: Sequence[int] | None = None,
        allowed: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """logits [q, V] of q verified rows; row i has length cur_len + i (a chain) or cur_len +
        depths[i] (a tree). `allowed`: the only ids row 0 may take (token healing, `blockdecode.decoding.healing`),
        applied where `generate` applies a `prefix_allowed_tokens_fn`. Returns the scores greedy would take
        the argmax of, in place where it can."""
        if not self.active and allowed is None:
            return logits
        lengths = list(range(cur_len, cur_len + logits.shape[0])) if depths is None else [cur_len + d for d in depths]
        if self.bad:
            logits[:, self.bad] = -torch.inf
        for row, n in enumerate(lengths):
            if self.eos and (n < self.min_length or n - self.prompt_len < self.min_new_tokens):
                logits[row, self.eos] = -torch.inf
        if allowed is not None:
            self._within(logits[0], allowed)
        for row, n in enumerate(lengths):
            if self.forced_bos is not None and n == 1:
                self._only(logits[row], [self.forced_bos])
            if self.forced_eos and n == self.max_length - 1:
                self._only(logits[row], self.forced_eos)
        if self.remove_invalid:
            limits = torch.finfo(logits.dtype)
            logits.nan_to_num_(nan=0.0, posinf=limits.max, neginf=limits.min)
        if self.suppress:
            logits[:, self.suppress] = -torch.inf
        for row, n in enumerate(lengths):
            if self.begin_suppress and n == self.begin_index:
                logits[row, self.begin_suppress] = -torch.inf
        return logits

    @staticmethod
    def _within(row: torch.Tensor, allowed: Sequence[int]) -> None:
        """generate's prefix_allowed_tokens_fn: every other score -inf; where that leaves no allowed id
        above -inf, the allowed ones 0 (the lowest id wins), so that the constraint holds."""
        mask = torch.full_like(row, -torch.inf)
        mask[torch.as_tensor(allowed, device=row.device)] = 0
        masked = row + mask
        row.copy_(torch.where(masked.max().isneginf(), mask, masked))

    @staticmethod
    def _only(row: torch.Tensor, allowed: list[int]) -> None:
        """Greedy's forced token: every other score -inf, the allowed ones 0 (the lowest id wins a tie)."""
        row.fill_(-torch.inf)
        row[allowed] = 0


def refuse_settings(cfg, refused: dict[str, tuple], why: str, action: str) -> None:
    """A clear error for a generation-config setting in `refused` (name -> the values that leave it
    out of `generate`; None always does) that is set to anything else."""
    for name, neutral in refused.items():
        value = getattr(cfg, name, None)
        if value is not None and value not in neutral:
            raise ValueError(
                f"the model's generation config sets {name}={value!r}, which {why}: set "
                f"model.generation_config.{name} = None to {action} without it"
            )


def greedy_rules(model: PreTrainedModel, prompt_len: int, max_new_tokens: int, eos: set[int]) -> GreedyRules:
    """The rules `model.generate(do_sample=False, num_beams=1, max_new_tokens=...)` applies, from
    the model's generation config; a clear error for any it would apply that cannot be applied
    exactly here. `prompt_len`: the decoder's input length (1, the start token, for an
    encoder-decoder)."""
    cfg = model.generation_config
    refuse_settings(cfg, REFUSED, "greedy applies and blockwise decoding cannot apply exactly", "decode")
    eos_ids = sorted(eos)
    vocab = model.get_output_embeddings().weight.shape[0]
    bad = [list(w) for w in (getattr(cfg, "bad_words_ids", None) or []) if list(w) not in ([e] for e in eos_ids)]
    if any(len(w) != 1 for w in bad):
        raise ValueError(
            "the model's generation config bans token sequences longer than one token (bad_words_ids); blockwise "
            "decoding applies single-token bans only: set model.generation_config.bad_words_ids to single tokens"
        )
    if any(not 0 <= w[0] < vocab for w in bad):
        raise ValueError(f"the model's generation config bans token ids outside its vocabulary [0, {vocab})")
    forced_bos = getattr(cfg, "forced_bos_token_id", None)
    begin_index = prompt_len + (1 if prompt_len == 1 and forced_bos is not None else 0)
    min_new = getattr(cfg, "min_new_tokens", None)
    # As generate does: a min_new_tokens setting replaces min_length, even 0.
    min_length = prompt_len + min_new if min_new is not None else int(getattr(cfg, "min_length", 0) or 0)
    in_vocabulary = lambda ids: [t for t in _ids(ids) if 0 <= t < vocab]  # noqa: E731  (ids beyond: no effect)
    return GreedyRules(
        bad=sorted({w[0] for w in bad}),
        suppress=in_vocabulary(getattr(cfg, "suppress_tokens", None)),
        eos=eos_ids,
        min_length=min_length,
        min_new_tokens=int(min_new or 0),
        prompt_len=prompt_len,
        forced_bos=forced_bos,
        forced_eos=_ids(getattr(cfg, "forced_eos_token_id", None)),
        max_length=prompt_len + max_new_tokens,
        begin_suppress=in_vocabulary(getattr(cfg, "begin_suppress_tokens", None)),
        begin_index=begin_index,
        remove_invalid=bool(getattr(cfg, "remove_invalid_values", False)),
    )
