"""`drafter="auto"` and `tree="auto"`: the drafters and tree budget that decode fastest for this model,
dtype and machine, predicted in about a second rather than searched by decoding.

A setting's speed is what a call gains over what a call costs.

- What a call gains depends on the model and its heads, not on the machine: the accepted paths of
  decodes with the largest tree (drafters add their candidates best first, so a tree of B nodes is the
  first B nodes of the largest, and the part of a path within B is what B would have gained) and the
  blocks of the plain chain. These *acceptance statistics* come from decoding the model's own prompts
  (`prompts.json` beside a built-in model, else the prompts given). A built-in model ships them
  (`calibration.json`, written by `record_statistics`); for any other they are measured once and
  cached.
- What a call costs depends on the machine: t(q), one forward of q tokens over a cached context, and
  each setting's own time per call outside the forward (its drafters, the tree, the bookkeeping),
  timed on one short decode.

The fastest prediction is kept in the user's cache under a key naming the model's weights, dtype,
device, threads, CPU, drafters and k, so another model or setting is measured anew, never served
another's choice. The cache is read once per process and holds at most `CACHE_ENTRIES` choices, the
oldest dropped."""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blockdecode.adapter import takes_tree_masks
from blockdecode.decode import decode
from blockdecode.drafters import CHOICES, drafter_names
from blockdecode.hf import context_length, dtype_name, same_weights, weights_digest, weights_signature
from blockdecode.io import write_json
from blockdecode.plan import block_size, make_plan
from blockdecode.timing import forward_cost

LARGEST = 64  # the largest tree, decoded to predict every smaller one
STAT_TOKENS = 48  # decoded per prompt for the acceptance statistics
STAT_PROMPTS = 4
COST_TOKENS = 40  # decoded to time a setting's own cost per call
COST_POINTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 65)  # t(q) is measured here and interpolated between
CACHE_ENTRIES = 256
STATISTICS = "calibration.json"  # beside a saved model: its acceptance statistics


@dataclass
class Calibration:
    key: str
    drafter: str  # the drafters asked for, or for "auto" the fastest of CHOICES
    budget: int  # 0: the chain is fastest
    predicted: dict[str, dict[str, float]]  # per drafter: tokens/s of the chain ("0") and each budget
    seconds: float = 0.0  # what choosing took
    statistics: str = "measured"  # "shipped" when they came with the model

    @property
    def tree(self) -> int | None:
        return self.budget or None


def cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "blockdecode" / "calibration.json"


_CACHE: dict[str, dict] = {}  # cache file -> its entries, read once per process


def _entries() -> dict:
    path = str(cache_file())
    if path not in _CACHE:
        try:
            stored = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
        except (OSError, json.JSONDecodeError):
            stored = {}  # a damaged cache is measured again, never trusted
        _CACHE[path] = stored if isinstance(stored, dict) else {}
    return _CACHE[path]


def _store(key: str, entry: dict) -> None:
    entries = _entries()
    entries.pop(key, None)
    entries[key] = {**entry, "stored": time.time()}
    for old in sorted(entries, key=lambda k: entries[k].get("stored", 0) if isinstance(entries[k], dict) else 0)[
        : max(0, len(entries) - CACHE_ENTRIES)
    ]:
        del entries[old]
    write_json(cache_file(), entries)


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (versions, hash)


def fingerprint(model: torch.nn.Module) -> str:
    """A short exact hash of a model's weights; computed again only when a weight has changed in
    place since (tensor version counters), so `generate` does not read every weight each call."""
    versions = tuple(p._version for p in model.parameters())
    known = _FINGERPRINTS.get(model)
    if known is None or known[0] != versions:
        _FINGERPRINTS[model] = known = (versions, weights_digest(model)[:16])
    return known[1]


def calibration_key(lm, drafter: str, k: int) -> str:
    device = next(lm.parameters()).device
    machine = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else torch.cuda.get_device_name(device)
    chosen_among = "auto:" + ",".join(CHOICES) if drafter == "auto" else drafter  # a new source is measured anew
    parts = [fingerprint(lm), dtype_name(lm.base.dtype), str(device), f"{torch.get_num_threads()} threads"]
    return "|".join([*parts, machine, chosen_among, f"k={k}"])


def t_at(t: dict[int, float], q: int) -> float:
    """t(q), linear between the measured points, flat past the last."""
    points = sorted(t)
    upper = next((p for p in points if p >= q), points[-1])
    lower = max((p for p in points if p <= q), default=points[0])
    if upper == lower:
        return t[upper]
    return t[lower] + (t[upper] - t[lower]) * (q - lower) / (upper - lower)


def predict(stats: dict, t: dict[int, float], loop_tree: float, loop_chain: float) -> dict[int, float]:
    """Tokens/s of the chain (budget 0) and of every tree budget 1..LARGEST, from the acceptance
    statistics of one drafter setting, t(q), and the seconds a call spends outside its forward with a
    tree and with the chain. Budget B gains 1 + the accepted path's nodes within B and costs
    t(min(verified, B + 1)) plus the tree's loop time."""
    chain, tree, speeds = stats["chain"], stats["tree"], {}
    if chain["gained"]:
        cost = loop_chain + statistics.mean(t_at(t, q) for q in chain["verified"])
        speeds[0] = statistics.mean(chain["gained"]) / cost
    if tree["paths"]:
        for budget in range(1, LARGEST + 1):
            gained = statistics.mean(1 + sum(node <= budget for node in path) for path in tree["paths"])
            cost = loop_tree + statistics.mean(t_at(t, min(q, budget + 1)) for q in tree["verified"])
            speeds[budget] = gained / cost
    return speeds


def shared(spec) -> bool:
    """Whether `spec` names several drafters, which share a tree and have no chain."""
    if isinstance(spec, str):
        return len(drafter_names(spec)) > 1
    return isinstance(spec, Sequence) and len(spec) > 1


def acceptance_statistics(lm, prompts: list[torch.LongTensor], spec, k: int, trees: bool) -> dict:
    """Per call, what the largest tree accepted (node indices) and verified, and what the chain gained
    and verified, over `prompts`: the machine-independent half of a prediction."""
    stats = {"tree": {"paths": [], "verified": []}, "chain": {"gained": [], "verified": []}}
    settings = [("tree", LARGEST)] if trees else []
    if not shared(spec):
        settings.append(("chain", None))
    for mode, tree in settings:
        plan = make_plan(lm.base, spec, k, tree, eos_token_id=[], lm=lm)
        for ids in prompts:
            s = decode(lm.base, ids, STAT_TOKENS, plan).stats
            stats[mode]["verified"] += s.verified
            if mode == "tree":
                stats[mode]["paths"] += s.accepted_nodes
            else:
                stats[mode]["gained"] += s.block_sizes
    return stats


def loop_seconds(lm, prompt: torch.LongTensor, spec, k: int, tree: int | None, t: dict[int, float]) -> float:
    """Seconds a call spends outside its forward with this setting: one short decode, the median of
    each call's wall time less t(tokens it verified)."""
    plan = make_plan(lm.base, spec, k, tree, eos_token_id=[], lm=lm)
    decode(lm.base, prompt, 4, plan)  # warm-up
    stamps: list[float] = []
    out = decode(lm.base, prompt, COST_TOKENS, plan, on_block=lambda _: stamps.append(time.perf_counter()))
    calls = [b - a for a, b in zip(stamps, stamps[1:])]  # call i's time lies between blocks i-1 and i
    if not calls:
        return 0.0
    # the median call's excess: one call slowed by something else on the machine does not move it
    return max(0.0, statistics.median(c - t_at(t, q) for c, q in zip(calls, out.stats.verified)))


def shipped_statistics(lm, k: int) -> dict | None:
    """The acceptance statistics saved beside the model's weights, if they are for these weights and k."""
    folder = lm.base_location
    path = Path(folder) / STATISTICS if folder and Path(folder).is_dir() else None
    if path is None or not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if saved.get("k") != k or not same_weights(saved.get("signature", []), weights_signature(lm)):
        return None
    return saved.get("sources")


def record_statistics(lm, prompts: list[torch.LongTensor], folder: str | Path) -> dict:
    """Measure the acceptance statistics of every drafter `auto` chooses among and save them beside
    the model in `folder`, so that choosing on any machine needs only the machine's costs."""
    trees = takes_tree_masks(lm.base)
    sources = {name: acceptance_statistics(lm, prompts, name, lm.k, trees) for name in CHOICES}
    saved = {"k": lm.k, "signature": weights_signature(lm), "prompts": len(prompts), "new_tokens": STAT_TOKENS}
    write_json(Path(folder) / STATISTICS, {**saved, "sources": sources})
    return sources


_CHOOSING = threading.Lock()


def one_at_a_time(choose: Callable[..., Calibration]) -> Callable[..., Calibration]:
    """Calibrations in one process run one at a time: a thread that asks while another measures waits
    and reads the choice from the cache, rather than measuring under the other's load or racing it
    to store."""

    @functools.wraps(choose)
    def serialised(*args, **kwargs) -> Calibration:
        with _CHOOSING:
            return choose(*args, **kwargs)

    return serialised


@one_at_a_time
def calibrate(
    lm, prompts: list[torch.LongTensor], drafter="auto", k: int | None = None, refresh: bool = False, show: bool = True
) -> Calibration:
    """The fastest setting for `lm` here (and for drafter="auto" the fastest drafters of CHOICES),
    from the cache when it was chosen for exactly this model and setting, else predicted now and
    stored. `drafter` is a name or a drafter object. One line on stderr says when it measures."""
    k = lm.k if k is None else block_size(k)
    name = drafter if isinstance(drafter, str) else make_plan(lm.base, drafter, k, 1, lm=lm).drafter_name
    key = calibration_key(lm, name, k)
    entry = _entries().get(key)
    if not refresh and isinstance(entry, dict) and entry.get("key") == key:
        try:
            return Calibration(**{f: entry[f] for f in Calibration.__dataclass_fields__ if f in entry})
        except TypeError:
            pass  # written by another version: measured again
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    limit = context_length(lm.base)
    room = limit - STAT_TOKENS - LARGEST - 1 if limit is not None else None
    if room is not None and room < 1:  # too short a context to measure in: the chain, unstored
        return Calibration(key, "heads" if name == "auto" else name, 0, {})
    began = time.perf_counter()
    if show:
        where = f"once; cached in {cache_file()}"
        print(f"blockdecode: choosing drafters and tree for this model and machine ({where})", file=sys.stderr)
    prompts = [ids[:, -room:] if room else ids for ids in prompts[:STAT_PROMPTS]]
    device = next(lm.parameters()).device
    prompts = [ids.to(device) for ids in prompts]
    names = CHOICES if name == "auto" else (name,)
    spec = {n: (n if isinstance(drafter, str) else drafter) for n in names}
    trees = takes_tree_masks(lm.base)
    if not trees:  # chains only: shared drafters fall back to the first one's chain
        names = tuple(n for n in names if not shared(spec[n]))
        if not names:
            return Calibration(key, name, LARGEST, {})
    shipped = shipped_statistics(lm, k) if isinstance(drafter, str) else None
    stats = {n: shipped[n] for n in names} if shipped and all(n in shipped for n in names) else None
    if stats is None:
        stats = {n: acceptance_statistics(lm, prompts, spec[n], k, trees) for n in names}
    t = forward_cost(lm.base, prompts[0], COST_POINTS, reps=5)
    predicted = {}
    for n in names:
        loop_tree = loop_seconds(lm, prompts[0], spec[n], k, LARGEST, t) if trees else 0.0
        loop_chain = 0.0 if shared(spec[n]) else loop_seconds(lm, prompts[0], spec[n], k, None, t)
        predicted[n] = predict(stats[n], t, loop_tree, loop_chain)
    best = max(((n, b) for n in names for b in predicted[n]), key=lambda nb: predicted[nb[0]][nb[1]])
    result = Calibration(
        key,
        best[0],
        best[1],
        {n: {str(b): s for b, s in curve.items()} for n, curve in predicted.items()},
        time.perf_counter() - began,
        "shipped" if shipped else "measured",
    )
    _store(key, asdict(result))
    return result
