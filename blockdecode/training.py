"""What every training run here shares: the learning-rate schedule, mixed precision, the
process setup, and the metrics log that a resumed run picks up from.

Precision is applied here (torch.autocast, and a gradient scaler for fp16) rather than through
accelerate's `mixed_precision`, which accelerate keeps in process-wide state: runs with different
precisions can then follow one another in one process, as a notebook or a sweep calls them."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator

from blockdecode.hardware import MIXED_PRECISIONS, native_bf16
from blockdecode.io import append_jsonl, read_jsonl, write_text

PRECISIONS = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def warmup_cosine(step: int, warmup: int, total: int, floor: float) -> float:
    """The learning-rate multiplier: linear warm-up to 1, then a cosine down to `floor` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int, floor: float):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup, total, floor))


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not on biases and norms), over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def run_state(step: int, cfg: object, data_digest: str, model, optimizer, scheduler, precision, **extra) -> dict:
    """What a from-scratch run's checkpoint holds: enough to continue as if never stopped (the RNG
    too, which dropout draws on)."""
    return {
        "step": step,
        "config": asdict(cfg),
        "data_digest": data_digest,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": precision.scaler.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        **extra,
    }


def restore_schedule(state: dict, optimizer, scheduler, steps: int) -> int:
    """Load the optimizer and schedule a checkpoint saved; the step to continue from.

    A resumed run may ask for more or fewer steps than the saved one (`steps` is not among the
    settings a resume must match): the cosine then runs to the new total from the saved step on,
    and the learning rate is set from it at once rather than after the first step. A run saves its
    last step too, so a finished run resumed with the same steps has nothing left to train."""
    step = state["step"]
    if step > steps:
        raise ValueError(
            f"--resume: the checkpoint is at step {step}, and this run asks for {steps} steps in all: "
            f"give at least {step}"
        )
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
    return step


def restore_run(state: dict, model, optimizer, scheduler, precision, steps: int) -> int:
    """Load what `run_state` saved; the step to continue from. Older checkpoints lack the scaler
    (written before fp16 scaling was saved) and the RNG (models without dropout)."""
    model.load_state_dict(state["model"])
    restore_schedule(state, optimizer, scheduler, steps)
    if state.get("scaler"):
        precision.scaler.load_state_dict(state["scaler"])
    if state.get("rng") is not None:
        torch.set_rng_state(state["rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():  # dropout on a GPU draws from these
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"]


def accelerator(**kwargs) -> Accelerator:
    """The process group: on the GPUs when there are some; `cpu=True` otherwise, without which
    processes launched on CPUs by torchrun never meet."""
    return Accelerator(cpu=not torch.cuda.is_available(), **kwargs)


class Precision:
    """Autocast for the forward, and for fp16 a gradient scaler around backward and step."""

    def __init__(self, mode: str, device: torch.device):
        if mode not in MIXED_PRECISIONS:
            raise ValueError(f"unknown mixed precision {mode!r}: choose one of {', '.join(MIXED_PRECISIONS)}")
        if mode == "auto":  # bf16 autocast only where the device computes bf16 natively
            mode = "bf16" if native_bf16(device) else "no"
        self.mode, self.device = mode, device
        self.scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")

    def autocast(self):
        dtype = PRECISIONS[self.mode]
        return torch.autocast(self.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)

    def backward(self, accelerator: Accelerator, loss: torch.Tensor) -> None:
        accelerator.backward(self.scaler.scale(loss))

    def step(
        self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter] = (), max_norm: float = 0.0
    ) -> None:
        """Unscale, clip to `max_norm` (if positive) and step; a step with inf/NaN gradients is
        skipped under fp16, as the scaler decides."""
        if max_norm > 0:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(list(params), max_norm)
        self.scaler.step(optimizer)
        self.scaler.update()


class MetricsLog:
    """metrics.jsonl: one record per logged step. A run resumed at step s keeps the records up to s
    and drops the ones a killed run wrote after its last checkpoint."""

    def __init__(self, path: Path, resume_step: int = 0, write: bool = True):
        self.path, self.write = Path(path), write
        if write:
            kept = [r for r in read_jsonl(self.path) if r["step"] <= resume_step] if resume_step else []
            write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def append(self, record: dict) -> None:
        if self.write:
            append_jsonl(self.path, record)

    def records(self) -> list[dict]:
        return read_jsonl(self.path)
