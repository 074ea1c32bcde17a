"""What every training run here shares: the one training loop and its parts.

A run is a `Task`: its model, optimizer and schedule, its batches and loss, its evaluation, what
its checkpoint holds beyond the loop's own and what it saves at the end. A `Loop` drives any task
and does the rest once for all of them: mixed precision, the schedule's steps, resume, when to log,
evaluate and checkpoint (atomically), the metrics log, the final save and the training plot.

Precision is applied here (torch.autocast, and a gradient scaler for fp16) rather than through
accelerate's `mixed_precision`, which accelerate keeps in process-wide state: runs with different
precisions can then follow one another in one process, as a notebook or a sweep calls them."""

from __future__ import annotations

import gc
import json
import math
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from blockdecode.core import plots
from blockdecode.core.hardware import MIXED_PRECISIONS, native_bf16
from blockdecode.core.io import (
    append_jsonl,
    check_writable,
    load_checkpoint,
    read_jsonl,
    remove_temporaries,
    save_checkpoint,
    saving_folder,
    write_text,
)

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


def run_state(step: int, cfg: object, data_digest: str, optimizer, scheduler, precision, **parts) -> dict:
    """What a run's checkpoint holds: the task's `parts` (its weights and anything else it needs) and
    the loop's state, enough to continue as if never stopped (the RNG too, which dropout draws on)."""
    return {
        "step": step,
        "config": asdict(cfg),
        "data_digest": data_digest,
        **parts,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": precision.scaler.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
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


def restore_run(state: dict, optimizer, scheduler, precision, steps: int) -> int:
    """Load the loop's part of what `run_state` saved; the step to continue from. Older checkpoints
    lack the scaler (written before fp16 scaling was saved) and the RNG (models without dropout), and
    head training's named its RNG `torch_rng`."""
    step = restore_schedule(state, optimizer, scheduler, steps)
    if state.get("scaler"):
        precision.scaler.load_state_dict(state["scaler"])
    rng = state.get("rng", state.get("torch_rng"))
    if rng is not None:
        torch.set_rng_state(rng)
    if state.get("cuda_rng") is not None and torch.cuda.is_available():  # dropout on a GPU draws from these
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return step


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


@dataclass
class LoopConfig:
    """How a run proceeds, whatever it trains: where it writes, how long, in what precision, and
    every how many steps it logs, evaluates and saves its checkpoint (and at its last step, so that
    a finished run resumed has nothing left to train)."""

    out: str
    steps: int
    log_every: int
    eval_every: int
    checkpoint_every: int
    mixed_precision: str = "no"
    resume: bool = False
    max_norm: float = 0.0  # clip the gradients' norm to this before each step; 0: no clipping

    @classmethod
    def of(cls, cfg: object, **overrides) -> LoopConfig:
        """The loop's settings from a run's own config, which names them alike."""
        names = [f.name for f in fields(cls) if hasattr(cfg, f.name) and f.name not in overrides]
        return cls(**{name: getattr(cfg, name) for name in names}, **overrides)

    def due(self, every: int, done: int) -> bool:
        return done % every == 0 or done == self.steps


class Task(ABC):
    """One kind of training run, as `Loop.fit` drives it. A task sets `model` (the module
    accelerate prepares), `optimizer` and `scheduler`, and `config` and `data_digest`, which its
    checkpoints record and a resume must match."""

    name = "train"  # the progress bar's label
    png = "training.png"  # the training plot, in the run's folder
    last: str  # the final save's file (or folder) written last: its presence marks the save whole
    curves = plots.Curves()
    rate = "tokens_per_s"  # the metrics' name for the training throughput
    evaluate_first = False  # evaluate before the first step: the point later evaluations compare to

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    config: object
    data_digest: str

    @abstractmethod
    def loss(self, model: torch.nn.Module, step: int) -> tuple[torch.Tensor, int]:
        """The loss of this process's batch at `step`, through `model` (accelerate's wrapper of
        `self.model`), and the tokens the batch held. The loop averages the loss over processes for
        the log and backpropagates it as it is, so under several processes a task whose batches are
        split scales its share to make accelerate's averaged gradients the global batch's."""

    @abstractmethod
    def state(self, model: torch.nn.Module) -> dict:
        """What a checkpoint holds of this task beyond the loop's own: the weights of `model`
        (unwrapped), and any state of its own."""

    @abstractmethod
    def load_state(self, state: dict) -> None:
        """Load what `state` saved into `self.model`, before the loop restores its own part."""

    @abstractmethod
    def save(self, model: torch.nn.Module, records: list[dict], folder: Path) -> None:
        """Write the trained `model` (unwrapped, in eval mode) and what the run reached (`records`,
        metrics.jsonl's) into `folder`, `last` last; on the main process only. `folder` is staging:
        its files replace the run folder's earlier ones, with the plot, as a whole."""

    def evaluate(self, model: torch.nn.Module) -> dict:
        """Held-out metrics of `model` (unwrapped); on the main process only."""
        return {}

    def logged(self) -> dict:
        """What a log step records beyond the loss, the learning rate and the throughput."""
        return {}

    def progress(self, done: int) -> dict:
        """What every record of step `done` carries beside the step."""
        return {}

    def stopped(self, records: list[dict]) -> str | None:
        """Why the run should stop before its last step, read from the records after an
        evaluation (and at resume, so a stopped run stays stopped); None to train on."""
        return None


def check_new_run(out: str | Path, resume: bool) -> None:
    """Refuse to start afresh in a folder that holds a run (its checkpoint or its metrics log):
    a fresh run would replace them, and its outputs, without a word."""
    out = Path(out)
    found = [name for name in ("checkpoint/state.pt", "metrics.jsonl") if (out / name).is_file()]
    if found and not resume:
        raise ValueError(
            f"--out {out} already holds a run ({' and '.join(found)}): pass --resume to continue it, or give a "
            "fresh --out"
        )


class Loop:
    """The one training loop: precision, the schedule's steps, resume, log / evaluation /
    checkpoint cadence, the metrics log, the final save and the plot, for any `Task`, on one
    process or under `accelerate launch`. Only the main process writes."""

    def __init__(self, cfg: LoopConfig, show: bool = True, **accelerator_kwargs):
        check_new_run(cfg.out, cfg.resume)  # on every process, so all stop alike, before anything loads
        self.cfg, self.out = cfg, Path(cfg.out)
        self.accelerator = accelerator(**accelerator_kwargs)
        self.precision = Precision(cfg.mixed_precision, self.accelerator.device)
        self.main = self.accelerator.is_main_process
        self.show = show and self.main
        self.checkpoint = self.out / "checkpoint" / "state.pt"
        if self.main:  # before any model or data loads: an unwritable --out fails at once
            check_writable(self.out)
            remove_temporaries(self.checkpoint.parent)  # a killed checkpoint write leaves one as large as the state

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def resume(
        self, cfg: object, must_match: Iterable[str], data_digest: str, meaning: Callable | None = None
    ) -> dict | None:
        """The checkpoint a resumed run continues from, refused if its `must_match` settings (by `meaning`, where
        given: `io.load_checkpoint`) or its data differ from this run's; None for a fresh run."""
        if not self.cfg.resume:
            return None
        if not self.checkpoint.is_file():
            warnings.warn(f"--resume: no checkpoint at {self.checkpoint}; starting from step 0", stacklevel=3)
            return None
        return load_checkpoint(self.checkpoint, cfg, tuple(must_match), data_digest, meaning)

    def fit(
        self, task: Task, state: dict | None = None, callback: Callable[[int, dict], None] | None = None
    ) -> torch.nn.Module:
        """Train `task` from `state` (what `resume` returned) or from its start, and return its
        module, unwrapped and in eval mode. metrics.jsonl, the checkpoint, the task's outputs and its
        plot go to the run's folder; `callback(step, record)` follows every step."""
        cfg, acc, precision = self.cfg, self.accelerator, self.precision
        start = 0
        if state is not None:
            task.load_state(state)
            start = restore_run(state, task.optimizer, task.scheduler, precision, cfg.steps)
        model, optimizer = acc.prepare(task.model, task.optimizer)
        metrics = MetricsLog(self.out / "metrics.jsonl", start, write=self.main)
        if start == 0 and task.evaluate_first and self.main:
            metrics.append({"step": 0, **task.evaluate(acc.unwrap_model(model))})
        end = cfg.steps
        reason = task.stopped(metrics.records()) if start else None
        if reason:  # it stopped early, as it would again: resumed, it only writes its outputs
            end = start
            if self.main:
                tqdm.write(f"--resume: this run stopped at step {start}: {reason}")
        model.train()
        bar = tqdm(range(start, end), initial=start, total=cfg.steps, desc=task.name, disable=not self.show)
        window_tokens, window_start = 0, time.perf_counter()
        for step in bar:
            with precision.autocast():
                loss, tokens = task.loss(model, step)
            precision.backward(acc, loss)
            loss = acc.reduce(loss.detach(), reduction="mean")
            if not torch.isfinite(loss):  # stop before a NaN reaches the weights, and save nothing
                kept = "no checkpoint yet"
                if self.checkpoint.is_file():
                    kept = f"the checkpoint in {self.checkpoint.parent} is intact"
                raise ValueError(
                    f"step {step + 1}: the training loss is {float(loss)}; stopped ({kept}): try a lower --lr"
                )
            precision.step(optimizer, model.parameters(), cfg.max_norm)
            task.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            window_tokens += tokens * acc.num_processes
            done = step + 1
            base = {"step": done, **task.progress(done)}
            record = dict(base)
            if cfg.due(cfg.log_every, done):
                rate = window_tokens / (time.perf_counter() - window_start)
                record.update({"loss": float(loss), "lr": task.scheduler.get_last_lr()[0], task.rate: rate})
                record.update(task.logged())
                bar.set_postfix(loss=f"{float(loss):.3f}", tok_s=f"{rate:.0f}")
            if cfg.due(cfg.eval_every, done) and self.main:
                evaluated = task.evaluate(acc.unwrap_model(model))
                record.update(evaluated)
                if self.show:
                    shown = ", ".join(f"{k} {v:.3f}" for k, v in evaluated.items() if isinstance(v, float))
                    bar.write(f"step {done}: {shown}")
            if len(record) > len(base):
                metrics.append(record)
                window_tokens, window_start = 0, time.perf_counter()  # after any evaluation, so it is not counted
            reason, stop = None, False
            if done % cfg.eval_every == 0 and done < cfg.steps:
                reason = task.stopped(metrics.records()) if self.main else None
                flag = torch.tensor(float(reason is not None), device=acc.device)
                stop = bool(acc.reduce(flag, reduction="sum") > 0)  # the main process decides; all stop
            if cfg.due(cfg.checkpoint_every, done) or stop:  # the last step too: see restore_schedule
                self._save_checkpoint(task, model, optimizer, done)
            if callback is not None:
                callback(done, record)
            if stop:
                if reason:
                    bar.write(f"step {done}: {reason}; stopping")
                break

        acc.wait_for_everyone()
        trained = acc.unwrap_model(model).eval()
        if self.main:
            records = metrics.records()
            with saving_folder(self.out, task.last) as staging:  # a stop leaves the earlier save and plot
                plots.training(records, staging / task.png, task.curves)
                task.save(trained, records, staging)
        # Drop the DDP wrapper while every process is still here, then end the process group: left
        # to interpreter exit, gloo's destructors can wait on a peer that is already gone.
        del model, optimizer
        acc.free_memory()
        gc.collect()
        acc.wait_for_everyone()
        acc.end_training()
        return trained

    def _save_checkpoint(self, task: Task, model, optimizer, step: int) -> None:
        """Everything a resumed run needs to continue as if never stopped, written atomically by the
        main process once every process has finished the step."""
        self.accelerator.wait_for_everyone()
        if self.main:
            parts = task.state(self.accelerator.unwrap_model(model))
            state = run_state(step, task.config, task.data_digest, optimizer, task.scheduler, self.precision, **parts)
            save_checkpoint(self.checkpoint, state)
