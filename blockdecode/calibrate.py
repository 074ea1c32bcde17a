"""`tree="auto"`: the tree budget that decodes fastest for this model, dtype, machine and drafter,
found by measurement once and cached.

What a budget buys depends on t(q), the cost of one forward of q tokens (flat up to a point, then
rising, at a different point on every machine and dtype), on how often the drafters' candidates
are right, and on what the drafters cost. Rather than model all three, calibration decodes a few
prompts with each candidate budget (and with the plain chain) in interleaved rounds and keeps the
fastest. The result is stored in the user's cache directory under a key naming the model's
fingerprint, dtype, device, threads and CPU capability, drafter and k: a model or setting it was
not measured for is recalibrated, never served another's choice."""

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

BUDGETS = (0, 4, 8, 16, 32, 64)  # 0: the chain


@dataclass
class Calibration:
    key: str
    budget: int  # 0: the chain is fastest
    tokens_per_s: dict[str, float]  # per budget tried
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


def measure_budgets(
    lm, prompts: list[torch.LongTensor], drafter, k: int, budgets=BUDGETS, new_tokens: int = 48, rounds: int = 2
) -> dict[int, float]:
    """Tokens per second of each budget on these prompts, medians over interleaved rounds."""
    if len(lm.drafters(drafter)) > 1:  # several drafters can only share a tree
        budgets = [b for b in budgets if b]
    speed: dict[int, list[float]] = {b: [] for b in budgets}
    for ids in prompts[:1]:  # warm-up
        for b in budgets:
            lm.generate(ids, new_tokens, eos_token_id=[], drafter=drafter, k=k, tree=b or None)
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
        return Calibration(**entry)
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    speeds = measure_budgets(lm, prompts, drafters, k)
    best = max(speeds, key=speeds.get)
    result = Calibration(key, best, {str(b): s for b, s in speeds.items()}, len(prompts), 48)
    stored[key] = asdict(result)
    write_json(path, stored)
    return result
