#!/usr/bin/env python
"""What choosing a setting costs the first `blockdecode generate`, and whether the choice is stable.

1. Whole commands, as a user runs them: `blockdecode generate` with `--tree off`, then with the
   default and an empty cache (cold: the setting is chosen), then again (warm: read from the
   cache); each `--repeats` times, interleaved, the medians kept.

Everything runs in the dtype `auto` picks for this CPU (`--dtype`).
2. The choice itself, made `--calibrations` times afresh on the built-in model; then every distinct
   setting chosen is decoded on the model's prompts in interleaved rounds, so their speeds can be
   compared (the target: within 10 % of each other).

    .venv/bin/python benchmarks/first_call.py            # writes benchmarks/results/first_call.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import dtype_flag, heading, title  # noqa: E402

from blockdecode import DEFAULT_MODEL, load  # noqa: E402
from blockdecode.core.hf import dtype_for  # noqa: E402
from blockdecode.core.io import save_figure, write_json  # noqa: E402
from blockdecode.decoding.calibrate import calibrate  # noqa: E402

BLOCKDECODE = str(Path(sys.executable).with_name("blockdecode"))
COMMAND = [BLOCKDECODE, "--threads", "2", "generate", "--prompt", "def fib(n):", "--max-new-tokens", "64"]


def command_seconds(extra: list[str], cache: str) -> float:
    start = time.perf_counter()
    subprocess.run([*COMMAND, *extra], check=True, capture_output=True, env={**os.environ, "XDG_CACHE_HOME": cache})
    return time.perf_counter() - start


def commands(repeats: int, dtype: str) -> dict[str, float]:
    """Median seconds of the whole command in `dtype` (a --dtype name): --tree off, cold (empty cache) and warm."""
    times: dict[str, list[float]] = {"tree off": [], "cold": [], "warm": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            times["tree off"].append(command_seconds(["--dtype", dtype, "--tree", "off"], cache))
            times["cold"].append(command_seconds(["--dtype", dtype], cache))
            times["warm"].append(command_seconds(["--dtype", dtype], cache))
    return {name: statistics.median(values) for name, values in times.items()}


def stability(calibrations: int, rounds: int, dtype: torch.dtype) -> dict:
    """The settings chosen by fresh calibrations, and each one's tokens/s on the model's prompts."""
    lm, tokenizer = load(DEFAULT_MODEL, dtype)
    texts = json.loads((Path(DEFAULT_MODEL) / "prompts.json").read_text())[:4]
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    chosen = []
    for _ in range(calibrations):
        found = calibrate(lm, prompts, "auto", refresh=True, show=False)
        chosen.append({"drafter": found.drafter, "tree": found.tree, "seconds": found.seconds})
    settings = sorted({(c["drafter"], c["tree"] or 0) for c in chosen})
    plans = {s: lm.plan(s[0], tree=s[1] or None, eos_token_id=[]) for s in settings}
    speed: dict[tuple, list[float]] = {s: [] for s in settings}
    for r in range(rounds):
        for s in settings[r % len(settings) :] + settings[: r % len(settings)]:
            start, tokens = time.perf_counter(), 0
            for ids in prompts:
                tokens += lm.generate(ids, 128, plan=plans[s]).stats.new_tokens
            speed[s].append(tokens / (time.perf_counter() - start))
    measured = {f"{d}:{t or 'chain'}": statistics.median(v) for (d, t), v in speed.items()}
    return {"chosen": chosen, "tokens_per_s": measured, "spread": max(measured.values()) / min(measured.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calibrations", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    dtype_flag(parser)
    parser.add_argument("--out", default="benchmarks/results/first_call.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    dtype = dtype_for(args.dtype)
    whole = commands(args.repeats, args.dtype)
    stable = stability(args.calibrations, args.rounds, dtype)
    report = {
        **heading("built-in code model", dtype, threads=2),
        "command": " ".join([*COMMAND[1:], "--dtype", args.dtype]),
        "seconds": whole,
        "cold_over_tree_off": whole["cold"] - whole["tree off"],
        "warm_over_tree_off": whole["warm"] - whole["tree off"],
        **stable,
    }
    write_json(Path(args.out), report)
    print(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(list(whole), list(whole.values()), color=["grey", "tab:red", "tab:green"])
    left.set_ylabel("seconds, whole command")
    left.set_title("blockdecode generate, 64 tokens")
    right.bar(list(stable["tokens_per_s"]), list(stable["tokens_per_s"].values()))
    right.set_ylabel("tokens/s")
    right.set_title(f"settings chosen by {args.calibrations} calibrations")
    fig.suptitle(title(report), fontsize=9)
    save_figure(fig, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
