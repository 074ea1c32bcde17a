"""Distilled data: the base model's own continuations of data prompts (greedy, decoded blockwise, or
beam search) and an encoder-decoder's own translations, cached by content, resumed after a kill, and
distilled again where the cache is damaged."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import hf_greedy, make_cfg, pairs_cfg, varied_base
from transformers import AutoModelForSeq2SeqLM

from blockdecode.training import distill as distill_module
from blockdecode.training.data import load_pairs
from blockdecode.training.distill import distill_pairs, distill_sequences


@torch.inference_mode()
def test_distill_sequences_are_the_base_models_greedy_output(tiny_base, tmp_path, monkeypatch):
    base = varied_base(tiny_base.vocab)
    sequences = tiny_base.sequences[:40]
    cfg = make_cfg(
        tiny_base,
        tmp_path / "out",
        mode="distill",
        distill_prompts=6,
        distill_prompt_len=8,
        distill_new_tokens=20,
        distill_batch_size=4,  # a full batch and a ragged one
    )
    prompts = sequences[torch.linspace(0, len(sequences) - 1, 6).long(), :8]
    # Choose as EOS a token greedy decoding emits mid-way through the first continuation, so at
    # least one row stops early and the padding after EOS is exercised.
    free = hf_greedy(base, prompts[:1], 20, eos_token_id=None)[0, 8:].tolist()
    eos = next(t for i, t in enumerate(free) if i >= 5 and t not in free[:i])
    base.generation_config.eos_token_id = eos
    base.config.eos_token_id = eos

    data = distill_sequences(base, sequences, cfg, show=False)
    assert data.shape == (6, 28) and data.dtype == torch.long
    stopped_early = 0
    for r in range(6):
        ref = hf_greedy(base, prompts[r : r + 1], 20, pad_token_id=0)[0]
        n = len(ref)
        assert torch.equal(data[r, :n], ref), f"row {r} is not the base's greedy continuation"
        assert (data[r, n:] == -1).all(), f"row {r}: expected -1 after EOS"
        if n < 28:
            stopped_early += 1
            assert int(ref[-1]) == eos
    assert stopped_early >= 1

    # Cached on disk, and a second call reads it back without generating.
    cached = list((tmp_path / "out" / "distill-cache").glob("distill-*.npy"))
    assert len(cached) == 1
    assert torch.equal(torch.from_numpy(np.load(cached[0])), data)

    def no_generate(*args, **kwargs):
        raise AssertionError("generate called although the distilled data is cached")

    monkeypatch.setattr(distill_module, "blockwise_generate", no_generate)
    assert torch.equal(distill_sequences(base, sequences, cfg, show=False), data)
    # ... and the cache key depends on what is generated: another budget is not served from it.
    with pytest.raises(AssertionError, match="generate called"):
        distill_sequences(base, sequences, replace(cfg, distill_new_tokens=21), show=False)


def crash_on_call(monkeypatch, n: int) -> list:
    """From now on, the n-th batch distilled raises KeyboardInterrupt, a Ctrl-C in the middle of the
    distillation; returns the list the calls are counted in."""
    generate, calls = distill_module.blockwise_generate, []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    monkeypatch.setattr(distill_module, "blockwise_generate", crashing)
    return calls


@torch.inference_mode()
def test_distillation_killed_mid_way_resumes_where_it_stopped(tiny_base, tmp_path, monkeypatch):
    """Each finished batch is saved at once: after a crash, a rerun generates only the batches still
    missing and ends with the same rows as an uninterrupted run, and leaves no partial files."""
    base = varied_base(tiny_base.vocab)
    sequences = tiny_base.sequences[:40]
    kw = dict(mode="distill", distill_prompts=10, distill_prompt_len=8, distill_new_tokens=12, distill_batch_size=3)
    whole = distill_sequences(base, sequences, make_cfg(tiny_base, tmp_path / "whole", **kw), show=False)

    cfg = make_cfg(tiny_base, tmp_path / "killed", **kw)
    generate, calls = distill_module.blockwise_generate, crash_on_call(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        distill_sequences(base, sequences, cfg, show=False)
    calls.clear()
    monkeypatch.setattr(distill_module, "blockwise_generate", lambda *a, **k: calls.append(1) or generate(*a, **k))
    assert torch.equal(distill_sequences(base, sequences, cfg, show=False), whole)
    assert len(calls) == 2  # batches 3 and 4 of 4
    cache = tmp_path / "killed" / "distill-cache"
    assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".npy"]
    stats = json.loads(next(cache.glob("*.json")).read_text())
    assert stats["rows"] == 10 and stats["tokens_per_s"] > 0


@pytest.mark.parametrize(
    "damage, match",
    [
        ("header", "is not a readable .npy array \\(the magic string is not correct"),
        ("truncated", "is not a readable .npy array"),
        ("shape", "holds int64 \\(9, 20\\), not int64 \\(10, 20\\)"),
    ],
)
@torch.inference_mode()
def test_a_damaged_distill_cache_is_named_and_distilled_again(tiny_base, tmp_path, monkeypatch, damage, match):
    base = varied_base(tiny_base.vocab)
    kw = dict(mode="distill", distill_prompts=10, distill_prompt_len=8, distill_new_tokens=12, distill_batch_size=5)
    cfg = make_cfg(tiny_base, tmp_path / "out", **kw)
    whole = distill_sequences(base, tiny_base.sequences[:40], cfg, show=False)
    path = next((tmp_path / "out" / "distill-cache").glob("distill-*.npy"))
    if damage == "header":
        path.write_bytes(b"\0" + path.read_bytes()[1:])
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    else:
        np.save(path, whole[:9].numpy())
    generate, calls = distill_module.blockwise_generate, []
    monkeypatch.setattr(distill_module, "blockwise_generate", lambda *a, **k: calls.append(1) or generate(*a, **k))
    with pytest.warns(UserWarning, match=f"{re.escape(str(path))} {match}.*: computing it again"):
        assert torch.equal(distill_sequences(base, tiny_base.sequences[:40], cfg, show=False), whole)
    assert len(calls) == 2 and torch.equal(torch.from_numpy(np.load(path)), whole)


@torch.inference_mode()
def test_distilled_batches_of_another_batch_size_are_not_taken_for_this_ones(tiny_base, tmp_path, monkeypatch):
    """A distillation killed with --distill-batch-size 3 and resumed with 4: the batches saved at 0
    (3 rows) and 3 are not this run's, so they are distilled again rather than leaving rows out."""
    base = varied_base(tiny_base.vocab)
    kw = dict(mode="distill", distill_prompts=10, distill_prompt_len=8, distill_new_tokens=12)
    whole = distill_sequences(base, tiny_base.sequences[:40], make_cfg(tiny_base, tmp_path / "whole", **kw), False)
    crash_on_call(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        distill_sequences(
            base, tiny_base.sequences[:40], make_cfg(tiny_base, tmp_path / "b", distill_batch_size=3, **kw)
        )
    with pytest.warns(UserWarning, match="000000000.npy holds int64 \\(3, 20\\), not int64 \\(4, 20\\)"):
        resumed = distill_sequences(
            base, tiny_base.sequences[:40], make_cfg(tiny_base, tmp_path / "b", distill_batch_size=4, **kw)
        )
    assert torch.equal(resumed, whole)


@torch.inference_mode()
def test_distill_sequences_with_beams(tiny_base, tmp_path):
    base = varied_base(tiny_base.vocab)
    sequences = tiny_base.sequences[:20]
    cfg = make_cfg(
        tiny_base,
        tmp_path / "out",
        mode="distill",
        distill_prompts=4,
        distill_prompt_len=8,
        distill_new_tokens=12,
        distill_beams=2,
    )
    data = distill_sequences(base, sequences, cfg, show=False)
    assert data.shape == (4, 20)
    prompts = sequences[torch.linspace(0, 19, 4).long(), :8]
    assert torch.equal(data[:, :8], prompts)
    assert ((data == -1) | ((data >= 0) & (data < tiny_base.vocab))).all()
    for r in range(4):
        ref = base.generate(
            prompts[r : r + 1],
            attention_mask=torch.ones(1, 8, dtype=torch.long),
            do_sample=False,
            num_beams=2,
            max_new_tokens=12,
            pad_token_id=0,
        )[0]
        assert torch.equal(data[r, : len(ref)], ref)


@pytest.mark.filterwarnings("ignore:left out")
@torch.inference_mode()
def test_distilled_targets_are_the_bases_own_translations(tiny_marian, tmp_path):
    """Batched with padding, each row is exactly what generate gives for that source alone."""
    base = AutoModelForSeq2SeqLM.from_pretrained(tiny_marian.dir).eval()
    tok = tiny_marian.tokenizer
    pairs = load_pairs([tiny_marian.data], tok, tok.pad_token_id, tok.eos_token_id, 128)[:9]
    cfg = pairs_cfg(tiny_marian, tmp_path, mode="distill", distill_batch_size=4, distill_new_tokens=30)
    distilled = distill_pairs(base, pairs, cfg, show=False)
    assert torch.equal(distilled.source, pairs.source) and distilled.decoder.shape == (9, 31)
    few = distill_pairs(base, pairs, replace(cfg, distill_prompts=3), show=False)  # drawn evenly: rows 0, 4, 8
    assert torch.equal(few.decoder, distilled.decoder[[0, 4, 8]])
    for r in range(9):
        source = pairs[r : r + 1].source
        ref = hf_greedy(base, source, 30)[0]
        assert torch.equal(distilled.decoder[r, : len(ref)], ref), f"row {r}"
        assert (distilled.decoder[r, len(ref) :] == -1).all()
