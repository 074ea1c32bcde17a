"""What training runs share: the schedule, precision, the metrics log a resumed run truncates, and
the loop itself on a toy task: its cadence, exact resume, early stop and non-finite losses."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pytest
import torch

from blockdecode.training import loop as training
from blockdecode.training.loop import MetricsLog, Precision, warmup_cosine


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


@dataclass
class ToyConfig:
    out: str
    steps: int = 8
    log_every: int = 2
    eval_every: int = 4
    checkpoint_every: int = 3
    resume: bool = False
    lr: float = 0.05
    stop_at: int = 0  # the step after whose evaluation the task asks to stop; 0: never


class Toy(training.Task):
    """A linear map learnt through dropout (so a resume must restore the RNG), batches drawn from the step."""

    name, last = "toy", "model.pt"

    def __init__(self, cfg: ToyConfig):
        self.config, self.data_digest = cfg, "toy data"
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(4, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.scheduler = training.scheduler(self.optimizer, 2, cfg.steps, floor=0.1)
        self.target = torch.randn(4, 1, generator=torch.Generator().manual_seed(1))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        return x, x @ self.target

    def loss(self, model, step: int) -> tuple[torch.Tensor, int]:
        x, y = self.batch(step)
        return torch.nn.functional.mse_loss(model(x), y), len(x)

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        x, y = self.batch(10**6)
        return {"heldout_loss": float(torch.nn.functional.mse_loss(model(x), y))}

    def stopped(self, records: list[dict]) -> str | None:
        return "asked to" if self.config.stop_at and records and records[-1]["step"] >= self.config.stop_at else None

    def state(self, model) -> dict:
        return {"model": model.state_dict()}

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])

    def save(self, model, records: list[dict], folder: Path) -> None:
        torch.save(model.state_dict(), folder / "model.pt")


def fit(cfg: ToyConfig, callback=None) -> torch.nn.Module:
    loop = training.Loop(training.LoopConfig.of(cfg), show=False)
    return loop.fit(Toy(cfg), loop.resume(cfg, ("lr",), "toy data"), callback)


class Killed(Exception):
    """Raised from the loop's callback to stop a run the way a kill would, mid-way."""


def kill_at(step: int):
    def callback(done: int, record: dict) -> None:
        if done == step:
            raise Killed

    return callback


def test_the_loop_keeps_its_cadence_and_a_killed_run_resumes_exactly(tmp_path: Path) -> None:
    whole = fit(ToyConfig(out=str(tmp_path / "a")))
    rows = MetricsLog(tmp_path / "a" / "metrics.jsonl", write=False).records()
    assert [r["step"] for r in rows] == [2, 4, 6, 8]  # logged every 2 steps, evaluated every 4
    assert ["heldout_loss" in r for r in rows] == [False, True, False, True]
    assert all({"loss", "lr", "tokens_per_s"} <= set(r) for r in rows)
    assert (tmp_path / "a" / "model.pt").is_file() and (tmp_path / "a" / "training.png").stat().st_size > 0

    with pytest.raises(Killed):
        fit(ToyConfig(out=str(tmp_path / "b")), callback=kill_at(5))
    state = torch.load(tmp_path / "b" / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == 3 and state["config"] == asdict(ToyConfig(out=str(tmp_path / "b")))
    assert set(state) == {
        "step",
        "config",
        "data_digest",
        "model",
        *("optimizer", "scheduler", "scaler", "rng", "cuda_rng"),
    }
    torch.manual_seed(123)  # the resumed run must not depend on the process's RNG state
    resumed = fit(ToyConfig(out=str(tmp_path / "b"), resume=True))
    for (name, p), q in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    again = MetricsLog(tmp_path / "b" / "metrics.jsonl", write=False).records()
    assert [r["step"] for r in again] == [2, 4, 6, 8]
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]
    with pytest.raises(ValueError, match="lr=0.05, this run asks for 0.1"):
        fit(ToyConfig(out=str(tmp_path / "b"), resume=True, lr=0.1))


class StoppedInSave(Toy):
    """A run stopped (Ctrl-C) after its final save has written the model, before it returns."""

    def save(self, model, records: list[dict], folder: Path) -> None:
        super().save(model, records, folder)
        raise KeyboardInterrupt


def test_a_run_stopped_in_its_final_save_leaves_the_earlier_model_and_plot(tmp_path: Path) -> None:
    """The final save and the training plot replace the earlier ones as one: stopped after the model
    is written, the folder holds the earlier model and plot, never the new model beside the old plot."""
    fit(ToyConfig(out=str(tmp_path)))
    earlier = {name: (tmp_path / name).read_bytes() for name in ("model.pt", "training.png")}
    cfg = ToyConfig(out=str(tmp_path), steps=12, resume=True)
    loop = training.Loop(training.LoopConfig.of(cfg), show=False)
    with pytest.raises(KeyboardInterrupt):
        loop.fit(StoppedInSave(cfg), loop.resume(cfg, ("lr",), "toy data"))
    assert {name: (tmp_path / name).read_bytes() for name in earlier} == earlier
    assert not list(tmp_path.glob(".save-*"))
    fit(cfg)
    assert all((tmp_path / name).read_bytes() != data for name, data in earlier.items())


def test_a_task_that_asks_to_stop_stops_and_stays_stopped(tmp_path: Path) -> None:
    cfg = ToyConfig(out=str(tmp_path), steps=20, stop_at=4, checkpoint_every=100)
    fit(cfg)
    rows = MetricsLog(tmp_path / "metrics.jsonl", write=False).records()
    assert rows[-1]["step"] == 4 and (tmp_path / "model.pt").is_file()
    assert torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=True)["step"] == 4  # saved where it stopped
    fit(replace(cfg, resume=True))
    assert MetricsLog(tmp_path / "metrics.jsonl", write=False).records() == rows


def test_a_non_finite_loss_stops_the_run_before_it_reaches_the_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"step \d+: the training loss is (nan|inf); stopped \(no checkpoint yet\)"):
        fit(ToyConfig(out=str(tmp_path), lr=1e30, checkpoint_every=100))
    assert not (tmp_path / "model.pt").exists()


def files_in(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("left", ["a finished run", "a run killed before its first checkpoint"])
def test_a_fresh_run_into_a_folder_that_holds_a_run_is_refused_and_changes_nothing(tmp_path: Path, left: str) -> None:
    if left == "a finished run":
        fit(ToyConfig(out=str(tmp_path)))
    else:
        with pytest.raises(Killed):
            fit(ToyConfig(out=str(tmp_path), checkpoint_every=100), callback=kill_at(3))
        assert not (tmp_path / "checkpoint" / "state.pt").exists()
    before = files_in(tmp_path)
    with pytest.raises(ValueError, match=r"^--out .* already holds a run .*: pass --resume to continue it, or give a"):
        fit(ToyConfig(out=str(tmp_path), steps=2))
    assert files_in(tmp_path) == before
