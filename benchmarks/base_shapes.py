#!/usr/bin/env python
"""Base-model shapes compared at equal compute: each trains from scratch on the same corpus for the
same number of training FLOPs (its step count set from its FLOPs per token: 6 x (non-embedding
parameters + the vocabulary projection) + 6 x layers x sequence x width for attention), with the
same schedule shape, and is judged by its held-out stdlib loss and by what one decoding step costs it
(t(1), the unit every speedup divides by). Counting FLOPs rather than seconds keeps the comparison
fair on a machine whose cores are shared.

    .venv/bin/python benchmarks/base_shapes.py --corpus /work/runs/corpus --out /work/runs/shapes

Writes base_shapes.json and base_shapes.png to --results (default benchmarks/results/); each shape's
run folder resumes like any `blockdecode pretrain` run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from blockdecode.core.io import save_figure, write_json  # noqa: E402
from blockdecode.pretraining.pretrain import PretrainConfig, pretrain  # noqa: E402

SHAPES = {
    "4x384": dict(layers=4, hidden_size=384, heads=6, kv_heads=6, intermediate_size=1024),
    "6x384": dict(layers=6, hidden_size=384, heads=6, kv_heads=6, intermediate_size=1024),
    "8x448": dict(layers=8, hidden_size=448, heads=7, kv_heads=7, intermediate_size=1216),
}


def flops_per_token(cfg: PretrainConfig, vocab_size: int) -> float:
    """Training FLOPs per token: forward and backward through every matrix, the output projection
    included, and attention over the sequence."""
    layer = 4 * cfg.hidden_size**2 + 3 * cfg.hidden_size * cfg.intermediate_size
    return 6 * (cfg.layers * layer + vocab_size * cfg.hidden_size) + 6 * cfg.layers * cfg.seq_len * cfg.hidden_size


@torch.inference_mode()
def decode_step_ms(models: dict[str, LlamaForCausalLM], context: int = 300, rounds: int = 30) -> dict[str, float]:
    """t(1) of each model: one new token over a cache of `context` tokens, in the dtype this machine
    decodes in, the models taking turns so that whatever else runs slows them alike."""
    from transformers import DynamicCache

    from blockdecode.core.hardware import auto_dtype

    caches = {}
    for name, model in models.items():
        model.to(auto_dtype()).eval()
        caches[name] = DynamicCache(config=model.config)
        model(input_ids=torch.zeros(1, context, dtype=torch.long), past_key_values=caches[name])
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            t0 = time.perf_counter()
            model(input_ids=torch.zeros(1, 1, dtype=torch.long), past_key_values=caches[name])
            times[name].append(time.perf_counter() - t0)
            caches[name].crop(-1)
    return {name: 1000 * float(np.median(t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--out", required=True, help="one run folder per shape goes here")
    parser.add_argument(
        "--budget", type=float, default=9.7e13, help="training FLOPs of each shape (default: 179 steps of 4x384)"
    )
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--results", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    corpus = Path(args.corpus)
    vocab_size = len(json.loads((corpus / "tokenizer.json").read_text())["model"]["vocab"])
    rows, models = [], {}
    for name in args.shapes:
        cfg = PretrainConfig(corpus=args.corpus, out=str(Path(args.out) / name), resume=True, **SHAPES[name])
        steps = max(20, round(args.budget / (flops_per_token(cfg, vocab_size) * cfg.batch_size * cfg.seq_len)))
        cfg.steps, cfg.warmup_steps, cfg.eval_every = steps, max(5, steps // 25), max(10, steps // 5)
        model = models[name] = pretrain(cfg)
        params = sum(p.numel() for p in model.parameters())
        evals = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in evals if "heldout_loss" in r]
        rows.append(
            {
                "shape": name,
                "config": asdict(cfg),
                "params": params,
                "flops_per_token": flops_per_token(cfg, vocab_size),
                "steps": steps,
                "tokens": steps * cfg.batch_size * cfg.seq_len,
                "heldout_loss": evals[-1]["heldout_loss"],
                "curve": [(r["step"] * cfg.batch_size * cfg.seq_len, r["heldout_loss"]) for r in evals],
            }
        )
    for row, ms in zip(rows, decode_step_ms(models).values()):
        row["decode_step_ms"] = ms
        print(json.dumps({k: v for k, v in row.items() if k not in ("config", "curve")}), flush=True)
    results = Path(args.results)
    meta = {
        "flops_each": args.budget,
        "threads": torch.get_num_threads(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }
    write_json(results / "base_shapes.json", {"what": "base shapes at equal training FLOPs", **meta, "rows": rows})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        xs, ys = zip(*row["curve"])
        ax.plot(
            np.array(xs) / 1e6,
            ys,
            "o-",
            label=f"{row['shape']} ({row['params'] / 1e6:.1f}M, t(1) {row['decode_step_ms']:.1f} ms)",
        )
    ax.set_xlabel(f"training tokens (M), {args.budget:.2g} FLOPs each")
    ax.set_ylabel("held-out stdlib loss (nats/token)")
    ax.legend()
    save_figure(fig, results / "base_shapes.png")


if __name__ == "__main__":
    main()
