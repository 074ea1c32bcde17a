#!/usr/bin/env python
"""The paper's "Both" trained until it stops growing (issue 37): for each run folder of `blockdecode
train --mode finetune+distill`, the held-out block and the base's held-out loss against the tokens seen,
from what the run logged at every evaluation (metrics.jsonl). The quality rule is drawn with them: the
base's held-out loss may rise at most `--rule` (2 %) over the original base's. A run that goes on from a
Both set (its --base and --init-heads one folder, recorded as finetune+distill) counts the tokens that set
had seen and the loss of the base it began from. The plateau rule is read on those tokens: the first
evaluation whose best block so far grew less than `--gain` over the best of the first half of its tokens.

    python benchmarks/both_curve.py runs/both-code runs/both-code-rows --out benchmarks/results/both_curve
"""

from __future__ import annotations

import argparse
from pathlib import Path

from blockdecode.core.io import read_json, read_jsonl, save_figure, write_json


def tokens_per_step(run: Path) -> float:
    """What a step of the run saw: its record's tokens over its steps once it has ended, else its batch
    of rows (distilled rows are the prompt and its continuation)."""
    record = run / "blockdecode.json"
    if record.is_file():
        training = read_json(record)["training"]
        return training["tokens_seen"] / training["steps"]
    cfg = read_json(run / "train_config.json")
    distilled = "distill" in cfg["mode"] and not cfg.get("distill_sources")
    row = cfg["distill_prompt_len"] + cfg["distill_new_tokens"] if distilled else cfg["seq_len"]
    return cfg["batch_size"] * row


def before(cfg: dict) -> dict:
    """What a run had behind it: the tokens and the original base's held-out loss of the Both set it goes on
    from, when its --base and --init-heads are that one folder; none for a run from a frozen base's heads."""
    start = cfg.get("init_heads")
    record = Path(start or "") / "blockdecode.json"
    continued = start and Path(start) == Path(cfg["base"]) and record.is_file()
    training = (read_json(record).get("training") or {}) if continued else {}
    if training.get("mode") != "finetune+distill":
        return {"tokens": 0, "original_base_loss": None}
    return {"tokens": training["tokens_seen"], "original_base_loss": training.get("original_base_heldout_loss")}


def plateau(points: list[dict], gain: float) -> dict | None:
    """The first evaluation at which the best block so far grew less than `gain` over the best up to half its
    tokens, once that half holds three evaluations (as `train --doubling-gain` decides, on all tokens seen)."""
    for p in points:
        half = [q["block"] for q in points if q["tokens"] <= p["tokens"] / 2]
        if len(half) < 3:
            continue
        grew = max(q["block"] for q in points if q["tokens"] <= p["tokens"]) - max(half)
        if grew < gain:
            return {"tokens": p["tokens"], "step": p["step"], "grew": grew}
    return None


def curve(run: Path, gain: float = 0.05) -> dict:
    """The run's evaluations: tokens seen, held-out block, the base's held-out loss and its rise."""
    per_step = tokens_per_step(run)
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if "eval_mean_block_size" in r]
    if not evals:
        raise ValueError(f"{run / 'metrics.jsonl'} holds no evaluation")
    cfg = read_json(run / "train_config.json")
    behind = before(cfg)
    first = behind["original_base_loss"] or evals[0]["eval_base_loss"]
    points = [
        {
            "step": r["step"],
            "tokens": behind["tokens"] + r["step"] * per_step,
            "block": r["eval_mean_block_size"],
            "base_loss": r["eval_base_loss"],
            "loss_rise": r["eval_base_loss"] / first - 1,
        }
        for r in evals
    ]
    best = max(points, key=lambda p: p["block"])
    return {
        "run": str(run),
        "config": cfg,
        "tokens_before": behind["tokens"],
        "points": points,
        "best": best,
        "plateau": plateau(points, gain),
    }


def plot(curves: list[dict], rule: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (blocks, quality) = plt.subplots(1, 2, figsize=(10, 4))
    for c in curves:
        millions = [p["tokens"] / 1e6 for p in c["points"]]
        label = Path(c["run"]).name
        (line,) = blocks.plot(millions, [p["block"] for p in c["points"]], marker="o", label=label)
        if c["plateau"]:
            blocks.axvline(c["plateau"]["tokens"] / 1e6, color=line.get_color(), linestyle=":", alpha=0.7)
        quality.plot(millions, [100 * p["loss_rise"] for p in c["points"]], marker="o", label=label)
    quality.axhline(100 * rule, color="red", linestyle="--", label=f"quality rule (+{100 * rule:g} %)")
    blocks.set(xlabel="tokens seen (millions)", ylabel="held-out accepted block", title="Both: block")
    quality.set(xlabel="tokens seen (millions)", ylabel="base held-out loss, % over the original", title="quality")
    for ax in (blocks, quality):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run folders of blockdecode train")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/both_curve"), help="writes OUT.json, OUT.png")
    p.add_argument("--rule", type=float, default=0.02, help="the base's held-out loss may rise this much")
    p.add_argument("--gain", type=float, default=0.05, help="the plateau: less block growth than this per doubling")
    args = p.parse_args(argv)
    curves = [curve(run, args.gain) for run in args.runs]
    report = {"rule": args.rule, "gain": args.gain, "curves": curves}
    write_json(args.out.with_suffix(".json"), report)
    plot(curves, args.rule, args.out.with_suffix(".png"))
    for c in curves:
        best, last = c["best"], c["points"][-1]
        print(
            f"{c['run']}: best block {best['block']:.3f} at {best['tokens'] / 1e6:.2f}M tokens; "
            f"last {last['block']:.3f} at {last['tokens'] / 1e6:.2f}M, base loss {100 * last['loss_rise']:+.2f} %; "
            + (
                f"plateau at {c['plateau']['tokens'] / 1e6:.2f}M ({c['plateau']['grew']:+.3f} over its doubling)"
                if c["plateau"]
                else "no plateau yet"
            )
        )
    return report


if __name__ == "__main__":
    main()
