"""The heads' training objective: base + heads and a batch -> each head's summed loss and accuracy
(`Objective`), and those sums -> the loss a step minimises (`combine_loss`). Head 1 is the base
model's own next-token prediction; its cross-entropies go through `blockdecode.core.loss`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockdecode.core.hf import decoder_output
from blockdecode.core.loss import IGNORE, draft_projection, head_targets, linear_cross_entropy
from blockdecode.decoding.adapter import sequence_logits
from blockdecode.drafters.heads import path_tokens
from blockdecode.model import BlockwiseLM
from blockdecode.training.config import TrainConfig
from blockdecode.training.data import Pairs


class Objective(nn.Module):
    """Base + heads -> the training loss and per-head accuracy; the module accelerate wraps."""

    def __init__(self, model: BlockwiseLM, cfg: TrainConfig):
        super().__init__()
        self.model = model
        self.cfg = cfg

    def train(self, mode: bool = True) -> Objective:
        """A frozen base stays in inference mode (no dropout) whatever the heads do."""
        super().train(mode)
        self.model.base.train(mode and self.cfg.finetune)
        return self

    def forward(
        self,
        batch: torch.LongTensor | Pairs,
        heads: list[int],
        features: tuple | None = None,
        anchor: torch.LongTensor | Pairs | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy per head [k] (head 1 is the base's own; heads 2..k not listed
        stay 0) and per-head [k, 2] (correct, count) tallies. `batch`: token rows of a causal LM,
        or an encoder-decoder's pairs, whose decoder sequences the heads learn. Sums, not means, so the loss can
        be normalised by the token count over all processes (`combine_loss`).

        A frozen base runs in inference mode, once per batch, with no autograd graph; the heads'
        k-1 projections through the vocabulary go chunk by chunk (`linear_cross_entropy`), so
        their [B, T, k-1, V] logits never exist at once. `features` (a frozen base's decoder outputs,
        argmax and loss on these rows, from `blockdecode.training.features`) spare the base's forward. `anchor`:
        other rows (real data) on which the base's own loss and accuracy (head 1's) are measured instead."""
        base, k = self.model.base, self.cfg.k
        input_ids, source, source_mask = decoder_inputs(batch)
        labels = head_targets(input_ids, k)
        counts = (labels != IGNORE).sum(dim=(0, 1)).float()  # [k]: target tokens per head
        target = labels[..., 0].flatten()
        tallies = torch.zeros(k, 2, device=input_ids.device)
        if features is not None:
            h, argmax, base_loss = features
            sums = [base_loss.sum()]  # already 0 where there is no target
        else:
            trains_base = self.cfg.finetune and self.training
            with decoder_output(base) as hidden, torch.enable_grad() if trains_base else torch.inference_mode():
                logits = sequence_logits(base, input_ids.clamp(min=0), source, source_mask)
            h = hidden[0] if trains_base else hidden[0].clone()  # an inference tensor cannot enter the graph
            argmax = logits.argmax(-1)
            sums = [F.cross_entropy(logits.flatten(0, 1).float(), target, ignore_index=IGNORE, reduction="sum")]
        tallies[0] = torch.stack([((argmax.flatten() == target) & (target != IGNORE)).sum(), counts[0]])
        if anchor is not None:
            sums[0], tallies[0] = self.base_loss(anchor)
        embeds = None
        if self.model.heads.takes_tokens:  # teacher forcing: the base's newest token, then the data's
            embeds = base.get_input_embeddings()(path_tokens(argmax, input_ids, k))
        # one [B, L, D] view per head: slicing each head's rows out of [B, L, k-1, D] would make every
        # head's backward fill and add a gradient of the whole stack
        states = self.model.heads(h, embeds).unbind(-2)
        project, short = draft_projection(base.get_output_embeddings(), self.model.token_map)
        soft = self.cfg.targets == "soft"
        for i in range(2, k + 1):
            if i not in heads:
                sums.append(sums[0].new_zeros(()))
                continue
            target = short(labels[:, : -(i - 1), i - 1])
            teacher = h[:, i - 1 :] if soft else None  # where the base itself predicts head i's token
            loss, hits = linear_cross_entropy(
                states[i - 2][:, : -(i - 1)], project, target, self.cfg.loss_chunk, teacher
            )
            sums.append(loss)
            tallies[i - 1] = torch.stack([hits.float(), counts[i - 1]])
        return torch.stack(sums), tallies

    def base_loss(self, batch: torch.LongTensor | Pairs) -> tuple[torch.Tensor, torch.Tensor]:
        """The base's own summed next-token loss on `batch`, and its (correct, count) tally."""
        ids, source, mask = decoder_inputs(batch)
        target = head_targets(ids, 1)[..., 0].flatten()
        with torch.enable_grad() if self.training else torch.inference_mode():
            logits = sequence_logits(self.model.base, ids.clamp(min=0), source, mask)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), target, ignore_index=IGNORE, reduction="sum")
        hits = ((logits.argmax(-1).flatten() == target) & (target != IGNORE)).sum()
        return loss, torch.stack([hits, (target != IGNORE).sum()]).float()


def decoder_inputs(batch: torch.LongTensor | Pairs) -> tuple[torch.LongTensor, torch.Tensor | None, ...]:
    """The token rows the heads learn (a causal LM's rows, or an encoder-decoder's decoder side), and for
    pairs the source ids and mask the encoder reads (padding -1 turned into id 0, masked out)."""
    if not isinstance(batch, Pairs):
        return batch, None, None
    return batch.decoder, batch.source.clamp(min=0), (batch.source >= 0).long()


def combine_loss(sums: torch.Tensor, counts: torch.Tensor, heads: list[int], cfg: TrainConfig) -> torch.Tensor:
    """The objective: weighted mean over the heads scored of each head's per-token loss, plus
    the base's own loss in finetune modes. `counts` are target tokens per head over the whole
    global batch, so every token weighs the same however the batch is split over processes."""
    weights = cfg.head_weights or [1.0] * (cfg.k - 1)
    total = sum(weights[i - 2] for i in heads)
    per_token = sums / counts.clamp(min=1)
    loss = sum(per_token[i - 1] * (weights[i - 2] / total) for i in heads)
    if cfg.finetune:
        loss = loss + cfg.base_loss_weight * per_token[0]
    return loss
