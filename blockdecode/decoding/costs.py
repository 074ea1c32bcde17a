"""What a call costs on this machine: t(q), one forward of q new tokens over a cached context, measured once per
base and machine, checked before it is kept, and checked again against the calls a decode times.

The ranked default sizes every call's tree from t(q), so one bad curve would make every later decode greedy:
a curve timed while other jobs ran (t(2) = 16 t(1) where a quiet machine says 1.0) once sized every tree to nothing,
for good. So a curve is measured as the lower quartile of rounds that take every q in turn, kept only where its
shape is possible (`insane`: t(q) / t(1) within [SANE_LOW, SANE_HIGH q]), and a decode whose calls take more than
`ranking.OFF_BY` times what it says, or less than 1 / OFF_BY, has it measured again and replaced, with one line.

It is keyed by what a forward's cost hangs on, the base's architecture and shapes (`shape_key`), its dtype, the
device, the thread count and the CPU: never by weights' values or heads, so a plain model or a GGUF, which gets fresh
untrained heads at every load, is measured once per machine, and a seeded sampled decode repeats in any process."""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
import weakref

import torch

from blockdecode.core.hardware import cpu_name
from blockdecode.core.hf import context_length, dtype_name, weights_key, weights_signature
from blockdecode.decoding import stored
from blockdecode.decoding.estimates import shipped_rates
from blockdecode.decoding.ranking import OFF_BY, Ranking
from blockdecode.decoding.timing import forward_cost

COST_POINTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 65)  # t(q) is measured here and interpolated between
COST_REPS = 7  # rounds, each taking every q once: a burst of other work slows one round, not one q
QUARTILE = 0.25  # of a point's rounds: the quiet machine's time (bursts only ever add time)
ATTEMPTS = 3  # measurements tried before a curve of impossible shape is used unstored
SANE_LOW, SANE_HIGH = 0.7, 1.25  # t(q) / t(1) lies in [0.7, 1.25 q]: more tokens never cost much less, nor more
# than one call each (noise allowed for); a busy machine's 16 t(1) at q = 2 breaks it


def t_at(t: dict[int, float], q: int) -> float:
    """t(q), linear between the measured points, flat past the last."""
    points = sorted(t)
    upper = next((p for p in points if p >= q), points[-1])
    lower = max((p for p in points if p <= q), default=points[0])
    if upper == lower:
        return t[upper]
    return t[lower] + (t[upper] - t[lower]) * (q - lower) / (upper - lower)


_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (weights key, shape key)


def shape_key(module: torch.nn.Module) -> str:
    """A short hash of what a forward's cost hangs on: the module's class, its config (without paths) and every
    parameter's name, shape and dtype; not the weights' values, which differ between two loads of a plain model's
    untrained heads but cost the same."""
    key = weights_key(module.parameters())
    known = _SHAPES.get(module)
    if known is None or known[0] != key:
        config = getattr(module, "config", None)
        settings = config.to_dict() if config is not None else {}
        settings = {k: v for k, v in settings.items() if not k.startswith("_") or k == "_attn_implementation"}
        settings.pop("transformers_version", None)
        settings["_attn_implementation"] = getattr(config, "_attn_implementation", None)
        shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
        text = json.dumps([type(module).__name__, settings, shapes], sort_keys=True, default=str)
        _SHAPES[module] = known = (key, hashlib.sha256(text.encode()).hexdigest()[:16])
    return known[1]


def machine_key(module: torch.nn.Module) -> list[str]:
    """What timing `module` here hangs on besides its shapes: dtype, device, threads and the CPU (or GPU)."""
    p = next(module.parameters())
    if p.device.type == "cpu":
        machine = f"{torch.backends.cpu.get_cpu_capability()} {cpu_name()}"
    else:
        machine = torch.cuda.get_device_name(p.device)
    return [dtype_name(p.dtype), str(p.device), f"{torch.get_num_threads()} threads", machine]


def curve_key(base: torch.nn.Module, cache_implementation: str) -> str:
    return "|".join(["cost", shape_key(base), *machine_key(base), cache_implementation])


def insane(curve: dict[int, float]) -> str:
    """Why `curve` cannot be this machine's cost of a call ("" when it can): a time that is not positive, t(q)
    outside [SANE_LOW, SANE_HIGH q] t(1), or below SANE_LOW times a shorter call's (more tokens never cost much
    less: a burst of other work slowed the shorter one)."""
    if not curve or not all(stored.is_number(t) and t > 0 for t in curve.values()):
        return "its times are not positive seconds"
    t1, most = curve[min(curve)], 0.0
    for q, t in sorted(curve.items()):
        if not SANE_LOW <= t / t1 <= SANE_HIGH * q:
            return f"t({q}) = {t / t1:.2f} t(1)"
        if t < SANE_LOW * most:
            return f"t({q}) = {t / t1:.2f} t(1), below a shorter call's {most / t1:.2f}"
        most = max(most, t)
    return ""


def bounded(curve: dict[int, float]) -> dict[int, float]:
    """`curve` with each t(q) / t(1) brought within the possible: what a decode ranks with when no measurement
    here had a possible shape (the machine too busy to measure), never stored."""
    t1 = curve[min(curve)]
    return {q: min(max(t, SANE_LOW * t1), SANE_HIGH * q * t1) for q, t in curve.items()}


def measure(base: torch.nn.Module, context: torch.LongTensor, points, cache_implementation: str):
    """(t(q) at `points`, "" or why it is impossible): up to ATTEMPTS measurements, each point the least any of
    them found (other work only ever adds time, so a burst that slowed one point in one measurement is outvoted),
    until the curve's shape is possible."""
    best: dict[int, float] = {}
    for _ in range(ATTEMPTS):
        curve = forward_cost(base, context[:1], points, COST_REPS, cache_implementation, quantile=QUARTILE)
        best = {q: min(t, best.get(q, t)) for q, t in curve.items()}
        why = insane(best)
        if not why:
            return best, ""
    return bounded(best), why


def points_for(base: torch.nn.Module, context: torch.LongTensor) -> list[int]:
    """The q's measured: those a context of this length leaves room for (t(q) is extrapolated past them)."""
    room = context_length(base)
    return [q for q in COST_POINTS if room is None or context.shape[1] + q <= room] or [1]


def cost_curve(base: torch.nn.Module, context: torch.LongTensor, cache_implementation: str = "dynamic"):
    """t(q) of `base` here: from the calibration cache where a base of these shapes was measured on this machine,
    dtype, thread count and cache kind, else measured over `context` (about a second on a small model) and stored
    if its shape is possible. Read, not timed afresh, it decides the same in every process: a ranked sampled chain's
    seed repeats its tokens. A damaged or impossible entry is one line, then measured again."""
    points, key = points_for(base, context), curve_key(base, cache_implementation)
    entry = stored.entries().get(key)
    if entry is not None:
        cost = entry.get("cost") if isinstance(entry, dict) else None
        if isinstance(cost, dict) and sorted(cost) == sorted(map(str, points)):
            curve = {int(q): t for q, t in cost.items()}
            why = insane(curve)
            if not why:
                return {q: float(t) for q, t in curve.items()}
        else:
            why = f"is not seconds at {points}"
        stored.note(f"{stored.cache_file()} entry for the cost curve {why}")
    return _measured(base, context, points, key, cache_implementation)


def _measured(base, context, points, key: str, cache_implementation: str, agrees=lambda curve: True):
    curve, why = measure(base, context, points, cache_implementation)
    if why or not agrees(curve):
        reason = why or "it disagrees with this decode's calls"
        print(f"blockdecode: the cost curve measured here is off ({reason}): the machine may be busy; ranking "
              "with it, not cached", file=sys.stderr)  # fmt: skip
        return curve
    stored.say_once(stored.store(key, {"key": key, "cost": {str(q): t for q, t in curve.items()}}),
                    "ranking with it anyway")  # fmt: skip
    return curve


_REMEASURED: set[str] = set()  # curves measured again in this process: a later disproof rescales, never re-times


def remeasured(base, context, cache_implementation: str, calls: list[tuple[int, float]], off: float, curve: dict):
    """t(q) anew because a decode's `calls` ((tokens verified, seconds) each) took `off` times what `curve`, the one
    it ranks with, says. The first time in a process it is measured again and stored in the cached one's place where
    it agrees with those calls (within OFF_BY), so that a curve timed on a busy machine is replaced once the machine
    is quiet, and one timed now while busy is not kept unless the calls saw the same. After that, the machine's load
    is what moves: `curve` scaled by `off`, unstored, at no cost (a measurement of a 0.5B model takes seconds)."""
    key = curve_key(base, cache_implementation)
    if key in _REMEASURED:
        return {q: t * off for q, t in curve.items()}
    _REMEASURED.add(key)
    print(f"blockdecode: this decode's calls took {off:.2g}x what the cost curve in {stored.cache_file()} says: "
          "measuring it again", file=sys.stderr)  # fmt: skip

    def agrees(curve: dict[int, float]) -> bool:
        ratio = statistics.median(seconds / t_at(curve, q) for q, seconds in calls)
        return 1 / OFF_BY <= ratio <= OFF_BY

    return _measured(base, context, points_for(base, context), key, cache_implementation, agrees)


def heads_cost(lm, context: torch.LongTensor, k: int) -> float:
    """Seconds the heads take to propose a chain of k-1 here: from the calibration cache as the cost curve is
    (keyed by the heads' shapes, not their values), else timed on `context` (the lower quartile of 20) and stored.
    Read, not timed afresh, it lets a sampled decode ask the heads only where they pay, and still repeat its seed in
    another process. A damaged entry is measured again."""
    key = "|".join(["heads", shape_key(lm.base), shape_key(lm.heads), *machine_key(lm.base), f"k={k}"])
    entry = stored.entries().get(key)
    if entry is not None:
        seconds = entry.get("seconds") if isinstance(entry, dict) else None
        if stored.is_number(seconds) and seconds > 0:
            return float(seconds)
        stored.note(f"{stored.cache_file()} entry for the heads' cost is not positive seconds")
    drafter, depth = lm.drafter(), min(k, lm.k) - 1
    width = lm.base.get_output_embeddings().weight.shape[1]
    hidden = torch.zeros(1, width, dtype=lm.base.dtype, device=context.device)
    samples = []
    for _ in range(21):  # the first warms up
        start = time.perf_counter()
        drafter.chain_scored(context[:1], hidden, depth)
        samples.append(time.perf_counter() - start)
    seconds = sorted(samples[1:])[int(QUARTILE * 19)]
    stored.store(key, {"key": key, "seconds": seconds})
    return seconds


_RANKINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # BlockwiseLM -> (key, Ranking)


def model_ranking(lm, context: torch.LongTensor, cache_implementation: str = "dynamic") -> Ranking:
    """The ranking for BlockwiseLM `lm` on this machine: its base's cost curve (`cost_curve`) and the rates shipped
    beside its drafters or its base (`shipped_rates`), found once per set of weights, thread count and cache kind in
    a process, not at every `generate`; a curve a decode measured again (`remeasured`) is what later sequences rank
    with."""
    key = (weights_key(lm.parameters()), torch.get_num_threads(), cache_implementation)
    known = _RANKINGS.get(lm)
    if known is None or known[0] != key:
        cost = cost_curve(lm.base, context, cache_implementation)
        signature = weights_signature(lm.measured)  # the drafters' own folder first (the package's, for a GGUF)
        rates = shipped_rates(lm.priors_folder, signature) or shipped_rates(lm.base_location, signature)
        _RANKINGS[lm] = known = (key, Ranking(tuple(sorted(cost.items())), tuple(sorted(rates.items())), measured=True))
    return known[1]
