"""What training runs share: the schedule, precision and the metrics log a resumed run truncates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockdecode import training
from blockdecode.training import MetricsLog, Precision, warmup_cosine


def test_warmup_then_cosine_to_the_floor() -> None:
    assert [warmup_cosine(s, 4, 20, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warmup_cosine(4, 4, 20, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(12, 4, 20, 0.1) == pytest.approx(0.55)  # halfway down the cosine
    assert warmup_cosine(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(50, 4, 20, 0.1) == pytest.approx(0.1)  # past the end it stays at the floor


def _schedule_at(step: int, total: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    scheduler = training.scheduler(optimizer, 4, total, floor=0.1)
    for _ in range(step):
        optimizer.step()
        scheduler.step()
    return optimizer, scheduler


def test_a_resumed_schedule_follows_the_new_total_from_the_saved_step() -> None:
    """A run saved at step 10 of 40 and resumed for 20 continues on the 20-step cosine, at once."""
    optimizer, scheduler = _schedule_at(10, 40)
    state = {"step": 10, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    shorter, shorter_schedule = _schedule_at(0, 20)
    assert training.restore_schedule(state, shorter, shorter_schedule, steps=20) == 10
    assert shorter.param_groups[0]["lr"] == pytest.approx(warmup_cosine(10, 4, 20, 0.1))
    shorter.step()
    shorter_schedule.step()
    assert shorter.param_groups[0]["lr"] == pytest.approx(warmup_cosine(11, 4, 20, 0.1))
    same, same_schedule = _schedule_at(0, 40)  # unchanged steps: exactly where the saved run was
    training.restore_schedule(state, same, same_schedule, steps=40)
    assert same.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert training.restore_schedule(state, *_schedule_at(0, 10), steps=10) == 10  # finished: nothing left
    with pytest.raises(ValueError, match="step 10, and this run asks for 9 steps in all: give at least 10"):
        training.restore_schedule(state, *_schedule_at(0, 9), steps=9)


def test_metrics_log_keeps_only_what_a_resumed_run_reached(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in (0, 10, 20, 30):
        log.append({"step": step})
    assert [r["step"] for r in MetricsLog(path, resume_step=20).records()] == [0, 10, 20]
    assert MetricsLog(path).records() == []  # a fresh run starts a fresh log
    quiet = MetricsLog(tmp_path / "other.jsonl", write=False)  # a non-main process writes nothing
    quiet.append({"step": 1})
    assert not (tmp_path / "other.jsonl").exists()


def test_precision_runs_twice_in_one_process_with_different_modes() -> None:
    """Unlike accelerate's mixed_precision, which is process-wide state."""
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with Precision("bf16", torch.device("cpu")).autocast():
        assert layer(x).dtype == torch.bfloat16
    with Precision("no", torch.device("cpu")).autocast():
        assert layer(x).dtype == torch.float32
    with pytest.raises(ValueError, match="unknown mixed precision 'fp8'"):
        Precision("fp8", torch.device("cpu"))
