"""`tree="auto"`: the tree budget that decodes fastest for this model, dtype, machine and drafter,
found by measurement once and cached.

A budget of B nodes pays what a call gains over what a call costs. One decode with the largest
tree measures both: every call's accepted path, as node indices in insertion order (drafters add
their candidates best first, so a tree of B nodes is the first B nodes of the largest one, and the
part of the path within B is what B would have gained), and every call's wall time, of which the
forward's share follows t(q), the cost curve of one forward of q tokens, measured at the prompt's
context. That predicts tokens/s for every budget 1..64 from one decode. The best predicted budget
and the plain chain, which the tree's statistics cannot predict, are then decoded in interleaved
rounds and the faster is kept.

The result is stored in the user's cache directory under a key naming the model's weights, dtype,
device, threads and CPU capability, drafter and k: a model or setting it was not measured for is
recalibrated, never served another's choice."""

from __future__ import annotations

import json
import os
import statistics
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blockdecode.hf import dtype_name, weights_digest
from blockdecode.io import write_json
from blockdecode.timing import forward_cost

LARGEST = 64  # the largest tree tried, and the one decoded to predict every smaller one
COST_POINTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # t(q) is measured here and interpolated between


@dataclass
class Calibration:
    key: str
    budget: int  # 0: the chain is fastest
    predicted: dict[str, float]  # tokens/s of each tree budget 1..LARGEST, from one decode and t(q)
    measured: dict[str, float]  # tokens/s decoded: the best predicted budget, and the chain ("0")
    prompts: int
    new_tokens: int

    @property
    def tree(self) -> int | None:
        return self.budget or None


def cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "blockdecode" / "calibration.json"


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (versions, hash)


def fingerprint(model: torch.nn.Module) -> str:
    """A short exact hash of a model's weights; computed again only when a weight has changed in
    place since (tensor version counters), so `generate(tree="auto")` does not read every weight
    on every call."""
    versions = tuple(p._version for p in model.parameters())
    known = _FINGERPRINTS.get(model)
    if known is None or known[0] != versions:
        _FINGERPRINTS[model] = known = (versions, weights_digest(model)[:16])
    return known[1]


def calibration_key(lm, drafter: str, k: int) -> str:
    device = next(lm.parameters()).device
    return "|".join(
        [
            fingerprint(lm),
            dtype_name(lm.base.dtype),
            str(device),
            f"{torch.get_num_threads()} threads",
            torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else torch.cuda.get_device_name(device),
            drafter,
            f"k={k}",
        ]
    )


def predict(
    paths: list[list[int]], verified: list[int], call_seconds: list[float], t: dict[int, float]
) -> dict[int, float]:
    """Tokens/s of each budget 1..LARGEST from calls decoded with the largest tree: each call's
    accepted node indices (`paths`), tokens scored (`verified`) and wall seconds, and t(q). A
    budget B gains 1 + the path's nodes within B, and costs the loop's own time (what the calls
    took beyond t(verified)) plus t(min(verified, B + 1))."""
    points = sorted(t)

    def t_at(q: int) -> float:  # linear between measured points, flat past the last
        upper = next((p for p in points if p >= q), points[-1])
        lower = max((p for p in points if p <= q), default=points[0])
        if upper == lower:
            return t[upper]
        return t[lower] + (t[upper] - t[lower]) * (q - lower) / (upper - lower)

    loop = max(0.0, statistics.mean(call_seconds) - statistics.mean(map(t_at, verified)))
    speeds = {}
    for budget in range(1, LARGEST + 1):
        gained = statistics.mean(1 + sum(node <= budget for node in path) for path in paths)
        cost = loop + statistics.mean(t_at(min(q, budget + 1)) for q in verified)
        speeds[budget] = gained / cost
    return speeds


def predict_budgets(lm, prompts: list[torch.LongTensor], drafter, k: int, new_tokens: int = 48) -> dict[int, float]:
    """Predicted tokens/s of every tree budget, from one decode of each prompt with the largest."""
    settings = dict(eos_token_id=[], drafter=drafter, k=k, tree=LARGEST)
    lm.generate(prompts[0], new_tokens, **settings)  # warm-up
    paths, verified, call_seconds = [], [], []
    for ids in prompts:
        stamps: list[float] = []
        out = lm.generate(ids, new_tokens, on_block=lambda _, s=stamps: s.append(time.perf_counter()), **settings)
        paths += out.stats.accepted_nodes[1:]  # call i's time lies between blocks i-1 and i
        verified += out.stats.verified[1:]
        call_seconds += [b - a for a, b in zip(stamps, stamps[1:])]
    if not paths:
        raise ValueError("calibration needs prompts and new tokens that leave room for two calls")
    context = prompts[0].to(next(lm.parameters()).device)
    t = forward_cost(lm.base, context, [q for q in COST_POINTS if q < max(verified)] + [max(verified)], reps=3)
    return predict(paths, verified, call_seconds, t)


def measure_budgets(
    lm, prompts: list[torch.LongTensor], drafter, k: int, budgets, new_tokens: int = 48, rounds: int = 2
) -> dict[int, float]:
    """Tokens per second of each budget on these prompts (0: the chain), medians over interleaved
    rounds after a warm-up."""
    if len(lm.drafters(drafter)) > 1:  # several drafters can only share a tree
        budgets = [b for b in budgets if b]
    speed: dict[int, list[float]] = {b: [] for b in budgets}
    for b in budgets:
        lm.generate(prompts[0], new_tokens, eos_token_id=[], drafter=drafter, k=k, tree=b or None)
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            order = budgets[(r + i) % len(budgets) :] + budgets[: (r + i) % len(budgets)]
            for b in order:
                start = time.perf_counter()
                out = lm.generate(ids, new_tokens, eos_token_id=[], drafter=drafter, k=k, tree=b or None)
                speed[b].append(out.stats.new_tokens / (time.perf_counter() - start))
    return {b: statistics.median(v) for b, v in speed.items()}


def calibrate(
    lm,
    prompts: list[torch.LongTensor],
    drafter: str = "heads+ngram",
    k: int | None = None,
    refresh: bool = False,
    drafters=None,
) -> Calibration:
    """The fastest budget for `lm` here, from the cache when it was measured for exactly this
    model and setting, else measured now and stored. `drafter` names the drafters in the key;
    `drafters` (default: the name itself) are what is measured."""
    k = k or lm.k
    drafters = drafters if drafters is not None else drafter
    key = calibration_key(lm, drafter, k)
    path = cache_file()
    try:
        stored = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        stored = {}  # a damaged cache is measured again, never trusted
    entry = stored.get(key)
    if not refresh and isinstance(entry, dict) and entry.get("key") == key:
        try:
            return Calibration(**entry)
        except TypeError:
            pass  # written by another version: measured again
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    predicted = predict_budgets(lm, prompts, drafters, k)
    best = max(predicted, key=predicted.get)
    measured = measure_budgets(lm, prompts, drafters, k, [0, best])
    result = Calibration(
        key,
        max(measured, key=measured.get),
        {str(b): s for b, s in predicted.items()},
        {str(b): s for b, s in measured.items()},
        len(prompts),
        48,
    )
    stored[key] = asdict(result)
    write_json(path, stored)
    return result
