"""Clocks for the benchmark and for calibration: device sync, forward calls counted and timed from
outside, and the cost curve t(q) of one forward pass of q new tokens over a cached context."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from blockdecode.core.hf import as_integer, is_seq2seq, vocab_size
from blockdecode.decoding.adapter import adapter_for


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall time is the work's time; a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Meter:
    """Forward calls of one model and the wall seconds spent inside them, in all and each (`each`: a
    decode's first is its prefill)."""

    calls: int = 0
    seconds: float = 0.0
    each: list[float] = field(default_factory=list)
    _start: list[float] = field(default_factory=list)


@contextmanager
def metered(*models: torch.nn.Module) -> Iterator[list[Meter]]:
    """Count and time the forward calls of each model, however generate drives them: the time a
    decoder spends outside its model's forward is its loop's own cost."""
    meters = [Meter() for _ in models]
    handles = []
    for model, meter in zip(models, meters):
        device = next(model.parameters()).device

        def before(_module, _args, _kwargs, meter=meter, device=device) -> None:
            sync(device)
            meter._start.append(time.perf_counter())

        def after(_module, _args, _kwargs, _out, meter=meter, device=device) -> None:
            sync(device)
            meter.calls += 1
            meter.each.append(time.perf_counter() - meter._start.pop())
            meter.seconds += meter.each[-1]

        handles.append(model.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(model.register_forward_hook(after, with_kwargs=True))
    try:
        yield meters
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def forward_cost(
    model: PreTrainedModel,
    context: torch.LongTensor,
    qs: int | Iterable[int],
    reps: int,
    cache_implementation: str = "dynamic",
    quantile: float = 0.5,
) -> dict[int, float]:
    """t(q): seconds of one forward pass of q new tokens over `context` already cached, the median of `reps`
    rounds (or another `quantile` of them), for each q in `qs` (an int: 1..qs), the cache cropped back after each
    pass so every pass sees the same context; the q's taken in turn each round."""
    qs = range(1, as_integer(qs) + 1) if as_integer(qs) is not None else sorted(qs)
    # An encoder-decoder encodes `context` and its decoder holds as many tokens of cache.
    base = adapter_for(model, context if is_seq2seq(model) else None, cache_implementation, context.shape[1] + max(qs))
    base.prefill(context)
    gen = torch.Generator().manual_seed(0)
    ids = {q: torch.randint(0, vocab_size(model), (1, q), generator=gen).to(context.device) for q in qs}
    samples: dict[int, list[float]] = {q: [] for q in qs}
    for rep in range(reps + 1):  # every q once a round, so a burst of other work slows them alike; round 0 warms up
        for q in qs:
            sync(context.device)
            start = time.perf_counter()
            base.score(ids[q])
            sync(context.device)
            elapsed = time.perf_counter() - start
            base.keep(range(context.shape[1]))
            if rep:
                samples[q].append(elapsed)
    if quantile == 0.5:
        return {q: statistics.median(samples[q]) for q in qs}
    return {q: sorted(samples[q])[round(quantile * (reps - 1))] for q in qs}
