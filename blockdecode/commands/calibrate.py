"""`blockdecode calibrate`: which tree budget decodes fastest on this machine (what --tree auto uses)."""

from __future__ import annotations

import argparse
import sys

import torch

from blockdecode.builtin import DEFAULT_MODEL
from blockdecode.commands.flags import (
    DRAFTER_CHOICES,
    positive_int,
)
from blockdecode.core.hf import DTYPE_CHOICES, dtype_for


def run(args: argparse.Namespace) -> None:
    from blockdecode.commands.demo import PROMPTS
    from blockdecode.decoding.calibrate import calibrate
    from blockdecode.decoding.stored import cache_file
    from blockdecode.model import load

    model, tokenizer = load(args.model, dtype_for(args.dtype), args.k)
    prompts = model.prompts or [tokenizer(t, return_tensors="pt").input_ids for t in PROMPTS]
    result = calibrate(model, prompts, args.drafter, args.k, refresh=args.refresh)
    chosen = f"trees of {result.tree}" if result.tree else "the chain"
    if not result.predicted:  # nothing could be measured: what --tree auto does instead, and why
        print(f"--tree auto decodes with {result.drafter}, {chosen}: {result.note}")
        return
    print(f"predicted tokens/s ({result.statistics} acceptance statistics, this machine's costs):")
    for name, curve in result.predicted.items():
        best = max(curve, key=curve.get)
        shown = sorted({"0", "1", "2", "4", "8", "16", "32", "64", best} & set(curve), key=int)
        print(
            f"{name:>12}: "
            + ", ".join(f"{'chain' if b == '0' else b}: {curve[b]:.0f}{'*' * (b == best)}" for b in shown)
        )
    print(f"\n--tree auto decodes with {result.drafter}, {chosen}, for {result.key} (chosen in {result.seconds:.1f} s)")
    if not result.note:  # else calibrate has said why it is not cached
        print(f"cached in {cache_file()}", file=sys.stderr)
    print_ranking(model, prompts[0], args.drafter, args.k)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure which tree budget decodes fastest here (what --tree auto uses)",
        description="Predicts the tokens/s of the chain and of every tree budget 1..64 for each drafter from "
        "acceptance statistics (shipped with a built-in model, else measured on its prompts) and this machine's "
        "cost curve t(q), and caches the fastest for this model, dtype, machine, threads, drafter and k.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="saved BlockwiseLM or transformers folder, or a GGUF file")
    p.add_argument("--drafter", choices=DRAFTER_CHOICES, default="auto", help="auto: choose the drafters too")
    p.add_argument("--k", type=positive_int, default=None, help="block size (default: the heads' k)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    p.add_argument("--refresh", action="store_true", help="measure again even if cached")
    p.set_defaults(func=run)


def print_ranking(model, ids: torch.LongTensor, drafter: str, k: int | None, new_tokens: int = 96) -> None:
    """What --tree expected starts from, and how one decode of `ids` moves it."""
    from blockdecode.decoding.calibrate import explain_ranking
    from blockdecode.decoding.estimates import PRIORS

    plan = model.plan(drafter, k, "expected", prompts=[ids])
    rows, mean_tree = explain_ranking(model, plan, ids, new_tokens)
    print(
        f"\n--tree expected ranks each call's candidates by their chance to stand, from the priors in {PRIORS} "
        f"beside the model where it has one (else the drafters' own), moved by what stands. A decode of "
        f"{new_tokens} tokens of the first prompt held {mean_tree:.1f} candidates a call and moved them:"
    )
    print(f"{'source':24} {'prior':>6} {'after':>6} {'trials':>7}")
    for name, prior, after, trials in rows:
        print(f"{name:24} {prior:6.2f} {after:6.2f} {trials:7.1f}")
