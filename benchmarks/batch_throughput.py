#!/usr/bin/env python
"""Batches: tokens/s of blockwise decoding against `transformers`' batched greedy `generate`, at
batch sizes 1, 4 and 8, on the built-in model's own prompts (left-padded, of different lengths).

Each row: the batch size, the drafter and k, the seconds of each (median of `--reps` runs after a
warm-up, the two taking turns), the speedup, the calls (forward passes) of the batch and of its
slowest row, the batch's tokens per call, and whether every row equals `generate`'s.

    .venv/bin/python benchmarks/batch_throughput.py      # writes benchmarks/results/batch_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from blockdecode import DEFAULT_MODEL, load  # noqa: E402
from blockdecode.io import write_json  # noqa: E402


def left_padded(tokenizer, texts: list[str], prompt_tokens: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The texts' last tokens (at most `prompt_tokens`, fewer for every other row) as a left-padded batch."""
    rows = [tokenizer(t).input_ids[-(prompt_tokens // (1 + i % 2)) :] for i, t in enumerate(texts)]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def seconds(runs: dict, reps: int) -> tuple[dict[str, float], dict]:
    """The median seconds of each of `runs` over `reps` rounds after a warm-up, taking turns so that a
    machine's changing load weighs on each alike; and each one's last result."""
    out = {name: run() for name, run in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            began = time.perf_counter()
            out[name] = run()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}, out


@torch.inference_mode()
def measure(lm, ids, mask, new_tokens: int, drafter: str, k: int, reps: int, pad: int) -> dict:
    """One row of the table: this batch decoded by `transformers` and by blockwise decoding."""
    base = lm.base
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad)
    prompts = [row[m.bool()][None] for row, m in zip(ids, mask)]
    plan = lm.plan(drafter, k, prompts=prompts, rows=len(prompts))  # "auto": measured once, then cached
    runs = {
        "transformers": lambda: base.generate(ids, **kwargs),
        "blockwise": lambda: lm.generate(ids, new_tokens, attention_mask=mask, plan=plan),
    }
    took, outs = seconds(runs, reps)
    (hf_seconds, ours), (ref, out) = took.values(), outs.values()
    return {
        "batch": ids.shape[0],
        "drafter": f"{drafter}: {plan.drafter_name}, {plan.setting}",
        "k": k,
        "transformers_seconds": hf_seconds,
        "blockwise_seconds": ours,
        "speedup": hf_seconds / ours,
        "calls": out.stats.calls,
        "slowest_row_calls": max(s.calls for s in out.row_stats),
        "tokens_per_call": out.stats.mean_block_size,
        "exact": out.sequences.shape == ref.shape and torch.equal(out.sequences, ref),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--drafters", nargs="+", default=["auto", "heads", "ngram"])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 10])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/batch_throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    lm, tokenizer = load(args.model)
    texts = json.loads((Path(args.model) / "prompts.json").read_text())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for batch in args.batches:
        ids, mask = left_padded(tokenizer, texts[:batch], args.prompt_tokens)
        for drafter in args.drafters:
            for k in args.k:
                row = measure(lm, ids, mask, args.new_tokens, drafter, min(k, lm.k), args.reps, pad)
                rows.append(row)
                print(json.dumps(row), flush=True)
    write_json(Path(args.out), {"threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "rows": rows})


if __name__ == "__main__":
    main()
