"""`blockdecode pretrain-translation`: the built-in English-Spanish Marian, trained on Bible verse pairs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blockdecode.commands.flags import (
    add_run_arguments,
    config_from,
    say_what_may_change,
)


def run(args: argparse.Namespace) -> None:
    from blockdecode.pretraining.translation import TranslationConfig, train_translation

    cfg = config_from(TranslationConfig, args)
    train_translation(cfg)
    print(f"saved the translation model and its tokenizer to {Path(cfg.out) / 'model'}", file=sys.stderr)


def add_parser(sub) -> None:
    from blockdecode.pretraining.translation import RESUME_MUST_MATCH, TranslationConfig

    d = TranslationConfig(corpus="", out="")
    p = sub.add_parser(
        "pretrain-translation",
        help="train an English-Spanish Marian from scratch on the Bible verse pairs",
        description="Trains a shared BPE on the training verses (`blockdecode bible` writes them), then a "
        "MarianMTModel with label smoothing, evaluating held-out loss and greedy BLEU on the validation "
        "verses. --resume continues a stopped run.",
    )
    p.add_argument("--corpus", required=True, help="folder holding train.tsv and valid.tsv")
    p.add_argument("--out", required=True, help="tokenizer/, checkpoints, metrics.jsonl, translation.png, model/")
    p.add_argument(
        "--tokenizer",
        help="a folder whose tokenizer to use instead of training one (a draft model shares its target's)",
    )
    ints = ("vocab_size", "hidden_size", "encoder_layers", "decoder_layers", "heads", "intermediate_size", "context")
    ints += ("steps", "batch_tokens", "warmup_steps", "eval_every", "eval_verses", "checkpoint_every")
    add_run_arguments(p, d, ints, ("lr", "min_lr", "weight_decay", "label_smoothing"))
    say_what_may_change(p, TranslationConfig, RESUME_MUST_MATCH)
    p.set_defaults(func=run)
