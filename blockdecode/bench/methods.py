"""The decoders a benchmark compares, each run on one prompt and counted the same way from outside,
and the rounds that run them side by side.

Every (prompt, repeat) round runs every method once, in an order rotated from round to round, so
machine drift hits all of them alike; a method's speedup is the median over rounds of
t(greedy) / t(method) within the round."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from blockdecode.decoding.adapter import decoder_prompt, sequence_logits
from blockdecode.decoding.healing import Healing
from blockdecode.decoding.loop import decode
from blockdecode.decoding.plan import DecodePlan
from blockdecode.decoding.reference import first_divergence, greedy_generate
from blockdecode.decoding.timing import metered, sync


@dataclass
class Run:
    """One method on one prompt: its output, wall time, model calls and the time inside them."""

    sequence: list[int]
    seconds: float
    calls: int
    draft_calls: int = 0
    block_sizes: list[int] = field(default_factory=list)
    forward_seconds: float = 0.0
    verified: list[int] = field(default_factory=list)  # tokens each call scored
    supplied: dict[str, int] = field(default_factory=dict)  # accepted proposals by the drafter that made them


@dataclass
class Method:
    name: str
    family: str  # greedy | prompt_lookup | assisted | heads | ngram | system
    run: Callable[[torch.LongTensor], Run]
    k: int | None = None
    acceptance: str = "exact"

    @property
    def exact(self) -> bool:
        return self.acceptance == "exact"


def transformers_run(
    model: PreTrainedModel, ids: torch.LongTensor, new_tokens: int, stop_at_eos: bool = False, **generate_kwargs
) -> Run:
    """transformers' generate (greedy, or with prompt_lookup_num_tokens / assistant_model), EOS off
    so that every method makes the same number of tokens, or (`stop_at_eos`, as a translation
    ends) the model's own EOS."""
    assistant = generate_kwargs.get("assistant_model")
    eos = {} if stop_at_eos else {"eos_token_id": [], "min_new_tokens": new_tokens}
    with metered(model, *([assistant] if assistant else [])) as meters:
        start = time.perf_counter()
        out = greedy_generate(model, ids, new_tokens, **eos, **generate_kwargs)
        sync(ids.device)
        seconds = time.perf_counter() - start
    draft_calls = meters[1].calls if assistant else 0
    return Run(new_part(model, ids, out), seconds, meters[0].calls, draft_calls, [], meters[0].seconds)


def new_part(model: PreTrainedModel, ids: torch.LongTensor, out: torch.LongTensor) -> list[int]:
    """The generated tokens of `out`: after the prompt, or after an encoder-decoder's start token."""
    return out[0, decoder_prompt(model, ids)[1].shape[1] :].tolist()


def blockwise_run(
    model: PreTrainedModel, ids: torch.LongTensor, new_tokens: int, plan: DecodePlan, healing: Healing | None = None
) -> Run:
    """blockdecode as `plan` says (with `healing`, if given, for these ids), timed and counted from outside
    exactly as `transformers_run` is."""
    with metered(model) as meters:
        start = time.perf_counter()
        out = decode(model, ids, new_tokens, plan, healing=healing)
        sync(ids.device)
        seconds = time.perf_counter() - start
    sequence = new_part(model, ids, out.sequences)
    stats = out.stats
    return Run(
        sequence, seconds, meters[0].calls, 0, stats.block_sizes, meters[0].seconds, stats.verified, stats.supplied
    )


def measure(
    methods: list[Method], prompts: list[torch.LongTensor], repeats: int, show: bool, warmup: bool = True
) -> dict[str, dict]:
    """Warm every method up (unless told not to), then run rounds of all methods in rotated order.
    The first method is the baseline every speedup is taken against."""
    if warmup:
        for m in methods:
            m.run(prompts[0])
    baseline = methods[0].name
    runs: dict[str, list[Run]] = {m.name: [] for m in methods}
    ratios: dict[str, list[float]] = {m.name: [] for m in methods}
    rounds = [(p, r) for r in range(repeats) for p in range(len(prompts))]
    for i, (p, _) in enumerate(tqdm(rounds, desc="bench rounds", disable=not show)):
        order = methods[i % len(methods) :] + methods[: i % len(methods)]
        times = {}
        for m in order:
            run = m.run(prompts[p])
            runs[m.name].append(run)
            times[m.name] = run.seconds
        for m in methods:
            ratios[m.name].append(times[baseline] / times[m.name])
    reference = {p: runs[baseline][p].sequence for p in range(len(prompts))}
    results = {}
    for m in methods:
        rs = runs[m.name]
        tokens = sum(len(r.sequence) for r in rs)
        calls = sum(r.calls for r in rs)
        outputs = rs[: len(prompts)]
        agreement = [_agreement(r.sequence, reference[p]) for p, r in enumerate(outputs)]
        prefix = [_prefix_agreement(r.sequence, reference[p]) for p, r in enumerate(outputs)]
        results[m.name] = {
            "family": m.family,
            "k": m.k,
            "acceptance": m.acceptance,
            "exact_method": m.exact,
            "tokens_per_s": statistics.median(len(r.sequence) / r.seconds for r in rs),
            "speedup": statistics.median(ratios[m.name]),
            "speedup_per_round": ratios[m.name],
            "calls_per_token": calls / tokens,
            "tokens_per_call": tokens / calls,
            "draft_calls_per_token": sum(r.draft_calls for r in rs) / tokens,
            # wall time outside the model's forward, per call: the decoder's own loop
            "overhead_ms_per_call": 1000 * sum(r.seconds - r.forward_seconds for r in rs) / calls,
            "forward_share": sum(r.forward_seconds for r in rs) / sum(r.seconds for r in rs),
            "identical_to_greedy": all(a == 1.0 for a in prefix),
            "token_agreement": statistics.mean(agreement),
            "prefix_agreement": statistics.mean(prefix),
            "outputs": [r.sequence for r in outputs],
        }
        if m.k is not None:
            results[m.name].update(block_stats(rs, m.k))
    return results


def block_stats(runs: list[Run], k: int) -> dict:
    """Mean accepted block, its histogram, and per head the share of calls that reached it."""
    blocks = [b for r in runs for b in r.block_sizes]
    hist = [blocks.count(b) for b in range(1, k + 1)]
    reached = [sum(1 for b in blocks if b >= i) / max(1, len(blocks)) for i in range(2, k + 1)]
    # Head i's own rate: accepted when heads 2..i-1 were.
    own = [reached[i] / reached[i - 1] if i and reached[i - 1] else reached[i] for i in range(len(reached))]
    verified = [q for r in runs for q in r.verified]
    supplied: dict[str, int] = {}
    for r in runs:
        for name, n in r.supplied.items():
            supplied[name] = supplied.get(name, 0) + n
    total = sum(supplied.values())
    return {
        "supplied_share": {name: n / total for name, n in supplied.items()} if total else {},
        "mean_block_size": statistics.mean(blocks) if blocks else 0.0,
        "mean_verified": statistics.mean(verified) if verified else float(k),
        "block_histogram": hist,
        "head_reached": reached,
        "head_acceptance": own,
    }


def _agreement(ours: list[int], greedy: list[int]) -> float:
    """Share of positions holding greedy's token."""
    return sum(a == b for a, b in zip(ours, greedy)) / max(1, len(greedy))


def _prefix_agreement(ours: list[int], greedy: list[int]) -> float:
    """Share of greedy's tokens reproduced before the first difference (1.0: identical)."""
    if len(ours) == len(greedy) and ours == greedy:
        return 1.0
    same = next((i for i, (a, b) in enumerate(zip(ours, greedy)) if a != b), min(len(ours), len(greedy)))
    return same / max(1, len(greedy))


@torch.inference_mode()
def continuation_loss(base: PreTrainedModel, prompt: torch.LongTensor, tokens: list[int]) -> float:
    """The base model's mean cross-entropy (nats/token) of a generated continuation (for an
    encoder-decoder, of the decoder's tokens given the source)."""
    source, start = decoder_prompt(base, prompt)
    ids = torch.cat([start, torch.tensor([tokens], device=prompt.device)], dim=1)
    logits = sequence_logits(base, ids, source)[0, start.shape[1] - 1 : -1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, start.shape[1] :]))


def add_quality(results: dict[str, dict], tokenizer, base: PreTrainedModel, prompts: list[torch.LongTensor]) -> None:
    """chrF of each method's text against greedy's (sacrebleu) and the base model's loss on it."""
    from sacrebleu.metrics import CHRF

    chrf = CHRF()
    greedy = results["greedy"]["outputs"]
    refs = [tokenizer.decode(t) for t in greedy]
    for r in results.values():
        hyps = [tokenizer.decode(t) for t in r["outputs"]]
        r["chrf"] = chrf.corpus_score(hyps, [refs]).score
        r["loss"] = statistics.mean(continuation_loss(base, p, t) for p, t in zip(prompts, r["outputs"]))
        if r["exact_method"] and not r["identical_to_greedy"]:
            r["divergences"] = divergences(base, prompts, greedy, r["outputs"])


def divergences(
    base: PreTrainedModel, prompts: list[torch.LongTensor], greedy: list[list[int]], outputs: list[list[int]]
) -> list[dict]:
    """Where an exact method's output first parts from greedy's, per differing prompt, and whether
    greedy's own top-2 logit gap there is within the dtype's rounding: a near-tie that a k-token
    pass may resolve the other way from a 1-token pass, not a decoding error."""
    found = []
    for i, (prompt, ref, ours) in enumerate(zip(prompts, greedy, outputs)):
        source, start = decoder_prompt(base, prompt)
        as_ids = [torch.cat([start, torch.tensor([t], device=prompt.device)], dim=1) for t in (ref, ours)]
        d = first_divergence(base, *as_ids, source=source)
        if d is not None:
            found.append(
                {"prompt": i, "position": d.position - start.shape[1], "top2_gap": d.top2_gap,
                 "near_tie": d.near_tie(base.dtype)}
            )  # fmt: skip
    return found


def add_ceilings(results: dict[str, dict], cost: dict[int, float]) -> None:
    """Each blockwise row's ceiling k̂ · t(1) / t(q) and its efficiency, measured / ceiling: q is k
    for a chain, and for a tree the tokens it verified per call on average."""
    for r in results.values():
        if not r.get("k") or "mean_block_size" not in r:
            continue
        q = min(round(r["mean_verified"]), max(cost)) if r["family"].endswith("tree") else r["k"]
        if q in cost:
            r["ceiling"] = r["mean_block_size"] * cost[1] / cost[q]
            r["efficiency"] = r["speedup"] / r["ceiling"]
