#!/usr/bin/env python
"""How deep the default's lookup drafts (issue 57): the ranked default at several k side by side, each call's tree
sized by the cost curve, the heads guessing their own k-1 and a lookup the rest; with the lookup chains alone at the
heads' k and at the deepest k, and `transformers`' greedy and prompt lookup, on the same windows in turns.

On the built-in code model: unseen third-party code, 12 windows of 64 and 12 of 300 tokens (`lookup_study`'s);
with `--gguf` (Gemma 3 270M by default where its package is installed): `real.py`'s 6 code and 4 prose windows of
256 tokens. Times are the best of `--rounds` interleaved runs; figures are medians over windows of each method's
speed against greedy's, and of each k's against the first k's (with the worst window).

    python benchmarks/lookup_depth.py                 # the built-in model, about 2 min on 2 cores
    python benchmarks/lookup_depth.py --gguf real     # Gemma 3 270M, about 4 min
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from lookup_study import LOOPS, Timed, Window, best_of, code_windows, loops, speed, timed, transformers_methods
from real import prose_windows, real_model_file

from blockdecode import DEFAULT_MODEL, load
from blockdecode.bench.report import cpu_name, write_results
from blockdecode.core.io import save_figure

RESULTS = Path(__file__).parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ks", default="8,12,16", help="the default's k, compared with the first")
    window_args(p, rounds=2)
    p.add_argument("--out", type=Path, default=None, help="default: results/lookup_depth[_real].json")
    return p.parse_args(argv)


def window_args(p: argparse.ArgumentParser, rounds: int) -> None:
    """The model, windows and timing settings this study shares with `fallback_margin` and `sampling_speed`."""
    p.add_argument("--gguf", default=None, help="a GGUF file, or 'real' for Gemma 3 270M (default: the built-in model)")
    p.add_argument("--windows", type=int, default=12, help="built-in model: code windows at each prompt length")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=None, help="default: 128 on the built-in model, 96 on a GGUF")


def load_model(args: argparse.Namespace) -> tuple[object, object, int]:
    """The model `window_args` name (bf16, at their thread count), its tokenizer, and the new tokens a window."""
    if args.gguf == "real":
        args.gguf = str(real_model_file(None))
    torch.set_num_threads(args.threads)
    lm, tokenizer = load(args.gguf or DEFAULT_MODEL, dtype=torch.bfloat16)
    lm.eval()
    return lm, tokenizer, args.new_tokens or (128 if args.gguf is None else 96)


def report_head(args: argparse.Namespace, n: int, **settings) -> dict:
    """What a study of `window_args`' model and windows opens its report with, its own `settings` after, then its
    window sets (filled by the study)."""
    model = Path(args.gguf).name if args.gguf else "built-in code model"
    return {"model": model, "machine": cpu_name(), "dtype": "bf16", "threads": args.threads, "new_tokens": n,
            "rounds": args.rounds, **settings, "sets": {}}  # fmt: skip


def results_path(args: argparse.Namespace, study: str) -> Path:
    """Where a study writes its report: --out, else results/<study>.json (<study>_real.json on a GGUF)."""
    return args.out or RESULTS / (f"{study}.json" if args.gguf is None else f"{study}_real.json")


def windows_of(args: argparse.Namespace, tokenizer) -> dict[str, list[Window]]:
    """The sets of windows, by name: prompt lengths on the built-in model, kinds on a GGUF."""
    if args.gguf is None:
        return {str(n): code_windows(tokenizer, args.windows, n) for n in (64, 300)}
    return {"code": code_windows(tokenizer, 6, 256), "prose": prose_windows(tokenizer, 4, 256)}


def measure(lm, windows: list[Window], ks: list[int], n: int, rounds: int) -> list[dict[str, Timed]]:
    """Every method on every window, best of `rounds` interleaved runs."""
    methods = transformers_methods(lm.base, n)
    lookup = "suffix" if "suffix" in lm.plan(prompts=[windows[0].ids]).drafter_name else "ngram"
    settings = {f"default k={k}": ("auto", k, "default") for k in ks}
    settings |= {f"{lookup} chain k={k}": (lookup, k, None) for k in (ks[0], ks[-1])}
    for name, (drafter, k, tree) in settings.items():
        plan = lm.plan(drafter, k, tree, prompts=[windows[0].ids])
        methods[name] = lambda w, plan=plan: lm.generate(w.ids, n, plan=plan, remember=False)
    for method in methods.values():  # warm: first calls, the ranking's cost curve
        method(windows[0])
    rows = []
    for w in windows:
        runs: dict[str, list[Timed]] = {name: [] for name in methods}
        for _ in range(rounds):
            for name, method in methods.items():
                runs[name].append(timed(lm.base, w.ids.shape[1], method, w))
        rows.append(best_of(runs))
    return rows


def summarize(rows: list[dict[str, Timed]], windows: list[Window], ks: list[int]) -> dict:
    first = f"default k={ks[0]}"
    out = {
        "windows": len(rows),
        "looping": sum(
            loops(r["transformers greedy"].tokens, w.ids[0].tolist()) > LOOPS for r, w in zip(rows, windows)
        ),
        "median_vs_greedy": {m: statistics.median(speed(r, m, "transformers greedy") for r in rows) for m in rows[0]},
        "tokens_per_call": {m: sum(len(r[m].tokens) for r in rows) / sum(r[m].calls for r in rows) for m in rows[0]},
        "vs_first_k": {},
    }
    for k in ks[1:]:
        ratios = [speed(r, f"default k={k}", first) for r in rows]
        out["vs_first_k"][str(k)] = {"median": statistics.median(ratios), "worst": min(ratios)}
    return out


def plot(report: dict, png: Path) -> None:
    sets = list(report["sets"])
    methods = list(report["sets"][sets[0]]["median_vs_greedy"])
    bars = {name: [report["sets"][name]["median_vs_greedy"][m] for m in methods] for name in sets}
    plot_bars(report, methods, bars, "median speed against transformers' greedy", "the default's depth", png,
              size=(10, 4.2), rotation=30, ha="right", fontsize=8)  # fmt: skip


def plot_bars(report: dict, groups: list[str], bars: dict[str, list[float]], ylabel: str, what: str, png: Path,
              size: tuple[float, float] = (8, 4), **ticks) -> None:  # fmt: skip
    """The studies' plot: for each label of `bars`, a bar in every group, a line at 1.0; titled with `what` and the
    report's model, dtype, threads and machine. `ticks`: how the groups' names are set (matplotlib's text options)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    width = 0.8 / len(bars)
    for j, (label, values) in enumerate(bars.items()):
        ax.bar([i + j * width for i in range(len(groups))], values, width, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + width * (len(bars) - 1) / 2 for i in range(len(groups))], groups, **ticks)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{report['model']}, {report['dtype']}, {report['threads']} threads: {what}", fontsize=9)
    ax.legend(fontsize=8)
    fig.suptitle(report["machine"], fontsize=8)
    fig.tight_layout()
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    lm, tokenizer, n = load_model(args)
    sets = windows_of(args, tokenizer)
    report = report_head(args, n, ks=ks)
    every: tuple[list, list] = ([], [])
    for name, windows in sets.items():
        rows = measure(lm, windows, ks, n, args.rounds)
        report["sets"][name] = summarize(rows, windows, ks)
        every[0].extend(rows)
        every[1].extend(windows)
        print(f"{name}: " + ", ".join(f"{m} {v:.2f}x" for m, v in report["sets"][name]["median_vs_greedy"].items()))
    report["sets"]["all"] = summarize(*every, ks)
    out = results_path(args, "lookup_depth")
    write_results(report, out, plot)
    return report


if __name__ == "__main__":
    main()
