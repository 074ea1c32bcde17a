"""A chat's next reply: the messages through the tokenizer's chat template, decoded, the reply's text.

A chat template's generation prompt ends where the reply begins (`<|im_start|>assistant\\n`), so the prompt is never
healed: healing would drop that newline, write it again, and the reply would no longer be the model's. The
earlier turns are in the prompt, so the lookup drafters (the default's suffix lookup, n-gram lookup) draft from
what the conversation already holds. `BlockStreamer` shows a reply as it is decoded, each block as it stands."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from blockdecode.core.hf import resolve_eos
from blockdecode.decoding.output import BlockwiseOutput, DecodeStats


class Replying(Protocol):
    """What a reply needs of its model (a `BlockwiseLM`): its base, its tokenizer and `generate`."""

    base: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None

    def generate(self, input_ids: torch.LongTensor, max_new_tokens: int, **kwargs) -> BlockwiseOutput: ...


Messages = Sequence[Mapping[str, str]]


class ChatReply(NamedTuple):
    reply: str  # the reply's text: special tokens skipped, the end of the turn not included
    stats: DecodeStats
    output: BlockwiseOutput  # the templated prompt's tokens and the reply's, as generate returns them


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> torch.LongTensor:
    """[1, T]: `messages` through the tokenizer's chat template, ending in its generation prompt."""
    if isinstance(messages, str):
        raise TypeError("messages takes a list of {'role': ..., 'content': ...} dicts, got a str: pass "
                        "[{'role': 'user', 'content': text}]")  # fmt: skip
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{type(tokenizer).__name__} has no chat template: a chat needs an instruct model's tokenizer")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_tensors="pt")
    return ids["input_ids"] if isinstance(ids, Mapping) else ids


def reply_to(
    model: Replying,
    messages: Messages,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_new_tokens: int = 256,
    **generate_kwargs,
) -> ChatReply:
    """The model's reply to `messages` (a list of {"role", "content"} dicts, as `apply_chat_template` takes them):
    decoded by `model.generate` with `generate_kwargs` (its default drafter unless given; `streamer=`, `stop_strings=`
    and the rest as `generate` takes them), never healed, stopping at the end of the turn (the generation config's
    EOS ids, unless `eos_token_id` says otherwise). `tokenizer`: the model's own (`load` sets it) unless given."""
    if "heal" in generate_kwargs:
        raise ValueError("a chat prompt is never healed: its template's generation prompt ends where the reply begins")
    tokenizer = tokenizer or model.tokenizer
    if tokenizer is None:
        raise ValueError("chat needs the model's tokenizer: pass tokenizer=, or load the model with blockdecode.load")
    ids = chat_ids(tokenizer, messages).to(model.base.device)
    out = model.generate(ids, max_new_tokens, tokenizer=tokenizer, **generate_kwargs)
    eos = resolve_eos(model.base, generate_kwargs.get("eos_token_id"))
    return ChatReply(reply_text(tokenizer, out, ids.shape[1], eos), out.stats, out)


def reply_text(tokenizer: PreTrainedTokenizerBase, out: BlockwiseOutput, prompt_len: int, eos: Collection[int]) -> str:
    """The text of a one-row output's new tokens, special tokens skipped and the end of the turn (an `eos` id)
    left out."""
    new = out.sequences[0, prompt_len : prompt_len + out.stats.new_tokens].tolist()
    if new and new[-1] in eos:
        new = new[:-1]
    return tokenizer.decode(new, skip_special_tokens=True)


class BlockStreamer(BaseStreamer):
    """Writes a reply's text as each block stands, special tokens skipped: unlike `TextStreamer`, which holds the
    last word back until a space follows it, it holds back only a character still missing bytes (a byte-level
    token may end inside one). The first `put` is the prompt, not shown."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, write: Callable[[str], object] | None = None):
        self.tokenizer, self.write = tokenizer, write or _write_stdout
        self.tokens: list[int] = []
        self.shown = 0  # characters of the reply's text written so far
        self.prompt = True  # the next put is the prompt

    def put(self, value: torch.Tensor) -> None:
        if self.prompt:
            self.prompt = False
            return
        self.tokens += value.reshape(-1).tolist()
        self._show(final=False)

    def end(self) -> None:
        self._show(final=True)
        self.tokens, self.shown, self.prompt = [], 0, True

    def _show(self, final: bool) -> None:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        end = len(text) if final else len(text.rstrip("\ufffd"))  # an unfinished character waits for its bytes
        if end > self.shown:
            self.write(text[self.shown : end])
            self.shown = end


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
