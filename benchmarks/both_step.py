#!/usr/bin/env python
"""What one training step of the paper's "Both" (base and heads fine-tuned together on distilled rows,
`blockdecode train --mode finetune+distill`) costs per token, against the base's own pretraining step.

Every arm runs the built-in model (fp32 weights, bf16 autocast where the CPU computes bf16 natively, as
training does) on the same batch of standard-library token rows, forward, backward and an AdamW step:

- pretraining: the base's next-token loss alone, eager and `torch.compile`d (as `blockdecode pretrain`);
- Both, base loss on real data (`--base-loss-on data`): the heads on the distilled rows and the base's
  loss on a second batch of real rows, two passes of the base;
- Both, base loss on the distilled rows (`--base-loss-on rows`, the paper's: fine-tuning on distilled
  data): one pass;
- the heads alone on a frozen base (`--mode distill`), for what the heads' own work costs.

Arms take turns in every round; the medians go to --out as JSON. Pause other jobs while it runs.

    python benchmarks/both_step.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from blockdecode import DEFAULT_MODEL, BlockwiseLM  # noqa: E402
from blockdecode.bench.report import cpu_name  # noqa: E402
from blockdecode.core.io import (
    read_text,  # noqa: E402
    write_json,  # noqa: E402
)
from blockdecode.loading import load_tokenizer  # noqa: E402
from blockdecode.pretraining.corpus import stdlib_files
from blockdecode.training.config import TrainConfig  # noqa: E402
from blockdecode.training.loop import Precision  # noqa: E402
from blockdecode.training.objective import Objective, combine_loss  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="a saved BlockwiseLM (base and heads)")
    p.add_argument("--out", default="benchmarks/results/both_step.json")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=192, help="tokens a row (the distilled rows' 32 + 160)")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds; the first is a warm-up")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled pretraining arm")
    args = p.parse_args(argv)
    for name in ("batch_size", "seq_len", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.rounds < 2:
        p.error(f"--rounds must be at least 2 (the first warms up), got {args.rounds}")
    if not Path(args.model).is_dir():
        p.error(f"--model {args.model} is not a folder")
    return args


def stdlib_rows(tokenizer, rows: int, length: int) -> torch.LongTensor:
    """`rows` x `length` tokens of standard-library source, consecutive."""
    ids: list[int] = []
    for path in stdlib_files():
        ids += tokenizer(read_text(path)).input_ids
        if len(ids) >= 2 * rows * length:
            break
    return torch.tensor(ids[: 2 * rows * length]).view(2 * rows, length)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    lm = BlockwiseLM.from_pretrained(args.model, dtype=torch.float32)
    tokens = stdlib_rows(load_tokenizer(args.model), args.batch_size, args.seq_len)
    rows, real = tokens[: args.batch_size], tokens[args.batch_size :]
    precision = Precision("auto", torch.device("cpu"))
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-9)  # tiny steps: every arm sees the same model
    heads = list(range(2, lm.k + 1))

    def lm_loss(ids: torch.LongTensor) -> torch.Tensor:
        logits = lm.base(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    def objective(mode: str, on: str = "rows"):
        cfg = TrainConfig(
            base=args.model, data=["-"], out="-", mode=mode, k=lm.k, base_loss_on=on,
            draft_vocab=lm.config.draft_vocab, head_hidden_size=lm.config.head_hidden_size,
        )  # fmt: skip
        task = Objective(lm, cfg).train()
        anchor = real if on == "data" else None
        return lambda: combine_loss(*fixed_counts(task(rows, heads, None, anchor)), heads, cfg)

    arms = {
        "pretraining, eager": lambda: lm_loss(rows),
        "Both, base loss on real data (two passes)": objective("finetune+distill", "data"),
        "Both, base loss on the distilled rows (one pass)": objective("finetune+distill"),
        "heads alone, frozen base": objective("distill"),
    }
    compile_s = None
    if args.compile:
        compiled = torch.compile(lm_loss)
        arms["pretraining, compiled"] = lambda: compiled(rows)
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for rnd in range(args.rounds):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            frozen = name.startswith("heads alone")
            lm.base.requires_grad_(not frozen)
            start = time.perf_counter()
            with precision.autocast():
                loss = arms[name]()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            if rnd:
                seconds[name].append(elapsed)
            elif name == "pretraining, compiled":
                compile_s = elapsed
        print(f"round {rnd + 1}/{args.rounds}", flush=True)
    tokens_per_step = args.batch_size * args.seq_len
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    report = {
        "config": vars(args),
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "precision": precision.mode},
        "tokens_per_step": tokens_per_step,
        "compile_s": compile_s,
        "seconds_per_step": medians,
        "tokens_per_s": {name: tokens_per_step / s for name, s in medians.items()},
    }
    write_json(Path(args.out), report)
    base = report["tokens_per_s"]["pretraining, eager"]
    for name, rate in report["tokens_per_s"].items():
        print(f"{name}: {rate:,.0f} tokens/s ({rate / base:.2f}x eager pretraining)", flush=True)
    return report


def fixed_counts(found: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The objective's sums and its token counts per head, as `combine_loss` takes them (one process)."""
    sums, tallies = found
    return sums, tallies[:, 1]


if __name__ == "__main__":
    main()
