#!/usr/bin/env python
"""Heads' training tokens/s on a frozen base, with and without what makes a step cheap: cached base
features (`--feature-cache`) and a short draft vocabulary (`--draft-vocab`).

Trains the built-in model's base in `frozen` mode (the step `distill` also takes) for a few steps on a
slice of the standard library, once per variant, in the precision `auto` picks, and reports the median
tokens/s of the logged windows after the first; the feature fill is timed apart, as it is made once.

    .venv/bin/python benchmarks/heads_throughput.py      # writes benchmarks/results/heads_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from blockdecode import DEFAULT_MODEL  # noqa: E402
from blockdecode.core.io import read_jsonl, write_json  # noqa: E402
from blockdecode.training.train import TrainConfig, train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--files", type=int, default=60, help="standard-library files to train on")
    parser.add_argument("--draft-vocab", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results/heads_throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    work = Path(tempfile.mkdtemp())
    data = work / "data"
    data.mkdir()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[: args.files]:
        shutil.copy(path, data)
    features = str(work / "features")
    variants = {
        "plain": {},
        "cached features": {"feature_cache": features},
        f"draft vocabulary {args.draft_vocab}": {"draft_vocab": args.draft_vocab},
        f"cached features + draft vocabulary {args.draft_vocab}": {
            "feature_cache": features,
            "draft_vocab": args.draft_vocab,
        },
    }
    rows = {}
    for name, extra in variants.items():
        out = work / name.replace(" ", "-")
        cfg = TrainConfig(
            base=DEFAULT_MODEL, data=[str(data)], out=str(out), mode="frozen", k=10, head_hidden_size=128,
            steps=args.steps, batch_size=16, seq_len=256, log_every=5, eval_every=10**6, checkpoint_every=10**6,
            eval_prompts=1, **extra,
        )  # fmt: skip
        start = time.perf_counter()
        train(cfg)
        rates = [r["tokens_per_s"] for r in read_jsonl(out / "metrics.jsonl") if r.get("tokens_per_s")][1:]
        rows[name] = {"tokens_per_s": statistics.median(rates), "wall_s": time.perf_counter() - start}
        print(name, rows[name], flush=True)
    plain = rows["plain"]["tokens_per_s"]
    for row in rows.values():
        row["speedup"] = row["tokens_per_s"] / plain
    report = {"base": DEFAULT_MODEL, "cpu": torch.backends.cpu.get_cpu_capability(), "steps": args.steps, "rows": rows}
    write_json(Path(args.out), report)
    print(json.dumps(report, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
