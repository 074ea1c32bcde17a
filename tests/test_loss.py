"""The chunked cross-entropy through the output projection: the same sum and the same gradients as
materialising every logit, for any chunk size, with ignored targets, with and without a bias."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from blockdecode.loss import IGNORE, linear_cross_entropy


def reference(hidden: torch.Tensor, projection: nn.Linear, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = projection(hidden).flatten(0, -2)
    flat = target.reshape(-1)
    loss = nn.functional.cross_entropy(logits, flat, ignore_index=IGNORE, reduction="sum")
    return loss, ((logits.argmax(-1) == flat) & (flat != IGNORE)).sum()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_chunked_equals_unchunked_in_value_and_gradients(chunk: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(chunk)
    projection = nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(3, 11, 16, generator=gen, requires_grad=True)
    target = torch.randint(0, 50, (3, 11), generator=gen)
    target[0, :4] = IGNORE
    target[2, -1] = IGNORE

    loss, correct = linear_cross_entropy(hidden, projection, target, chunk=chunk)
    loss.backward()
    ours = [hidden.grad.clone(), *(p.grad.clone() for p in projection.parameters())]
    hidden.grad = None
    projection.zero_grad()
    want, want_correct = reference(hidden, projection, target)
    want.backward()
    theirs = [hidden.grad, *(p.grad for p in projection.parameters())]

    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-6)
    assert int(correct) == int(want_correct)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_padding_rows_get_zero_gradient_and_an_all_padding_batch_gives_zeros() -> None:
    projection = nn.Linear(8, 20)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    target = torch.full((2, 5), IGNORE)
    target[1, 2] = 3
    linear_cross_entropy(hidden, projection, target, chunk=1)[0].backward()
    assert hidden.grad[1, 2].abs().sum() > 0 and hidden.grad.abs().sum() == hidden.grad[1, 2].abs().sum()
    hidden.grad = None
    loss, correct = linear_cross_entropy(hidden, projection, torch.full((2, 5), IGNORE))
    loss.backward()
    assert loss.item() == 0 and int(correct) == 0 and not hidden.grad.any()


def test_frozen_projection_gets_no_gradient_and_scaling_flows() -> None:
    """A frozen output layer (frozen and distill modes) is not differentiated; an outer factor on
    the loss scales the gradient as autograd would."""
    projection = nn.Linear(8, 20).requires_grad_(False)
    hidden = torch.randn(5, 8, requires_grad=True)
    target = torch.randint(0, 20, (5,))
    loss, _ = linear_cross_entropy(hidden, projection, target, chunk=2)
    (3 * loss).backward()
    mine = hidden.grad.clone()
    hidden.grad = None
    (3 * reference(hidden, projection, target)[0]).backward()
    torch.testing.assert_close(mine, hidden.grad)
    assert projection.weight.grad is None


def test_no_grad_evaluation_and_bad_chunk() -> None:
    projection = nn.Linear(8, 20)
    hidden = torch.randn(5, 8)
    with torch.no_grad():
        loss, _ = linear_cross_entropy(hidden, projection, torch.randint(0, 20, (5,)))
    assert not loss.requires_grad
    with pytest.raises(ValueError, match="chunk must be positive"):
        linear_cross_entropy(hidden, projection, torch.zeros(5, dtype=torch.long), chunk=0)
