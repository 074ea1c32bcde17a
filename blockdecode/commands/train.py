"""`blockdecode train`: proposal heads, an EAGLE-3 or a DFlash drafter, trained on a base (frozen, tuned, distilled)."""

from __future__ import annotations

import argparse
import os
import sys

from blockdecode.builtin import DEFAULT_MODEL
from blockdecode.commands.flags import (
    RESUME,
    config_from,
    random_seed,
    say_what_may_change,
)
from blockdecode.core.hardware import MIXED_PRECISIONS


def run(args: argparse.Namespace) -> None:
    from blockdecode.training.train import TrainConfig, train, training_summary

    cfg = config_from(TrainConfig, args)
    model = train(cfg)
    if os.environ.get("RANK", "0") == "0":  # once, not once per process under a launcher
        if cfg.head_type == "eagle3":
            layers = list(model.eagle3.config.aux_layers)
            print(f"saved an EAGLE-3 drafter (layers {layers}) with its model to {cfg.out}", file=sys.stderr)
        elif cfg.head_type == "dflash":
            shape = model.dflash.config
            print(f"saved a DFlash drafter (block {shape.block_size}, {shape.num_hidden_layers} layer(s), reading "
                  f"layers {list(shape.target_layer_ids)}) with its model to {cfg.out}", file=sys.stderr)  # fmt: skip
        else:
            print(f"saved {model.config.head_type} heads (k={model.k}) to {cfg.out}", file=sys.stderr)
        print(training_summary(cfg.out), file=sys.stderr)


def add_parser(sub) -> None:
    from blockdecode.training.config import BASE_LOSS_ON, HEAD_LOSSES, MODES, TARGETS, TRAIN_HEAD_TYPES, TrainConfig
    from blockdecode.training.train import RESUME_MUST_MATCH

    d = TrainConfig(base="", data=["-"], out="")
    modes = "\n".join(f"  {name:17} {text}" for name, text in MODES.items())
    p = sub.add_parser(
        "train",
        help="train proposal heads",
        description=f"Train proposal heads. Modes:\n{modes}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--base", default=DEFAULT_MODEL, help="transformers folder with its tokenizer, or GGUF (default: built-in)"
    )
    p.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="text files, folders of them, or .npy token-id arrays; for an encoder-decoder base, pairs: one .tsv "
        "(source and target in its last two columns) or two aligned text files",
    )
    p.add_argument("--out", required=True, help="where checkpoints, metrics.jsonl, training.png and the model go")
    p.add_argument("--k", type=int, default=d.k, help="block size: heads p2..pk are trained")
    p.add_argument("--mode", choices=tuple(MODES), default=d.mode)
    p.add_argument(
        "--head-type",
        choices=TRAIN_HEAD_TYPES,
        default=d.head_type,
        help="eagle3: an EAGLE-3 drafter (one layer reading three of the base's); dflash: a block drafter guessing "
        "the whole block (--k) in one pass; both for the serving engines too",
    )
    p.add_argument(
        "--aux-layers",
        type=int,
        nargs="+",
        default=None,
        help="eagle3 (three), dflash: the layers whose inputs it reads, vLLM's ids (0: the embeddings; default 2, "
        "N/2, N-3, or distinct layers of a shallow base)",
    )
    p.add_argument("--dflash-layers", type=int, default=d.dflash_layers, help="dflash: its decoder layers")
    p.add_argument("--anchors", type=int, default=d.anchors, help="dflash: blocks a training row holds")
    p.add_argument(
        "--gamma", type=float, default=d.gamma, help="dflash: block position i's loss weighs exp(-(i - 1) / gamma)"
    )
    p.add_argument("--head-hidden-size", type=int, default=d.head_hidden_size,
                   help="the heads' hidden layer (0: the base's width); eagle3: its MLP's (0: the base's)")  # fmt: skip
    p.add_argument(
        "--draft-vocab", type=int, default=d.draft_vocab, help="N: the heads score only their N most frequent targets"
    )
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch, split over processes")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate of the heads")
    p.add_argument("--base-lr", type=float, default=d.base_lr, help="learning rate of the base (finetune modes)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--head-loss", choices=HEAD_LOSSES, default=d.head_loss, help="random: one head per step")
    p.add_argument(
        "--targets", choices=tuple(TARGETS), default=d.targets, help="soft: the base's distribution, not its argmax"
    )
    p.add_argument("--head-weights", type=float, nargs="+", default=None, help="k-1 weights, heads 2..k (all)")
    p.add_argument("--base-loss-weight", type=float, default=d.base_loss_weight, help="finetune: base's own loss")
    p.add_argument(
        "--base-loss-on",
        choices=tuple(BASE_LOSS_ON),
        default=d.base_loss_on,
        help="finetune+distill: data measures the base's own loss on real rows, keeping its quality",
    )
    p.add_argument("--holdout", type=float, default=d.holdout, help="fraction of sequences held out")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts, help="held-out prompts decoded per eval")
    p.add_argument("--eval-new-tokens", type=int, default=d.eval_new_tokens, help="tokens decoded per eval prompt")
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--resume", action="store_true", help=RESUME)
    p.add_argument("--seed", type=random_seed, default=d.seed)
    p.add_argument("--mixed-precision", choices=MIXED_PRECISIONS, default=d.mixed_precision)
    p.add_argument(
        "--distill-prompts", type=int, default=d.distill_prompts, help="prompts (or source sentences) distilled"
    )
    p.add_argument("--distill-new-tokens", type=int, default=d.distill_new_tokens)
    p.add_argument("--distill-batch-size", type=int, default=d.distill_batch_size, help="rows generated at once")
    p.add_argument("--distill-beams", type=int, default=d.distill_beams, help="1: greedy; more: beam search")
    p.add_argument("--distill-cache", default=None, help="folder for distilled data, reused across runs")
    p.add_argument(
        "--distill-sources",
        nargs="+",
        default=None,
        metavar="FILE",
        help="encoder-decoder distill modes: text files of more source sentences, one a line (bible "
        "--extra-sources writes them); --distill-prompts are drawn evenly from the training sources and these",
    )
    p.add_argument(
        "--feature-cache",
        default=None,
        help="frozen/distill: a folder where the base's outputs on the training rows are computed once, reused",
    )
    p.add_argument("--patience", type=int, default=d.patience, help="stop after N evals with no longer block; 0: off")
    p.add_argument("--init-heads", default=None, help="a saved BlockwiseLM whose heads start this run")
    p.add_argument("--min-delta", type=float, default=d.min_delta, help="the block growth that counts (--patience)")
    p.add_argument(
        "--doubling-gain",
        type=float,
        default=d.doubling_gain,
        help="stop once the held-out block grows less than this over a doubling of steps (tokens); 0: off",
    )
    say_what_may_change(p, TrainConfig, RESUME_MUST_MATCH)
    p.set_defaults(func=run)
