#!/usr/bin/env python
"""What a call of each decode method costs beside its forward (issue 48's starting point): for the default and
the drafters alone, the wall time a call, the part of it inside the model's forward (timed from outside, as
`blockdecode.decoding.timing.metered` does), the tokens it gains and verifies, and the bare forward t(q) it is held
against. The loop's own share is what a leaner loop can remove; a profile of the default names where it goes.

    python benchmarks/call_cost.py --third-party 8 --prompt-len 300 --new-tokens 96 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch
from paper_table import THIRD_PARTY, third_party_prompts

from blockdecode import DEFAULT_MODEL, load
from blockdecode.core.hardware import auto_dtype
from blockdecode.core.io import save_figure, write_json
from blockdecode.decoding.ranking import Ranker
from blockdecode.decoding.timing import forward_cost, metered

METHODS = {  # name: (drafter, tree) as model.plan takes them
    "default": ("auto", "default"),
    "n-gram chain": ("ngram", None),
    "n-gram tree 16": ("ngram", 16),
    "heads chain": ("heads", None),
}
EAGLE3 = {"eagle3 chain": ("eagle3", None)}  # with --eagle3: the model's EAGLE-3 drafter's chain, at its trained depth
PARTS = {  # where the default's time goes: the functions a profile reads, by what they do
    "forward": ("adapter.py", "score"),
    "predict": ("loop.py", "predict"),
    "rank": ("ranking.py", "_rank"),
    "accept": ("loop.py", "accept"),
    "cut the cache": ("adapter.py", "keep_paths"),
    "tree mask": ("adapter.py", "_attention_mask"),
}
COST_QS = (1, 4, 8, 12, 16, 24, 32, 64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--third-party", type=int, default=8, help="prompts from code the built-in model never saw")
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eagle3", action="store_true", help="also the chain of the model's EAGLE-3 drafter")
    p.add_argument("--profile", action="store_true", help="also profile the default: where its time goes")
    p.add_argument("--out", default="benchmarks/results/call_cost.json")
    args = p.parse_args(argv)
    for name in ("third_party", "prompt_len", "new_tokens", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    return args


def decode_all(model, prompts: list[torch.LongTensor], plan, new_tokens: int) -> dict:
    """Every prompt decoded once through `plan`: a call's figures over all of them, each prompt's prefill
    counted as a call (the tokens verified a call: the decode's calls alone), and a decode call's own, the
    prefill's forward left out (`decode_ms_per_call`)."""
    seconds = forward = calls = tokens = verified = prefill = 0.0
    for ids in prompts:
        with metered(model.base) as (meter,):
            start = time.perf_counter()
            out = model.generate(ids, new_tokens, plan=plan)
            seconds += time.perf_counter() - start
        forward += meter.seconds
        prefill += meter.each[0]
        calls += meter.calls
        tokens += out.stats.new_tokens
        verified += sum(out.stats.verified)
    decode_calls = calls - len(prompts)  # each prompt's prefill is one call
    return {
        "decode_ms_per_call": 1000 * (seconds - prefill) / decode_calls,
        "ms_per_call": 1000 * seconds / calls,
        "forward_ms_per_call": 1000 * forward / calls,
        "loop_ms_per_call": 1000 * (seconds - forward) / calls,
        "tokens_per_call": tokens / calls,
        "verified_per_call": verified / decode_calls,
        "ms_per_token": 1000 * seconds / tokens,
    }


def profile_default(model, prompts: list[torch.LongTensor], plan, new_tokens: int) -> dict[str, float]:
    """Each part's share of the default's decode under cProfile (which inflates Python's share)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for ids in prompts:
        model.generate(ids, new_tokens, plan=plan)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    cumulative = {(Path(f).name, fn): entry[3] for (f, _, fn), entry in stats.items()}
    total = cumulative[("loop.py", "decode")]
    return {part: cumulative.get(where, 0.0) / total for part, where in PARTS.items()}


def plot(report: dict, png: Path) -> None:
    """Each method's ms a call, split into its forward and the loop around it, beside t(q)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = list(report["methods"])
    rows = [report["methods"][n] for n in names]
    ax.bar(names, [r["forward_ms_per_call"] for r in rows], label="in the forward")
    ax.bar(names, [r["loop_ms_per_call"] for r in rows], bottom=[r["forward_ms_per_call"] for r in rows],
           label="the loop around it")  # fmt: skip
    for q in (1, 16):
        ax.axhline(report["forward_ms"][q], ls="--", lw=0.8, color="grey")
        ax.annotate(f"t({q})", (len(names) - 0.5, report["forward_ms"][q]), fontsize=8, va="bottom")
    ax.set_ylabel("ms a call")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("A decode call: its forward and its loop")
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, dtype=auto_dtype())
    prompts = third_party_prompts(tokenizer, THIRD_PARTY, args.third_party, args.prompt_len)
    asked = METHODS | (EAGLE3 if args.eagle3 else {})
    plans = {name: model.plan(drafter, None, tree, prompts=prompts[:1]) for name, (drafter, tree) in asked.items()}
    for plan in plans.values():  # warm: the first call of each
        model.generate(prompts[0], 8, plan=plan)
    methods = {name: decode_all(model, prompts, plan, args.new_tokens) for name, plan in plans.items()}
    for name, plan in plans.items():
        methods[name]["setting"] = f"{plan.drafter_name}, {plan.setting}"
    context = torch.cat([prompts[0], prompts[0][:, : args.new_tokens // 2]], dim=1)
    cost = forward_cost(model.base, context, COST_QS, reps=7)
    curve = Ranker(cost)  # t(q) between the measured points
    for r in methods.values():  # a decode call against a bare forward of as many tokens over the same context
        r["bare_forward_ms"] = 1000 * curve.seconds(round(r["verified_per_call"]))
        r["vs_bare_forward"] = r["decode_ms_per_call"] / r["bare_forward_ms"]
    report = {
        "model": str(args.model),
        "dtype": str(model.base.dtype).removeprefix("torch."),
        "threads": args.threads,
        "prompts": len(prompts),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "forward_ms": {q: 1000 * t for q, t in cost.items()},
        "methods": methods,
    }
    if args.profile:
        report["default_profile"] = profile_default(model, prompts, plans["default"], args.new_tokens)
    out = Path(args.out)
    write_json(out, report)
    plot(report, out.with_suffix(".png"))
    for name, r in methods.items():
        print(f"{name:>15}: {r['ms_per_call']:.2f} ms a call ({r['forward_ms_per_call']:.2f} in the forward; "
              f"{r['decode_ms_per_call']:.2f} without the prefill, {r['vs_bare_forward']:.2f}x a bare forward), "
              f"{r['tokens_per_call']:.2f} tokens, {r['verified_per_call']:.1f} verified, "
              f"{r['ms_per_token']:.2f} ms a token ({r['setting']})")  # fmt: skip
    print("t(q) ms:", ", ".join(f"{q}: {t:.2f}" for q, t in report["forward_ms"].items()))
    if args.profile:
        print("the default's decode:", ", ".join(f"{p} {100 * s:.1f} %" for p, s in report["default_profile"].items()))
    return report


if __name__ == "__main__":
    main()
