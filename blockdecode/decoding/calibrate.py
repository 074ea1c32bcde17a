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

What a call gains is measured under the acceptance rule the decode will use: a relaxed one lets more
stand (a model ships exact acceptance's statistics only). The fastest prediction is kept in the user's
cache under a key naming the model's weights, dtype, device, threads, CPU, drafters, acceptance rule
and k, so another model or setting is measured anew, never served another's choice. The cache is
kept as `stored` keeps every entry: a damaged one is measured again, and one that cannot be stored is used anyway.
t(q) is the base's cost curve (`costs.cost_curve`), measured once per base and machine and checked."""

from __future__ import annotations

import functools
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from blockdecode.core.hf import (
    check_loaded,
    check_model,
    context_length,
    same_weights,
    weights_digest,
    weights_key,
    weights_signature,
)
from blockdecode.core.io import read_json, write_json
from blockdecode.decoding import stored
from blockdecode.decoding.acceptance import EXACT, Acceptance
from blockdecode.decoding.adapter import takes_tree_masks
from blockdecode.decoding.costs import cost_curve, machine_key, t_at
from blockdecode.decoding.estimates import PRIORS, Estimates, own_prior, source_name
from blockdecode.decoding.loop import decode
from blockdecode.decoding.plan import block_size, make_plan, max_tree
from blockdecode.decoding.ranking import CAP, Ranker, Ranking
from blockdecode.drafters.proposals import Source
from blockdecode.drafters.registry import CHOICES, drafter_names

LARGEST = 64  # the largest tree, decoded to predict every smaller one
STAT_TOKENS = 48  # decoded per prompt for the acceptance statistics
STAT_PROMPTS = 4
COST_TOKENS = 40  # decoded to time a setting's own cost per call
STATISTICS = "calibration.json"  # beside a saved model: its acceptance statistics


@dataclass
class Calibration:
    key: str
    drafter: str  # the drafters asked for, or for "auto" the fastest of CHOICES
    budget: int  # 0: the chain is fastest
    predicted: dict[str, dict[str, float]]  # per drafter: tokens/s of the chain ("0") and each budget
    seconds: float = 0.0  # what choosing took
    statistics: str = "measured"  # "shipped" when they came with the model
    note: str = ""  # why the choice is not in the cache; "" when it is

    def entry(self) -> dict:
        """What the cache keeps of it."""
        return {f: v for f, v in asdict(self).items() if f != "note"}

    @property
    def tree(self) -> int | None:
        return self.budget or None

    def best_chain(self) -> str:
        """The drafter whose chain is predicted fastest, what a batch decodes with (one chain a row);
        unmeasured, the first of the chosen drafters."""
        chains = {name: curve["0"] for name, curve in self.predicted.items() if "0" in curve}
        return max(chains, key=chains.get) if chains else drafter_names(self.drafter)[0]


def is_budget(value: object, largest: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= largest


def is_curve(curve: object) -> bool:
    """Whether `curve` maps budgets 0..LARGEST (as JSON keys) to tokens/s, as `predict`'s do."""
    budgets = {str(b) for b in range(LARGEST + 1)}
    return (
        isinstance(curve, dict) and bool(curve) and all(b in budgets and stored.is_number(v) for b, v in curve.items())
    )


def cached(entry: object, key: str, spec: dict, largest: int) -> Calibration:
    """The choice a cache entry holds, if it is one `calibrate` could have made for `key` among the
    drafters of `spec` (name -> drafter) with budgets up to `largest`; else a ValueError saying which
    value is not."""
    if not isinstance(entry, dict):
        raise ValueError(f"holds {type(entry).__name__}, not an object")
    if entry.get("key") != key:
        raise ValueError(f"names another setting, {entry.get('key')!r}")
    drafter, budget = entry.get("drafter"), entry.get("budget")
    if drafter not in spec:
        raise ValueError(f"names drafter {drafter!r}, not one measured for it ({', '.join(spec)})")
    if not is_budget(budget, largest) or (budget == 0 and shared(spec[drafter])):
        raise ValueError(f"holds budget {budget!r}, not one of 0..{largest} that {drafter} decodes with")
    predicted = entry.get("predicted")
    if (
        not isinstance(predicted, dict)
        or not predicted
        or not all(name in spec and is_curve(curve) for name, curve in predicted.items())
    ):
        raise ValueError("holds predictions that are not tokens/s per drafter and budget")
    if not stored.is_number(entry.get("seconds")) or entry.get("statistics") not in ("measured", "shipped"):
        raise ValueError("holds a bad time or statistics source")
    return Calibration(key, drafter, budget, predicted, entry["seconds"], entry["statistics"])


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (weights key, hash)


def fingerprint(model: torch.nn.Module) -> str:
    """A short exact hash of a model's weights; computed again only when a weight has been replaced or
    changed in place since (`weights_key`), so `generate` does not read every weight each call."""
    key = weights_key(model.parameters())
    known = _FINGERPRINTS.get(model)
    if known is None or known[0] != key:
        _FINGERPRINTS[model] = known = (key, weights_digest(model)[:16])
    return known[1]


def calibration_key(lm, drafter: str, k: int, acceptance: Acceptance = EXACT) -> str:
    """What a choice hangs on: what the base and its heads accept (their weights), and the machine's costs."""
    chosen_among = "auto:" + ",".join(CHOICES) if drafter == "auto" else drafter  # a new source is measured anew
    return "|".join([fingerprint(lm.measured), *machine_key(lm.base), chosen_among, f"acceptance={acceptance.key}",
                     f"k={k}"])  # fmt: skip


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


def acceptance_statistics(
    lm, prompts: list[torch.LongTensor], spec, k: int, trees: bool, acceptance: Acceptance = EXACT
) -> dict:
    """Per call, what the largest tree accepted (node indices) and verified, and what the chain gained
    and verified, over `prompts` under `acceptance`: the machine-independent half of a prediction."""
    stats = {"tree": {"paths": [], "verified": []}, "chain": {"gained": [], "verified": []}}
    settings = [("tree", LARGEST)] if trees else []
    if not shared(spec):
        settings.append(("chain", None))
    for mode, tree in settings:
        plan = make_plan(lm.base, spec, k, tree, acceptance, eos_token_id=[], lm=lm)
        for ids in prompts:
            s = decode(lm.base, ids, STAT_TOKENS, plan).stats
            stats[mode]["verified"] += s.verified
            if mode == "tree":
                stats[mode]["paths"] += s.accepted_nodes
            else:
                stats[mode]["gained"] += s.block_sizes
    return stats


def loop_seconds(
    lm, prompt: torch.LongTensor, spec, k: int, tree: int | None, t: dict[int, float], acceptance: Acceptance = EXACT
) -> float:
    """Seconds a call spends outside its forward with this setting: one short decode, the median of
    each call's wall time less t(tokens it verified)."""
    plan = make_plan(lm.base, spec, k, tree, acceptance, eos_token_id=[], lm=lm)
    decode(lm.base, prompt, 4, plan)  # warm-up
    stamps: list[float] = []
    out = decode(lm.base, prompt, COST_TOKENS, plan, on_block=lambda _: stamps.append(time.perf_counter()))
    calls = [b - a for a, b in zip(stamps, stamps[1:])]  # call i's time lies between blocks i-1 and i
    if not calls:
        return 0.0
    # the median call's excess: one call slowed by something else on the machine does not move it
    return max(0.0, statistics.median(c - t_at(t, q) for c, q in zip(calls, out.stats.verified)))


def counts(values: object) -> bool:
    return isinstance(values, list) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in values)


def is_statistics(stats: object) -> bool:
    """Whether `stats` has the form `acceptance_statistics` gives, which `predict` reads."""
    try:
        tree, chain = stats["tree"], stats["chain"]
        paths, verified = tree["paths"], tree["verified"]
        return (
            isinstance(paths, list)
            and all(counts(path) for path in paths)
            and counts(verified)
            and len(paths) == len(verified)
            and counts(chain["gained"])
            and counts(chain["verified"])
            and len(chain["gained"]) == len(chain["verified"])
        )
    except (TypeError, KeyError):
        return False


def shipped_statistics(lm, k: int, names: Sequence[str]) -> dict | None:
    """The acceptance statistics of drafters `names` saved beside the model's weights, if they are for
    these weights and k; a damaged file is noted and measured again."""
    folder = lm.base_location
    path = Path(folder) / STATISTICS if folder and Path(folder).is_dir() else None
    if path is None or not path.is_file():
        return None
    try:
        saved = read_json(path)
        if not isinstance(saved, dict):
            raise ValueError(f"{path} holds a JSON {type(saved).__name__}, not an object")
        signature, sources = saved.get("signature"), saved.get("sources")
        if not (
            isinstance(signature, list) and all(stored.is_number(x) for x in signature) and isinstance(sources, dict)
        ):
            raise ValueError(f"{path} holds no weights signature or no statistics")
    except ValueError as err:
        stored.note(str(err))
        return None
    if saved.get("k") != k or not same_weights(signature, weights_signature(lm.measured)):
        return None
    if any(n not in sources for n in names):
        return None
    if not all(is_statistics(sources[n]) for n in names):
        stored.note(f"{path} holds acceptance statistics that are not lists of counts")
        return None
    return {n: sources[n] for n in names}


def record_statistics(lm, prompts: list[torch.LongTensor], folder: str | Path) -> dict:
    """Measure the acceptance statistics of every drafter `auto` chooses among and save them beside
    the model in `folder`, so that choosing on any machine needs only the machine's costs."""
    trees = takes_tree_masks(lm.base)
    sources = {name: acceptance_statistics(lm, prompts, name, lm.k, trees) for name in CHOICES}
    saved = {"k": lm.k, "signature": weights_signature(lm.measured), "prompts": len(prompts), "new_tokens": STAT_TOKENS}
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
    lm,
    prompts: list[torch.LongTensor],
    drafter="auto",
    k: int | None = None,
    refresh: bool = False,
    show: bool = True,
    acceptance: Acceptance = EXACT,
) -> Calibration:
    """The fastest setting for `lm` here (and for drafter="auto" the fastest drafters of CHOICES),
    from the cache when it was chosen for exactly this model and setting, else predicted now and
    stored. `drafter` is a name or a drafter object. `acceptance`: the rule the decode will use, which
    what stands is measured under (min-block applies to chains only: it has no tree to choose).
    One line on stderr says when it measures."""
    check_model(lm.base)
    check_loaded(lm, "the BlockwiseLM")  # its heads too: the fingerprint reads every weight
    if acceptance.rule == "min-block":
        raise ValueError(f"{acceptance.spec} forces a chain's first proposals: there is no tree to calibrate for it")
    heads = isinstance(drafter, str) and (drafter == "auto" or "heads" in drafter)  # checked before it says a word
    k = lm.k if k is None else block_size(k, lm.k if heads else None)
    if isinstance(drafter, str) and drafter != "auto":
        drafter_names(drafter)  # an unknown name is refused before anything runs the model
    name = drafter if isinstance(drafter, str) else make_plan(lm.base, drafter, k, 1, lm=lm).drafter_name
    key = calibration_key(lm, name, k, acceptance)
    names = CHOICES if name == "auto" else (name,)
    spec = {n: (n if isinstance(drafter, str) else drafter) for n in names}
    entry = stored.entries().get(key)
    if not refresh and entry is not None:
        try:
            return cached(entry, key, spec, min(LARGEST, max_tree(lm.base)))
        except ValueError as err:
            stored.note(f"{stored.cache_file()} entry for {name}, k={k} {err}")
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    limit = context_length(lm.base)
    room = limit - STAT_TOKENS - LARGEST - 1 if limit is not None else None
    if room is not None and room < 1:  # too short a context to measure in: the chain (shared drafters: a tree)
        why = f"the model's context of {limit} tokens is too short to calibrate in (it needs {limit - room + 1})"
        if name != "auto" and shared(spec[name]):
            budget = min(LARGEST, max_tree(lm.base))
            return Calibration(key, name, budget, {}, note=f"{name} share a tree, unmeasured: {why}; nothing is cached")
        return Calibration(key, "heads" if name == "auto" else name, 0, {}, note=f"{why}; nothing is cached")
    trees = takes_tree_masks(lm.base)
    if not trees:  # chains only: shared drafters fall back to the first one's chain
        names = tuple(n for n in names if not shared(spec[n]))
        if not names:
            why = f"{type(lm.base).__name__} scores no trees, and {name} shares one: the first drafter's chain"
            return Calibration(key, name, LARGEST, {}, note=f"{why}; nothing is cached")
    began = time.perf_counter()
    if show:
        where = f"once; cached in {stored.cache_file()}"
        print(f"blockdecode: choosing drafters and tree for this model and machine ({where})", file=sys.stderr)
    prompts = [ids[:, -room:] if room else ids for ids in prompts[:STAT_PROMPTS]]
    device = next(lm.parameters()).device
    prompts = [ids.to(device) for ids in prompts]
    exact = isinstance(drafter, str) and acceptance.rule == "exact"  # what a model ships was measured so
    shipped = shipped_statistics(lm, k, names) if exact else None
    stats = shipped or {n: acceptance_statistics(lm, prompts, spec[n], k, trees, acceptance) for n in names}
    t = cost_curve(lm.base, prompts[0])
    predicted = {}
    for n in names:
        loop_tree = loop_seconds(lm, prompts[0], spec[n], k, LARGEST, t, acceptance) if trees else 0.0
        loop_chain = 0.0 if shared(spec[n]) else loop_seconds(lm, prompts[0], spec[n], k, None, t, acceptance)
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
    result.note = stored.store(result.key, result.entry())
    stored.say_once(result.note, "decoding with this choice anyway")
    return result


# What tree="expected" starts from (blockdecode.decoding.ranking): recorded beside a model, and explained.


def record_rates(lm, prompts: Sequence[torch.LongTensor], folder: str | Path, new_tokens: int = 64,
                 drafter: str = "heads+ngram") -> dict:  # fmt: skip
    """Decode `prompts` with `drafter`'s drafters in one ranked tree whose calls cost the same up to `CAP`
    tokens (so every candidate is verified, and every source tried), without forgetting, and save each
    source's hit rate beside the model in `folder` (`PRIORS`): the prior a sequence starts from."""
    flat = Ranking(((1, 1.0), (CAP + 1, 1.0)))
    plan = make_plan(lm.base, drafter, lm.k, CAP, eos_token_id=[], lm=lm, ranking=flat)
    seen = Estimates(decay=1.0)
    for ids in prompts:
        ranker = flat.start(decay=1.0)
        decode(lm.base, ids, new_tokens, replace(plan, ranking=_Recording(flat.cost, ranker=ranker)))
        for key, (hits, trials) in ranker.estimates.counts.items():
            counts = seen.counts.setdefault(key, [0.0, 0.0])
            counts[0] += hits
            counts[1] += trials
    rates = seen.rates_seen()
    signature = weights_signature(lm.measured)
    write_json(Path(folder) / PRIORS, {"signature": signature, "prompts": len(prompts), "rates": rates})
    return rates


def explain_ranking(
    lm, plan, ids: torch.LongTensor, new_tokens: int
) -> tuple[list[tuple[str, float, float, float]], float]:
    """How one decode of `ids` under `plan` (a ranked plan of `lm`) moves the estimates: for every
    source it tried, (name, prior, estimate after, trials since decayed), and the mean candidates a call."""
    ranker = plan.ranking.start()
    decode(lm.base, ids, new_tokens, replace(plan, ranking=_Recording(plan.ranking.cost, ranker=ranker)))
    rows = []
    for (drafter, key), (_, trials) in sorted(ranker.estimates.counts.items()):
        source = Source(drafter, key, own_prior(drafter, key))
        prior = ranker.estimates.prior(source)
        rows.append((source_name(drafter, key), prior, ranker.estimates.chance(source), trials))
    return rows, sum(ranker.sizes) / max(1, len(ranker.sizes))


@dataclass(frozen=True)
class _Recording(Ranking):
    """A ranking whose every sequence is `ranker` (one decode at a time), so its counts can be read after."""

    ranker: Ranker | None = None

    def start(self, decay: float | None = None) -> Ranker:
        return self.ranker
