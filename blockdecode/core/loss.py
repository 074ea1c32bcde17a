"""Cross-entropy through a vocabulary projection, a chunk of rows at a time, and the targets it learns.

Training k-1 heads projects every position k-1 times through the output layer; kept whole, the
[B, T, k-1, V] logits and their softmax dominate memory and time. This computes the same sum of
cross-entropies, and its exact gradients, chunk by chunk: the gradient with respect to a chunk's
logits (softmax minus the one-hot target) is known in the forward pass, so each chunk's logits
live only while it is processed and backward has nothing left to recompute. Head i at position t
learns the token at t+i (`head_targets`); a draft vocabulary maps targets into its rows
(`draft_projection`).

Soft targets (Hydra++'s distillation) replace the one-hot target by a teacher's distribution:
the same projection of the teacher's hidden states (the base's own, at the position where it
predicts the target token), so each head learns what the base would say there, not only its argmax.
The gradient is then softmax minus the teacher's softmax."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

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
