#!/usr/bin/env python
"""Does a base model write code a reader recognises? Two measures of the built-in base (or any):

- its greedy continuations of the demo's prompts and of `def fib(n):`, 128 tokens each, and whether
  each holds a loop: the same run of 8 tokens three times or more in a row (the target: no loop in at
  least 4 of the 5), and, stricter, whether a whole line recurs three times in a row;
- its held-out loss on a corpus folder's held-out splits (`blockdecode pretrain --corpus`), per token
  and per byte of text (bytes per token from the corpus' files.json), so a tokenizer cannot flatter it.

    .venv/bin/python benchmarks/base_quality.py --model runs/base/model --corpus runs/corpus
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import heading  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from blockdecode import DEFAULT_MODEL  # noqa: E402
from blockdecode.commands.demo import PROMPTS  # noqa: E402
from blockdecode.core.io import write_json  # noqa: E402
from blockdecode.decoding.reference import greedy_generate  # noqa: E402
from blockdecode.loading import load_base  # noqa: E402
from blockdecode.pretraining.pretrain import PretrainConfig, heldout_batches, heldout_loss  # noqa: E402

FIB = "def fib(n):"


def loop_in(tokens: list[int], n: int = 8, times: int = 3) -> tuple[int, int] | None:
    """(start, period) of the first run of `n` or more tokens that repeats back to back `times` times
    or more, with any period from 1 to n (a period p < n repeats an n-token run too); None if none."""
    for start in range(len(tokens)):
        for period in range(1, n + 1):
            span = max(n, period) + period * (times - 1)  # an n-token window, then times-1 more periods
            if start + span > len(tokens):
                continue
            window = tokens[start : start + span]
            if all(window[i] == window[i - period] for i in range(period, span)):
                return start, period
    return None


def repeated_line(text: str, times: int = 3) -> str | None:
    """The first non-blank line that recurs `times` times in a row: a loop of whole lines, which a line of
    more than 8 tokens hides from `loop_in`; None if there is none."""
    lines = text.splitlines()
    for i in range(len(lines) - times + 1):
        if lines[i].strip() and all(lines[i + j] == lines[i] for j in range(1, times)):
            return lines[i]
    return None


def continuations(model, tokenizer, prompts: list[str], new_tokens: int) -> list[dict]:
    rows = []
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = greedy_generate(model, ids, new_tokens, eos_token_id=[])[0, ids.shape[1] :].tolist()
        found, decoded = loop_in(out), tokenizer.decode(out)
        rows.append({"prompt": text, "text": decoded, "loop": found, "repeated_line": repeated_line(decoded)})
    return rows


def heldout(model, corpus: Path, batches: int) -> dict:
    stats = json.loads((corpus / "files.json").read_text())
    cfg = PretrainConfig(corpus=str(corpus), out="", eval_batches=batches)
    result = {}
    for split in ("heldout", "heldout_packages"):
        if (corpus / f"{split}.npy").is_file():
            tokens = np.load(corpus / f"{split}.npy", mmap_mode="r")
            loss = heldout_loss(model, heldout_batches(tokens, cfg))
            bpt = stats[split]["bytes_per_token"]
            result[split] = {"loss": loss, "bytes_per_token": bpt, "loss_per_byte": loss / bpt}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--corpus", default=None, help="a corpus folder for the held-out losses")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/base_quality.json")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    model = load_base(args.model, torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = continuations(model, tokenizer, [*PROMPTS, FIB], args.new_tokens)
    report = {
        **heading(args.model, torch.float32, threads=torch.get_num_threads()),
        "continuations": rows,
        "without_a_loop": sum(r["loop"] is None for r in rows),
        "without_a_repeated_line": sum(r["repeated_line"] is None for r in rows),
        "of": len(rows),
        "heldout": heldout(model, Path(args.corpus), args.eval_batches) if args.corpus else None,
    }
    write_json(Path(args.out), report)
    for r in rows:
        line = f"; line repeated: {r['repeated_line'].strip()!r}" if r["repeated_line"] else ""
        print(f"{r['prompt'].splitlines()[0]!r}: {'loops at ' + str(r['loop']) if r['loop'] else 'no loop'}{line}")
    print(f"{report['without_a_loop']} of {report['of']} continuations without a loop of 8 tokens, "
          f"{report['without_a_repeated_line']} without a line three times in a row")  # fmt: skip
    if report["heldout"]:
        print(json.dumps(report["heldout"], indent=2))


if __name__ == "__main__":
    main()
