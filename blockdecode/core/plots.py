"""Every figure the package draws: a training run's curves and a benchmark's speedups, blocks and costs.

matplotlib is imported on first use, with the Agg backend (no display needed), so importing the
package does not pay for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from blockdecode.core.io import save_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass
class Curves:
    """What a training run's figure shows: its training loss, held-out metrics on the same axis
    (metric -> label) and, beside them, an optional panel of the run's own."""

    train: str = "train loss"
    heldout: dict[str, str] = field(default_factory=dict)
    ylabel: str | None = "nats / token"
    side: Callable[[Axes, list[dict]], None] | None = None


def training(rows: list[dict], png: Path, curves: Curves) -> None:
    """A run's metrics.jsonl records over steps, as `curves` says."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2 if curves.side else 1, figsize=(11 if curves.side else 7, 4), squeeze=False)
    ax = axes[0][0]
    logged = [r for r in rows if "loss" in r]
    ax.plot([r["step"] for r in logged], [r["loss"] for r in logged], label=curves.train)
    for key, label in curves.heldout.items():
        evals = [r for r in rows if key in r]
        if evals:
            ax.plot([r["step"] for r in evals], [r[key] for r in evals], "o-", label=label)
    ax.set_xlabel("step")
    if curves.ylabel:
        ax.set_ylabel(curves.ylabel)
    ax.legend()
    if curves.side:
        curves.side(axes[0][1], rows)
    save_figure(fig, png)


def bleu(ax: Axes, rows: list[dict]) -> None:
    """Validation BLEU at each evaluation."""
    evals = [r for r in rows if "bleu" in r]
    ax.plot([r["step"] for r in evals], [r["bleu"] for r in evals], "o-")
    ax.set_xlabel("step")
    ax.set_ylabel("validation BLEU (greedy)")


def head_accuracy(ax: Axes, rows: list[dict]) -> None:
    """Each head's top-1 accuracy on the training batches, and the last held-out mean accepted block."""
    logged = [r for r in rows if "head_acc" in r]
    if logged:
        for i in range(len(logged[0]["head_acc"])):
            ax.plot([r["step"] for r in logged], [r["head_acc"][i] for r in logged], label=f"head {i + 1}")
        ax.legend(fontsize="small", ncol=2)
    ax.set_xlabel("step")
    ax.set_ylabel("top-1 accuracy (train)")
    evals = [r for r in rows if "eval_mean_block_size" in r]
    if evals:
        ax.set_title(f"held-out mean accepted block: {evals[-1]['eval_mean_block_size']:.2f}")


BENCH_PLOTS = ("speedup.png", "blocks.png", "cost.png", "batches.png")  # what `bench` may draw


def bench(report: dict, out: Path) -> None:
    """speedup.png (speedup against k per method), blocks.png (block-size histograms at the best
    k), batches.png (speedup against batch size) and cost.png (t(q) / t(1), the price of verifying a
    block)."""
    plt = _pyplot()
    methods = report["methods"]

    if methods:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for family, label in (("heads", "blockdecode, heads"), ("ngram", "blockdecode, n-gram")):
            rows = sorted(
                (r for r in methods.values() if r["family"] == family and r["exact_method"]), key=lambda r: r["k"]
            )
            ax.plot([r["k"] for r in rows], [r["speedup"] for r in rows], "o-", label=label)
            if family == "heads":
                ax.plot(
                    [r["k"] for r in rows if "ceiling" in r],
                    [r["ceiling"] for r in rows if "ceiling" in r],
                    "x:",
                    label="heads' ceiling k̂·t(1)/t(k)",
                )
        for spec in report["config"]["acceptance"]:
            rows = sorted((r for r in methods.values() if r["acceptance"] == spec), key=lambda r: r["k"])
            ax.plot(
                [r["k"] for r in rows], [r["speedup"] for r in rows], "s--", alpha=0.7, label=f"heads, {spec} (approx.)"
            )
        for name in ("prompt lookup", "assisted"):
            if name in methods:
                ax.axhline(
                    methods[name]["speedup"],
                    linestyle="--",
                    color="grey" if name == "assisted" else "tan",
                    label=f"transformers {name}",
                )
        ax.axhline(1.0, color="black", linewidth=0.8, label="transformers greedy")
        ax.set_xlabel("k (block size)")
        ax.set_ylabel("speedup over greedy generate")
        ax.legend(fontsize="small")
        save_figure(fig, out / "speedup.png")

        fig, ax = plt.subplots(figsize=(7, 4))
        for family in ("heads", "ngram"):
            top = fastest(report, family)
            if top:
                ax.bar(
                    [b + (0.2 if family == "ngram" else -0.2) for b in range(1, top["k"] + 1)],
                    top["block_histogram"],
                    width=0.4,
                    label=f"{family}, k={top['k']}",
                )
        ax.set_xlabel("accepted block size (tokens per call)")
        ax.set_ylabel("calls")
        ax.legend()
        save_figure(fig, out / "blocks.png")

    if report.get("batches"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for drafter in dict.fromkeys(r["drafter"] for r in report["batches"]):
            rows = [r for r in report["batches"] if r["drafter"] == drafter]
            ax.plot([r["batch"] for r in rows], [r["speedup"] for r in rows], "o-", label=f"blockdecode, {drafter}")
        ax.axhline(1.0, color="black", linewidth=0.8, label="transformers batched greedy")
        ax.set_xlabel("batch size (prompts)")
        ax.set_ylabel("speedup over batched greedy generate")
        ax.legend(fontsize="small")
        save_figure(fig, out / "batches.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    curves = []
    if "cost" in report:
        curves.append(("built-in model", report["cost"]["seconds"]))
    if "system_ceiling" in report:
        study = report["system_ceiling"]
        curves += [(f"{study['model']} ({study['dtype']}, {impl})", c) for impl, c in study["cost"].items()]
    for label, cost in curves:
        cost = {int(q): t for q, t in cost.items()}
        qs = sorted(cost)
        ax.plot(qs, [cost[q] / cost[1] for q in qs], "o-", label=label)
    ax.set_xlabel("q (tokens in one forward pass)")
    ax.set_ylabel("t(q) / t(1)")
    ax.legend(fontsize="small")
    save_figure(fig, out / "cost.png")


def fastest(report: dict, family: str) -> dict | None:
    """The fastest exact row of a benchmark's method family."""
    rows = [r for r in report["methods"].values() if r["family"] == family and r["exact_method"]]
    return max(rows, key=lambda r: r["speedup"], default=None)
