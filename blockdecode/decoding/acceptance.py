"""Which proposals a verifying pass accepts: exact (the default), or one of the paper's relaxed
rules (Stern et al., 2018, §5.1), which trade exactness for longer blocks.

A rule looks at the proposals [n] and the base model's logits over the block [n+1, V] (row i
scores the token proposal i stands in for) and says how many leading proposals to keep; the
base model's own token at the first rejected position follows them, so every call still gains
at least one token. Only `exact` reproduces greedy decoding; the others say so."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from blockdecode.core.hf import at_least


@dataclass(frozen=True)
class Acceptance:
    """`exact`, `topk:N`, `distance:EPS` (with a token -> value map) or `min-block:L`."""

    rule: str = "exact"
    n: int = 1  # topk: how many of the base model's best tokens count as agreeing
    eps: float = 0.0  # distance: the largest |value(proposal) - value(argmax)| accepted
    min_block: int = 1  # min-block: tokens gained per call at the least
    values: torch.Tensor | None = field(default=None, compare=False)  # distance: token id -> value [V], NaN: none

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown acceptance rule {self.rule!r}: choose {', '.join(RULES)}")
        if self.rule == "topk":
            object.__setattr__(self, "n", at_least(self.n, 1, "topk:N needs an integer N >= 1"))
        if self.rule == "min-block":
            object.__setattr__(self, "min_block", at_least(self.min_block, 1, "min-block:L needs an integer L >= 1"))
        if self.rule == "distance":
            if not self.eps >= 0:  # also refuses NaN
                raise ValueError(f"distance:EPS needs a number EPS >= 0, got {self.eps!r}")
            if self.values is None:
                raise ValueError(
                    "distance:EPS needs a token -> value map (parse_acceptance(spec, values=...), or --value-map "
                    "FILE): the value each token stands for"
                )
            object.__setattr__(self, "values", torch.as_tensor(self.values, dtype=torch.float32).reshape(-1))

    @property
    def spec(self) -> str:
        return {
            "exact": "exact",
            "topk": f"topk:{self.n}",
            "distance": f"distance:{self.eps:g}",
            "min-block": f"min-block:{self.min_block}",
        }[self.rule]

    @property
    def key(self) -> str:
        """The rule as a cache key: its spec, and a distance rule's value map by digest (two maps, two rules)."""
        if self.rule != "distance":
            return self.spec
        return f"{self.spec} values {hashlib.sha256(self.values.cpu().numpy().tobytes()).hexdigest()[:16]}"

    def check(self, k: int, vocab_size: int) -> None:
        """Refuse a rule that cannot apply to this decode: a minimum block beyond k, a value
        map of the wrong vocabulary."""
        if self.rule == "min-block" and self.min_block > k:
            raise ValueError(f"min-block:{self.min_block} asks for more tokens per call than the block size k={k}")
        if self.rule == "distance" and len(self.values) != vocab_size:
            raise ValueError(
                f"the distance rule's value map covers {len(self.values)} tokens, the model's vocabulary {vocab_size}"
            )

    def agree(self, draft: torch.Tensor, logits: torch.Tensor | None, greedy: torch.Tensor) -> torch.Tensor:
        """Which proposals of `draft` [n] the rule lets stand, each on its own, given the block's
        logits [n+1, V] and their argmax `greedy` [n+1]: a bool tensor [n], left on the device. The exact
        rule compares ids alone (`logits` may be None).
        A proposal counts only if every one before it on its path counts too (`accepted`)."""
        n = draft.shape[0]
        agree = draft == greedy[:n]
        if n == 0 or self.rule == "exact":
            return agree
        if self.rule == "topk":
            rows = logits[:n].float()
            kth = rows.topk(min(self.n, rows.shape[-1]), dim=-1).values[:, -1]
            agree = rows.gather(-1, draft[:, None])[:, 0] >= kth  # ties with the N-th best count as in
        elif self.rule == "distance":
            values = self.values.to(draft.device)  # NaN: a token with no value, which only matches itself
            agree = agree | ((values[draft] - values[greedy[:n]]).abs() <= self.eps)
        elif self.rule == "min-block":
            agree[: self.min_block - 1] = True
        return agree

    def accepted(self, draft: torch.Tensor, logits: torch.Tensor, greedy: torch.Tensor) -> int:
        """How many leading proposals of a chain `draft` [n] to keep: the agreeing prefix."""
        return int(self.agree(draft, logits, greedy).long().cumprod(0).sum())


RULES = ("exact", "topk", "distance", "min-block")
EXACT = Acceptance()


def parse_acceptance(spec: str | Acceptance | None, values: Sequence[float] | torch.Tensor | None = None) -> Acceptance:
    """An Acceptance from its text form (`exact`, `topk:2`, `distance:0.5`, `min-block:3`);
    `values` maps token ids to ordinal values, for `distance` only."""
    if spec is None:
        return EXACT
    if isinstance(spec, Acceptance):
        return spec
    name, _, arg = str(spec).strip().partition(":")
    if name == "exact" and not arg:
        return EXACT
    kinds = {"topk": ("n", int), "min-block": ("min_block", int), "distance": ("eps", float)}
    if name not in kinds:
        raise ValueError(f"unknown acceptance {spec!r}: choose exact, topk:N, distance:EPS or min-block:L")
    field_name, kind = kinds[name]
    try:
        number = kind(arg)
    except ValueError:
        raise ValueError(f"bad acceptance {spec!r}: {name} needs a number after the colon, e.g. {name}:2") from None
    return Acceptance(name, **{field_name: number}, values=values if name == "distance" else None)
