"""The chunked cross-entropy through the output projection: the same sum and the same gradients as
materialising every logit, for any chunk size, with ignored targets, with and without a bias."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from blockdecode.core.loss import IGNORE, head_targets, linear_cross_entropy


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


def orthonormal_projection(d: int, v: int, bias: bool) -> nn.Linear:
    projection = nn.Linear(d, v, bias=bias)
    with torch.no_grad():
        projection.weight.copy_(torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(1)))[0][:v])
    return projection


@pytest.mark.parametrize("chunk", [3, 4096])
@pytest.mark.parametrize("bias", [False, True])
def test_soft_targets_from_a_one_hot_teacher_equal_the_hard_loss(chunk: int, bias: bool) -> None:
    """A teacher whose distribution is one-hot on the target gives the hard loss, value and gradients."""
    projection = orthonormal_projection(64, 20, bias)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 64, generator=gen, requires_grad=True)
    target = torch.randint(0, 20, (2, 9), generator=gen)
    target[1, :3] = IGNORE
    teacher = 1e3 * projection.weight.detach()[target.clamp(min=0)]  # logit gap 1e3: softmax is exactly one-hot
    assert torch.equal(projection(teacher).softmax(-1), nn.functional.one_hot(target.clamp(min=0), 20).float())
    results = []
    for soft in (None, teacher):
        loss, correct = linear_cross_entropy(hidden, projection, target, chunk=chunk, teacher=soft)
        loss.backward()
        grads = [hidden.grad.clone(), *(p.grad.clone() for p in projection.parameters())]
        results.append((loss.detach(), int(correct), *grads))
        hidden.grad = None
        projection.zero_grad()
    (hard, hard_hits, *hard_grads), (soft, soft_hits, *soft_grads) = results
    torch.testing.assert_close(soft, hard)
    assert soft_hits == hard_hits
    for a, b in zip(soft_grads, hard_grads):
        torch.testing.assert_close(a, b)


def test_soft_targets_equal_the_materialised_cross_entropy_and_leave_the_teacher_alone() -> None:
    """Against a teacher's full distribution: sum over rows of -p . log_softmax(logits), the same gradients,
    and none flowing into the teacher."""
    gen = torch.Generator().manual_seed(2)
    projection = nn.Linear(16, 50)
    hidden = torch.randn(3, 7, 16, generator=gen, requires_grad=True)
    teacher = torch.randn(3, 7, 16, generator=gen, requires_grad=True)
    target = torch.randint(0, 50, (3, 7), generator=gen)
    target[0, -2:] = IGNORE
    loss, _ = linear_cross_entropy(hidden, projection, target, chunk=5, teacher=teacher)
    loss.backward()
    ours = [hidden.grad.clone(), *(p.grad.clone() for p in projection.parameters())]
    assert teacher.grad is None
    hidden.grad = None
    projection.zero_grad()
    keep = target != IGNORE
    p = projection(teacher[keep]).softmax(-1).detach()
    want = -(p * projection(hidden[keep]).log_softmax(-1)).sum()
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-5)
    for a, b in zip(ours, [hidden.grad, *(p.grad for p in projection.parameters())]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_head_targets_hand_built():
    ids = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, -1, -1]])
    labels = head_targets(ids, 3)
    x = IGNORE
    expected = torch.tensor(
        [
            # t:   head 1 (t+1), head 2 (t+2), head 3 (t+3)
            [[11, 12, 13], [12, 13, 14], [13, 14, x], [14, x, x], [x, x, x]],
            [[21, 22, x], [22, x, x], [x, x, x], [x, x, x], [x, x, x]],
        ]
    )
    assert labels.shape == (2, 5, 3)
    assert torch.equal(labels, expected)
    # the rule, stated generally
    for b in range(2):
        for t in range(5):
            for i in range(1, 4):
                want = int(ids[b, t + i]) if t + i < 5 and ids[b, t + i] >= 0 else IGNORE
                assert labels[b, t, i - 1] == want


def test_head_targets_shorter_than_k():
    """A sequence shorter than the block (e.g. a distilled row of prompt_len + new_tokens <= k)
    has no targets for the far heads: all IGNORE, not a crash."""
    labels = head_targets(torch.tensor([[5, 6, 7]]), 4)
    expected = torch.tensor([[[6, 7, IGNORE, IGNORE], [7, IGNORE, IGNORE, IGNORE], [IGNORE] * 4]])
    assert torch.equal(labels, expected)
