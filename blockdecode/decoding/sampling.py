"""Sampling that stays exact in distribution: speculative sampling (Leviathan et al., 2023; Chen et
al., 2023) in place of greedy's "accept what equals the argmax".

Each verified position has the distribution `transformers`' `generate(do_sample=True)` samples from
there: the generation config's rules (`blockdecode.decoding.rules`), then its warpers in its order
(temperature, top-k, top-p), then a softmax. A proposal x from a drafter with distribution q is
kept with probability min(1, p(x) / q(x)); the first one rejected is replaced by a draw from the
residual normalise(max(0, p - q)), and a chain kept whole earns a bonus draw from p after it. Every
token of the output then has exactly distribution p given the tokens before it, whatever the
drafter proposes. The drafters here are deterministic, so q is one-hot: x is kept with probability
p(x), and a rejected position draws from p with x left out."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.generation.logits_process import (
    LogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from blockdecode.decoding.rules import refuse_settings

# What `generate` uses for a setting that neither the call nor the model's generation config gives
# (transformers' GenerationConfig._get_default_generation_params).
DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}

# Warpers a generation config may turn on that these settings do not model, with the values at which
# `generate` leaves them out (None always is).
REFUSED = {"min_p": (), "typical_p": (1.0,), "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,), "top_h": ()}


@dataclass(frozen=True)
class Sampling:
    """`generate(do_sample=True, temperature, top_k, top_p)`'s settings: top_k=0 and top_p=1.0 are off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 < t < math.inf:
            raise ValueError(f"temperature must be a number > 0 when sampling, got {t!r} (for greedy, do_sample=False)")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise ValueError(f"top_p must lie in (0, 1] (1: off), got {p!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))

    @property
    def spec(self) -> str:
        return f"temperature={self.temperature:g}, top_k={self.top_k}, top_p={self.top_p:g}"

    def warpers(self) -> list[LogitsProcessor]:
        """transformers' own warpers, in its order, each only where `generate` would add it."""
        warpers: list[LogitsProcessor] = []
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p))
        return warpers

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [q, V] after the generation config's rules -> the distributions sampled from [q, V].
        The warpers never read the tokens, so each row is warped on its own."""
        scores = scores.float()
        for warper in self.warpers():
            scores = warper(None, scores)
        return scores.softmax(-1)


def sampling_settings(
    model: PreTrainedModel,
    do_sample: bool,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Sampling | None:
    """The sampling a decode does (None: greedy). A setting not given comes from the model's generation
    config, else from transformers' defaults, as `generate` takes it; a setting without do_sample=True,
    or a warper of the generation config that is not modelled here, is refused by name."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    if not do_sample:
        named = [f"{name}={value!r}" for name, value in given.items() if value is not None]
        if named:
            raise ValueError(f"{', '.join(named)} applies only when sampling: pass do_sample=True (CLI: --sample)")
        return None
    cfg = model.generation_config
    refuse_settings(cfg, REFUSED, "sampling with blockdecode does not apply", "sample")
    settings = {}
    for name, value in given.items():
        configured = getattr(cfg, name, None)
        settings[name] = value if value is not None else configured if configured is not None else DEFAULTS[name]
    return Sampling(**settings)


def check_generator(generator: object, device: torch.device) -> None:
    """A clear error, before the model is called, for a `generator` sampling cannot draw from: anything
    but a torch.Generator (or None: torch's global one), or one on another device than the model's."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (or None), got {type(generator).__name__}")
    if generator.device != device:
        raise ValueError(
            f"generator is on {generator.device}, the model on {device}: "
            f"make it with torch.Generator(device={str(device)!r})"
        )


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)) along the last axis: what a rejected position draws from, so that
    acceptance and rejection together give p. Where p <= q everywhere (p == q), rejection never
    happens; that row is p, to stay a distribution."""
    left = (p - q).clamp(min=0)
    mass = left.sum(-1, keepdim=True)
    return torch.where(mass > 0, left / mass.clamp(min=torch.finfo(left.dtype).tiny), p)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token from each row of probs [n, V] (long [n]), by the inverse of its running sum: one uniform a row.
    `torch.multinomial` draws a random number for every entry of the vocabulary, 120 us a row of 8,192 on a 2-core
    EPYC against 9 us here. The sum is taken in float64 and searched to the right, below its end, so no token
    without mass is ever drawn (a uniform of 0 skips the leading zeros; a product rounded up to the whole sum
    stops at the last token that has mass)."""
    total = probs.double().cumsum(-1)
    end = total[:, -1:]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    return torch.searchsorted(total, torch.minimum(u * end, torch.nextafter(end, end.new_zeros(()))), right=True)[:, 0]


def speculative_sample(
    probs: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None = None, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [n+1, V]: the distribution at the newest token and after each proposal; draft [n]: the
    proposals, drawn from q [n, V] (None: certain guesses, q one-hot at each, as every drafter here makes).
    Returns which proposals stand on their own (bool [n]: kept with probability min(1, p(x) / q(x))) and the
    token after the leading ones that stand (a 0-dim long): at the first rejected position a draw from the
    residual, after a chain kept whole a draw from p itself. Only that one row is drawn from, on the device:
    the rows past it are never reached, and a draw costs a running sum over the whole vocabulary."""
    n = draft.shape[0]
    rows = torch.arange(n, device=probs.device)
    u = torch.rand(n, generator=generator, device=probs.device)
    if q is None:  # kept with p(x); a rejected position draws from p without x (`draw` normalises a row)
        kept = u < probs[rows, draft]
    else:
        kept = u * q[rows, draft] < probs[rows, draft]  # u < p(x) / q(x), without dividing by a zero q(x)
    stop = torch.cat([kept, kept.new_zeros(1)]).to(torch.uint8).argmin()  # the first not kept; n: all were
    p = probs[stop]
    if q is None:
        guess = torch.cat([draft, draft.new_full((1,), -1)])[stop]  # none after the chain
        left = p.masked_fill(torch.arange(p.shape[0], device=p.device) == guess, 0)
        rest = torch.where(left.sum() > 0, left, p)  # p(x) held all the mass: p itself, still a token
    else:
        rest = residual(p, torch.cat([q, q.new_zeros(1, q.shape[1])])[stop])  # after the chain: p itself
    return kept, draw(rest[None], generator)[0]
