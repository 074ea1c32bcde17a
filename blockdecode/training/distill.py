"""Distilled training data: the base model's own continuations of prompts drawn from the data
(Stern et al., 2018, §5), or for an encoder-decoder its own translations of the sources (the
paper's sequence-level distillation), which the heads then learn to predict.

Generation is the expensive part of a distill run, so its rows are saved batch by batch as they
are done (a killed run resumes where it stopped) and cached by content (prompts, settings, base
weights): every later run on the same base and prompts reuses them."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from blockdecode.core.hf import generate_length, resolve_eos, weights_digest
from blockdecode.core.io import atomic_write, cached_npy, save_npy, write_json
from blockdecode.decoding.adapter import decoder_prompt
from blockdecode.decoding.loop import blockwise_generate
from blockdecode.decoding.reference import greedy_generate
from blockdecode.decoding.rules import greedy_rules
from blockdecode.drafters.ngram import NgramDrafter
from blockdecode.training.config import TrainConfig
from blockdecode.training.data import Pairs, padded


def drawn_evenly(n: int, count: int) -> torch.LongTensor:
    """`count` indices spread evenly over range(n), first and last included (all n if count >= n)."""
    return torch.linspace(0, n - 1, min(count, n)).long()


DISTILL_K = 4
"""Tokens a call at best when distillation decodes greedily: its batches are decoded blockwise with prompt
lookup's chains (no heads exist yet), 1.3-1.7x `transformers`' batched greedy at 16 rows of 32 + 128 tokens
on the built-in model, one thread (k = 3 and 6 were no faster)."""


@torch.inference_mode()
def distill_sequences(
    base: PreTrainedModel, sequences: torch.LongTensor, cfg: TrainConfig, show: bool = True
) -> torch.LongTensor:
    """The base model's own continuations (greedy, decoded blockwise in batches; or beam search) of
    prompts drawn evenly from `sequences`: [N, prompt_len + new_tokens], -1 after an EOS (padding the
    loss ignores)."""
    prompts = sequences[drawn_evenly(len(sequences), cfg.distill_prompts), : cfg.distill_prompt_len]
    eos = resolve_eos(base, None)

    def generate(rows: slice) -> torch.LongTensor:
        # the model's own argmax (or beam search), as decoding will verify it
        batch = prompts[rows].to(base.device)
        if cfg.distill_beams == 1:
            out = blockwise_generate(base, batch, cfg.distill_new_tokens, NgramDrafter(), DISTILL_K).sequences.cpu()
        else:
            out = greedy_generate(base, batch, cfg.distill_new_tokens, num_beams=cfg.distill_beams).cpu()
        return _cut_at_eos(out, cfg.distill_prompt_len, eos, cfg.distill_prompt_len + cfg.distill_new_tokens)

    inputs = prompts.numpy().tobytes()
    return _cached_generation(base, inputs, len(prompts), generate, cfg.distill_prompt_len, cfg, show)


@torch.inference_mode()
def distill_pairs(
    base: PreTrainedModel, pairs: Pairs, cfg: TrainConfig, show: bool = True, extra: Sequence[list[int]] = ()
) -> Pairs:
    """Sequence-level distillation for an encoder-decoder (the paper's): the base's own
    translations (greedy, or beam search) of `distill_prompts` sources drawn evenly from the
    training pairs' and then `extra` (token ids of sources with no target) replace the targets."""
    rows = [row[row >= 0].tolist() for row in pairs.source] + list(extra)
    sources = padded([rows[i] for i in drawn_evenly(len(rows), cfg.distill_prompts)])
    eos = resolve_eos(base, None)
    pad = base.generation_config.pad_token_id
    pad = pad if pad is not None else 0
    start = int(decoder_prompt(base, sources[:1, :1].clamp(min=0))[1])

    def generate(rows: slice) -> torch.LongTensor:
        batch = sources[rows]
        batch = batch[:, : int((batch >= 0).sum(1).max())]  # the batch's own width
        out = base.generate(
            batch.masked_fill(batch < 0, pad).to(base.device),
            attention_mask=(batch >= 0).long().to(base.device),
            do_sample=False,
            num_beams=cfg.distill_beams,
            decoder_start_token_id=start,
            **generate_length(base, 1, cfg.distill_new_tokens),
        ).cpu()
        return _cut_at_eos(out, 1, eos, 1 + cfg.distill_new_tokens)

    inputs = sources.numpy().tobytes() + start.to_bytes(8, "little")
    decoder = _cached_generation(base, inputs, len(sources), generate, 1, cfg, show)
    return Pairs(sources, decoder)


def distilled(
    base: PreTrainedModel, rows: torch.LongTensor | Pairs, cfg: TrainConfig, show: bool = True, extra=()
) -> torch.LongTensor | Pairs:
    """The rows a distilled run learns: the base's own continuations of prompts cut from `rows`, or for an
    encoder-decoder's pairs its own translations of their sources and of `extra` sources."""
    if isinstance(rows, Pairs):
        return distill_pairs(base, rows, cfg, show, extra)
    return distill_sequences(base, rows, cfg, show=show)


def sources_record(cfg: TrainConfig, training: int, extra: list[list[list[int]]]) -> dict:
    """What a run's record keeps of its --distill-sources: each file's sources and how many of the
    distill_prompts, drawn evenly from the `training` sources and then the files', are its."""
    sizes = [training, *map(len, extra)]
    drawn = drawn_evenly(sum(sizes), cfg.distill_prompts)
    shares = torch.bucketize(drawn, torch.tensor(sizes).cumsum(0), right=True).bincount(minlength=len(sizes)).tolist()
    return {
        "distilled_training_sources": shares[0],
        "distill_sources": {
            path: {"sources": n, "distilled": share}
            for path, n, share in zip(cfg.distill_sources, sizes[1:], shares[1:])
        },
    }


def _cut_at_eos(out: torch.LongTensor, first_new: int, eos: set[int], width: int) -> torch.LongTensor:
    """Generated rows [B, width], -1 after each row's first EOS among its new tokens."""
    rows = []
    for row in out.tolist():
        stop = next((i + 1 for i in range(first_new, len(row)) if row[i] in eos), len(row))
        rows.append(row[:stop])
    result = padded(rows)
    return torch.cat([result, result.new_full((len(rows), width - result.shape[1]), -1)], dim=1)


def _cached_generation(
    base: PreTrainedModel,
    inputs: bytes,
    n: int,
    generate: Callable[[slice], torch.LongTensor],
    first_new: int,
    cfg: TrainConfig,
    show: bool,
) -> torch.LongTensor:
    """Distilled rows, generated in batches of cfg.distill_batch_size, each batch saved as it is
    done, so a killed run resumes where it stopped; the whole set is cached on disk by content
    hash (inputs, settings, base weights) and reused by later runs, with its generation throughput
    beside it (`.json`)."""
    key = hashlib.sha256(inputs)
    key.update(json.dumps([cfg.distill_new_tokens, cfg.distill_beams, weights_digest(base)]).encode())
    rules = greedy_rules(base, first_new, cfg.distill_new_tokens, resolve_eos(base, None))
    if rules.active:  # what the generation config makes generate do (none: the key is as it always was)
        key.update(repr(rules).encode())
    cache_dir = Path(cfg.distill_cache or Path(cfg.out) / "distill-cache")
    path = cache_dir / f"distill-{key.hexdigest()[:16]}.npy"
    width = first_new + cfg.distill_new_tokens
    cached = cached_npy(path, (n, width), np.int64)  # None where damaged too: then distilled again
    if cached is not None:
        return torch.from_numpy(cached)
    parts = path.with_suffix(".parts")  # one file per finished batch
    size = cfg.distill_batch_size
    batches = {s: cached_npy(parts / f"{s:09d}.npy", (min(size, n - s), width), np.int64) for s in range(0, n, size)}
    todo = [s for s, batch in batches.items() if batch is None]
    bar = tqdm(batches, desc="distilling", unit="batch", initial=len(batches) - len(todo), disable=not show)
    generated, began = 0, time.perf_counter()
    for start in todo:
        rows = generate(slice(start, start + size))
        batches[start] = rows.numpy()
        atomic_write(parts / f"{start:09d}.npy", lambda p, a=batches[start]: save_npy(p, a))
        generated += int((rows[:, first_new:] >= 0).sum())
        bar.update(1)
        bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - began):.0f}")
    bar.close()
    data = torch.from_numpy(np.concatenate(list(batches.values())))
    atomic_write(path, lambda p: save_npy(p, data.numpy()))
    seconds = time.perf_counter() - began
    write_json(
        path.with_suffix(".json"),
        {
            "rows": n,
            "new_tokens": int((data[:, first_new:] >= 0).sum()),
            "beams": cfg.distill_beams,
            "batch_size": cfg.distill_batch_size,
            "generated_this_run": generated,
            "seconds_this_run": seconds,
            "tokens_per_s": generated / seconds if generated else None,
        },
    )
    shutil.rmtree(parts)
    return data
