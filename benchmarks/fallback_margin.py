#!/usr/bin/env python
"""Whether the default's fallback to one part alone pays (issue 57): the default with each fallback margin side by
side, in turns on the same windows, each call of a sequence judged against its cheapest part as always; a sequence
falls back once that part alone gained `margin` times as much a second over 8 calls (`ranking.FALLBACK_MARGIN`;
"never": no fallback at all).

On the built-in code model: `lookup_study`'s unseen third-party code, 12 windows of 64 and 12 of 300 tokens; with
`--gguf` (Gemma 3 270M: `--gguf real`): `real.py`'s 6 code and 4 prose windows of 256 tokens. Times are the best of
`--rounds` interleaved runs; figures are, for each margin, the median and worst of its speed against the first
margin's window by window, its total time against the first's, and how many sequences fell back.

    python benchmarks/fallback_margin.py                 # the built-in model, about 4 min on 2 cores
    python benchmarks/fallback_margin.py --gguf real     # Gemma 3 270M, about 6 min
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from lookup_depth import load_model, plot_bars, report_head, results_path, window_args, windows_of
from lookup_study import Timed, Window, best_of, speed, timed

from blockdecode.bench.report import write_results
from blockdecode.decoding import ranking


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--margins", default="1.0,1.3,never", help="fallback margins, each compared with the first")
    window_args(p, rounds=3)
    p.add_argument("--out", type=Path, default=None, help="default: results/fallback_margin[_real].json")
    return p.parse_args(argv)


def margin_of(name: str) -> float:
    """A margin as --margins spells it: a number > 0, or "never" (no fallback)."""
    try:
        margin = math.inf if name == "never" else float(name)
    except ValueError:
        margin = 0.0
    if not margin > 0:
        raise SystemExit(f"error: --margins takes numbers > 0 or 'never', got {name!r}")
    return margin


def measure(lm, windows: list[Window], margins: list[str], n: int, rounds: int) -> tuple[list[dict[str, Timed]], dict]:
    """The default with each margin on every window, best of `rounds` interleaved runs; and how many sequences fell
    back under each margin, on average over the rounds."""
    plan = lm.plan(prompts=[windows[0].ids])
    fell = dict.fromkeys(margins, 0)

    def run(w: Window, margin: str):
        ranking.FALLBACK_MARGIN = margin_of(margin)  # read as each sequence is judged
        out = lm.generate(w.ids, n, plan=plan, remember=False)
        fell[margin] += "one part alone" in out.stats.note
        return out

    kept = ranking.FALLBACK_MARGIN
    try:
        for margin in margins:  # warm: first calls, the ranking's cost curve
            run(windows[0], margin)
        fell.update(dict.fromkeys(margins, 0))
        rows = []
        for w in windows:
            runs: dict[str, list[Timed]] = {m: [] for m in margins}
            for _ in range(rounds):
                for margin in margins:
                    runs[margin].append(timed(lm.base, w.ids.shape[1], run, w, margin))
            rows.append(best_of(runs))
    finally:
        ranking.FALLBACK_MARGIN = kept
    return rows, {m: f / rounds for m, f in fell.items()}  # a sequence's choice may differ from round to round


def summarize(rows: list[dict[str, Timed]], margins: list[str], fell: dict) -> dict:
    first = margins[0]
    out = {"windows": len(rows), "fell_back": fell, "vs_first": {}}
    for margin in margins[1:]:
        ratios = [speed(r, margin, first) for r in rows]
        total = sum(r[first].seconds for r in rows) / sum(r[margin].seconds for r in rows)
        out["vs_first"][margin] = {"median": statistics.median(ratios), "worst": min(ratios), "best": max(ratios),
                                   "total": total}  # fmt: skip
    return out


def plot(report: dict, png: Path) -> None:
    sets = list(report["sets"])
    bars = {f"margin {m}": [report["sets"][s]["vs_first"][m]["total"] for s in sets] for m in report["margins"][1:]}
    plot_bars(report, sets, bars, f"total speed against margin {report['margins'][0]}", "the fallback's margin", png)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    margins = args.margins.split(",")
    for margin in margins:
        margin_of(margin)  # each checked before anything loads
    lm, tokenizer, n = load_model(args)
    report = report_head(args, n, margins=margins)
    every: list[dict[str, Timed]] = []
    fell_all = dict.fromkeys(margins, 0)
    for name, windows in windows_of(args, tokenizer).items():
        rows, fell = measure(lm, windows, margins, n, args.rounds)
        report["sets"][name] = summarize(rows, margins, fell)
        every += rows
        fell_all = {m: fell_all[m] + fell[m] for m in margins}
        found = report["sets"][name]["vs_first"]
        print(f"{name}: " + ", ".join(f"margin {m} {v['median']:.3f}x median, {v['total']:.3f}x total"
                                      for m, v in found.items()))  # fmt: skip
    report["sets"]["all"] = summarize(every, margins, fell_all)
    out = results_path(args, "fallback_margin")
    write_results(report, out, plot)
    return report


if __name__ == "__main__":
    main()
