"""Batches in `blockdecode bench`: B prompts of different lengths decoded together, padded as
`transformers` pads them (left for a decoder-only model, right for an encoder-decoder's sources),
blockwise against `transformers`' own batched greedy `generate` on the same batch.

A batch verifies one chain a row, so every call scores B × k tokens, and it makes as many calls as
its slowest row needs. Each row says both: `calls` against `slowest_row_calls`, and `call_cost`,
one blockwise call's seconds over one of greedy's, so that speedup = (greedy's calls / ours) /
call_cost is visible in its parts. An output that differs from transformers' is checked as the
single-prompt rows are: "ties" where greedy's own top-2 gap at the first difference is within the
dtype's rounding (B × k tokens a call sum in another order than B)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from blockdecode.bench.methods import divergences
from blockdecode.core.hf import is_seq2seq, resolve_eos
from blockdecode.decoding.adapter import decoder_prompt
from blockdecode.decoding.reference import greedy_generate
from blockdecode.decoding.timing import metered, sync
from blockdecode.model import BlockwiseLM


def padded_batch(tokenizer, texts: list[str], seq2seq: bool, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The texts as one batch and its attention mask, padded where `transformers` expects it."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [tokenizer(t).input_ids for t in texts]
    width = max(map(len, rows))
    fill = [[pad] * (width - len(r)) for r in rows]
    ids = [r + f if seq2seq else f + r for r, f in zip(rows, fill)]
    mask = [[1] * len(r) + [0] * len(f) if seq2seq else [0] * len(f) + [1] * len(r) for r, f in zip(rows, fill)]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def timed(model, run: Callable[[], torch.LongTensor]) -> tuple[torch.LongTensor, float, int]:
    """A run's output, wall seconds and forward calls of `model`."""
    with metered(model) as meters:
        start = time.perf_counter()
        out = run()
        sync(next(model.parameters()).device)
        seconds = time.perf_counter() - start
    return out, seconds, meters[0].calls


@torch.inference_mode()
def batch_rows(
    lm: BlockwiseLM,
    ids: torch.Tensor,
    mask: torch.Tensor,
    new_tokens: int,
    drafters: list[str],
    k: int,
    repeats: int,
    show: bool = False,
) -> list[dict]:
    """One row per drafter for this batch: each decoded with its own chain, against transformers'
    batched greedy, in `repeats` rounds after a warm-up, the order rotated from round to round. A
    code continuation runs the whole budget (EOS off for every method alike); a translation ends at
    the model's own EOS. "auto" is the chain the calibration predicts fastest, measured on the rows;
    "expected", each row's likelier drafter's chain, all to the width the rows' rankings choose."""
    base, seq2seq = lm.base, is_seq2seq(lm.base)
    full_budget = {} if seq2seq else {"eos_token_id": [], "min_new_tokens": new_tokens}
    prompts = [row[m.bool()][None] for row, m in zip(ids, mask)]

    def greedy() -> torch.LongTensor:
        return greedy_generate(base, ids, new_tokens, attention_mask=mask, **full_budget)

    def blockwise(plan) -> Callable[[], torch.LongTensor]:
        return lambda: lm.generate(ids, new_tokens, attention_mask=mask, plan=plan)

    def plan_for(name: str):
        heads_k = min(k, lm.k) if name in ("auto", "expected") or "heads" in name else k
        drafter, tree = ("auto", name) if name in ("auto", "expected") else (name, None)
        eos = None if seq2seq else []
        return lm.plan(drafter, heads_k, tree, eos_token_id=eos, prompts=prompts, rows=len(prompts))

    plans = {name: plan_for(name) for name in drafters}
    runs = {"greedy": greedy, **{name: blockwise(plan) for name, plan in plans.items()}}
    outs = {name: run() for name, run in runs.items()}  # warm-up, and the outputs compared
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    calls: dict[str, int] = {}
    names = list(runs)
    for i in tqdm(range(repeats), desc=f"batch of {ids.shape[0]}", disable=not show):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            _, s, calls[name] = timed(base, runs[name])
            seconds[name].append(s)
    reference, hf_seconds = outs["greedy"], statistics.median(seconds["greedy"])
    start = decoder_prompt(base, prompts[0])[1].shape[1] if seq2seq else ids.shape[1]
    ends = resolve_eos(base, None) if seq2seq else set()
    greedy_rows = new_tokens_of(reference, start, ends)
    rows = []
    for name, plan in plans.items():
        out, ours = outs[name], statistics.median(seconds[name])
        identical = out.sequences.shape == reference.shape and torch.equal(out.sequences, reference)
        found = [] if identical else divergences(base, prompts, greedy_rows, new_tokens_of(out.sequences, start, ends))
        rows.append(
            {
                "batch": ids.shape[0],
                "drafter": name,
                "plan": f"{plan.drafter_name}, {plan.setting}",
                "k": plan.k,
                "greedy_seconds": hf_seconds,
                "seconds": ours,
                "tokens_per_s": sum(s.new_tokens for s in out.row_stats) / ours,
                "speedup": hf_seconds / ours,
                "calls": calls[name],
                "greedy_calls": calls["greedy"],
                "slowest_row_calls": max(s.calls for s in out.row_stats),
                "row_mean_block": statistics.mean(s.mean_block_size for s in out.row_stats),
                "call_cost": (ours / calls[name]) / (hf_seconds / calls["greedy"]),
                "identical": identical,
                "divergences": found,
            }
        )
    return rows


def new_tokens_of(sequences: torch.LongTensor, start: int, eos: set[int]) -> list[list[int]]:
    """Each row's generated tokens: from `start`, through its first EOS if it has one (the padding
    after it left out)."""
    rows = []
    for row in sequences[:, start:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def identical(row: dict) -> str:
    """yes; "ties (n/B)" when every row that differs from transformers' starts to at a near-tie of
    greedy's own logits (its top-2 gap within the dtype's rounding); NO for a real divergence."""
    if row["identical"]:
        return "yes"
    found = row["divergences"]
    if found and all(d["near_tie"] for d in found):
        return f"ties ({len(found)}/{row['batch']})"
    return "NO"
