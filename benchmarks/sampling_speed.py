#!/usr/bin/env python
"""The default's sampling against `transformers`' own sampling (issue 57), at each temperature: the same seed for
both on a window, so every round of it draws the same tokens; speed is time a token over all windows (and the
median window's), the best of `--rounds` interleaved runs a window.

On the built-in code model: `lookup_study`'s unseen third-party code, 12 windows of 64 and 12 of 300 tokens; with
`--gguf` (Gemma 3 270M: `--gguf real`): `real.py`'s 6 code and 4 prose windows of 256 tokens, where every scored
position costs a row of 262,144 logits, and a draw a running sum over them.

    python benchmarks/sampling_speed.py                 # the built-in model, about 4 min on 2 cores
    python benchmarks/sampling_speed.py --gguf real     # Gemma 3 270M, about 8 min
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import RESULTS, dtype_flag, heading, plot_bars
from lookup_study import Window, code_windows, study_sampling
from real import prose_windows, real_model_file

from blockdecode import DEFAULT_MODEL, load
from blockdecode.bench.report import write_results
from blockdecode.core.hf import dtype_for


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--temperatures", default="0.7,1.0", help="comma-separated, each > 0")
    p.add_argument("--gguf", default=None, help="a GGUF file, or 'real' for Gemma 3 270M (default: the built-in model)")
    p.add_argument("--windows", type=int, default=12, help="built-in model: code windows at each prompt length")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=None, help="default: 128 on the built-in model, 96 on a GGUF")
    dtype_flag(p)
    p.add_argument("--out", type=Path, default=None, help="default: results/sampling_speed[_real].json")
    return p.parse_args(argv)


def temperatures(spelt: str) -> tuple[float, ...]:
    """--temperatures as numbers > 0, or one line naming the first that is not."""
    found = []
    for item in spelt.split(","):
        try:
            value = float(item)
        except ValueError:
            value = 0.0
        if not value > 0:
            raise SystemExit(f"error: --temperatures takes numbers > 0, got {item!r}")
        found.append(value)
    return tuple(found)


def windows_of(gguf: str | None, n: int, tokenizer) -> dict[str, list[Window]]:
    """The sets of windows, by name: n of code at each prompt length on the built-in model, code and prose on a GGUF."""
    if gguf is None:
        return {str(length): code_windows(tokenizer, n, length) for length in (64, 300)}
    return {"code": code_windows(tokenizer, 6, 256), "prose": prose_windows(tokenizer, 4, 256)}


def plot(report: dict, png: Path) -> None:
    sets = list(report["sets"])
    temps = report["sets"][sets[0]]
    bars = {f"temperature {t}": [report["sets"][s][t]["vs_transformers"] for s in sets] for t in temps}
    plot_bars(report, sets, bars, "speed against transformers' sampling", "sampling", png, size=(7, 4))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    temps = temperatures(args.temperatures)  # checked before anything loads
    gguf = str(real_model_file(None)) if args.gguf == "real" else args.gguf
    torch.set_num_threads(args.threads)
    lm, tokenizer = load(gguf or DEFAULT_MODEL, dtype=dtype_for(args.dtype))
    lm.eval()
    n = args.new_tokens or (128 if gguf is None else 96)
    model = Path(gguf).name if gguf else "built-in code model"
    report = {**heading(model, lm.base.dtype, threads=args.threads, new_tokens=n, rounds=args.rounds), "sets": {}}
    for name, windows in windows_of(gguf, args.windows, tokenizer).items():
        found = report["sets"][name] = study_sampling(lm, windows, n, temps, args.rounds)
        for t, v in found.items():
            print(f"{name}, temperature {t}: {v['vs_transformers']:.3f}x transformers' sampling, "
                  f"{v['tokens_per_call']:.2f} tokens a call")  # fmt: skip
    write_results(report, args.out or RESULTS / f"sampling_speed{'_real' if gguf else ''}.json", plot)
    return report


if __name__ == "__main__":
    main()
