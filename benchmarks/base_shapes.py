#!/usr/bin/env python
"""Base-model shapes compared at equal compute: each trains from scratch on the same corpus for the
same wall-clock budget on this machine (its step count set from its own measured time per step),
with the same schedule shape, and is judged by its held-out stdlib loss and by what one decoding step
costs it (t(1), the unit every speedup divides by).

    .venv/bin/python benchmarks/base_shapes.py --corpus /work/runs/corpus --out /work/runs/shapes --minutes 6

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
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from blockdecode import training  # noqa: E402
from blockdecode.io import save_figure, write_json  # noqa: E402
from blockdecode.pretrain import PretrainConfig, llama_config, pretrain, windows  # noqa: E402

SHAPES = {
    "4x384": dict(layers=4, hidden_size=384, heads=6, kv_heads=6, intermediate_size=1024),
    "6x384": dict(layers=6, hidden_size=384, heads=6, kv_heads=6, intermediate_size=1024),
    "8x448": dict(layers=8, hidden_size=448, heads=7, kv_heads=7, intermediate_size=1216),
}


def seconds_per_step(cfg: PretrainConfig, vocab_size: int, tokens: np.ndarray, steps: int = 4) -> float:
    """The compiled training step's time, after its compilation and one warm-up step."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(cfg, vocab_size, 0))
    optimizer = training.adamw(model, cfg.lr, cfg.weight_decay, betas=(0.9, 0.95))
    precision = training.Precision(cfg.mixed_precision, torch.device("cpu"))

    def lm_loss(batch):
        with precision.autocast():
            logits = model(input_ids=batch, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())

    step_loss = torch.compile(lm_loss) if cfg.compile else lm_loss
    times = []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        step_loss(windows(tokens, step, cfg.batch_size, cfg.seq_len, 0)).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    return float(np.median(times[2:]))


@torch.inference_mode()
def decode_step_ms(model: LlamaForCausalLM, context: int = 300, repeats: int = 20) -> float:
    """t(1): one new token over a cache of `context` tokens, in the dtype this machine decodes in."""
    from transformers import DynamicCache

    from blockdecode.hardware import auto_dtype

    model = model.to(auto_dtype()).eval()
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.zeros(1, context, dtype=torch.long), past_key_values=cache)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), past_key_values=cache)
        times.append(time.perf_counter() - t0)
        cache.crop(-1)
    return 1000 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--out", required=True, help="one run folder per shape goes here")
    parser.add_argument("--minutes", type=float, default=6.0, help="training budget of each shape")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--results", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    corpus = Path(args.corpus)
    tokens = np.load(corpus / "train.npy", mmap_mode="r")
    vocab_size = len(json.loads((corpus / "tokenizer.json").read_text())["model"]["vocab"])
    rows = []
    for name in args.shapes:
        cfg = PretrainConfig(corpus=args.corpus, out=str(Path(args.out) / name), resume=True, **SHAPES[name])
        per_step = seconds_per_step(cfg, vocab_size, tokens)
        steps = max(20, int(args.minutes * 60 / per_step))
        cfg.steps, cfg.warmup_steps, cfg.eval_every = steps, max(5, steps // 25), max(10, steps // 5)
        model = pretrain(cfg)
        params = sum(p.numel() for p in model.parameters())
        evals = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in evals if "heldout_loss" in r]
        rows.append(
            {
                "shape": name,
                "config": asdict(cfg),
                "params": params,
                "seconds_per_step": per_step,
                "steps": steps,
                "tokens": steps * cfg.batch_size * cfg.seq_len,
                "heldout_loss": evals[-1]["heldout_loss"],
                "curve": [(r["step"] * cfg.batch_size * cfg.seq_len, r["heldout_loss"]) for r in evals],
                "decode_step_ms": decode_step_ms(model),
            }
        )
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("config", "curve")}), flush=True)
    results = Path(args.results)
    meta = {
        "minutes_each": args.minutes,
        "threads": torch.get_num_threads(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }
    write_json(results / "base_shapes.json", {"what": "base shapes at equal training time", **meta, "rows": rows})
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
    ax.set_xlabel(f"training tokens (M), {args.minutes:g} min each")
    ax.set_ylabel("held-out stdlib loss (nats/token)")
    ax.legend()
    save_figure(fig, results / "base_shapes.png")


if __name__ == "__main__":
    main()
