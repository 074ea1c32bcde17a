"""`blockdecode bench`: every method on the same model and prompts, side by side, with plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blockdecode.commands.flags import (
    comma_names,
    listed,
    positive_int,
    temperature,
    tree_budgets,
)
from blockdecode.core.hf import DTYPE_CHOICES


def run(args: argparse.Namespace) -> None:
    from blockdecode.bench import (
        PRESETS,
        acceptance_markdown,
        batch_markdown,
        core_markdown,
        markdown,
        measure_bench,
        sampling_markdown,
        write_report,
    )

    preset = "quick" if args.quick else args.preset
    chosen = {"model": args.model, "draft": args.draft, "prompts": args.prompts}
    if args.dtype:  # the core study has no model of its own: its dtype is the scripted model's
        chosen["system_dtype" if preset == "core" else "dtype"] = args.dtype
    chosen["acceptance"] = [a for a in (args.acceptance or "").split(",") if a]
    if args.trees:
        chosen["trees"] = [t for t in args.trees if t is not None]
    for name in ("ks", "temperatures", "batches", "drafters"):
        if getattr(args, name) is not None:
            chosen[name] = getattr(args, name)
    if args.corpus:
        chosen["corpus"] = tuple(args.corpus)
    for name in ("new_tokens", "n_prompts", "repeats", "out", "device"):
        if getattr(args, name):
            chosen[name] = getattr(args, name)
    if args.no_system:
        chosen["system"] = False
    if args.static_cache:
        chosen["static_cache"] = True
    cfg = PRESETS[preset](**chosen)
    report = measure_bench(cfg)  # printed before it is written: a folder that fails then loses no result
    if report["methods"]:
        print(markdown(report))
    if report.get("sampling"):
        print(f"\n{sampling_markdown(report['sampling'])}")
    if report.get("batches"):
        print(f"\n{batch_markdown(report['batches'])}")
    if cfg.acceptance:
        print("\nApproximate acceptance: NOT the exact greedy output; what each rule costs:\n")
        print(acceptance_markdown(report))
    if "system_ceiling" in report:
        print(f"\nScripted drafters (the decode loop alone):\n\n{core_markdown(report['system_ceiling'])}")
    write_report(report, Path(cfg.out))
    print(f"\nresults, plots and tables in {cfg.out} ({report['seconds']:.0f} s)", file=sys.stderr)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="blockdecode against greedy, prompt lookup and assisted generation, side by side",
        description="Every method on the same model, prompts, dtype and threads, in one process, with interleaved "
        "rounds. Writes bench.json, speedup.png, blocks.png, batches.png, cost.png and table.md to --out. "
        "Presets: default; quick (about two minutes); core (the decode loop alone: scripted drafters on a "
        "GPT-2-small-sized model, dynamic and static cache).",
    )
    p.add_argument("--preset", choices=("default", "quick", "core"), default="default")
    p.add_argument("--quick", action="store_true", help="the same as --preset quick")
    p.add_argument("--model", default=None, help="BlockwiseLM or transformers folder, or GGUF (default: built-in)")
    p.add_argument("--draft", default=None, help="draft model for assisted generation (default: built-in draft)")
    p.add_argument("--prompts", default=None, help="JSON list of prompt texts (default: held-out code)")
    p.add_argument(
        "--k",
        dest="ks",
        type=listed(positive_int),
        default=None,
        help="block sizes, comma-separated (default 2,4,6,8,10; --quick 2,4,8)",
    )
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="default auto (core: fp32)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/bench, bench_quick or core)")
    p.add_argument("--new-tokens", type=positive_int, default=None)
    p.add_argument("--n-prompts", type=positive_int, default=None)
    p.add_argument("--repeats", type=positive_int, default=None)
    p.add_argument("--acceptance", default=None, help="approximate rules to measure too, e.g. topk:2,min-block:3")
    p.add_argument(
        "--temperatures",
        type=listed(temperature),
        default=None,
        help="sampling temperatures, comma-separated (default 0.7,1.0; quick 0.7), or off",
    )
    p.add_argument(
        "--batches",
        type=listed(positive_int),
        default=None,
        help="batch sizes against transformers' batched greedy, comma-separated (default 1,4,8; quick 4), or off",
    )
    p.add_argument(
        "--trees",
        type=tree_budgets,
        default=None,
        help="tree budgets to measure, comma-separated: N, auto (default) or expected, off",
    )
    p.add_argument(
        "--drafters",
        type=comma_names,
        default=None,
        help="drafters measured, comma-separated: heads, ngram or suffix, each a chain at every k and a tree, or "
        "several joined by + sharing a tree, e.g. heads,ngram,suffix,heads+suffix (default heads,ngram,heads+ngram)",
    )
    p.add_argument(
        "--corpus",
        action="append",
        metavar="PATH",
        help="a file or folder of text the --drafters with suffix lookup also draft from (repeatable; indexed once, "
        "cached in ~/.cache/blockdecode/corpus); each prompt is measured alone, no earlier output remembered",
    )
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument("--no-system", action="store_true", help="skip the GPT-2-small-sized scripted-drafter study")
    p.add_argument(
        "--static-cache", action="store_true", help="also greedy and the chains at the largest k with a static cache"
    )
    p.set_defaults(func=run)
