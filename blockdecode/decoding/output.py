"""What a decode returns: the sequences, and per row what it cost and whether it is greedy's output."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from blockdecode.core.hf import dtype_name


@dataclass
class DecodeStats:
    """What one generate call cost. `calls` counts base-model forward passes, prefill included;
    `block_sizes` holds the tokens gained by each call after the prefill, `verified` the tokens
    that call scored (the newest token and the proposals), `accepted_nodes` the proposals it
    accepted, as node indices (a chain's 1..a; a tree's in insertion order, so what a smaller
    budget would have gained is the part of the path within it). An encoder-decoder's `calls`
    are its decoder's; its encoder's one pass is `encoder_calls`. `sampling` holds the settings of a
    sampled output ("" for greedy); `note` says where the decode differs from what was asked, and its
    near ties. `near_ties`: (position, gap) where greedy's choice was closer than the model's dtype
    resolves (`reference.near_tie`), so that another pass, `transformers`' own or this one at other
    shapes, may choose the runner-up there: the position is the token's index in `sequences`, prompt
    included (as `generate --compare` counts), the gap its top-2 score gap, from the scores each call
    already took the argmax of. Exact greedy decoding only (empty under sampling or a relaxed rule); a
    batch's are in each row's `row_stats`."""

    calls: int = 0
    encoder_calls: int = 0
    block_sizes: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    accepted_nodes: list[list[int]] = field(default_factory=list)
    supplied: dict[str, int] = field(default_factory=dict)  # accepted proposals, by the drafter that made them
    new_tokens: int = 0
    seconds: float = 0.0
    acceptance: str = "exact"  # anything else: the output is not the exact greedy output
    sampling: str = ""  # set: sampled, exact in distribution, not greedy's output
    near_ties: list[tuple[int, float]] = field(default_factory=list)
    note: str = ""

    @property
    def exact(self) -> bool:
        """Whether the output is greedy decoding's own (which, at `near_ties`, another pass may not repeat)."""
        return self.acceptance == "exact" and not self.sampling

    @property
    def mean_block_size(self) -> float:
        return sum(self.block_sizes) / len(self.block_sizes) if self.block_sizes else 0.0

    @property
    def mean_verified(self) -> float:
        """Tokens a call scored, on average: the newest token and its candidates (a tree's size + 1)."""
        return sum(self.verified) / len(self.verified) if self.verified else 0.0

    def supplied_share(self) -> str:
        """Which drafters supplied the accepted proposals, e.g. "ngram 62 %, heads 38 %"."""
        total = sum(self.supplied.values())
        ranked = sorted(self.supplied.items(), key=lambda item: -item[1])
        return ", ".join(f"{name} {100 * n / total:.0f} %" for name, n in ranked) if total else "none"

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def pooled(cls, stats: Iterable[DecodeStats]) -> DecodeStats:
        """Several calls' stats as one: counts and times added, block sizes concatenated."""
        total = cls()
        for s in stats:
            total.calls += s.calls
            total.encoder_calls += s.encoder_calls
            total.block_sizes += s.block_sizes
            total.verified += s.verified
            total.accepted_nodes += s.accepted_nodes
            total.near_ties += s.near_ties
            for name, n in s.supplied.items():
                total.supplied[name] = total.supplied.get(name, 0) + n
            total.new_tokens += s.new_tokens
            total.seconds += s.seconds
            total.acceptance, total.sampling, total.note = s.acceptance, s.sampling, s.note
        return total

    def to_dict(self) -> dict:
        return {
            "calls": self.calls,
            "encoder_calls": self.encoder_calls,
            "new_tokens": self.new_tokens,
            "mean_block_size": self.mean_block_size,
            "block_sizes": list(self.block_sizes),
            "verified": list(self.verified),
            "mean_verified": self.mean_verified,
            "supplied": dict(self.supplied),
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "acceptance": self.acceptance,
            "sampling": self.sampling,
            "exact": self.exact,
            "near_ties": [list(tie) for tie in self.near_ties],
            "note": self.note,
        }


@dataclass
class BlockwiseOutput:
    """Like transformers' generate output: `sequences` [B, T + new] holds the prompts and the new
    tokens, each row padded after its end as `generate` pads. `stats`: the whole decode (for a batch,
    `block_sizes` and `verified` add up every row's tokens per call); `row_stats`: each row's own, its
    `calls` the prefill and the calls it took part in, its `seconds` the batch's."""

    sequences: torch.LongTensor
    stats: DecodeStats
    row_stats: list[DecodeStats] = field(default_factory=list)


def ties_note(ties: Sequence[tuple[int, float]], dtype: torch.dtype, shown: int = 5) -> str:
    """What a row's note says of its near ties: "2 near ties (bf16): positions 17 (gap 0), 40 (gap 0.0625);
    another pass may flip them", the first `shown` of them named (all are in `near_ties`); "" for none."""
    if not ties:
        return ""
    s, where = "s" if len(ties) > 1 else "", ", ".join(f"{position} (gap {gap:.3g})" for position, gap in ties[:shown])
    more = f" and {len(ties) - shown} more" if len(ties) > shown else ""
    them = "them" if len(ties) > 1 else "it"
    return f"{len(ties)} near tie{s} ({dtype_name(dtype)}): position{s} {where}{more}; another pass may flip {them}"


def per_call(rows: Iterable[list[int]]) -> list[int]:
    """A batch's count per call from each row's: a row takes part in the calls from the first until it ends."""
    total: list[int] = []
    for counts in rows:
        total += [0] * (len(counts) - len(total))
        for i, n in enumerate(counts):
            total[i] += n
    return total
