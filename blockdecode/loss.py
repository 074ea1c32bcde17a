"""The heads' training objective, and the cross-entropy through a vocabulary projection it is made of.

`Objective` turns base + heads and a batch into each head's summed loss and accuracy, and
`combine_loss` those sums into the loss a step minimises. Head i at position t learns the token at
t+i (`head_targets`); head 1 is the base model's own next-token prediction.

Its cross-entropy goes a chunk of rows at a time (`linear_cross_entropy`). Training k-1 heads
projects every position k-1 times through the output layer; kept whole, the [B, T, k-1, V] logits
and their softmax dominate memory and time. This computes the same sum of cross-entropies, and its
exact gradients, chunk by chunk: the gradient with respect to a chunk's
logits (softmax minus the one-hot target) is known in the forward pass, so each chunk's logits
live only while it is processed and backward has nothing left to recompute.

Soft targets (Hydra++'s distillation) replace the one-hot target by a teacher's distribution:
the same projection of the teacher's hidden states (the base's own, at the position where it
predicts the target token), so each head learns what the base would say there, not only its argmax.
The gradient is then softmax minus the teacher's softmax."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from blockdecode.adapter import sequence_logits
from blockdecode.data import Pairs
from blockdecode.heads import path_tokens
from blockdecode.hf import decoder_output
from blockdecode.model import BlockwiseLM
from blockdecode.train_config import TrainConfig

IGNORE = -100


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, teacher, chunk: int, grad_enabled: bool):
        """hidden [N, D], weight [V, D], bias [V] or None, target [N], teacher [N, D] or None ->
        (loss sum, correct count)."""
        need_h, need_w = grad_enabled and hidden.requires_grad, grad_enabled and weight.requires_grad
        need_b = grad_enabled and bias is not None and bias.requires_grad
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros((), dtype=torch.long, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start : start + chunk], target[start : start + chunk]
            logits = nn.functional.linear(h, weight, bias).float()
            valid = t != IGNORE
            safe = t.clamp(min=0)
            lse = logits.logsumexp(-1)
            if teacher is None:
                picked = logits.gather(1, safe[:, None])[:, 0]
            else:
                with torch.no_grad():
                    p = nn.functional.linear(teacher[start : start + chunk], weight, bias).float().softmax(-1)
                picked = (p * logits).sum(-1)
            loss += ((lse - picked) * valid).sum()
            correct += ((logits.argmax(-1) == t) & valid).sum()
            if need_h or need_w or need_b:
                grad = torch.exp(logits - lse[:, None])  # d(loss)/d(logits): softmax minus the target's
                if teacher is None:
                    grad[torch.arange(len(t), device=t.device), safe] -= 1
                else:
                    grad -= p
                grad *= valid[:, None]
                if need_h:
                    grad_h[start : start + chunk] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_w:
                    grad_w += grad.T @ h.float()
                if need_b:
                    grad_b += grad.sum(0)
        ctx.save_for_backward(
            *(g if g is not None else torch.empty(0) for g in (grad_h, grad_w, grad_b)),
        )
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        ctx.needs = (need_h, need_w, need_b)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs
        w_dtype, b_dtype = ctx.dtypes
        return (
            grad_h * grad_loss.to(grad_h.dtype) if need_h else None,
            (grad_w * grad_loss).to(w_dtype) if need_w else None,
            (grad_b * grad_loss).to(b_dtype) if need_b else None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    projection: nn.Linear,
    target: torch.LongTensor,
    chunk: int = 1024,
    teacher: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of cross-entropies of `projection(hidden)` [..., V] against `target` [...] (IGNORE
    skipped), or with `teacher` [..., D] against the distribution `projection(teacher)` gives at
    the same rows (soft targets; `target` then only marks the rows scored and the hits counted),
    and how many argmaxes hit the target, never holding more than `chunk` rows of logits.
    Rows whose target is IGNORE (padding: half of a batch of verse pairs) add nothing to the loss
    or its gradients, so they are dropped before the projection rather than projected and masked."""
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    hidden, target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    if teacher is not None:
        teacher = teacher.detach().reshape(-1, teacher.shape[-1]).to(hidden.dtype)
    kept = (target != IGNORE).nonzero().squeeze(1)
    if len(kept) < len(target):
        hidden, target = hidden[kept], target[kept]
        teacher = teacher[kept] if teacher is not None else None
    return _LinearCrossEntropy.apply(
        hidden,
        projection.weight,
        projection.bias,
        target,
        teacher,
        chunk,
        torch.is_grad_enabled(),  # inside the Function's forward grad mode is always off
    )


def head_targets(input_ids: torch.LongTensor, k: int) -> torch.LongTensor:
    """labels [B, L, k]: labels[b, t, i-1] is the token head i must predict at position t,
    input_ids[b, t+i], or IGNORE where that lies beyond the sequence or is padding (< 0)."""
    b, length = input_ids.shape
    labels = input_ids.new_full((b, length, k), IGNORE)
    for i in range(1, k + 1):
        labels[:, : max(0, length - i), i - 1] = input_ids[:, i:]
    return labels.masked_fill(labels < 0, IGNORE)


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
        argmax and loss on these rows, from `blockdecode.features`) spare the base's forward. `anchor`:
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


def draft_projection(project: nn.Module, token_map: torch.LongTensor | None):
    """The projection the heads are trained through, and the map of targets into its rows: the full
    vocabulary, or the draft vocabulary's rows (gathered, so a fine-tuned projection still learns),
    where a target outside the map is IGNORE: never proposed, so never learnt, but still counted."""
    if token_map is None:
        return project, lambda target: target
    bias = project.bias[token_map] if project.bias is not None else None
    rows = SimpleNamespace(weight=project.weight[token_map], bias=bias)
    inverse = torch.full((project.weight.shape[0],), IGNORE, dtype=torch.long, device=token_map.device)
    inverse[token_map] = torch.arange(len(token_map), device=token_map.device)
    return rows, lambda target: torch.where(target == IGNORE, target, inverse[target.clamp(min=0)])


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
