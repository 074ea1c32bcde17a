#!/usr/bin/env python
"""Training throughput of the proposal heads, per mode, on the CPU (or any device accelerate picks).

Builds a ~15M-parameter random Llama (vocab 8192, width 384, 6 layers) and a byte-level BPE tokenizer
of 8192 trained on --files standard-library sources (blockdecode.pretraining.corpus), saves both, then runs
blockdecode.training.train.train for a few steps in each mode and precision asked for. For each run it reports

- tokens/s: training tokens per second from metrics.jsonl (tokens_per_s of every log window after the
  first, which holds the warm-up step; their median, and the first window's separately);
- the held-out mean accepted block size measured by the run's own evaluation at step 0 (untrained heads)
  and at the last step;
- wall time of the whole run (load, distillation if any, evaluations, saving included).

Distillation is generated once (distill modes share --distill-cache) and timed on its own.

    .venv/bin/python benchmarks/train_throughput.py                       # all four modes, fp32; frozen in bf16 too
    .venv/bin/python benchmarks/train_throughput.py --modes frozen --precisions no,bf16 --steps 10
    .venv/bin/python benchmarks/train_throughput.py --quick               # tiny model, checks the plumbing
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from blockdecode.core.io import read_text  # noqa: E402
from blockdecode.core.toy import toy_model  # noqa: E402
from blockdecode.pretraining.corpus import stdlib_files, train_tokenizer
from blockdecode.training.config import MODES, TrainConfig  # noqa: E402
from blockdecode.training.distill import distill_sequences  # noqa: E402
from blockdecode.training.train import base_and_tokenizer, train  # noqa: E402

QUICK = dict(vocab=1024, width=64, layers=2, heads=4, files=20, steps=6, seq_len=64, k=4, distill_prompts=8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)}")
    p.add_argument("--precisions", default="no", help="mixed_precision values for every mode: no,bf16")
    p.add_argument("--bf16-modes", default="frozen", help="modes also run with mixed_precision=bf16 ('' for none)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--log-every", type=int, default=5, help="tokens/s is measured per log window")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--base-lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--files", type=int, default=100, help="stdlib files for the tokenizer and the training data")
    p.add_argument("--eval-prompts", type=int, default=4)
    p.add_argument("--eval-prompt-len", type=int, default=32)
    p.add_argument("--eval-new-tokens", type=int, default=64)
    p.add_argument("--distill-prompts", type=int, default=64)
    p.add_argument("--distill-prompt-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--workdir", default=None, help="where the base model and runs go (default: a temporary folder)")
    p.add_argument("--out", default="benchmarks/results/train_throughput.json", help="JSON results path")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: checks the plumbing in ~30 s")
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
        args.out = args.out.replace(".json", "_quick.json")
    unknown = {m for m in args.modes.split(",") + [m for m in args.bf16_modes.split(",") if m] if m not in MODES}
    if unknown:
        p.error(f"unknown mode(s) {', '.join(sorted(unknown))}: choose from {', '.join(MODES)}")
    return args


def evenly(items: list, n: int) -> list:
    """n items spread over the whole list (the stdlib sorted by path is clustered by package)."""
    if n >= len(items):
        return items
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)] if n > 1 else items[:1]


def build_base(args: argparse.Namespace, root: Path) -> tuple[Path, list[Path], int]:
    files = evenly(stdlib_files(), args.files)
    tok = train_tokenizer((read_text(f) for f in files), vocab_size=args.vocab)
    model = toy_model(
        "llama",
        vocab=len(tok),
        width=args.width,
        layers=args.layers,
        heads=args.heads,
        std=0.02,
        context=args.context,
    )
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = tok.eos_token_id
    base = root / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    return base, files, sum(p.numel() for p in model.parameters())


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_one(args: argparse.Namespace, base: Path, files: list[Path], root: Path, mode: str, precision: str) -> dict:
    name = f"{mode}-{precision}".replace("+", "_")
    cfg = TrainConfig(
        base=str(base),
        data=[str(f) for f in files],
        out=str(root / name),
        k=args.k,
        mode=mode,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        base_lr=args.base_lr,
        warmup_steps=args.warmup_steps,
        eval_every=args.steps,
        log_every=args.log_every,
        checkpoint_every=args.steps,
        eval_batches=2,
        eval_prompts=args.eval_prompts,
        eval_prompt_len=args.eval_prompt_len,
        eval_new_tokens=args.eval_new_tokens,
        mixed_precision=precision,
        distill_prompts=args.distill_prompts,
        distill_prompt_len=args.distill_prompt_len,
        distill_new_tokens=args.seq_len - args.distill_prompt_len,  # distilled rows as long as seq_len
        distill_cache=str(root / "distill-cache"),
    )
    shutil.rmtree(cfg.out, ignore_errors=True)  # the benchmark's own run: timed afresh, never resumed
    load = loadavg()
    start = time.perf_counter()
    model = train(cfg)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    evals = [r for r in rows if "eval_mean_block_size" in r]
    heads_params = sum(p.numel() for p in model.heads.parameters())
    return {
        "mode": mode,
        "mixed_precision": precision,
        "steps": args.steps,
        "tokens_per_step": args.batch_size * args.seq_len,
        "tokens_per_s_median": statistics.median(rates[1:]) if len(rates) > 1 else (rates[0] if rates else None),
        "tokens_per_s_first_window": rates[0] if rates else None,
        "tokens_per_s_windows": rates,
        "block_size_before": evals[0]["eval_mean_block_size"] if evals else None,
        "block_size_after": evals[-1]["eval_mean_block_size"] if evals else None,
        "head_acc_after": evals[-1]["eval_head_acc"] if evals else None,
        "eval_base_loss_before": evals[0]["eval_base_loss"] if evals else None,
        "eval_base_loss_after": evals[-1]["eval_base_loss"] if evals else None,
        "final_train_loss": next((r["loss"] for r in reversed(rows) if "loss" in r), None),
        "wall_s": wall,
        "heads_params": heads_params,
        "loadavg_before": load,
        "loadavg_after": loadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    runs = [(m, p) for m in modes for p in args.precisions.split(",")]
    runs += [(m, "bf16") for m in args.bf16_modes.split(",") if m and (m, "bf16") not in runs]

    with tempfile.TemporaryDirectory(prefix="train-throughput-") as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        base, files, params = build_base(args, root)
        print(
            f"base: {params / 1e6:.1f}M parameters, tokenizer and data from {len(files)} stdlib files "
            f"({time.perf_counter() - t0:.1f} s to build)",
            file=sys.stderr,
        )

        distill_s = None
        if any(m.endswith("distill") for m, _ in runs):
            # Generate the distilled data once, timed, into the shared cache the distill runs then read.
            probe = TrainConfig(
                base=str(base),
                data=[str(f) for f in files],
                out=str(root / "probe"),
                k=args.k,
                seq_len=args.seq_len,
                distill_prompts=args.distill_prompts,
                distill_prompt_len=args.distill_prompt_len,
                distill_new_tokens=args.seq_len - args.distill_prompt_len,
                distill_cache=str(root / "distill-cache"),
            )
            from blockdecode.training.data import load_tokens, pack, split

            model, tok = base_and_tokenizer(probe)
            eos = model.generation_config.eos_token_id
            sequences = pack(load_tokens(probe.data, tok, eos), probe.seq_len)
            start = time.perf_counter()
            distill_sequences(model, split(sequences, probe.holdout)[0], probe)
            distill_s = time.perf_counter() - start
            del model

        results = []
        for mode, precision in runs:
            print(f"--- {mode} ({precision})", file=sys.stderr)
            results.append(run_one(args, base, files, root, mode, precision))

    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")},
        "base_params": params,
        "distill_generation_s": distill_s,
        "distilled_tokens": args.distill_prompts * args.seq_len if distill_s is not None else None,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "runs": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    print(
        f"\n{params / 1e6:.1f}M-parameter Llama, k={args.k}, batch {args.batch_size} x {args.seq_len} tokens, "
        f"{args.steps} steps, {torch.get_num_threads()} threads"
    )
    if distill_s is not None:
        print(
            f"distillation: {args.distill_prompts} prompts x {args.seq_len - args.distill_prompt_len} new tokens "
            f"in {distill_s:.2f} s"
        )
    header = f"{'mode':18} {'precision':9} {'tok/s':>8} {'first':>8} {'block before':>12} {'after':>6} {'wall s':>7}"
    print(header)
    for r in results:
        print(
            f"{r['mode']:18} {r['mixed_precision']:9} {r['tokens_per_s_median'] or 0:8.0f} "
            f"{r['tokens_per_s_first_window'] or 0:8.0f} {r['block_size_before'] or 0:12.2f} "
            f"{r['block_size_after'] or 0:6.2f} {r['wall_s']:7.1f}"
        )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
