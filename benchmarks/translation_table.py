"""The paper's Table 1 on translation, its own task: for heads trained frozen ("Regular"), on
distilled data, fine-tuned, and both, the BLEU of the exact (greedy) translations of held-out
Bible verses against the Spanish reference, and the mean accepted block k̂ at each k, with the
paper's figures (WMT En-De) beside ours.

Every run's heads were trained at the largest k; a smaller k decodes with heads 2..k of them. k=1
is plain greedy decoding, and every k's tokens are checked against it.

    python benchmarks/translation_table.py --corpus runs/bible \\
        --runs runs/translation-frozen runs/translation-distill runs/translation-finetune runs/translation-both
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import sacrebleu
import torch
from common import RESULTS, heading
from results_doc import DOC, update_section
from ship import install
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from blockdecode.core.io import save_figure, write_json
from blockdecode.decoding.loop import decode
from blockdecode.model import BlockwiseLM
from blockdecode.pretraining.bible import read_tsv

PAPER = {"frozen": {8: 1.76}, "distill": {8: 1.91}, "finetune+distill": {8: 4.69, 10: 4.95}}
"""Stern et al. (2018), Table 1, WMT En-De: k̂ of Regular, Distillation and Both, as cited here."""


@torch.inference_mode()
def table_row(lm, tokenizer, pairs: list, ks: list[int], show: bool = True) -> dict:
    """One row of the paper's Table 1 for a BlockwiseLM on an encoder-decoder: the BLEU of its
    exact (greedy) translations of `pairs` (bible.VersePair), and at each k the mean accepted
    block of the heads' chain; every k's tokens are checked against k=1's, which is greedy itself."""
    sources = [tokenizer(p.source, return_tensors="pt").input_ids.to(lm.base.device) for p in pairs]
    limit = lm.base.config.max_position_embeddings - 1
    budgets = [min(limit, 2 * s.shape[1] + 10) for s in sources]
    greedy, by_k = None, {}
    for k in tqdm(sorted(set([1, *ks])), desc="k", leave=False, disable=not show):
        plan = lm.plan("heads", k, tree=None)
        outs = [decode(lm.base, s, n, plan) for s, n in zip(sources, budgets)]
        tokens = [o.sequences[0].tolist() for o in outs]
        greedy = greedy or tokens
        per_verse = [o.stats.mean_block_size for o in outs]
        blocks = [b for o in outs for b in o.stats.block_sizes]
        by_k[k] = {
            "mean_block_size": sum(blocks) / max(1, len(blocks)),
            "median_block_size": float(np.median(per_verse)),
            "identical_to_greedy": sum(t == g for t, g in zip(tokens, greedy)) / len(tokens),
        }
    hypotheses = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in greedy]
    return {"bleu": sacrebleu.corpus_bleu(hypotheses, [[p.target for p in pairs]]).score, "by_k": by_k}


def markdown(rows: list[dict], ks: list[int]) -> str:
    lines = ["| heads trained | steps | BLEU | " + " | ".join(f"k̂ at k={k}" for k in ks) + " |"]
    lines.append("|---|---|---|" + "---|" * len(ks))
    for r in rows:
        cells = [f"{r['by_k'][str(k)]['mean_block_size']:.2f}" if str(k) in r["by_k"] else "" for k in ks]
        steps = r["training"].get("steps", "")
        lines.append(f"| {r['mode']} | {steps} | {r['bleu']:.1f} | " + " | ".join(cells) + " |")
    for mode, figures in PAPER.items():
        lines.append(f"| paper, {mode} (WMT En-De) | | | " + " | ".join(str(figures.get(k, "")) for k in ks) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], ks: list[int], png: Path, conditions: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        shown = [k for k in ks if str(k) in r["by_k"]]
        ax.plot(
            shown,
            [r["by_k"][str(k)]["mean_block_size"] for k in shown],
            "o-",
            label=f"{r['mode']} ({r['bleu']:.1f} BLEU)",
        )
    ax.set_xlabel("k (block size)")
    ax.set_ylabel("mean accepted block k̂")
    ax.set_title(conditions, fontsize=9)
    ax.legend(fontsize="small")
    save_figure(fig, png)


def ship(rows: list[dict], directory: Path, sources: list[str], k: int = 8, max_bleu_drop: float = 1.0) -> dict:
    """Install the run with the largest k̂ at k (or its largest trained k below) as the built-in
    translation model. A run whose fine-tuned base's BLEU is more than `max_bleu_drop` points below
    the original model's (that of the runs whose base stayed frozen) is passed over: the paper's
    "Both" lost 0.3 BLEU for its speed."""
    frozen = [r["bleu"] for r in rows if r["training"].get("mode") in ("frozen", "distill")]
    if not frozen:
        raise ValueError("--ship needs a frozen or distill run: its BLEU is the original model's")

    def block(r: dict) -> float:
        return r["by_k"][str(max((kk for kk in map(int, r["by_k"]) if kk <= k), default=1))]["mean_block_size"]

    best = max((r for r in rows if r["bleu"] >= max(frozen) - max_bleu_drop), key=block)
    training = {
        **best["training"],
        "measured_in": "float32",
        "original_bleu": max(frozen),
        "bleu": best["bleu"],
        "mean_block_size": {kk: v["mean_block_size"] for kk, v in best["by_k"].items()},
    }
    install(best["run"], directory, training, sources)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="saved BlockwiseLM folders, one per training mode")
    parser.add_argument("--corpus", required=True, help="the folder `blockdecode bible` wrote (its test.tsv is used)")
    parser.add_argument("--ks", default="1,2,4,6,8,10")
    parser.add_argument("--verses", type=int, default=300, help="held-out verses, spread evenly over test.tsv")
    parser.add_argument("--out", default=str(RESULTS / "translation_table.json"))
    parser.add_argument(
        "--doc", nargs="?", const=str(DOC), default=None, help="write the table into this file (docs/results.md)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ship", default=None, help="install the best run (k̂ at k=8, BLEU kept) here, in bf16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    pairs = read_tsv(Path(args.corpus) / "test.tsv")
    pairs = [pairs[round(i * (len(pairs) - 1) / max(1, args.verses - 1))] for i in range(min(args.verses, len(pairs)))]
    start, rows = time.perf_counter(), []
    for run in tqdm(args.runs, desc="runs"):
        lm = BlockwiseLM.from_pretrained(run, dtype=torch.float32).eval()
        record = json.loads((Path(run) / "blockdecode.json").read_text()).get("training") or {}
        mode = record.get("mode", Path(run).name)
        settings = Path(run) / "train_config.json"
        if mode.endswith("distill") and settings.is_file():  # which distillation taught it: beam search or greedy
            config = json.loads(settings.read_text())
            beams = config.get("distill_beams", 1)
            mode += " (greedy targets)" if beams == 1 else f" ({beams}-beam targets)"
            if config.get("distill_sources"):  # and on which extra sources (`bible --extra-sources` names them)
                mode += " + " + ", ".join(Path(f).stem.removeprefix("sources-") for f in config["distill_sources"])
        row = table_row(lm, AutoTokenizer.from_pretrained(run), pairs, [k for k in ks if k <= lm.k])
        by_k = {str(k): v for k, v in row["by_k"].items()}
        rows.append({"run": run, "mode": mode, "trained_k": lm.k, "training": record, **row, "by_k": by_k})
    result = {
        **heading(", ".join(Path(run).name for run in args.runs), torch.float32, threads=args.threads),
        "what": "BLEU of exact greedy translations (sacrebleu) and mean accepted block at each k, fp32",
        "verses": len(pairs),
        "ks": ks,
        "paper": PAPER,
        "rows": rows,
        "seconds": time.perf_counter() - start,
        "torch": torch.__version__,
    }
    out = Path(args.out)
    write_json(out, result)
    conditions = f"{len(pairs)} held-out verses, exact greedy in {result['dtype']}; {result['machine']}"
    plot(rows, ks, out.with_suffix(".png"), conditions)
    table = f"{conditions}\n\n{markdown(rows, ks)}"
    print(table)
    if args.doc:
        update_section(Path(args.doc), "translation-table", table)
    if args.ship:
        best = ship(rows, Path(args.ship), [p.source for p in pairs[:: max(1, len(pairs) // 32)]])
        print(f"shipped {best['run']} ({best['mode']}) to {args.ship}")


if __name__ == "__main__":
    main()
