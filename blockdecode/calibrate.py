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
from tqdm.auto import tqdm

from blockdecode.decode import takes_tree_masks
from blockdecode.hf import context_length, dtype_name, weights_digest
from blockdecode.io import write_json
from blockdecode.timing import forward_cost

LARGEST = 64  # the largest tree tried, and the one decoded to predict every smaller one
NEW_TOKENS = 48  # decoded per prompt and setting
COST_POINTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 65)  # t(q) is measured here and interpolated between


SOURCES = ("heads", "ngram", "heads+ngram")  # what drafter="auto" chooses from


@dataclass
class Calibration:
    key: str
    drafter: str  # the drafters asked for, or for "auto" the fastest of SOURCES
    budget: int  # 0: the chain is fastest
    predicted: dict[str, dict[str, float]]  # per drafter: tokens/s of each tree budget 1..LARGEST
    measured: dict[str, float]  # "drafter:budget" -> tokens/s decoded (budget 0: the chain)
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
            drafter if drafter != "auto" else "auto:" + ",".join(SOURCES),  # a new source is measured anew
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


def predict_budgets(
    lm,
    prompts: list[torch.LongTensor],
    drafter,
    k: int,
    cost: dict[int, float],
    new_tokens: int = NEW_TOKENS,
    warm_up: bool = True,
) -> dict[int, float]:
    """Predicted tokens/s of every tree budget, from one decode of each prompt with the largest
    and the cost curve t(q) (`cost`)."""
    settings = dict(eos_token_id=[], drafter=drafter, k=k, tree=LARGEST)
    if warm_up:
        lm.generate(prompts[0], new_tokens, **settings)
    paths, verified, call_seconds = [], [], []
    for ids in prompts:
        stamps: list[float] = []
        out = lm.generate(ids, new_tokens, on_block=lambda _, s=stamps: s.append(time.perf_counter()), **settings)
        paths += out.stats.accepted_nodes[1:]  # call i's time lies between blocks i-1 and i
        verified += out.stats.verified[1:]
        call_seconds += [b - a for a, b in zip(stamps, stamps[1:])]
    if not paths:
        raise ValueError("calibration needs prompts and new tokens that leave room for two calls")
    return predict(paths, verified, call_seconds, cost)


def measure_settings(
    lm,
    prompts: list[torch.LongTensor],
    settings: dict[str, tuple],
    k: int,
    new_tokens: int = NEW_TOKENS,
    rounds: int = 2,
) -> dict[str, float]:
    """Tokens per second of each named (drafters, budget) setting on these prompts (budget 0:
    the chain), medians over interleaved rounds after a warm-up."""

    def run(label: str, ids: torch.LongTensor):
        drafter, budget = settings[label]
        return lm.generate(ids, new_tokens, eos_token_id=[], drafter=drafter, k=k, tree=budget or None)

    labels = list(settings)
    for label in labels:
        run(label, prompts[0])
    speed: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            shift = (r + i) % len(labels)
            for label in labels[shift:] + labels[:shift]:
                start = time.perf_counter()
                out = run(label, ids)
                speed[label].append(out.stats.new_tokens / (time.perf_counter() - start))
    return {label: statistics.median(v) for label, v in speed.items()}


def calibrate(
    lm,
    prompts: list[torch.LongTensor],
    drafter: str = "auto",
    k: int | None = None,
    refresh: bool = False,
    drafters=None,
    show: bool = True,
) -> Calibration:
    """The fastest budget for `lm` here (and for drafter="auto" the fastest drafters of SOURCES),
    from the cache when it was measured for exactly this model and setting, else measured now
    and stored. `drafter` names the drafters in the key; `drafters` (default: the name itself)
    are what is measured. A few seconds on a small model, shown with a progress bar."""
    k = k or lm.k
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
    limit = context_length(lm.base)
    room = limit - NEW_TOKENS - LARGEST - 1 if limit is not None else None
    if room is not None and room < 1:  # too short a context to measure in: the chain, unstored
        return Calibration(key, "heads" if drafter == "auto" else drafter, 0, {}, {}, 0, 0)
    prompts = [ids[:, -room:] if room else ids for ids in prompts[:2]]  # two; their newest tokens, as many as fit
    names = SOURCES if drafter == "auto" else (drafter,)
    specs = {name: drafters if drafters is not None and drafter != "auto" else name for name in names}
    trees = takes_tree_masks(lm.base)  # else only the chains are measured
    bar = tqdm(total=len(names) * trees + 1, desc="calibrating (once for this model and setting)", disable=not show)
    predicted = {}
    settings = {}
    if trees:
        cost = forward_cost(lm.base, prompts[0].to(next(lm.parameters()).device), COST_POINTS, reps=3)  # once for all
        for name in names:  # the first decode warms the model up for all
            predicted[name] = predict_budgets(lm, prompts, specs[name], k, cost=cost, warm_up=not predicted)
            bar.update()
        best = max(((n, b) for n in names for b in predicted[n]), key=lambda nb: predicted[nb[0]][nb[1]])
        settings[f"{best[0]}:{best[1]}"] = (specs[best[0]], best[1])
    for name in names:  # the chains, which no tree's statistics predict; shared drafters have none
        if len(lm.drafters(specs[name])) == 1:
            settings[f"{name}:0"] = (specs[name], 0)
    if not settings:  # shared drafters on a model without trees: decoded as generate falls back, the first's chain
        settings[f"{names[0]}:{LARGEST}"] = (specs[names[0]], LARGEST)
    measured = measure_settings(lm, prompts, settings, k)
    bar.update()
    bar.close()
    chosen, budget = max(measured, key=measured.get).rsplit(":", 1)
    result = Calibration(
        key,
        chosen,
        int(budget),
        {name: {str(b): s for b, s in curve.items()} for name, curve in predicted.items()},
        measured,
        len(prompts),
        NEW_TOKENS,
    )
    stored[key] = asdict(result)
    write_json(path, stored)
    return result


def resolve(lm, prompts: list[torch.LongTensor], drafter, tree: int | str | None, k: int | None, rule: str = "exact"):
    """The drafters and tree budget a run uses. `tree="auto"` calibrates the budget, and for
    drafter "auto" (or None) the drafters too; min-block acceptance forces a chain's first
    proposals, so it gets the chain. Otherwise "auto" drafters are the heads. Named drafters come
    back as a name, drafter objects as given."""
    auto = drafter is None or drafter == "auto"
    if tree == "auto" and rule == "min-block":
        tree = None
    if tree != "auto":
        return ("heads" if auto else drafter), tree
    if auto or isinstance(drafter, str):
        found = calibrate(lm, prompts, "auto" if auto else drafter, k)
        return found.drafter, found.tree
    name = "+".join(type(d).__name__ for d in lm.drafters(drafter))
    return drafter, calibrate(lm, prompts, name, k, drafters=drafter).tree
