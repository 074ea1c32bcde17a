"""Head training: batches, the objective's effect, distill runs, resume, multi-process, bad input, CLI.

Every run trains a 2-layer toy Llama (width 64) on a small repetitive corpus (conftest's `tiny_base`):
eight words in cyclic order, each line starting at a random word. A model that learns it predicts
several tokens ahead with certainty, so trained heads must lift the accepted block size well above 1
within 60 steps."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from conftest import CONTEXT, NO_EOS, SEQ_LEN, assert_greedy_equal, hf_greedy, make_cfg, pairs_cfg, varied_base  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM  # noqa: E402

from blockdecode import BlockwiseLM  # noqa: E402
from blockdecode.cli import main as cli_main  # noqa: E402
from blockdecode.core.io import read_jsonl  # noqa: E402
from blockdecode.core.toy import toy_model  # noqa: E402
from blockdecode.loading import (  # noqa: E402
    HEADS_CONFIG,
    HEADS_WEIGHTS,
    load_base,  # noqa: E402
)
from blockdecode.training import distill as distill_module  # noqa: E402
from blockdecode.training import objective as objective_module  # noqa: E402
from blockdecode.training.config import TrainConfig  # noqa: E402
from blockdecode.training.data import batch_indices, load_tokens, split  # noqa: E402
from blockdecode.training.objective import Objective  # noqa: E402
from blockdecode.training.train import RESUME_MUST_MATCH, doubling_gain, plateaued, sampled_heads, train

# ----------------------------------------------------------------------------- fixtures and helpers


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def base_state(directory: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()


def assert_nothing_saved(out: Path) -> None:
    """A failed run leaves no model behind: no heads, no config that would make the folder look loadable."""
    assert not (out / HEADS_WEIGHTS).exists(), f"{out} holds {HEADS_WEIGHTS} after a failed run"
    assert not (out / HEADS_CONFIG).exists(), f"{out} holds {HEADS_CONFIG} after a failed run"


def log_every_step(cfg: TrainConfig) -> TrainConfig:
    """Same run, every step logged, one evaluation at the end."""
    return replace(cfg, log_every=1, eval_every=cfg.steps)


def assert_same_tensors(got: dict, want: dict, atol: float, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: different tensors saved"
    for name in want:
        diff = float((got[name].float() - want[name].float()).abs().max())
        assert diff <= atol, (
            f"{what} differ: {name}, max |diff| {diff:.3g} (largest value {want[name].abs().max():.3g})"
        )


class Killed(Exception):
    """Raised from a training callback to stop a run the way a kill would, mid-way."""


def kill_at(step: int):
    def callback(done: int, record: dict) -> None:
        if done == step:
            raise Killed(f"killed at step {done}")

    return callback


# ----------------------------------------------------------------------------- batches and heads


def test_batch_indices_epochs_and_determinism():
    n, bs = 20, 8
    per_epoch = n // bs
    batches = [batch_indices(s, n, bs, seed=3) for s in range(2 * per_epoch)]
    assert all(len(b) == bs for b in batches)
    assert all(torch.equal(b, batch_indices(s, n, bs, seed=3)) for s, b in enumerate(batches))
    first_epoch = torch.cat(batches[:per_epoch])
    assert len(set(first_epoch.tolist())) == len(first_epoch)  # no sequence twice within an epoch
    assert not torch.equal(batches[0], batch_indices(0, n, bs, seed=4))
    small = batch_indices(0, 3, 8, seed=0)  # fewer sequences than a batch: repeated to fill it
    assert len(small) == 8 and set(small.tolist()) == {0, 1, 2}


def test_sampled_heads():
    cfg = TrainConfig(base="b", data=["d"], out="o", k=5, head_loss="all")
    assert sampled_heads(7, cfg) == [2, 3, 4, 5]
    cfg = TrainConfig(base="b", data=["d"], out="o", k=5, head_loss="random")
    draws = [sampled_heads(s, cfg) for s in range(200)]
    assert all(len(d) == 1 and 2 <= d[0] <= 5 for d in draws)
    assert {d[0] for d in draws} == {2, 3, 4, 5}
    assert draws == [sampled_heads(s, cfg) for s in range(200)]  # seeded by the step


def test_every_seed_torch_takes_draws_batches_and_heads():
    """--seed takes 0 to 2**64 - 1, as torch's generators do; what is derived from it stays in that range."""
    cfg = TrainConfig(base="b", data=["d"], out="o", k=5, head_loss="random", seed=2**64 - 1)
    assert len(batch_indices(5, 20, 8, cfg.seed)) == 8 and len(sampled_heads(5, cfg)) == 1
    assert torch.equal(batch_indices(5, 20, 8, seed=3), batch_indices(5, 20, 8, seed=3 + 2**64))  # as before


# ----------------------------------------------------------------------------- the objective works


def test_frozen_lowers_loss_and_leaves_base_untouched(tiny_base, tmp_path):
    out = tmp_path / "out"
    before = base_state(tiny_base.dir)
    model = train(make_cfg(tiny_base, out, mode="frozen", steps=30, log_every=1, eval_every=30))

    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, f"head loss did not drop: {first:.3f} -> {last:.3f}"

    after = model.base.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), f"frozen mode changed base weight {name}"

    # The saved model is heads only, pointing at the original base.
    assert (out / HEADS_WEIGHTS).is_file() and (out / "training.png").is_file()
    assert not (out / "model.safetensors").exists()
    meta = json.loads((out / HEADS_CONFIG).read_text())
    assert meta["base_model"] == str(tiny_base.dir.resolve())
    assert meta["heads"]["k"] == 4
    loaded = BlockwiseLM.from_pretrained(out)
    for name, tensor in loaded.base.state_dict().items():
        assert torch.equal(tensor, before[name])
    saved = load_file(out / HEADS_WEIGHTS)
    for name, tensor in model.heads.state_dict().items():
        assert torch.equal(saved[name], tensor)
    assert not torch.equal(saved["down.weight"], torch.zeros_like(saved["down.weight"]))  # trained


def test_frozen_heads_find_their_base_from_anywhere(tiny_base, tmp_path, monkeypatch):
    """A heads-only save names its base; given as a relative path, that name must still lead to the
    base when the saved model is loaded from another working directory."""
    out = tmp_path / "out"
    monkeypatch.chdir(tiny_base.dir.parent)
    train(make_cfg(tiny_base, out, base="base", data=["corpus.txt"], steps=2, log_every=1, eval_every=2))
    meta = json.loads((out / HEADS_CONFIG).read_text())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = BlockwiseLM.from_pretrained(out)  # fails if base_model is "base", relative to the old cwd
    assert Path(meta["base_model"]).resolve() == tiny_base.dir.resolve()
    assert loaded.k == 4


def test_finetune_raises_block_size_and_stays_exact(tiny_base, tmp_path):
    out = tmp_path / "out"
    original = base_state(tiny_base.dir)
    model = train(make_cfg(tiny_base, out, mode="finetune", steps=60, eval_every=30))

    evals = [r for r in read_metrics(out) if "eval_mean_block_size" in r]
    assert [r["step"] for r in evals] == [0, 30, 60]
    start, end = evals[0]["eval_mean_block_size"], evals[-1]["eval_mean_block_size"]
    assert end > 2 * start and end > 2.5, f"mean accepted block size {start:.2f} -> {end:.2f} (k=4)"

    # A new base was saved beside the heads, and it is the fine-tuned one.
    meta = json.loads((out / HEADS_CONFIG).read_text())
    assert meta["base_model"] == "."
    loaded = BlockwiseLM.from_pretrained(out).eval()
    trained = model.base.state_dict()
    for name, tensor in loaded.base.state_dict().items():
        assert torch.equal(tensor, trained[name])
    assert any(not torch.equal(t, original[n]) for n, t in trained.items()), "finetune left the base unchanged"
    assert (out / "tokenizer.json").is_file()

    # Blockwise decoding of a held-out prompt is greedy decoding of the saved (fine-tuned) base, and fast.
    _, held_out = split(tiny_base.sequences, 0.05)
    reference_base = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    blocks = []
    for row in held_out[:3]:
        prompt = row[:16].unsqueeze(0)
        ours = loaded.generate(prompt, max_new_tokens=48, tree=None)
        ref = hf_greedy(reference_base, prompt, 48)
        assert_greedy_equal(reference_base, prompt, ours.sequences, ref, what="fine-tuned base")
        blocks += ours.stats.block_sizes
    assert sum(blocks) / len(blocks) > 2.5


def test_finetune_starts_from_trained_heads(tiny_base, tmp_path):
    """--init-heads: the run's first evaluation already scores the saved heads (the base is still
    the original), and heads of another shape are refused before training."""
    frozen = tmp_path / "frozen"
    train(make_cfg(tiny_base, frozen, mode="frozen", steps=30, eval_every=30))
    trained = [r for r in read_metrics(frozen) if "eval_mean_block_size" in r][-1]
    out = tmp_path / "both"
    train(make_cfg(tiny_base, out, mode="finetune", steps=1, eval_every=1, init_heads=str(frozen)))
    first = [r for r in read_metrics(out) if "eval_mean_block_size" in r][0]
    assert first["step"] == 0
    assert first["eval_head_acc"] == pytest.approx(trained["eval_head_acc"])
    assert first["eval_head_loss"] == pytest.approx(trained["eval_head_loss"])
    assert min(first["eval_head_acc"][1:]) > 0.3  # trained, not random

    with pytest.raises(ValueError, match="k 4 \\(this run: 3\\)"):
        train(make_cfg(tiny_base, tmp_path / "k3", mode="finetune", k=3, steps=1, init_heads=str(frozen)))
    assert not (tmp_path / "k3" / "metrics.jsonl").exists()


def test_init_heads_of_a_base_of_another_width_are_refused_by_name(tiny_base, tmp_path):
    narrow = tmp_path / "narrow"
    BlockwiseLM.from_base(toy_model("llama", vocab=tiny_base.vocab, width=32, layers=1), k=4).save_pretrained(narrow)
    with pytest.raises(ValueError, match=f"^--init-heads {re.escape(str(narrow))}: .*hidden size 32, the base model's"):
        train(make_cfg(tiny_base, tmp_path / "out", mode="finetune", steps=1, init_heads=str(narrow)))
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_head_weights_with_a_zero_and_random_head_loss_stay_finite(tiny_base, tmp_path):
    """head_weights=[1, 1, 0] (head 4 switched off) with head_loss="random": a step that draws head 4
    divides by a total weight of 0. Either reject such weights up front or never draw a zero-weight head;
    a NaN loss that silently ruins the heads is neither."""
    try:
        cfg = make_cfg(tiny_base, tmp_path / "out", head_weights=[1.0, 1.0, 0.0], head_loss="random", steps=8)
    except ValueError:
        return  # rejecting zero weights is a fix too
    model = train(log_every_step(cfg))
    losses = [r["loss"] for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert all(math.isfinite(x) for x in losses), f"losses {losses}"
    assert all(torch.isfinite(p).all() for p in model.heads.parameters())


@pytest.mark.parametrize("mode", ["frozen", "finetune"])
def test_chunked_head_loss_equals_the_whole_one_on_a_model(tiny_base, tmp_path, mode):
    """The objective's loss and every gradient (heads; in finetune the base and its shared output
    layer too) are the same whether the head logits go through in chunks of 5 rows or all at once."""
    results = []
    for chunk in (5, 10**6):
        cfg = make_cfg(tiny_base, tmp_path, mode=mode, loss_chunk=chunk)
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_base.dir, dtype=torch.float32)
        model = BlockwiseLM.from_base(base, k=cfg.k)
        for p in model.heads.parameters():
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
        base.requires_grad_(cfg.finetune)
        objective = Objective(model, cfg).train()
        batch = tiny_base.sequences[:3].clone()
        batch[1, -5:] = -1  # padding, as after an EOS in distilled rows
        sums, tallies = objective(batch, list(range(2, cfg.k + 1)))
        sums.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((sums.detach(), tallies, grads))
    (sums_a, tallies_a, grads_a), (sums_b, tallies_b, grads_b) = results
    torch.testing.assert_close(sums_a, sums_b, atol=1e-3, rtol=1e-5)
    assert torch.equal(tallies_a, tallies_b)
    assert grads_a.keys() == grads_b.keys() and any("heads" in n for n in grads_a)
    assert any(n.startswith("base") for n in grads_a) == (mode == "finetune")
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-5, rtol=1e-4, msg=name)


def test_same_seed_gives_same_heads(tiny_base, tmp_path):
    """cfg.seed should make a run reproducible. train() seeds torch only after building the heads,
    so their random initialisation depends on whatever the process did before."""
    cfg_a = make_cfg(tiny_base, tmp_path / "a", steps=2, log_every=1, eval_every=2, eval_prompts=1)
    cfg_b = make_cfg(tiny_base, tmp_path / "b", steps=2, log_every=1, eval_every=2, eval_prompts=1)
    torch.manual_seed(1)
    train(cfg_a)
    torch.manual_seed(2)
    train(cfg_b)
    a, b = load_file(tmp_path / "a" / HEADS_WEIGHTS), load_file(tmp_path / "b" / HEADS_WEIGHTS)
    assert_same_tensors(b, a, 0.0, "heads of two runs with the same config and seed")


# ----------------------------------------------------------------------------- distill runs


def test_distill_mode_trains_and_reuses_the_cache(tiny_base, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    kw = dict(mode="finetune+distill", steps=4, distill_prompts=16, distill_cache=str(cache), log_every=1, eval_every=4)
    train(make_cfg(tiny_base, tmp_path / "a", **kw))
    assert len(list(cache.glob("distill-*.npy"))) == 1
    assert (tmp_path / "a" / HEADS_WEIGHTS).is_file() and (tmp_path / "a" / "model.safetensors").is_file()

    def no_generate(*args, **kwargs):
        raise AssertionError("a second run with the same base and prompts generated again")

    monkeypatch.setattr(transformers.GenerationMixin, "generate", no_generate)
    monkeypatch.setattr(distill_module, "blockwise_generate", no_generate)
    train(make_cfg(tiny_base, tmp_path / "b", **kw))
    assert (tmp_path / "b" / HEADS_WEIGHTS).is_file()


def test_distilled_rows_shorter_than_the_block_are_refused(tiny_base, tmp_path):
    """Distilled rows are distill_prompt_len + distill_new_tokens long, whatever seq_len says; at or
    below k the far heads have no targets (seq_len > k is checked, this is the same rule)."""
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="distill"):
        train(make_cfg(tiny_base, out, mode="distill", k=8, distill_prompts=8, distill_prompt_len=4,
                       distill_new_tokens=3, steps=2, log_every=1, eval_every=2, eval_prompts=1))  # fmt: skip
    assert_nothing_saved(out)


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("mode, head_loss", [("frozen", "all"), ("finetune", "all"), ("frozen", "random")])
def test_resume_after_kill_matches_uninterrupted_run(tiny_base, tmp_path, mode, head_loss):
    kw = dict(mode=mode, head_loss=head_loss, steps=8, checkpoint_every=4, log_every=1, eval_every=100)
    a, b = tmp_path / "a", tmp_path / "b"
    # Seed both fresh runs alike: train() does not seed the heads' initialisation itself (see
    # test_same_seed_gives_same_heads); this test is about the resume, not that.
    torch.manual_seed(0)
    train(make_cfg(tiny_base, a, **kw))

    torch.manual_seed(0)
    with pytest.raises(Killed):
        train(make_cfg(tiny_base, b, **kw), callback=kill_at(6))
    assert (b / "checkpoint" / "state.pt").is_file()
    assert_nothing_saved(b)
    assert [r["step"] for r in read_metrics(b)] == list(range(7))

    torch.manual_seed(123)  # the resumed run must not depend on the process's RNG state
    train(make_cfg(tiny_base, b, resume=True, **kw))

    assert_same_tensors(
        load_file(b / HEADS_WEIGHTS), load_file(a / HEADS_WEIGHTS), 1e-6, "resumed and uninterrupted heads"
    )
    if mode == "finetune":
        assert_same_tensors(
            load_file(b / "model.safetensors"),
            load_file(a / "model.safetensors"),
            1e-6,
            "resumed and uninterrupted base",
        )

    rows_a, rows_b = read_metrics(a), read_metrics(b)
    steps_b = [r["step"] for r in rows_b]
    assert steps_b == list(range(9)), f"metrics steps after resume: {steps_b}"
    loss_a = [r["loss"] for r in rows_a if "loss" in r]
    loss_b = [r["loss"] for r in rows_b if "loss" in r]
    assert len(loss_b) == 8 and loss_b == pytest.approx(loss_a, rel=1e-5)
    assert rows_b[-1]["eval_mean_block_size"] == pytest.approx(rows_a[-1]["eval_mean_block_size"])


# ----------------------------------------------------------------------------- bad input


def write_npy(path: Path, array: np.ndarray) -> Path:
    np.save(path, array)
    return path


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("empty file", ValueError, "fewer than one sequence|no tokens"),
        ("missing path", FileNotFoundError, "does not exist"),
        ("empty folder", ValueError, "no training data found"),
        ("ids beyond vocab", ValueError, "vocabulary"),
        ("negative ids", ValueError, "vocabulary"),
        ("float array", ValueError, "integer"),
        ("one sequence", ValueError, "at least 2 sequences"),
        ("seq_len beyond context", ValueError, "context"),
    ],
)
def test_bad_input_fails_clearly_and_saves_nothing(tiny_base, tmp_path, case, error, match):
    data, overrides = tmp_path / "data", {}
    data.mkdir()
    if case == "empty file":
        path = data / "empty.txt"
        path.write_text("")
    elif case == "missing path":
        path = data / "nope.txt"
    elif case == "empty folder":
        path = data / "sub"
        path.mkdir()
        (path / "notes.bin").write_bytes(b"\0")  # not a data suffix: ignored in a folder
    elif case == "ids beyond vocab":
        path = write_npy(data / "ids.npy", np.arange(400, dtype=np.int64) % (tiny_base.vocab + 5))
    elif case == "negative ids":
        ids = np.arange(400, dtype=np.int64) % tiny_base.vocab
        ids[17] = -3
        path = write_npy(data / "ids.npy", ids)
    elif case == "float array":
        path = write_npy(data / "ids.npy", np.arange(400, dtype=np.float32))
    elif case == "one sequence":
        path = write_npy(data / "ids.npy", np.arange(SEQ_LEN + 10, dtype=np.int64) % tiny_base.vocab)
    else:
        path, overrides = tiny_base.corpus, {"seq_len": CONTEXT + 1}
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        train(make_cfg(tiny_base, out, data=[str(path)], **overrides))
    assert not out.exists(), f"{case}: the failed run created {sorted(p.name for p in out.iterdir())}"


def test_npy_token_data_trains(tiny_base, tmp_path):
    """Token-id arrays are data too (int32 here), used as they are."""
    path = write_npy(tmp_path / "ids.npy", tiny_base.sequences[:40].numpy().astype(np.int32))
    out = tmp_path / "out"
    train(make_cfg(tiny_base, out, data=[str(path)], steps=2, log_every=1, eval_every=2, eval_prompts=1))
    assert (out / HEADS_WEIGHTS).is_file()


@pytest.mark.parametrize(
    "changed",
    [
        {"k": 3},
        {"mode": "finetune"},
        {"seed": 7},
        {"batch_size": 4},
        {"distill_prompts": 9},
        {"holdout": 0.1},
        {"lr": 0.01},
    ],  # fmt: skip
)
def test_resume_with_a_different_config_is_refused(tiny_base, tmp_path, changed):
    out = tmp_path / "out"
    kw = dict(steps=8, checkpoint_every=4, log_every=1, eval_every=100)
    with pytest.raises(Killed):
        train(make_cfg(tiny_base, out, k=4, **kw), callback=kill_at(5))
    metrics = (out / "metrics.jsonl").read_bytes()
    checkpoint = (out / "checkpoint" / "state.pt").read_bytes()

    name, value = next(iter(changed.items()))
    with pytest.raises(ValueError, match=rf"{name}=.*{value}") as err:
        train(make_cfg(tiny_base, out, resume=True, **{**kw, **changed}))
    assert "resume" in str(err.value)
    assert_nothing_saved(out)
    assert (out / "metrics.jsonl").read_bytes() == metrics
    assert (out / "checkpoint" / "state.pt").read_bytes() == checkpoint


RESUME_MAY_CHANGE = {
    *("steps", "eval_every", "log_every", "checkpoint_every", "patience", "min_delta", "doubling_gain"),
    *("loss_chunk", "distill_batch_size", "distill_cache", "feature_cache"),
}


def test_every_setting_is_checked_on_resume_or_allowed_to_change():
    """A new setting must be sorted: into RESUME_MUST_MATCH, or here, and into docs/training.md's list."""
    others = {"out", "resume", "data"}  # the data is checked by content (test_resume_checks_the_data_content...)
    must = set(RESUME_MUST_MATCH)
    assert not must & RESUME_MAY_CHANGE
    assert must | RESUME_MAY_CHANGE | others == set(TrainConfig.__dataclass_fields__)


def test_a_fresh_run_into_a_finished_run_is_refused_and_leaves_its_files(tiny_base, tmp_path):
    out = tmp_path / "out"
    train(make_cfg(tiny_base, out, steps=3, log_every=1, eval_every=3, eval_prompts=1, checkpoint_every=3))
    before = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert {"checkpoint/state.pt", "metrics.jsonl", HEADS_WEIGHTS, HEADS_CONFIG} <= set(before)
    with pytest.raises(ValueError, match=f"^--out {re.escape(str(out))} already holds a run .*--resume.*fresh --out"):
        train(make_cfg(tiny_base, out, steps=2, log_every=1, eval_every=2, eval_prompts=1))
    assert {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before


@pytest.mark.parametrize("steps", [6, 10])
def test_resume_may_shorten_or_extend_the_run(tiny_base, tmp_path, steps):
    """A run killed at step 5 of 8 and resumed for 6 or 10 steps ends there, its heads saved; one
    asking for fewer steps than the checkpoint holds is refused."""
    out = tmp_path / "out"
    kw = dict(checkpoint_every=4, log_every=1, eval_every=100)
    with pytest.raises(Killed):
        train(make_cfg(tiny_base, out, steps=8, **kw), callback=kill_at(5))
    with pytest.raises(ValueError, match="checkpoint is at step 4, and this run asks for 3 steps in all"):
        train(make_cfg(tiny_base, out, steps=3, resume=True, **kw))
    train(make_cfg(tiny_base, out, steps=steps, resume=True, **kw))
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, steps + 1))
    assert (out / HEADS_WEIGHTS).is_file()


def test_a_finished_run_resumed_trains_nothing_more(tiny_base, tmp_path):
    """A run keeps its last step's checkpoint: resumed with the same steps it only writes its outputs
    again, and given more it goes on from its end, not from its last periodic checkpoint. One that
    stopped on a plateau stays stopped."""
    out = tmp_path / "out"
    kw = dict(checkpoint_every=4, log_every=1, eval_every=100, mode="finetune")
    train(make_cfg(tiny_base, out, steps=6, **kw))
    heads, base, metrics = (out / HEADS_WEIGHTS).read_bytes(), base_state(out), read_metrics(out)
    train(make_cfg(tiny_base, out, steps=6, resume=True, **kw))
    assert (out / HEADS_WEIGHTS).read_bytes() == heads and read_metrics(out) == metrics
    for name, weight in base_state(out).items():
        torch.testing.assert_close(weight, base[name], rtol=0, atol=0, msg=name)
    train(make_cfg(tiny_base, out, steps=8, resume=True, **kw))
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, 9))

    flat = tmp_path / "flat"  # a learning rate of 0: the block never grows, and patience 1 stops it
    stop = dict(steps=8, eval_every=2, eval_prompts=1, patience=1, lr=0.0, checkpoint_every=100)
    train(make_cfg(tiny_base, flat, **stop))
    stopped = read_metrics(flat)
    assert stopped[-1]["step"] == 2
    train(make_cfg(tiny_base, flat, resume=True, **stop))
    assert read_metrics(flat) == stopped


def test_resume_checks_the_data_content_not_its_path(tiny_base, tmp_path):
    """A moved data file resumes; the same path holding other tokens is refused."""
    first = write_npy(tmp_path / "a.npy", tiny_base.sequences[:40].numpy())
    out = tmp_path / "out"
    kw = dict(steps=8, checkpoint_every=4, log_every=1, eval_every=100, eval_prompts=1)
    with pytest.raises(Killed):
        train(make_cfg(tiny_base, out, data=[str(first)], **kw), callback=kill_at(5))
    moved = first.rename(tmp_path / "moved.npy")
    with pytest.raises(Killed):  # the same tokens elsewhere: resumed from step 4, not refused
        train(make_cfg(tiny_base, out, data=[str(moved)], resume=True, **kw), callback=kill_at(6))
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")][-2:] == [5, 6]

    edited = tiny_base.sequences[:40].numpy().copy()
    edited[3, 5] = (edited[3, 5] + 1) % tiny_base.vocab
    write_npy(moved, edited)
    with pytest.raises(ValueError, match="trained on other data"):
        train(make_cfg(tiny_base, out, data=[str(moved)], resume=True, **kw))
    assert_nothing_saved(out)


def test_resume_from_a_corrupt_checkpoint_says_so(tiny_base, tmp_path):
    out = tmp_path / "out"
    kw = dict(steps=8, checkpoint_every=4, log_every=1, eval_every=100)
    with pytest.raises(Killed):
        train(make_cfg(tiny_base, out, **kw), callback=kill_at(5))
    (out / "checkpoint" / "state.pt").write_bytes(b"garbage\n")
    with pytest.raises(ValueError, match="checkpoint .* is corrupt"):
        train(make_cfg(tiny_base, out, resume=True, **kw))


def test_resume_without_a_checkpoint_warns_and_starts_over(tiny_base, tmp_path):
    with pytest.warns(UserWarning, match="no checkpoint"):
        train(make_cfg(tiny_base, tmp_path / "out", steps=2, eval_every=100, resume=True))
    assert [r["step"] for r in read_metrics(tmp_path / "out")][0] == 0


def test_eval_every_does_not_depend_on_log_every(tiny_base, tmp_path):
    out = tmp_path / "out"
    train(make_cfg(tiny_base, out, steps=6, eval_every=3, log_every=2, eval_prompts=1))
    evaluated = [r["step"] for r in read_metrics(out) if "eval_mean_block_size" in r]
    logged = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert evaluated == [0, 3, 6] and logged == [2, 4, 6]


# ----------------------------------------------------------------------------- CLI


def test_cli_train(tiny_base, tmp_path, capsys):
    out = tmp_path / "out"
    cli_main(
        [
            "train", "--base", str(tiny_base.dir), "--data", str(tiny_base.corpus), "--out", str(out),
            "--k", "4", "--steps", "5", "--batch-size", "8", "--seq-len", "64", "--log-every", "1",
            "--eval-every", "5", "--eval-prompts", "1", "--checkpoint-every", "100", "--lr", "3e-3",
        ]
    )  # fmt: skip
    png = (out / "training.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == [0, 1, 2, 3, 4, 5]
    assert (out / HEADS_WEIGHTS).is_file() and (out / HEADS_CONFIG).is_file()
    assert json.loads((out / HEADS_CONFIG).read_text())["heads"]["k"] == 4
    err = capsys.readouterr().err
    assert "saved paper heads (k=4)" in err
    assert re.search(r"held-out base loss [\d.]+ -> [\d.]+; heads 2..k top-1 accuracy [\d.]+ -> [\d.]+;", err)
    assert re.search(r"mean accepted block size [\d.]+ -> [\d.]+", err)


def test_cli_train_rejects_bad_arguments(tiny_base, tmp_path, capsys):
    common = ["train", "--base", str(tiny_base.dir), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as err:
        cli_main([*common, "--data", str(tiny_base.corpus), "--mode", "bogus"])
    assert err.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        cli_main([*common, "--data", str(tmp_path / "missing.txt"), "--steps", "1"])
    assert str(err.value.code).startswith("error:") and "does not exist" in str(err.value.code)
    with pytest.raises(SystemExit) as err:
        cli_main([*common, "--data", str(tiny_base.corpus), "--k", "4", "--head-weights", "1", "1"])
    assert "head_weights" in str(err.value.code)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- two processes

TWO_PROCESS_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from blockdecode.training.train import TrainConfig, train
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the heads' initialisation; train() does not seed it (rank 0's is broadcast)
    train(TrainConfig(**json.loads(sys.argv[1])))
    """
)


def launch_two(script: Path, cfg: TrainConfig, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # accelerate's own launcher with --cpu starts a single process unless told --multi_gpu; torchrun
    # (the same torch.distributed.run accelerate uses underneath) gives two gloo ranks on the CPU.
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    # A session of its own, so a hung run is killed whole: torchrun's workers too, not just torchrun.
    proc = subprocess.Popen(
        [*command, str(script), json.dumps(asdict(cfg))],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def two_process_runs(tiny_base, tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("two-processes")
    script = root / "run_train.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    kw = dict(mode="finetune", steps=6, log_every=1, eval_every=6, checkpoint_every=3, eval_prompts=1)
    two = make_cfg(tiny_base, root / "two", **kw)
    proc = launch_two(script, two)
    assert proc.returncode == 0, proc.stderr[-4000:]
    torch.manual_seed(0)
    train(make_cfg(tiny_base, root / "one", **kw))
    return SimpleNamespace(root=root, script=script, one=root / "one", two=root / "two")


@pytest.mark.slow
def test_two_processes_train_the_same_heads_as_one(two_process_runs):
    one, two = two_process_runs.one, two_process_runs.two
    assert_same_tensors(load_file(two / HEADS_WEIGHTS), load_file(one / HEADS_WEIGHTS), 1e-5, "2-process heads")
    assert_same_tensors(
        load_file(two / "model.safetensors"), load_file(one / "model.safetensors"), 1e-5, "2-process base"
    )
    assert [r["step"] for r in read_metrics(two)] == list(range(7))  # one writer, no duplicated lines


@pytest.mark.slow
def test_two_processes_log_the_global_batch_loss(two_process_runs):
    """metrics.jsonl's loss describes the global batch, whatever the number of processes: under
    two processes it must match the single-process run's (to float noise), not rank 0's half."""
    loss_1 = [r["loss"] for r in read_metrics(two_process_runs.one) if "loss" in r]
    loss_2 = [r["loss"] for r in read_metrics(two_process_runs.two) if "loss" in r]
    assert loss_2 == pytest.approx(loss_1, rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_two_processes_refuse_an_uneven_batch(two_process_runs, tiny_base):
    out = two_process_runs.root / "uneven"
    proc = launch_two(two_process_runs.script, make_cfg(tiny_base, out, batch_size=3, steps=2, eval_prompts=1))
    assert proc.returncode != 0
    assert "does not split evenly" in proc.stderr
    assert_nothing_saved(out)


@pytest.fixture(scope="module")
def eos_heavy_base(tiny_base, tmp_path_factory) -> Path:
    """A varied random base whose EOS is the token its greedy continuations emit most: distilled
    rows then stop at many different lengths, so the two halves of a batch hold unequal token counts."""
    base = varied_base(tiny_base.vocab)
    free = hf_greedy(base, tiny_base.sequences[:16, :16], 48, eos_token_id=None, pad_token_id=0)[:, 16:]
    eos = int(torch.mode(free.flatten()).values)
    for cfg in (base.config, base.generation_config):
        cfg.eos_token_id = eos
    directory = tmp_path_factory.mktemp("eos-heavy")
    base.save_pretrained(directory)
    tiny_base.tokenizer.save_pretrained(directory)
    return directory


def test_tokens_seen_leaves_out_what_follows_a_distilled_rows_eos(tiny_base, eos_heavy_base, tmp_path):
    out = tmp_path / "out"
    kw = dict(mode="distill", steps=2, eval_every=2, eval_prompts=1, distill_prompts=16, distill_new_tokens=48)
    cfg = make_cfg(tiny_base, out, base=str(eos_heavy_base), **kw)
    train(cfg)
    lengths = (np.load(next((out / "distill-cache").glob("*.npy"))) >= 0).sum(1)
    assert lengths.min() < lengths.max() == cfg.distill_prompt_len + cfg.distill_new_tokens
    record = json.loads((out / HEADS_CONFIG).read_text())["training"]
    assert record["tokens_seen"] == round(2 * cfg.batch_size * lengths.mean())


@pytest.mark.slow
def test_two_processes_distill_with_uneven_rows_match_one(two_process_runs, tiny_base, eos_heavy_base):
    """The global batch's loss is a mean over its valid tokens. Distilled rows end at EOS (the rest is
    ignored padding), so each process's half holds a different number of valid tokens; DDP averaging
    the two per-process means weights tokens unequally, unlike the single process."""
    kw = dict(
        base=str(eos_heavy_base), mode="distill", steps=6, log_every=1, eval_every=6, checkpoint_every=100,
        eval_prompts=1, distill_prompts=32, distill_prompt_len=16, distill_new_tokens=48,
    )  # fmt: skip
    root = two_process_runs.root
    proc = launch_two(two_process_runs.script, make_cfg(tiny_base, root / "distill-two", **kw))
    assert proc.returncode == 0, proc.stderr[-4000:]
    torch.manual_seed(0)
    train(make_cfg(tiny_base, root / "distill-one", **kw))
    rows = torch.from_numpy(np.load(next((root / "distill-one" / "distill-cache").glob("*.npy"))))
    lengths = (rows >= 0).sum(1)
    assert lengths.min() < lengths.max(), "the distilled rows were meant to have different lengths"
    heads_1 = load_file(root / "distill-one" / HEADS_WEIGHTS)
    assert_same_tensors(load_file(root / "distill-two" / HEADS_WEIGHTS), heads_1, 1e-5, "2-process distilled heads")


# ----------------------------------------------------------------------------- mixed precision


def run_script(script: Path, cfg: TrainConfig, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(script), json.dumps(asdict(cfg))], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_bf16_mixed_precision_trains(tiny_base, tmp_path):
    """In a fresh process (accelerate's state is per process, see the next test)."""
    script = tmp_path / "run_train.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    out = tmp_path / "out"
    cfg = make_cfg(tiny_base, out, mode="finetune", mixed_precision="bf16", steps=20, log_every=1, eval_every=20)
    proc = run_script(script, cfg)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3])
    heads = load_file(out / HEADS_WEIGHTS)
    assert all(t.dtype == torch.float32 for t in heads.values())  # weights stay fp32; only compute is bf16
    loaded = BlockwiseLM.from_pretrained(out)
    prompt = tiny_base.sequences[-1:, :16]
    assert_greedy_equal(loaded.base, prompt, loaded.generate(prompt, 24).sequences, hf_greedy(loaded.base, prompt, 24))


def test_train_twice_in_one_process_with_different_mixed_precision(tiny_base, tmp_path):
    """train() is a library call: a notebook or a sweep calls it again with other settings. accelerate keeps
    one AcceleratorState per process and refuses a different mixed_precision the second time."""
    kw = dict(steps=2, log_every=1, eval_every=2, eval_prompts=1)
    train(make_cfg(tiny_base, tmp_path / "fp32", mixed_precision="no", **kw))
    train(make_cfg(tiny_base, tmp_path / "bf16", mixed_precision="bf16", **kw))
    assert (tmp_path / "bf16" / HEADS_WEIGHTS).is_file()


# ----------------------------------------------------------------------------- stopping and the record kept


def test_plateaued_reads_the_held_out_block_sizes():
    evals = [{"step": s, "eval_mean_block_size": b} for s, b in enumerate([1.0, 1.5, 1.505, 1.49, 1.6])]
    assert not plateaued(evals[:2], patience=2, min_delta=0.01)
    assert not plateaued(evals[:3], patience=2, min_delta=0.01)  # 1.505 is not longer by 0.01: one eval
    assert plateaued(evals[:4], patience=2, min_delta=0.01)
    assert not plateaued(evals, patience=2, min_delta=0.01)  # 1.6 is
    assert not plateaued([{"step": 3, "loss": 1.0}], patience=1, min_delta=0.0)


def test_doubling_gain_compares_the_best_block_at_half_the_steps():
    evals = [{"step": s, "eval_mean_block_size": b} for s, b in [(0, 1.0), (10, 1.5), (20, 1.4), (30, 1.6), (40, 1.62)]]
    assert doubling_gain(evals[:3], eval_every=10) is None  # half of 20 is the first evaluation after step 0
    assert doubling_gain(evals[:4], eval_every=10) is None  # half of 30 is 15: still before the second
    assert doubling_gain(evals, eval_every=10) == pytest.approx(1.62 - 1.5)  # best by step 20 was 1.5, not 1.4
    dip = [*evals, {"step": 80, "eval_mean_block_size": 1.3}]
    assert doubling_gain(dip, eval_every=10) == pytest.approx(0.0)  # the best by 40 (1.62) still stands
    assert doubling_gain([{"step": 3, "loss": 1.0}], eval_every=1) is None


def test_doubling_gain_stops_a_run_whose_block_stops_growing(tiny_base, tmp_path):
    """With a zero learning rate the block never grows: the run stops at the first evaluation whose
    half-way point is the second evaluation, and says why."""
    out = tmp_path / "out"
    train(make_cfg(tiny_base, out, lr=0.0, steps=40, eval_every=2, doubling_gain=0.05, checkpoint_every=100))
    assert max(r["step"] for r in read_metrics(out)) == 8  # evals at 0..8: half of 8 is 4, the second after 0
    with pytest.raises(ValueError, match="doubling_gain must be >= 0"):
        make_cfg(tiny_base, out, doubling_gain=-1.0)


def test_patience_stops_a_run_whose_block_stops_growing(tiny_base, tmp_path):
    """With a zero learning rate the held-out block never grows: the run stops after `patience`
    evaluations, saves its model, and blockdecode.json records what it was and what it reached."""
    out = tmp_path / "out"
    cfg = make_cfg(tiny_base, out, lr=0.0, steps=40, eval_every=2, patience=2, checkpoint_every=100)
    train(cfg)
    rows = read_metrics(out)
    assert max(r["step"] for r in rows) == 4  # evals at 0, 2, 4: two without growth
    record = json.loads((out / HEADS_CONFIG).read_text())["training"]
    assert record["mode"] == "frozen" and record["k"] == 4 and record["steps"] == 4
    assert record["tokens_seen"] == 4 * cfg.batch_size * cfg.seq_len
    assert record["original_base_heldout_loss"] == pytest.approx(record["base_heldout_loss"])
    assert record["mean_block_size"] == rows[-1]["eval_mean_block_size"]
    BlockwiseLM.from_pretrained(out)  # the record does not get in the way of loading


def test_a_non_finite_loss_stops_the_run_and_saves_nothing(tiny_base, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="lr must be a finite number >= 0, got nan"):
        make_cfg(tiny_base, out, lr=float("nan"))
    cfg = make_cfg(tiny_base, out, lr=1e38, steps=30, log_every=1, eval_every=30, checkpoint_every=2)
    with pytest.raises(ValueError, match="the training loss is (nan|inf).*stopped"):
        train(cfg)
    assert_nothing_saved(out)


def test_out_inside_a_data_folder_is_refused(tiny_base, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("alpha beta " * 200)
    with pytest.raises(ValueError, match="lies inside the data folder"):
        make_cfg(tiny_base, data / "run", data=[str(data)])


def test_binary_files_in_data_are_skipped_and_counted(tiny_base, tmp_path):
    (tmp_path / "a.txt").write_text(tiny_base.corpus.read_text())
    (tmp_path / "blob.bin.txt").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.warns(UserWarning, match="skipped 1 binary file"):
        tokens = load_tokens([tmp_path], tiny_base.tokenizer, tiny_base.tokenizer.eos_token_id)
    assert tokens.numel() > 0


def test_a_killed_checkpoint_write_leaves_nothing_behind_on_the_next_run(tiny_base, tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / ".state.pt.abc123.tmp").write_bytes(b"half a checkpoint")
    train(make_cfg(tiny_base, out, steps=2, log_every=1, eval_every=2, eval_prompts=1))
    assert not list((out / "checkpoint").glob(".*.tmp"))


def test_an_unwritable_out_fails_before_anything_loads(tiny_base, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cfg = make_cfg(tiny_base, blocker / "out", base=str(tmp_path / "no-base-here"))
    with pytest.raises(OSError, match="--out .* cannot be written"):
        train(cfg)  # the missing base would fail later: the output folder is checked first


# ----------------------------------------------------------------------------- encoder-decoder bases


def test_pairs_load_from_a_tsv_or_two_aligned_files(tiny_marian, tmp_path):
    from blockdecode.training.data import load_pairs, read_parallel

    texts = read_parallel([tiny_marian.data])
    (tmp_path / "en.txt").write_text("\n".join(s for s, _ in texts))
    (tmp_path / "es.txt").write_text("\n".join(t for _, t in texts))
    assert read_parallel([tmp_path / "en.txt", tmp_path / "es.txt"]) == texts
    tok, eos = tiny_marian.tokenizer, tiny_marian.tokenizer.eos_token_id
    pairs = load_pairs([tiny_marian.data], tok, start=5, eos=eos, max_len=1000)
    first = pairs[0:1]
    assert first.decoder[0].tolist() == [5, *tok(texts[0][1]).input_ids]  # start token first, one EOS last
    assert first.source[0].tolist() == tok(texts[0][0]).input_ids and first.decoder[0, -1] == eos
    with pytest.warns(UserWarning, match="left out .* longer than 60 tokens"):
        assert len(load_pairs([tiny_marian.data], tok, start=5, eos=eos, max_len=60)) < len(texts)
    (tmp_path / "short.txt").write_text("one line\n")
    with pytest.raises(ValueError, match="must align"):
        read_parallel([tmp_path / "en.txt", tmp_path / "short.txt"])


@pytest.mark.filterwarnings("ignore:left out")
@pytest.mark.parametrize("mode", ["frozen", "finetune", "distill", "finetune+distill"])
def test_heads_train_on_pairs_in_every_mode_and_decode_exactly(tiny_marian, tmp_path, mode):
    model = train(pairs_cfg(tiny_marian, tmp_path, mode=mode, head_loss="random" if mode == "distill" else "all"))
    rows = read_metrics(tmp_path)
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert rows[-1]["eval_mean_block_size"] >= 1.0
    saved = json.loads((tmp_path / "blockdecode.json").read_text())["training"]
    assert saved["mode"] == mode and 0 < saved["tokens_seen"] < 6 * 8 * 128
    loaded = BlockwiseLM.from_pretrained(tmp_path)
    assert loaded.base.config.is_encoder_decoder
    source = tiny_marian.tokenizer("In the beginning was the Word.", return_tensors="pt").input_ids
    ref = hf_greedy(loaded.base, source, 30)
    assert_greedy_equal(loaded.base, source, loaded.generate(source, 30, tree=None).sequences, ref, what=mode)
    if mode.startswith("finetune"):
        assert not torch.equal(model.base.get_input_embeddings().weight, toy_marian_weights(tiny_marian))


def toy_marian_weights(tiny_marian) -> torch.Tensor:
    return AutoModelForSeq2SeqLM.from_pretrained(tiny_marian.dir).get_input_embeddings().weight


@pytest.mark.filterwarnings("ignore:left out")
def test_training_on_pairs_resumes_exactly(tiny_marian, tmp_path):
    kw = dict(mode="finetune+distill", steps=6, checkpoint_every=3, eval_every=100)
    torch.manual_seed(0)
    train(pairs_cfg(tiny_marian, tmp_path / "a", **kw))
    torch.manual_seed(0)
    with pytest.raises(Killed):
        train(pairs_cfg(tiny_marian, tmp_path / "b", **kw), callback=kill_at(4))
    train(pairs_cfg(tiny_marian, tmp_path / "b", resume=True, **kw))
    for name in (HEADS_WEIGHTS, "model.safetensors"):
        assert_same_tensors(load_file(tmp_path / "b" / name), load_file(tmp_path / "a" / name), 1e-6, name)


SOURCES = ["The Lord is my shepherd; I shall not want.", "He maketh me to lie down in green pastures.", "",
           "He leadeth me beside the still waters."]  # fmt: skip


def write_sources(folder: Path) -> Path:
    """A --distill-sources file as `blockdecode bible --extra-sources` writes one, with a blank line."""
    path = folder / "sources-web.txt"
    path.write_text("".join(f"{line}\n" for line in SOURCES), encoding="utf-8")
    return path


@pytest.mark.filterwarnings("ignore:left out")
@torch.inference_mode()
def test_distill_sources_join_the_training_sources(tiny_marian, tmp_path):
    """The files' lines follow the training sources, the prompts are drawn evenly from them all, and
    each distilled row is the base's own translation of its source."""
    from blockdecode.training.data import load_pairs, load_sources
    from blockdecode.training.distill import distill_pairs

    base = AutoModelForSeq2SeqLM.from_pretrained(tiny_marian.dir).eval()
    tok = tiny_marian.tokenizer
    pairs = load_pairs([tiny_marian.data], tok, tok.pad_token_id, tok.eos_token_id, 128)[:6]
    (extra,) = load_sources([write_sources(tmp_path)], tok, 128)
    assert extra == tok([s for s in SOURCES if s]).input_ids  # the blank line skipped
    with pytest.raises(FileNotFoundError, match="distillation sources .*missing.txt do not exist"):
        load_sources([tmp_path / "missing.txt"], tok, 128)
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="blank.txt holds no source sentence"):
        load_sources([tmp_path / "blank.txt"], tok, 128)
    cfg = pairs_cfg(tiny_marian, tmp_path, mode="distill", distill_batch_size=4, distill_new_tokens=30)
    distilled = distill_pairs(base, pairs, cfg, show=False, extra=extra)
    assert [row[row >= 0].tolist() for row in distilled.source] == [
        *(row[row >= 0].tolist() for row in pairs.source),
        *extra,
    ]
    for r, source in enumerate(extra, start=len(pairs)):
        ref = hf_greedy(base, torch.tensor([source]), 30)[0]
        assert torch.equal(distilled.decoder[r, : len(ref)], ref), f"row {r}"
    few = distill_pairs(base, pairs, replace(cfg, distill_prompts=3), show=False, extra=extra)  # rows 0, 4, 8
    assert torch.equal(few.decoder, distilled.decoder[[0, 4, 8]])


@pytest.mark.filterwarnings("ignore:left out")
def test_distill_sources_change_the_cache_and_are_recorded(tiny_marian, tmp_path):
    sources, cache = write_sources(tmp_path), tmp_path / "cache"
    kw = dict(mode="distill", steps=2, eval_every=2, eval_prompts=1, distill_prompts=40, distill_new_tokens=20)
    train(pairs_cfg(tiny_marian, tmp_path / "plain", distill_cache=str(cache), **kw))
    assert "distill_sources" not in json.loads((tmp_path / "plain" / HEADS_CONFIG).read_text())["training"]
    cli_main(
        [
            "train", "--base", str(tiny_marian.dir), "--data", str(tiny_marian.data), "--out", str(tmp_path / "more"),
            "--mode", "distill", "--k", "4", "--steps", "2", "--batch-size", "8", "--seq-len", "128",
            "--eval-every", "2", "--eval-prompts", "1", "--distill-prompts", "40", "--distill-new-tokens", "20",
            "--distill-cache", str(cache), "--distill-sources", str(sources),
        ]
    )  # fmt: skip
    assert len(list(cache.glob("distill-*.npy"))) == 2  # the sources drawn changed the content hash
    record = json.loads((tmp_path / "more" / HEADS_CONFIG).read_text())["training"]
    drawn = record["distill_sources"][str(sources)]["distilled"]
    assert record["distill_sources"] == {str(sources): {"sources": 3, "distilled": drawn}}
    assert drawn >= 1 and record["distilled_training_sources"] + drawn == 40


def test_distill_sources_are_refused_for_a_causal_base(tiny_base, tmp_path):
    """A causal LM's distillation prompts are cut from its data: the text belongs in --data."""
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="--distill-sources .* causal LM"):
        train(make_cfg(tiny_base, out, mode="distill", distill_sources=[str(write_sources(tmp_path))]))
    assert not out.exists()


@pytest.mark.filterwarnings("ignore:left out")
def test_resume_refuses_other_distill_sources(tiny_marian, tmp_path):
    """Other files, or the same file edited, are other distilled data."""
    sources, out = write_sources(tmp_path), tmp_path / "out"
    kw = dict(mode="distill", steps=6, checkpoint_every=3, eval_every=100, distill_prompts=24, distill_new_tokens=20)
    with pytest.raises(Killed):
        train(pairs_cfg(tiny_marian, out, distill_sources=[str(sources)], **kw), callback=kill_at(4))
    with pytest.raises(ValueError, match="has distill_sources=.*sources-web.txt'], this run asks for None"):
        train(pairs_cfg(tiny_marian, out, resume=True, **kw))
    sources.write_text("Another source altogether, never distilled before.\n")
    with pytest.raises(ValueError, match="trained on other data"):
        train(pairs_cfg(tiny_marian, out, resume=True, distill_sources=[str(sources)], **kw))
    assert_nothing_saved(out)


@pytest.mark.parametrize("mode, targets", [("frozen", "hard"), ("finetune", "soft"), ("distill", "soft")])
def test_hydra_heads_train_in_every_mode_and_decode_exactly(tiny_base, tmp_path, mode, targets):
    """Sequential heads learn by teacher forcing, from hard or soft targets, and what they learn decodes
    exactly, as a chain and as a tree; their next-token guesses beat the base's next token repeated."""
    out = tmp_path / "out"
    kw = dict(distill_cache=str(tmp_path / "distill"), head_type="hydra", targets=targets)
    model = train(make_cfg(tiny_base, out, mode=mode, steps=30, log_every=1, eval_every=30, **kw))
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    # soft targets' loss is bounded below by the teacher's entropy, near log V for this untrained base
    assert sum(losses[-3:]) / 3 < (0.9 if targets == "hard" else 0.9995) * sum(losses[:3]) / 3
    evals = [r for r in read_metrics(out) if "eval_head_acc" in r]
    if targets == "hard":  # head 2 learnt the data (soft targets learn this untrained base's flat guesses)
        assert evals[-1]["eval_head_acc"][1] > evals[0]["eval_head_acc"][1]
    loaded = BlockwiseLM.from_pretrained(out)
    assert loaded.config.head_type == "hydra"
    ids = torch.tensor([[5, 9, 11, 7]])
    want = hf_greedy(loaded.base, ids, 24, eos_token_id=NO_EOS)
    for tree in (None, 10):
        decoded = loaded.generate(ids, 24, eos_token_id=NO_EOS, drafter="heads", tree=tree)
        assert_greedy_equal(loaded.base, ids, decoded.sequences, want, what=f"tree {tree}")
    assert model.config == loaded.config


def test_the_base_loss_on_real_data_is_the_bases_own_loss_on_those_rows(tiny_base, tmp_path):
    """ "Both" with base_loss_on="data": the base's term is its next-token loss on real rows (an anchor to
    real text), not on the distilled rows the heads learn from; the heads' terms are unchanged. A short
    run trains, keeps the base within reach of its start, and decodes exactly."""
    base = load_base(str(tiny_base.dir))
    cfg = make_cfg(tiny_base, tmp_path / "unit", mode="finetune+distill", base_loss_on="data")
    objective = Objective(BlockwiseLM.from_base(base, k=4), cfg).eval()
    gen = torch.Generator().manual_seed(0)
    rows, real = torch.randint(0, 200, (2, 12), generator=gen), torch.randint(0, 200, (3, 10), generator=gen)
    plain, plain_tallies = objective(rows, [2, 3, 4])
    anchored, tallies = objective(rows, [2, 3, 4], anchor=real)
    with torch.no_grad():
        logits = base(real).logits[:, :-1]
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), real[:, 1:].flatten(), reduction="sum")
    torch.testing.assert_close(anchored[0], want, atol=1e-4, rtol=1e-5)
    assert int(tallies[0, 1]) == 3 * 9 and torch.equal(anchored[1:], plain[1:])
    assert torch.equal(tallies[1:], plain_tallies[1:])

    out = tmp_path / "run"
    kw = dict(mode="finetune+distill", base_loss_on="data", steps=20, eval_every=20, log_every=1)
    model = train(make_cfg(tiny_base, out, distill_cache=str(tmp_path / "distill"), **kw))
    assert all(math.isfinite(r["loss"]) for r in read_metrics(out) if "loss" in r)
    ids = torch.tensor([[5, 9, 11, 7]])
    decoded = model.generate(ids, 16, eos_token_id=NO_EOS, tree=None)
    assert_greedy_equal(model.base, ids, decoded.sequences, hf_greedy(model.base, ids, 16, eos_token_id=NO_EOS))


@pytest.mark.parametrize("mode", ["frozen", "finetune"])
def test_a_draft_vocabulary_is_learnt_from_the_targets_and_saved_with_the_heads(tiny_base, tmp_path, mode):
    """--draft-vocab N: the heads score the N most frequent targets (their map saved with them and
    its coverage recorded), learn through those rows alone, still lower their loss, and decode
    exactly, proposing only ids of the map."""
    out = tmp_path / "out"
    model = train(make_cfg(tiny_base, out, mode=mode, steps=30, log_every=1, eval_every=30, draft_vocab=24))
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3
    record = json.loads((out / HEADS_CONFIG).read_text())
    assert record["heads"]["draft_vocab"] == 24 and 0.5 < record["training"]["draft_vocab_coverage"] <= 1.0
    loaded = BlockwiseLM.from_pretrained(out)
    assert torch.equal(loaded.token_map, model.token_map) and not torch.equal(loaded.token_map, torch.arange(24))
    ids = torch.tensor([[5, 9, 11, 7]])
    decoded = loaded.generate(ids, 24, eos_token_id=NO_EOS, drafter="heads", tree=None)
    assert_greedy_equal(loaded.base, ids, decoded.sequences, hf_greedy(loaded.base, ids, 24, eos_token_id=NO_EOS))
    proposed = loaded.drafter().propose(ids, torch.randn(1, loaded.config.hidden_size), 3)
    assert set(proposed[0].tolist()) <= set(loaded.token_map.tolist())


@pytest.mark.parametrize(
    "mode, head_type, targets",
    [("frozen", "paper", "hard"), ("distill", "paper", "hard"), ("distill", "hydra", "soft")],
)
def test_cached_base_features_train_the_same_heads_without_running_the_base(
    tiny_base, tmp_path, mode, head_type, targets, monkeypatch
):
    """--feature-cache: a frozen base's outputs on the rows are computed once and read at every step
    (the base runs only for evaluation), and the heads come out as without the cache (hydra's teacher
    forcing and the soft targets read the cached outputs too)."""
    kw = dict(mode=mode, steps=8, log_every=1, eval_every=8, distill_cache=str(tmp_path / "distill"))
    kw |= dict(head_type=head_type, targets=targets)
    calls = []
    real = objective_module.sequence_logits
    monkeypatch.setattr(objective_module, "sequence_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = train(make_cfg(tiny_base, tmp_path / "plain", **kw))
    plain_calls, calls[:] = len(calls), []
    cached = train(make_cfg(tiny_base, tmp_path / "cached", feature_cache=str(tmp_path / "features"), **kw))
    assert len(calls) == plain_calls - 8  # the 8 training steps ran no base; the evaluations still do
    for name, tensor in plain.heads.state_dict().items():
        torch.testing.assert_close(cached.heads.state_dict()[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    plain_loss = [r["loss"] for r in read_metrics(tmp_path / "plain") if "loss" in r]
    cached_loss = [r["loss"] for r in read_metrics(tmp_path / "cached") if "loss" in r]
    assert cached_loss == pytest.approx(plain_loss, rel=1e-4)


def test_cached_features_of_pairs_train_the_same_heads(tiny_marian, tmp_path):
    """An encoder-decoder's frozen base: its decoder outputs given each source, cached per pair (in
    fp32, as the uncached run computes them here: under bf16 autocast they would differ by its rounding)."""
    kw = dict(mode="frozen", steps=6, eval_every=6, log_every=1, mixed_precision="no")
    plain = train(pairs_cfg(tiny_marian, tmp_path / "plain", **kw))
    cached = train(pairs_cfg(tiny_marian, tmp_path / "cached", feature_cache=str(tmp_path / "features"), **kw))
    for name, tensor in plain.heads.state_dict().items():
        torch.testing.assert_close(cached.heads.state_dict()[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
