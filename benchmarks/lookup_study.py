#!/usr/bin/env python
"""The default against `transformers`' greedy and prompt lookup, and against its own drafters alone, in one run
(issue 48): (a) code the built-in model never saw, windows cut mid-line, with 64- and 300-token prompts; (b) the
same windows with the package's other files as a corpus; (c) translation of held-out verses in book order, with
and without remembered outputs; (d) sampling at temperatures 0.7 and 1.0 against `transformers`' sampling.

Every method decodes every window, in the dtype `auto` picks for this CPU (`--dtype`); times are the best of
`--rounds` interleaved runs, so a method is never timed while the machine is busier than for the others.
`loop ms/call` is a call's wall time outside the model's forward (timed from outside,
`blockdecode.decoding.timing.metered`). A window "loops" when more than half of its greedy continuation's 4-grams
stood before it (`benchmarks/repetition.py`), which flatters every lookup drafter: each figure is given on the
windows that do not loop too. With llama.cpp installed (`pip install .[llama]`), its greedy of the same model (a
GGUF as `benchmarks/sizes.py` writes it) is timed on (a) too.

    python benchmarks/lookup_study.py --windows 12 --bible /tmp/bible   # about 15 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from common import dtype_flag, heading, title
from paper_table import THIRD_PARTY
from repetition import repetition
from sizes import llama_cpp_greedy, llama_cpp_installed, write_gguf

from blockdecode import DEFAULT_MODEL, DEFAULT_TRANSLATION_MODEL, load
from blockdecode.bench.report import write_results
from blockdecode.core.hf import dtype_for, generate_length
from blockdecode.core.io import save_figure
from blockdecode.decoding.timing import metered
from blockdecode.pretraining.bible import read_tsv

LOOPS = 0.5  # a continuation loops when more than this share of its 4-grams stood before
PARTS = ("n-gram chain", "n-gram chain k=16", "n-gram chain k=32", "n-gram tree 16", "heads chain")  # drafters alone
GREEDY_METHODS = {  # name: (drafter, tree, k) as model.plan takes them (k None: the plan's own)
    "default": ("auto", "default", None),
    "n-gram chain": ("ngram", None, None),
    "n-gram chain k=16": ("ngram", None, 16),  # as deep as the default's lookup drafts in a chain (a batch, sampling)
    "n-gram chain k=32": ("ngram", None, 32),  # and in a tree
    "n-gram tree 16": ("ngram", 16, None),
    "heads chain": ("heads", None, None),
    "heads+ngram ranked": ("heads+ngram", "default", None),
    "heads+suffix ranked": ("heads+suffix", "default", None),
}


@dataclass
class Window:
    ids: torch.LongTensor  # the prompt, its last token cut mid-line
    path: Path  # the file it is cut from
    package: Path  # that file's package: its other files are the corpus of (b)


@dataclass
class Timed:
    tokens: list[int]
    seconds: float
    calls: int
    forward: float  # seconds inside the model's forward passes


def code_windows(tokenizer, n: int, length: int) -> list[Window]:
    """n windows of `length` tokens from files spread evenly over the third-party packages, each ending in
    the middle of a line a third of the way into its file (past the headers; a line of 16 characters or more)."""
    import importlib.util

    files = []
    for name in THIRD_PARTY:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"error: package {name} is not installed")
        roots = [Path(r) for r in spec.submodule_search_locations]
        files += [(p, root) for root in roots for p in sorted(root.rglob("*.py"))]
    windows = []
    for path, root in files[:: max(1, len(files) // (3 * n))]:
        text = path.read_text(errors="replace")
        start = text.find("\n", len(text) // 3) + 1
        lines = text[start:].splitlines(keepends=True)
        before = next((i for i, line in enumerate(lines) if len(line.strip()) >= 16), None)
        if not start or before is None:
            continue
        line_start = start + sum(len(line) for line in lines[:before])
        cut = line_start + len(lines[before].rstrip()) // 2
        ids = tokenizer(text[:cut]).input_ids
        if len(ids) >= length:
            windows.append(Window(torch.tensor([ids[-length:]]), path, root))
    if len(windows) < n:
        raise SystemExit(f"error: only {len(windows)} files of {THIRD_PARTY} are long enough for {n} windows")
    return [windows[round(i * (len(windows) - 1) / max(1, n - 1))] for i in range(n)]


def timed(model, prompt_len: int, call: Callable[..., object], *args, **kwargs) -> Timed:
    """One decode, `call(*args, **kwargs)`: its new tokens, wall time, forward passes and their time."""
    with metered(model) as (meter,):
        start = time.perf_counter()
        out = call(*args, **kwargs)
        seconds = time.perf_counter() - start
    if isinstance(out, Timed):  # an engine that times itself
        return out
    sequences = out.sequences if hasattr(out, "sequences") else out
    return Timed(sequences[0, prompt_len:].tolist(), seconds, meter.calls, meter.seconds)


def best_of(runs: dict[str, list[Timed]]) -> dict[str, Timed]:
    return {name: min(found, key=lambda r: r.seconds / max(1, len(r.tokens))) for name, found in runs.items()}


def summary(rows: list[dict], method: str, against: str | None = None) -> dict:
    """A method's figures over windows: ms a token, calls a token, loop and forward ms a call, and (with
    `against`) its median speed against that method, window by window."""
    runs = [r[method] for r in rows]
    tokens = sum(len(r.tokens) for r in runs)
    calls = sum(r.calls for r in runs)
    out = {
        "windows": len(rows),
        "ms_per_token": 1000 * sum(r.seconds for r in runs) / tokens,
        "calls_per_token": calls / tokens,
        "loop_ms_per_call": 1000 * sum(r.seconds - r.forward for r in runs) / calls,
        "forward_ms_per_call": 1000 * sum(r.forward for r in runs) / calls,
    }
    if against is not None:
        out[f"median_vs_{against}"] = statistics.median(speed(r, method, against) for r in rows)
    return out


def speed(row: dict[str, Timed], method: str, against: str) -> float:
    """How many times faster `method` ran than `against` on one window, by time a token."""
    a, b = row[method], row[against]
    return (b.seconds / max(1, len(b.tokens))) / (a.seconds / max(1, len(a.tokens)))


def loops(tokens: list[int], prompt: list[int]) -> float:
    repeated, total = repetition(prompt + tokens, len(prompt))
    return repeated / total if total else 0.0


def transformers_methods(base, n: int) -> dict[str, Callable[[Window], object]]:
    """`transformers`' own greedy and prompt lookup (10 tokens) of `n` new tokens: the baselines of every study."""
    return {
        "transformers greedy": lambda w: base.generate(w.ids, attention_mask=torch.ones_like(w.ids), do_sample=False,
                                                       max_new_tokens=n),
        "transformers prompt lookup": lambda w: base.generate(w.ids, attention_mask=torch.ones_like(w.ids),
                                                              do_sample=False, max_new_tokens=n,
                                                              prompt_lookup_num_tokens=10),
    }  # fmt: skip


def study_code(lm, windows: list[Window], args, corpus: bool) -> dict:
    """(a): every method on every window, best of `args.rounds`; with `corpus`, (b): suffix lookup's default
    with and without the package's other files."""
    base, n = lm.base, args.new_tokens
    chosen = ("heads+suffix ranked",) if corpus else tuple(GREEDY_METHODS)
    plans = {name: lm.plan(drafter, k, tree, prompts=[windows[0].ids])
             for name in chosen for drafter, tree, k in [GREEDY_METHODS[name]]}  # fmt: skip
    methods = transformers_methods(base, n)
    for name, plan in plans.items():
        methods[name] = lambda w, plan=plan: lm.generate(w.ids, n, plan=plan, remember=False)
    if corpus:
        del methods["transformers prompt lookup"]
        plan = plans["heads+suffix ranked"]
        methods["heads+suffix ranked + corpus"] = lambda w: lm.generate(
            w.ids, n, plan=plan, remember=False, corpus=[w.package / p for p in others(w)]
        )
        for w in windows:  # each window's corpus indexed (and cached) before anything is timed
            lm.generate(w.ids, 2, plan=plan, remember=False, corpus=[w.package / p for p in others(w)])
    llama = None
    if not corpus and args.llama_cpp and llama_cpp_installed() and base.dtype in (torch.bfloat16, torch.float32):
        folder = tempfile.TemporaryDirectory(prefix="lookup-study-")
        path = Path(folder.name) / "model.gguf"
        write_gguf(base, path, base.dtype == torch.bfloat16)
        llama = llama_cpp_greedy(path, torch.get_num_threads(), windows[0].ids.shape[1] + n + 8)
        methods["llama.cpp greedy"] = lambda w: engine_run(llama(w.ids, n))
    for method in methods.values():  # warm: first calls, calibrations, caches
        method(windows[0])
    rows: list[dict[str, Timed]] = []
    for w in windows:
        runs: dict[str, list[Timed]] = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, method in methods.items():
                runs[name].append(timed(base, w.ids.shape[1], method, w))
        rows.append(best_of(runs))
    prompt = [w.ids[0].tolist() for w in windows]
    looping = [loops(r["transformers greedy"].tokens, p) > LOOPS for r, p in zip(rows, prompt)]
    report = {"windows": len(rows), "looping": sum(looping), "methods": {}, "per_window": []}
    for subset, keep in (("all", [True] * len(rows)), ("not looping", [not x for x in looping])):
        chosen = [r for r, k in zip(rows, keep) if k]
        if not chosen:
            continue
        report["methods"][subset] = {name: summary(chosen, name, "transformers greedy") for name in methods}
        if corpus:
            report["methods"][subset]["corpus_vs_none"] = statistics.median(
                speed(r, "heads+suffix ranked + corpus", "heads+suffix ranked") for r in chosen
            )
            continue
        default = report["methods"][subset]["default"]
        default["median_vs_prompt_lookup"] = statistics.median(
            speed(r, "default", "transformers prompt lookup") for r in chosen
        )
        default["worst_vs_best_part"] = min(
            speed(r, "default", min(PARTS, key=lambda p: r[p].seconds / len(r[p].tokens))) for r in chosen
        )
    for w, r, p, loop in zip(windows, rows, prompt, looping):
        greedy = r["transformers greedy"].tokens
        report["per_window"].append({
            "file": str(w.path.relative_to(w.package.parent)),
            "repeated_4grams": round(loops(greedy, p), 3),
            "loops": loop,
            "ms_per_token": {name: 1000 * run.seconds / max(1, len(run.tokens)) for name, run in r.items()},
            "same_as_greedy": {name: run.tokens == greedy[: len(run.tokens)] for name, run in r.items()},
        })  # fmt: skip
    return report


def engine_run(run) -> Timed:
    """llama.cpp's run as timed here: every second of it inside the engine's calls, one a token."""
    return Timed(run.sequence, run.seconds, run.calls, run.seconds)


def others(w: Window) -> list[str]:
    """The window's package's files but its own, relative to the package."""
    return [str(p.relative_to(w.package)) for p in sorted(w.package.rglob("*.py")) if p != w.path]


def study_translation(bible: Path, verses: int, rounds: int, model=None, extra: dict[str, dict] | None = None) -> dict:
    """(c): held-out verses in book order, greedy against the default with and without remembered outputs, and
    `extra`'s methods (name: `generate`'s settings) on `model` (lm, tokenizer; default: the built-in translation
    model)."""
    lm, tokenizer = model or load(DEFAULT_TRANSLATION_MODEL, dtype=dtype_for("auto"))
    pairs = read_tsv(bible / "test.tsv")[:verses]
    sources = [torch.tensor([tokenizer(p.source).input_ids]) for p in pairs]
    limits = [min(lm.base.config.max_position_embeddings - 1, int(1.5 * s.shape[1]) + 10) for s in sources]
    plan = lm.plan("heads+suffix", prompts=sources[:1])
    methods = {
        "transformers greedy": lambda s, m: lm.base.generate(
            s, attention_mask=torch.ones_like(s), do_sample=False, **generate_length(lm.base, s.shape[1], m)
        ),
        "default": lambda s, m: lm.generate(s, m, remember=False),
        "heads+suffix, not remembering": lambda s, m: lm.generate(s, m, plan=plan, remember=False),
        "heads+suffix, remembering": lambda s, m: lm.generate(s, m, plan=plan),
    }  # fmt: skip
    for name, settings in (extra or {}).items():
        methods[name] = lambda s, m, settings=settings: lm.generate(s, m, remember=False, **settings)
    for method in methods.values():
        method(sources[0], 4)
    totals = {name: float("inf") for name in methods}
    calls = dict.fromkeys(methods, 0)
    tokens = dict.fromkeys(methods, 0)
    for _ in range(rounds):  # a round translates the verses in order, each method in turn
        lm.forget()
        seconds = dict.fromkeys(methods, 0.0)
        for s, m in zip(sources, limits):
            for name, method in methods.items():
                run = timed(lm.base, 1, method, s, m)
                seconds[name] += run.seconds
                calls[name], tokens[name] = calls[name] + run.calls, tokens[name] + len(run.tokens)
        totals = {name: min(totals[name], seconds[name]) for name in methods}
    return {
        "verses": len(pairs),
        "first": pairs[0].ref,
        "last": pairs[-1].ref,
        "methods": {
            name: {
                "seconds": totals[name],
                "vs_greedy": totals["transformers greedy"] / totals[name],
                "calls_per_token": calls[name] / tokens[name],
            }
            for name in methods
        },
    }


def study_sampling(
    lm, windows: list[Window], new_tokens: int, temperatures: tuple[float, ...], rounds: int = 1
) -> dict:
    """(d): the default's sampling against `transformers`', the same seed for both on a window, so that every round
    of it draws the same tokens: time a token over all windows, the best of `rounds` interleaved runs a window."""
    return {str(t): sampled(lm, windows, new_tokens, t, rounds) for t in temperatures}


def sampled(lm, windows: list[Window], new_tokens: int, temperature: float, rounds: int) -> dict:
    """(d) at one temperature."""
    base = lm.base
    plan = lm.plan(do_sample=True, temperature=temperature, prompts=[windows[0].ids])

    def ours(w: Window, seed: int):
        return lm.generate(w.ids, new_tokens, plan=plan, remember=False, generator=torch.Generator().manual_seed(seed))

    def theirs(w: Window, seed: int):
        torch.manual_seed(seed)
        return base.generate(w.ids, attention_mask=torch.ones_like(w.ids), do_sample=True, temperature=temperature,
                             max_new_tokens=new_tokens)  # fmt: skip

    rows = []
    for i, w in enumerate(windows):
        runs: dict[str, list[Timed]] = {"blockdecode": [], "transformers": []}
        for _ in range(rounds):
            runs["blockdecode"].append(timed(base, w.ids.shape[1], ours, w, i))
            runs["transformers"].append(timed(base, w.ids.shape[1], theirs, w, i))
        rows.append(best_of(runs))
    mine, hf = summary(rows, "blockdecode", "transformers"), summary(rows, "transformers")
    return {
        "plan": f"{plan.drafter_name}, {plan.setting}",
        "vs_transformers": hf["ms_per_token"] / mine["ms_per_token"],
        "tokens_per_call": 1 / mine["calls_per_token"],
        **{key: mine[key] for key in ("median_vs_transformers", "forward_ms_per_call", "loop_ms_per_call")},
        "transformers_ms_per_token": hf["ms_per_token"],
    }


def plot(report: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [3, 1.2, 1.2]})
    ax = axes[0]
    names = [n for n in report["code"]["300"]["methods"]["all"] if n != "transformers greedy"]
    width = 0.2
    for j, (label, key, subset) in enumerate([("64-token prompts", "64", "all"), ("300-token prompts", "300", "all"),
                                              ("300, not looping", "300", "not looping"),
                                              ("300, with a corpus", "corpus", "all")]):  # fmt: skip
        found = report["code"].get(key, {}).get("methods", {}).get(subset, {})
        shown = {"heads+suffix ranked": "heads+suffix ranked + corpus"} if key == "corpus" else {}  # (b)'s bar
        values = [found.get(shown.get(n, "") if key == "corpus" else n, {}).get("median_vs_transformers greedy", 0.0)
                  for n in names]  # fmt: skip
        ax.bar([i + (j - 1.5) * width for i in range(len(names))], values, width, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("median speed against transformers' greedy")
    ax.set_title("(a, b) unseen code")
    ax.legend(fontsize=7)
    if "translation" in report:
        found = report["translation"]["methods"]
        axes[1].bar(range(len(found)), [v["vs_greedy"] for v in found.values()])
        axes[1].set_xticks(range(len(found)), list(found), rotation=30, ha="right", fontsize=7)
        axes[1].axhline(1.0, color="grey", lw=0.8)
        axes[1].set_title(f"(c) {report['translation']['verses']} verses in order")
    found = report["sampling"]
    axes[2].bar([f"T={t}" for t in found], [v["vs_transformers"] for v in found.values()])
    axes[2].axhline(1.0, color="grey", lw=0.8)
    axes[2].set_title("(d) sampling, against\ntransformers' sampling")
    fig.suptitle(title(report), fontsize=9)
    fig.tight_layout()
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bible", default=None, help="the folder `blockdecode bible` wrote: (c) reads its test.tsv")
    p.add_argument("--verses", type=int, default=100)
    p.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    dtype_flag(p)
    p.add_argument("--out", default="benchmarks/results/lookup_study.json")
    args = p.parse_args(argv)
    for name in ("windows", "new_tokens", "rounds", "threads", "verses"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.bible and not (Path(args.bible) / "test.tsv").is_file():
        p.error(f"--bible {args.bible} holds no test.tsv: write it with `blockdecode bible --out {args.bible}`")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    dtype = dtype_for(args.dtype)
    lm, tokenizer = load(DEFAULT_MODEL, dtype=dtype)
    report = heading("built-in code model", dtype, threads=args.threads, new_tokens=args.new_tokens,
                     rounds=args.rounds, code={})  # fmt: skip
    print(title(report), flush=True)
    for length in (64, 300):
        windows = code_windows(tokenizer, args.windows, length)
        report["code"][str(length)] = study_code(lm, windows, args, corpus=False)
        print(f"(a) {length}-token prompts: done, {time.perf_counter() - started:.0f} s")
    report["code"]["corpus"] = study_code(lm, windows, args, corpus=True)
    print(f"(b) with a corpus: done, {time.perf_counter() - started:.0f} s")
    report["sampling"] = study_sampling(lm, windows, args.new_tokens, (0.7, 1.0), args.rounds)
    print(f"(d) sampling: done, {time.perf_counter() - started:.0f} s")
    if args.bible:
        translator = load(DEFAULT_TRANSLATION_MODEL, dtype=dtype)
        report["translation"] = study_translation(Path(args.bible), args.verses, args.rounds, translator)
        print(f"(c) translation: done, {time.perf_counter() - started:.0f} s")
    report["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    write_results(report, out, plot)
    return report


if __name__ == "__main__":
    main()
