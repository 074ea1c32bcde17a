"""`blockdecode pretrain`: the built-in base, trained from scratch on Python source."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blockdecode.commands.flags import (
    add_run_arguments,
    config_from,
    say_what_may_change,
)
from blockdecode.core.io import check_writable
from blockdecode.pretraining.corpus import CORPUS_PACKAGES


def run(args: argparse.Namespace) -> None:
    from blockdecode.pretraining.pretrain import CorpusConfig, PretrainConfig, prepare_corpus, pretrain
    from blockdecode.training.loop import check_new_run

    # Every setting is checked, and --out found writable and free, before the corpus is read or written.
    cfg = config_from(PretrainConfig, args)
    corpus = config_from(CorpusConfig, args, out=args.corpus)
    check_writable(Path(args.out))
    check_new_run(cfg.out, cfg.resume)
    prepare_corpus(corpus)
    pretrain(cfg)
    print(f"saved the base model and its tokenizer to {Path(cfg.out) / 'model'}", file=sys.stderr)


def add_parser(sub) -> None:
    from blockdecode.pretraining.pretrain import RESUME_MUST_MATCH, PretrainConfig

    d = PretrainConfig(corpus="", out="")
    p = sub.add_parser(
        "pretrain",
        help="train a base model from scratch on Python source: the standard library's, torch's, transformers'",
        description="Prepare the corpus (split by file, BPE tokenizer trained on the training files) unless "
        "--corpus already holds it, then train a Llama on it. --resume continues a stopped run.",
    )
    p.add_argument("--corpus", required=True, help="folder for tokenizer.json and {train,heldout}.npy (reused)")
    p.add_argument("--out", required=True, help="checkpoints, metrics.jsonl, pretrain.png and model/ go here")
    p.add_argument("--root", default=None, help="a folder of .py files instead of the standard library")
    p.add_argument(
        "--packages", nargs="*", default=list(CORPUS_PACKAGES), help="installed packages whose source joins the corpus"
    )
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files (quick trials)")
    ints = ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "context", "steps", "batch_size")
    ints += ("seq_len", "warmup_steps", "eval_every", "eval_batches", "checkpoint_every")
    add_run_arguments(p, d, ints, ("lr", "min_lr", "weight_decay"))
    p.add_argument("--no-compile", dest="compile", action="store_false", help="train without torch.compile")
    say_what_may_change(p, PretrainConfig, RESUME_MUST_MATCH)
    p.set_defaults(func=run)
