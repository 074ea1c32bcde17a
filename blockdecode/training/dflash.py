"""Training a DFlash block drafter on a frozen base (`--head-type dflash`): blocks after random anchors of each
row, all in one pass, against the base's own greedy continuation from each anchor; its layers' features cached or
computed each step."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from blockdecode.core.hf import vocab_size
from blockdecode.decoding.loop import decode_prompts
from blockdecode.decoding.plan import make_plan
from blockdecode.drafters.dflash.config import config_for
from blockdecode.drafters.dflash.drafting import DFlashDrafter
from blockdecode.drafters.dflash.model import DFlash
from blockdecode.drafters.heads import most_frequent
from blockdecode.loading import has_heads
from blockdecode.model import BlockwiseLM
from blockdecode.training.config import TrainConfig
from blockdecode.training.data import decoder_rows, eval_prompts
from blockdecode.training.distill import distilled
from blockdecode.training.eagle3 import Eagle3Objective, Eagle3Training, fit_drafter


class DFlashObjective(Eagle3Objective):
    """A DFlash drafter and the frozen base it reads, as one module for accelerate: its forward is the anchored
    blocks' loss on a batch (`DFlash.loss`), the base's features read from the cache or computed."""

    layers_attribute = "target_layer_ids"

    def forward(self, tokens, aux=None, argmax=None, anchors: int = 16, gamma: float = 4.0, generator=None):
        if aux is None:
            aux, argmax = self.features(tokens)
        rows = decoder_rows(tokens)  # an encoder-decoder's blocks are its decoder's
        return self.drafter.loss(self.base[0], aux.to(self.drafter.fc.weight.dtype), rows, argmax, anchors, gamma,
                                 generator)  # fmt: skip


class DFlashTraining(Eagle3Training):
    """A DFlash drafter trained on a frozen base (`--head-type dflash`): each step's rows anchored at `--anchors`
    random positions, each position of a block weighted exp(-(i - 1) / gamma); the features of the base's layers
    cached (`--feature-cache`) or computed each step (several processes)."""

    name = "dflash"

    def loss(self, model, step: int) -> tuple[torch.Tensor, int]:
        cfg, acc = self.config, self.accelerator
        tokens, aux, argmax = self.batch(step)
        seed = cfg.seed * 1_000_003 + step * acc.num_processes + acc.process_index
        generator = torch.Generator().manual_seed(seed)
        loss, tallies = model(tokens, aux, argmax, cfg.anchors, cfg.gamma, generator)
        self.tallies += acc.reduce(tallies.to(acc.device), reduction="sum").cpu()
        return loss, tokens.numel()

    @torch.inference_mode()
    def evaluate(self, model: DFlashObjective) -> dict:
        """Held-out loss and accuracy at each block position (the same anchors each time), and the mean accepted
        block of the drafter's chain decoding held-out prompts."""
        cfg, device = self.config, self.accelerator.device
        was_training = model.training
        model.eval()
        losses, tallies = [], torch.zeros(cfg.k - 1, 2)
        for b in range(min(cfg.eval_batches, math.ceil(len(self.held_out) / cfg.batch_size))):
            rows = self.held_out[b * cfg.batch_size : (b + 1) * cfg.batch_size].to(device)
            loss, t = model(rows, anchors=cfg.anchors, gamma=cfg.gamma, generator=torch.Generator().manual_seed(b))
            losses, tallies = losses + [float(loss)], tallies + t
        prompts, budget, eos = eval_prompts(self.lm.base, self.held_out, cfg)
        plan = make_plan(self.lm.base, DFlashDrafter(model.drafter, self.lm.base), cfg.k, eos_token_id=eos)
        _, stats = decode_prompts(self.lm.base, prompts, budget, plan)
        model.train(was_training)
        return {
            "eval_loss": sum(losses) / max(1, len(losses)),
            "eval_head_acc": (tallies[:, 0] / tallies[:, 1].clamp(min=1)).tolist(),
            "eval_mean_block_size": stats.mean_block_size,
        }

    def save(self, model: DFlashObjective, records: list[dict], folder: Path) -> None:
        """The drafter (dflash/) beside the heads of the model it was trained on, which it names as its base, with
        the run's record."""
        evals = [r for r in records if "eval_loss" in r]
        steps = max((r["step"] for r in records), default=0)
        cfg, shape = self.config, model.drafter.config
        record = {
            "head_type": "dflash",
            "mode": cfg.mode,
            "block_size": shape.block_size,
            "layers": shape.num_hidden_layers,
            "target_layer_ids": list(shape.target_layer_ids),
            "mask_token_id": shape.mask_token_id,
            "anchors": cfg.anchors,
            "gamma": cfg.gamma,
            **({"draft_vocab": cfg.draft_vocab, "draft_vocab_coverage": self.coverage} if cfg.draft_vocab else {}),
            "steps": steps,
            "tokens_seen": round(steps * cfg.batch_size * self.row_tokens),
            "heldout_loss": evals[-1]["eval_loss"] if evals else None,
            "heldout_accuracy_by_position": evals[-1]["eval_head_acc"] if evals else None,
            "mean_block_size": evals[-1]["eval_mean_block_size"] if evals else None,
        }
        self.lm.dflash = model.drafter
        self.lm.write_save(folder, save_base=False, training=record, tokenizer=self.tokenizer)


def mask_token(rows: torch.LongTensor, vocab: int) -> int:
    """The block's mask id: the id the training rows use least (none, where one exists; the highest such), so
    that its embedding, the base's own, carries no text the drafter would read into the masks."""
    counts = rows[rows >= 0].flatten().bincount(minlength=vocab)[:vocab]
    least = counts.min()
    return int((counts == least).nonzero().max())


def train_dflash(
    cfg: TrainConfig, loop, base, tokenizer, train_seqs, held_out, digest, state, callback, extra=()
) -> BlockwiseLM:
    """`train` for `--head-type dflash`: a block drafter on the frozen base, beside the heads `cfg.base` holds (or
    untrained ones); the model it saves decodes with drafter="dflash" and, for a decoder-only base, exports to the
    serving engines. A block is `cfg.k` positions: the newest token and k - 1 masks. An encoder-decoder's drafter
    reads its decoder's layers, learning the base's own translations of the sources (and of `extra` sources)."""
    acc = loop.accelerator
    lm = (
        BlockwiseLM.from_pretrained(cfg.base, base=base)
        if has_heads(cfg.base)
        else BlockwiseLM.from_base(base, k=cfg.k)
    )
    lm.base_location = lm.base_location or str(Path(cfg.base).resolve())
    vocab = vocab_size(base)
    if cfg.distill:
        with acc.main_process_first():
            train_seqs = distilled(base.to(acc.device), train_seqs, cfg, loop.main, extra)
    decoded = decoder_rows(train_seqs)
    mask = mask_token(decoded, vocab)
    shape = config_for(base, cfg.draft_vocab or vocab, mask, cfg.k, cfg.dflash_layers, cfg.aux_layers,
                       shared_head=not cfg.draft_vocab)  # fmt: skip
    drafter = DFlash(shape)
    token_map, coverage = most_frequent(decoded, vocab, cfg.draft_vocab or vocab)
    drafter.set_vocabulary(token_map)
    base.requires_grad_(False)
    objective = DFlashObjective(drafter.to(acc.device), base.to(acc.device)).train()
    task = DFlashTraining(cfg, lm, objective, train_seqs, held_out, digest, tokenizer, acc)
    fit_drafter(task, loop, coverage, shape.target_layer_ids, state, callback)
    return lm
