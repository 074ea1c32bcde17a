#!/usr/bin/env python
"""The built-in translation model's DFlash block drafter (issue 56: an encoder-decoder's block drafter, reading its
decoder's layers, which the source reaches through cross-attention) on held-out verses in book order:

- Blocks: the mean accepted block of the DFlash chain and of the paper's heads' chain at each k, in fp32, every
  translation checked against `transformers`' greedy.
- Speed: `transformers`' greedy, the default, the DFlash chain and DFlash ranked with n-gram lookup and with the
  heads, each verse's methods in turn, best of `--rounds` (`lookup_study.study_translation`), in the dtype `auto`
  picks for this CPU (`--dtype`); against greedy, with calls a token.

    python benchmarks/translation_dflash.py --bible runs/bible --dflash runs/translation-dflash/dflash   # ~10 min
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import RESULTS, dtype_flag, heading, title
from lookup_study import study_translation

from blockdecode import DEFAULT_TRANSLATION_MODEL, load
from blockdecode.bench.report import write_results
from blockdecode.core.hf import dtype_for, generate_length
from blockdecode.core.io import save_figure
from blockdecode.decoding.output import DecodeStats
from blockdecode.pretraining.bible import read_tsv

SPEED = {  # name: generate's settings
    "dflash chain, k = 8": dict(drafter="dflash", tree=None, k=8),
    "dflash+ngram ranked": dict(drafter="dflash+ngram"),
    "heads+dflash ranked": dict(drafter="heads+dflash"),
    "heads+dflash+ngram ranked": dict(drafter="heads+dflash+ngram"),
}


def loaded(dflash: str | None, dtype: torch.dtype):
    lm, tokenizer = load(DEFAULT_TRANSLATION_MODEL, dtype=dtype)
    if dflash:
        lm.attach_dflash(dflash)
    if lm.dflash is None:
        raise SystemExit("error: the built-in translation model holds no DFlash drafter: give --dflash FOLDER")
    return lm, tokenizer


@torch.inference_mode()
def blocks(lm, sources: list[torch.LongTensor], ks: list[int]) -> dict:
    """Each drafter's chain at each k: its mean accepted block over the verses, and whether every translation was
    `transformers`' greedy."""
    references = [
        lm.base.generate(s, attention_mask=torch.ones_like(s), do_sample=False, **generate_length(lm.base, 1, m))
        for s, m in zip(sources, limits(lm, sources))
    ]
    out: dict = {}
    for drafter in ("dflash", "heads"):
        for k in ks:
            if drafter == "dflash" and k > lm.dflash.config.block_size:
                continue
            runs = [lm.generate(s, m, drafter=drafter, tree=None, k=k, remember=False)
                    for s, m in zip(sources, limits(lm, sources))]  # fmt: skip
            same = sum(r.sequences.tolist() == ref.tolist() for r, ref in zip(runs, references))
            stats = DecodeStats.pooled(r.stats for r in runs)
            out[f"{drafter} chain, k = {k}"] = {"mean_block": stats.mean_block_size, "same_as_greedy": same}
            print(f"  {drafter} k={k}: block {stats.mean_block_size:.2f}, {same}/{len(runs)} as greedy")
    return out


def limits(lm, sources: list[torch.LongTensor]) -> list[int]:
    """Each verse's budget of new tokens, as `lookup_study` gives it: half as long again as its source, and 10."""
    return [min(lm.base.config.max_position_embeddings - 1, int(1.5 * s.shape[1]) + 10) for s in sources]


def plot(report: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    found = report["blocks"]
    left.bar(range(len(found)), [v["mean_block"] for v in found.values()])
    left.set_xticks(range(len(found)), list(found), rotation=30, ha="right", fontsize=8)
    left.set_ylabel("mean accepted block (fp32)")
    left.set_title(f"blocks, {report['verses']} held-out verses")
    found = report["speed"]["methods"]
    right.bar(range(len(found)), [v["vs_greedy"] for v in found.values()])
    right.set_xticks(range(len(found)), list(found), rotation=30, ha="right", fontsize=8)
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_ylabel("speed against transformers' greedy")
    right.set_title("verses in order")
    fig.suptitle(title(report), fontsize=9)
    fig.tight_layout()
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bible", required=True, help="the folder `blockdecode bible` wrote (its test.tsv)")
    p.add_argument("--dflash", default=None, help="a DFlash drafter's folder (default: the model's own)")
    p.add_argument("--verses", type=int, default=100)
    p.add_argument("--ks", default="4,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    dtype_flag(p, "the dtype timed (blocks are measured in fp32)")
    p.add_argument("--out", default=str(RESULTS / "translation_dflash.json"))
    args = p.parse_args(argv)
    if not (Path(args.bible) / "test.tsv").is_file():
        p.error(f"--bible {args.bible} holds no test.tsv: write it with `bash recipes/bible.sh`")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    lm, tokenizer = loaded(args.dflash, torch.float32)
    pairs = read_tsv(Path(args.bible) / "test.tsv")[: args.verses]
    sources = [torch.tensor([tokenizer(p.source).input_ids]) for p in pairs]
    dtype = dtype_for(args.dtype)
    report = heading("built-in translation model", dtype, threads=args.threads, verses=len(pairs),
                     dflash=args.dflash or "shipped")  # fmt: skip
    report["blocks"] = blocks(lm, sources, [int(k) for k in args.ks.split(",")])
    print(f"blocks: done, {time.perf_counter() - started:.0f} s")
    report["speed"] = study_translation(Path(args.bible), args.verses, args.rounds, loaded(args.dflash, dtype), SPEED)
    for name, found in report["speed"]["methods"].items():
        print(f"  {name}: {found['vs_greedy']:.2f}x greedy, {1 / found['calls_per_token']:.2f} tokens a call")
    report["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    write_results(report, out, plot)
    return report


if __name__ == "__main__":
    main()
