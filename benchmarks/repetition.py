#!/usr/bin/env python
"""How much of each model's greedy text repeats what came before it: the share of generated 4-grams already
seen in the prompt or earlier in the output, and the share of distinct tokens in the output. A base whose
greedy text loops more gives n-gram lookup more to copy, so a set that runs faster may only have a base
that says less; this tells the two apart (docs/results.md, "Both" trained until it stops growing).

    python benchmarks/repetition.py --models blockdecode/builtin/default_model runs/both-code \
        --prompts blockdecode/builtin/default_model/prompts.json --third-party 24
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import heading, title
from paper_table import THIRD_PARTY, third_party_prompts
from transformers import AutoTokenizer

from blockdecode.core.io import read_prompts, save_figure, write_json
from blockdecode.model import BlockwiseLM


def repetition(ids: list[int], prompt_len: int, n: int = 4) -> tuple[int, int]:
    """(repeated, all) of the n-grams that start in the output, an n-gram repeated when the same n tokens
    already stood anywhere before it, in the prompt or the output."""
    seen, repeated, total = set(), 0, 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        if i >= prompt_len:
            repeated, total = repeated + (gram in seen), total + 1
        seen.add(gram)
    return repeated, total


def measure(model: str, prompts: list[torch.LongTensor], new_tokens: int) -> dict:
    """One model's greedy continuations of every prompt, each the full `new_tokens` long, scored."""
    base = BlockwiseLM.from_pretrained(model, dtype=torch.float32).base.eval()
    repeated = total = 0
    distinct = []
    for ids in prompts:
        with torch.inference_mode():
            out = base.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        r, t = repetition(out[0].tolist(), ids.shape[1])
        repeated, total = repeated + r, total + t
        new = out[0, ids.shape[1] :].tolist()
        distinct.append(len(set(new)) / len(new))
    return {"repeated_4grams": repeated / total, "distinct_tokens": sum(distinct) / len(distinct)}


def plot(report: dict):
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    sets, models = list(dict.fromkeys(r["prompts"] for r in rows)), list(dict.fromkeys(r["model"] for r in rows))
    width = 0.8 / len(models)
    for j, model in enumerate(models):
        values = [next(r["repeated_4grams"] for r in rows if r["model"] == model and r["prompts"] == s) for s in sets]
        ax.bar([i + j * width for i in range(len(sets))], values, width, label=model)
    ax.set_xticks([i + width * (len(models) - 1) / 2 for i in range(len(sets))], sets)
    ax.set_ylabel("generated 4-grams seen before")
    ax.set_ylim(0, 1)
    ax.set_title(f"greedy text, {title(report)}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", required=True, help="saved BlockwiseLM folders sharing a tokenizer")
    parser.add_argument("--prompts", nargs="*", default=[], help="JSON lists of prompt texts")
    parser.add_argument("--third-party", type=int, default=0, help=f"also N windows of {', '.join(THIRD_PARTY)}")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens in a third-party window")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/repetition")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.models[0])
    sets = {Path(p).parent.name + "/" + Path(p).name: read_prompts(p) for p in args.prompts}
    prompts = {name: [tokenizer(t, return_tensors="pt").input_ids for t in texts] for name, texts in sets.items()}
    if args.third_party:
        prompts["third-party"] = third_party_prompts(tokenizer, THIRD_PARTY, args.third_party, args.prompt_len)
    rows = []
    for name, ids in prompts.items():
        for model in args.models:
            rows.append({"prompts": name, "model": model, "n": len(ids), **measure(model, ids, args.new_tokens)})
            print(f"{name} {model}: repeated 4-grams {rows[-1]['repeated_4grams']:.3f}, "
                  f"distinct tokens {rows[-1]['distinct_tokens']:.3f}")  # fmt: skip
    out = Path(args.out)
    report = {**heading(", ".join(Path(m).name for m in args.models), torch.float32, threads=args.threads),
              "config": vars(args), "rows": rows}  # fmt: skip
    write_json(out.with_suffix(".json"), report)
    save_figure(plot(report), out.with_suffix(".png"))


if __name__ == "__main__":
    main()
