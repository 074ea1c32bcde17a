"""What `BlockwiseLM.generate` takes besides a plan's settings.

A `transformers` user passes generate what a chat model needs: `stop_strings` with `tokenizer`, a `streamer`, a
`pad_token_id`. These are read as `transformers`' generate reads them (`Extras`). Any other keyword of its generate
(`num_beams`, `max_length`, `output_scores`, ...) is ignored, and one warning line names it, so that code written
for `generate` runs and says what it did not do; a name `generate` does not know either stays Python's TypeError.
The settings a `DecodePlan` holds are refused beside a plan (`check_beside_plan`)."""

from __future__ import annotations

import functools
import inspect
import reprlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

from blockdecode.core.hf import integer
from blockdecode.decoding.adapter import decoder_prompt
from blockdecode.decoding.loop import decode
from blockdecode.decoding.output import BlockwiseOutput
from blockdecode.decoding.plan import DecodePlan
from blockdecode.decoding.stopping import StopStrings

TAKEN = ("stop_strings", "tokenizer", "streamer", "pad_token_id")
"""The keywords of `transformers`' generate that `BlockwiseLM.generate` reads beside its own."""


def check_beside_plan(settings: dict[str, object], generate: Callable) -> None:
    """A plan replaces every decode setting of `generate`: one given beside it (not left at its default)
    would be ignored, a sampling one leaving the decode greedy, so it is refused by name."""
    defaults = inspect.signature(generate).parameters
    given = [f"{name}={value!r}" for name, value in settings.items() if _given(value, defaults[name].default)]
    if given:
        raise ValueError(
            f"plan= replaces every decode setting, so {', '.join(given)} would be ignored: pass "
            f"{'it' if len(given) == 1 else 'them'} to lm.plan(...) instead"
        )


def _given(value: object, default: object) -> bool:
    """Whether a setting holds other than its default (compared by value for plain values only: a tensor's
    == is elementwise)."""
    return value is not default and not (isinstance(value, str | int | float) and value == default)


@functools.cache
def generate_keywords() -> frozenset[str]:
    """Every keyword `transformers`' generate knows: its own parameters, its generation config's fields, and the
    tokenizers it takes from its keywords."""
    fields = {name for name in GenerationConfig().to_dict() if not name.startswith("_")}
    own = {n for n, p in inspect.signature(GenerationMixin.generate).parameters.items() if p.kind != p.VAR_KEYWORD}
    return frozenset(fields | own | {"tokenizer", "assistant_tokenizer"}) - {"self"}


@dataclass(frozen=True)
class Extras:
    """What a decode does beyond its plan: where rows also end (`stop_strings`), who is shown each block as it
    stands (`streamer`), and what a batch's finished rows are padded with (`pad_token_id`)."""

    stop_strings: StopStrings | None = None
    streamer: object | None = None  # transformers' BaseStreamer protocol: put(tensor), end()
    pad_token_id: int | None = None

    @classmethod
    def read(
        cls, owner: str, kwargs: dict[str, object], model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None
    ) -> Extras:
        """The extras among `owner`'s keywords `kwargs` (`tokenizer`: the model's own, used unless one is given);
        every other keyword generate knows is warned of by name, and one it does not is a TypeError."""
        unknown = [name for name in kwargs if name not in generate_keywords()]
        if unknown:
            raise TypeError(f"{owner}() got an unexpected keyword argument '{unknown[0]}'")
        for name, value in kwargs.items():
            if name not in TAKEN:
                warnings.warn(
                    f"{name}={reprlib.repr(value)} is ignored: blockdecode does not take this keyword of "
                    "transformers' generate",
                    stacklevel=3,
                )
        strings = kwargs.get("stop_strings") or getattr(model.generation_config, "stop_strings", None)
        tokenizer = kwargs.get("tokenizer") or tokenizer
        if strings and tokenizer is None:
            raise ValueError("stop_strings are matched on the model's text: pass its tokenizer (tokenizer=...)")
        streamer = kwargs.get("streamer")
        if streamer is not None and not all(callable(getattr(streamer, m, None)) for m in ("put", "end")):
            raise TypeError(f"streamer takes a transformers streamer (put and end), got {type(streamer).__name__}")
        pad = kwargs.get("pad_token_id")
        return cls(
            stop_strings=StopStrings(strings, tokenizer) if strings else None,
            streamer=streamer,
            pad_token_id=None if pad is None else integer(pad, "pad_token_id"),
        )

    def decode(
        self,
        model: PreTrainedModel,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        plan: DecodePlan,
        on_block: Callable[[list[int]], None] | None = None,
        **decode_kwargs,
    ) -> BlockwiseOutput:
        """`loop.decode` with these extras: the streamer is given the prompt (an encoder-decoder's decoder start),
        then each block as it stands, and told the end, as `generate` tells it; each row stops at its stop strings;
        a batch's rows are padded after their ends with `pad_token_id`."""
        streamer = self.streamer
        if streamer is not None:
            if input_ids.shape[0] > 1:
                raise ValueError(f"a streamer shows one sequence; input_ids has {input_ids.shape[0]} rows")
            streamer.put(decoder_prompt(model, input_ids)[1].cpu())
            on_block = _streaming(streamer, on_block)
        try:
            out = decode(model, input_ids, max_new_tokens, plan, on_block, stop_strings=self.stop_strings,
                         **decode_kwargs)  # fmt: skip
        finally:  # a reader iterating the stream (TextIteratorStreamer) is released even by an error
            if streamer is not None:
                streamer.end()
        if self.pad_token_id is not None:
            seq = out.sequences
            new = seq.new_tensor([[stats.new_tokens] for stats in out.row_stats])
            ends = seq.shape[1] - new.max() + new  # where each row's tokens end
            out.sequences = torch.where(torch.arange(seq.shape[1], device=seq.device) >= ends, self.pad_token_id, seq)
        return out


def _streaming(streamer, on_block: Callable[[list[int]], None] | None) -> Callable[[list[int]], None]:
    """An `on_block` that puts each block to `streamer` (as a 1-D tensor, a token a position) and then calls
    `on_block`."""

    def block(tokens: list[int]) -> None:
        streamer.put(torch.tensor(tokens))
        if on_block is not None:
            on_block(tokens)

    return block
