#!/usr/bin/env python
"""Mask drafts against the shipped heads at equal CPU time: issue 37's pilot, which decides whether
drafting with the whole network (`blockdecode.drafters.masks`) is integrated into decoding.

1. Data: the built-in model's own greedy continuations (`train.distill_sequences`, cached) of prompts
   from the standard library's training files, and of prompts from its held-out files.
2. Masks: trained on those rows for a budget of process CPU time (`--minutes`; the steps follow from a
   few timed ones) or `--steps`, bf16 autocast where the CPU computes bf16 natively, fp32 elsewhere;
   checkpointed, `--resume` continues. Optionally (`--paper-heads`) the paper's heads trained from
   scratch (`blockdecode.training.train`, distill mode) on the same rows for the CPU time the masks used.
3. Held-out, on the same anchors for everyone (every position of the continuation whose k-1 next
   tokens all lie in it): per offset d = 2..k the share of greedy's tokens guessed, and the chain's
   mean accepted block at k (1 + the leading right guesses), for the masks, the shipped heads and the
   paper heads.
4. What a decode-time verify call with a mask group costs (bf16): the newest token, k-1 candidates
   and the k-1 masks after the last one, against a one-token call and the chain alone, at k = 4, 6, 8.

Writes mask_pilot.json and mask_pilot.png into --out (beside the runs, the corpus and the distilled
rows, which later runs reuse). Anything the CPU time covers runs on one thread by default: OpenMP
threads that spin while waiting would count as CPU time.

    python benchmarks/mask_pilot.py --out runs/mask_pilot --minutes 30 --paper-heads
    python benchmarks/mask_pilot.py --out runs/mask_pilot --minutes 30 --paper-heads --resume   # after a stop
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from blockdecode import DEFAULT_MODEL, load  # noqa: E402
from blockdecode.bench.report import cpu_name  # noqa: E402
from blockdecode.commands.flags import config_from  # noqa: E402
from blockdecode.core import plots
from blockdecode.core.hardware import native_bf16  # noqa: E402
from blockdecode.core.hf import dtype_name, resolve_eos, vocab_size  # noqa: E402
from blockdecode.core.io import read_json, read_jsonl, save_figure, saving_folder, write_json  # noqa: E402
from blockdecode.core.loss import (
    IGNORE,  # noqa: E402
    draft_projection,  # noqa: E402
)
from blockdecode.decoding.adapter import adapter_for  # noqa: E402
from blockdecode.drafters.heads import most_frequent, short_projection  # noqa: E402
from blockdecode.drafters.masks import (  # noqa: E402
    MASKS_CONFIG,
    MaskDrafts,
    anchor_targets,
    attached,
    build_masks,
    mask_batch,
    mask_loss,
    mask_states,
    write_masks,
)
from blockdecode.model import BlockwiseLM  # noqa: E402
from blockdecode.pretraining.pretrain import CorpusConfig, prepare_corpus  # noqa: E402
from blockdecode.training import loop as training
from blockdecode.training.data import batch_indices, fingerprint, load_tokens, pack, split  # noqa: E402
from blockdecode.training.distill import distill_sequences  # noqa: E402
from blockdecode.training.train import TrainConfig, train  # noqa: E402

REPORT = "mask_pilot.json"
COSTS = "step_costs.json"  # CPU seconds a step of the masks and of the paper heads, measured once per --out
PROGRESS_ROWS, PROGRESS_EVERY = 16, 4  # the evaluation during training: these held-out rows, every 4th anchor
COST_KS = (4, 6, 8)
CURVE = ("step", "cpu_s", "eval_block", "eval_acc")  # what the report keeps of each evaluation (step 0's: no cpu_s)


@dataclass
class MaskRun:
    """The masks' training run: what its checkpoints record, and what a resume must match."""

    out: str
    steps: int
    k: int = 8
    rank: int = 16
    alpha: float = 32.0
    every: int = 4  # a mask group after every so many positions of a row
    draft_vocab: int = 1024
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 20
    seed: int = 0
    mixed_precision: str = "auto"
    budget_s: float | None = None  # process CPU seconds of training steps; None: `steps` decides
    log_every: int = 5
    eval_every: int = 50
    checkpoint_every: int = 25
    resume: bool = False
    loss_chunk: int = 2048


MUST_MATCH = (
    *("k", "rank", "alpha", "every", "draft_vocab", "batch_size", "seed"),
    *("lr", "warmup_steps", "mixed_precision"),  # the optimisation too: changed, a resume would train another run
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder of the runs, the data and the report")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a saved BlockwiseLM whose heads are the reference")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--minutes", type=float, help="process CPU minutes of mask training steps")
    budget.add_argument("--steps", type=int, help="mask training steps")
    p.add_argument("--paper-heads", action="store_true", help="also train the paper's heads for the masks' CPU time")
    p.add_argument("--k", type=int, default=8, help="the block: offsets 2..k are compared")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--every", type=int, default=4, help="a mask group after every so many positions in training")
    p.add_argument("--draft-vocab", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "no"), help="autocast of training")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--train-rows", type=int, default=4096, help="distilled training rows")
    p.add_argument("--eval-rows", type=int, default=64, help="distilled held-out rows")
    p.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations of the masks")
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--corpus", help="a folder prepare_corpus made (default: OUT/corpus, made from the stdlib)")
    p.add_argument("--max-files", type=int, help="only the first N stdlib files (tiny trial runs)")
    p.add_argument("--cost-reps", type=int, default=100, help="timed verify calls of each kind")
    p.add_argument("--cost-context", type=int, default=256, help="tokens cached before the timed calls")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    counts = ("steps", "k", "rank", "every", "draft_vocab", "batch_size", "prompt_len", "new_tokens", "train_rows",
              "eval_rows", "eval_every", "checkpoint_every", "cost_reps", "cost_context", "threads")  # fmt: skip
    for name in counts:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    for name in ("minutes", "lr", "alpha"):
        if getattr(args, name) is not None and not 0 < getattr(args, name) < math.inf:
            p.error(f"--{name} must be a positive number, got {getattr(args, name)}")
    if args.k < 2 or args.new_tokens <= args.k:
        p.error(
            f"--k must be >= 2, and --new-tokens more than k for a block to fit, got {args.k} and {args.new_tokens}"
        )
    if not Path(args.model).is_dir():
        p.error(f"--model {args.model} is not a folder")
    return args


class MaskTraining(training.Task):
    """Masks on a frozen base, for `training.Loop`: a batch of distilled rows with a mask group after
    every `every`-th position (shifted each epoch, so that `every` epochs cover every anchor), the mean
    over offsets of each offset's per-token loss. Every record carries the training steps' process CPU
    seconds (`cpu_s`: forward, backward and update; evaluations and checkpoints left out)."""

    name = "masks"
    last = MASKS_CONFIG
    evaluate_first = True

    def __init__(self, run: MaskRun, base, masks: MaskDrafts, rows: torch.LongTensor, heldout, prompt_len: int):
        self.config, self.base, self.model, self.rows = run, base, masks, rows
        self.heldout, self.prompt_len = heldout, prompt_len  # heldout: rows scored during training
        self.data_digest = fingerprint(rows)
        self.optimizer = torch.optim.AdamW(masks.parameters(), lr=run.lr, weight_decay=0.0)
        self.scheduler = training.scheduler(self.optimizer, run.warmup_steps, run.steps, floor=0.1)
        self.projection, self.short = draft_projection(base.get_output_embeddings(), masks.token_map)
        self.tallies = torch.zeros(run.k - 1, 2)
        self.cpu_s, self.started = 0.0, None
        self.curves = plots.Curves(train="train loss (mean over offsets)", side=self.side)

    def loss(self, model: MaskDrafts, step: int) -> tuple[torch.Tensor, int]:
        self.started = time.process_time()
        run = self.config
        shift = step * run.batch_size // len(self.rows) % run.every  # the epoch's: anchors from prompt_len - 1 + it
        rows = self.rows[batch_indices(step, len(self.rows), run.batch_size, run.seed)]
        batch = mask_batch(rows, run.k, model.config.vocab_size, self.prompt_len + shift, run.every)
        sums, hits = mask_loss(mask_states(self.base, model, batch), self.short(batch.targets), self.projection,
                               run.loss_chunk)  # fmt: skip
        counts = (batch.targets != IGNORE).sum(dim=(0, 1))
        self.tallies += torch.stack([hits.float(), counts.float()], dim=1)
        return (sums / counts.clamp(min=1)).mean(), int(batch.targets.shape[0] * batch.length)

    def progress(self, done: int) -> dict:
        if self.started is not None:  # the step that just ended: its forward, backward and update
            self.cpu_s += time.process_time() - self.started
            self.started = None
        return {"cpu_s": round(self.cpu_s, 3)}

    def logged(self) -> dict:
        accuracy = (self.tallies[:, 0] / self.tallies[:, 1].clamp(min=1)).tolist()
        self.tallies.zero_()
        return {"offset_acc": accuracy}

    def evaluate(self, model: MaskDrafts) -> dict:
        found = scores(*mask_guesses(self.base, model, self.heldout, self.prompt_len, PROGRESS_EVERY))
        return {"eval_block": found["mean_block"], "eval_acc": list(found["accuracy"].values())}

    def stopped(self, records: list[dict]) -> str | None:
        budget = self.config.budget_s
        if budget is not None and records and records[-1].get("cpu_s", 0.0) >= budget:
            return f"the CPU-time budget of {budget / 60:.1f} minutes is spent"
        return None

    def state(self, model: MaskDrafts) -> dict:
        return {"masks": model.state_dict(), "cpu_s": self.cpu_s}

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["masks"])
        self.cpu_s = state["cpu_s"]

    def save(self, model: MaskDrafts, records: list[dict], folder: Path) -> None:
        write_masks(model, folder)

    @staticmethod
    def side(ax, rows: list[dict]) -> None:
        evals = [r for r in rows if "eval_block" in r]
        ax.plot([r.get("cpu_s", 0.0) / 60 for r in evals], [r["eval_block"] for r in evals], "o-")
        ax.set_xlabel("training CPU minutes")
        ax.set_ylabel(f"held-out mean accepted block ({PROGRESS_ROWS} rows)")


def probe_seconds(task: MaskTraining, precision: training.Precision, steps: int = 3) -> float:
    """Process CPU seconds of one training step of `task` (forward, backward, update): the median of
    `steps` after one that warms up. `task` is spent: give it a copy of the masks."""
    times = []
    for step in range(steps + 1):
        start = time.process_time()
        with precision.autocast():
            loss, _ = task.loss(task.model, step)
        loss.backward()
        task.optimizer.step()
        task.optimizer.zero_grad()
        times.append(time.process_time() - start)
    return statistics.median(times[1:])


class StepClock:
    """A `train()` callback: the process CPU time between consecutive steps, the intervals holding an
    evaluation left out; what a step costs is their median."""

    def __init__(self):
        self.last: float | None = None
        self.intervals: list[float] = []

    def __call__(self, step: int, record: dict) -> None:
        now = time.process_time()
        if self.last is not None and not any(key.startswith("eval_") for key in record):
            self.intervals.append(now - self.last)
        self.last = now

    @property
    def per_step(self) -> float:
        return statistics.median(self.intervals)


@torch.inference_mode()
def mask_guesses(
    base, masks: MaskDrafts, rows: torch.LongTensor, prompt_len: int, every: int = 1, chunk: int = 4
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The masks' guesses [B, G, k-1] after every `every`-th anchor of `rows`, and greedy's tokens there."""
    projection = base.get_output_embeddings()
    if masks.config.draft_vocab:
        projection = short_projection(projection, masks.token_map)
    guesses, targets = [], []
    for start in range(0, len(rows), chunk):
        batch = mask_batch(rows[start : start + chunk], masks.config.k, masks.config.vocab_size, prompt_len, every)
        guesses.append(masks.draft(mask_states(base, masks, batch), projection))
        targets.append(batch.targets)
    return torch.cat(guesses), torch.cat(targets)


@torch.inference_mode()
def heads_guesses(
    lm: BlockwiseLM, rows: torch.LongTensor, prompt_len: int, k: int, every: int = 1, chunk: int = 16
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The heads' chains of k-1 guesses [B, G, k-1] from the base's decoder output at the same anchors
    as `mask_guesses`, proposed as decoding proposes them (`drafter().propose_rows`), and greedy's tokens."""
    drafter, guesses, targets = lm.drafter(), [], []
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        anchors, wanted = anchor_targets(part, k, prompt_len, every)
        hidden = lm.base.base_model(input_ids=part.clamp(min=0)).last_hidden_state[:, anchors]
        tokens = [part[b : b + 1, : a + 1] for b in range(len(part)) for a in anchors.tolist()]
        chains = drafter.propose_rows(tokens, hidden.flatten(0, 1), k - 1, list(range(len(tokens))))
        guesses.append(chains.view(*wanted.shape))
        targets.append(wanted)
    return torch.cat(guesses), torch.cat(targets)


def scores(guesses: torch.LongTensor, targets: torch.LongTensor) -> dict:
    """Over the anchors whose k-1 targets all lie in the continuation: per offset d = 2..k the share of
    guesses that are greedy's token, and the chain's mean accepted block, 1 + its leading right guesses."""
    full = (targets != IGNORE).all(-1)
    hits = (guesses == targets)[full]
    accuracy = hits.float().mean(0) if len(hits) else torch.zeros(targets.shape[-1])
    return {
        "anchors": int(full.sum()),
        "accuracy": {str(d): float(a) for d, a in enumerate(accuracy.tolist(), start=2)},
        "mean_block": float(1 + hits.long().cumprod(-1).sum(-1).float().mean()) if len(hits) else 1.0,
    }


@torch.inference_mode()
def call_cost(base, masks: MaskDrafts, context: torch.LongTensor, ks: list[int], reps: int) -> dict:
    """Median seconds of one verify call over `context`, cached, in the base's dtype: the newest token
    alone; per k the chain (newest + k-1 candidates), the chain and a group of k-1 masks after its last
    candidate (the masks' LoRA in fp32, and in the base's dtype), and as many plain tokens as that (what
    the masks add beyond their count). The kinds take turns in every round, so drift on a shared machine
    spreads over all of them; each call holds only its own hooks."""
    length, vocab = context.shape[1], masks.config.vocab_size
    adapter = adapter_for(base, None, "dynamic", length + 2 * max(ks))
    adapter.prefill(context)
    gen = torch.Generator().manual_seed(0)
    lora = {"fp32": copy.deepcopy(masks).float(), dtype_name(base.dtype): copy.deepcopy(masks).to(base.dtype)}

    def tokens(n: int) -> torch.LongTensor:
        return torch.randint(0, vocab, (1, n), generator=gen).to(context.device)

    calls: dict[str, tuple[torch.LongTensor, MaskDrafts | None]] = {"1": (tokens(1), None)}
    for k in ks:
        calls[f"chain {k}"] = (tokens(k), None)
        group = torch.cat([tokens(k), torch.arange(vocab, vocab + k - 1)[None]], dim=1)
        calls |= {f"chain {k} + masks ({name} LoRA)": (group, drafts) for name, drafts in lora.items()}
        calls[f"plain {2 * k - 1}"] = (tokens(2 * k - 1), None)

    def timed(ids: torch.LongTensor, drafts: MaskDrafts | None) -> Callable[[], float]:
        def call() -> float:
            with attached(base, drafts) if drafts is not None else nullcontext():
                start = time.perf_counter()
                adapter.score(ids)
                elapsed = time.perf_counter() - start
            adapter.keep(range(length))
            return elapsed

        return call

    seconds = medians_in_turns({name: timed(*kind) for name, kind in calls.items()}, reps)
    return {
        "dtype": dtype_name(base.dtype),
        "native_bf16": native_bf16(),
        "context": length,
        "reps": reps,
        "ms": {name: 1e3 * s for name, s in seconds.items()},
        "over_one_token": {name: s / seconds["1"] for name, s in seconds.items()},
    }


def medians_in_turns(calls: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    """The median of `reps` rounds of each call's own timing (it times what it should, and returns the
    seconds), every round running all of them in a rotated order after a round that warms up: drift on a
    shared machine spreads over all of them alike."""
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps + 1):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            elapsed = calls[name]()
            if rep:
                samples[name].append(elapsed)
    return {name: statistics.median(s) for name, s in samples.items()}


def distilled(base, cfg: TrainConfig, corpus: Path, eval_rows: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Training rows as `blockdecode.training.train` distils them for `cfg` (so a heads run finds them cached),
    and held-out rows the same way from the held-out files."""
    eos = sorted(resolve_eos(base, None))
    eos_id = eos[0] if eos else None
    train_seqs = split(pack(load_tokens(cfg.data, None, eos_id), cfg.seq_len), cfg.holdout)[0]
    rows = distill_sequences(base, train_seqs, cfg)
    held = replace(cfg, data=[str(corpus / "heldout.npy")], distill_prompts=eval_rows)
    heldout = distill_sequences(base, pack(load_tokens(held.data, None, eos_id), cfg.seq_len), held)
    return rows, heldout


def train_masks(args, base, masks: MaskDrafts, rows, heldout, steps: int) -> tuple[MaskDrafts, list[dict]]:
    """The masks trained for `steps` (`--minutes`: as many as the budget buys, stopping once it is
    spent); their training records."""
    budget = 60 * args.minutes if args.minutes else None
    run = config_from(MaskRun, args, out=str(Path(args.out) / "masks"), steps=steps, mixed_precision=args.precision,
                      budget_s=budget)  # fmt: skip
    loop = training.Loop(training.LoopConfig.of(run))
    task = MaskTraining(run, base, masks, rows, heldout[:PROGRESS_ROWS], args.prompt_len)
    state = loop.resume(run, MUST_MATCH, task.data_digest)
    return loop.fit(task, state), read_jsonl(Path(run.out) / "metrics.jsonl")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    corpus = Path(args.corpus or out / "corpus")
    print(f"corpus: {corpus}", flush=True)
    prepare_corpus(CorpusConfig(out=str(corpus), tokenizer=args.model, packages=(), max_files=args.max_files))
    lm, _ = load(args.model)
    if args.k > lm.k:
        raise SystemExit(f"mask_pilot.py: error: --k {args.k} exceeds the k={lm.k} of the heads in {args.model}")
    base = lm.base.requires_grad_(False)
    masks = build_masks(base, args.k, args.rank, args.alpha, draft_vocab=args.draft_vocab)  # its settings checked early
    cfg = TrainConfig(
        base=args.model,
        data=[str(corpus / "train.npy")],
        out=str(out / "paper-heads"),
        k=args.k,
        mode="distill",
        head_hidden_size=128,
        draft_vocab=args.draft_vocab,
        batch_size=16,
        seq_len=args.prompt_len + args.new_tokens,
        lr=2e-3,
        warmup_steps=50,
        eval_batches=1,  # train()'s own evaluation, kept small: the pilot scores the heads itself
        eval_prompts=1,
        eval_new_tokens=8,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        mixed_precision=args.precision,
        distill_prompts=args.train_rows,
        distill_prompt_len=args.prompt_len,
        distill_new_tokens=args.new_tokens,
        distill_cache=str(out / "distill-cache"),
    )
    print("distilled rows: the base's greedy continuations (cached)", flush=True)
    rows, heldout = distilled(base, cfg, corpus, args.eval_rows)
    token_map, coverage = most_frequent(rows[:, args.prompt_len :], vocab_size(base), args.draft_vocab)
    masks.token_map.copy_(token_map)

    costs_file = out / COSTS
    costs = read_json(costs_file) if args.resume and costs_file.is_file() else {}
    if args.steps is None and "mask_step_cpu_s" not in costs:
        spent = MaskTraining(
            MaskRun(out="", steps=10, k=args.k, every=args.every, batch_size=args.batch_size, lr=args.lr),
            base, copy.deepcopy(masks), rows, heldout[:1], args.prompt_len,
        )  # fmt: skip
        costs["mask_step_cpu_s"] = probe_seconds(spent, training.Precision(args.precision, base.device))
        write_json(costs_file, costs)
    steps = args.steps or max(1, math.ceil(60 * args.minutes / costs["mask_step_cpu_s"]))
    print(f"masks: {steps} steps" + (f" of {costs['mask_step_cpu_s']:.2f} CPU s" if args.minutes else ""), flush=True)
    masks, records = train_masks(args, base, masks, rows, heldout, steps)
    last = records[-1] if records else {"step": 0, "cpu_s": 0.0}
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # the first window holds warm-up
    report = {
        "config": vars(args),
        "machine": {
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "native_bf16": native_bf16(),
            "torch": torch.__version__,
        },  # fmt: skip
        "data": {
            "train_rows": len(rows),
            "heldout_rows": len(heldout),
            "row_tokens": rows.shape[1],
            "prompt_len": args.prompt_len,
            "draft_vocab_coverage": coverage,
        },  # fmt: skip
        "masks": {
            "precision": training.Precision(args.precision, base.device).mode,
            "steps": last["step"],
            "cpu_s": last["cpu_s"],
            "cpu_s_per_step": last["cpu_s"] / max(1, last["step"]),
            "row_tokens_per_cpu_s": last["step"] * args.batch_size * rows.shape[1] / max(last["cpu_s"], 1e-9),
            "row_tokens_per_s_median": statistics.median(rates) if rates else None,  # wall clock, log windows
            "curve": [{"cpu_s": 0.0, **{k: r[k] for k in r if k in CURVE}} for r in records if "eval_block" in r],
        },
    }
    print("held-out: masks, shipped heads" + (", paper heads" if args.paper_heads else ""), flush=True)
    report["masks"]["heldout"] = scores(*mask_guesses(base, masks, heldout, args.prompt_len))
    report["shipped_heads"] = {
        "k": lm.k,
        "heldout": scores(*heads_guesses(lm, heldout, args.prompt_len, args.k)),
        "progress_rows": scores(*heads_guesses(lm, heldout[:PROGRESS_ROWS], args.prompt_len, args.k, PROGRESS_EVERY)),
    }
    if args.paper_heads:
        report["paper_heads"] = paper_heads(cfg, costs, costs_file, last["cpu_s"], heldout, args)
    print("verify calls with a mask group (bf16)", flush=True)
    lm16, _ = load(args.model, dtype=torch.bfloat16)
    context = pack(load_tokens([str(corpus / "heldout.npy")]), args.cost_context)[:1]
    ks = [k for k in COST_KS if k <= args.k]
    report["call_cost"] = call_cost(lm16.base, masks, context, ks, args.cost_reps)
    write_report(report, out)
    print(summary(report), flush=True)
    return report


def paper_heads(cfg: TrainConfig, costs: dict, costs_file: Path, cpu_s: float, heldout, args) -> dict:
    """The paper's heads trained from scratch on the same rows for the masks' CPU time `cpu_s` (what a
    step costs: two timed steps of a probe run, once), and how they guess on the held-out anchors."""
    if "heads_step_cpu_s" not in costs:
        probe = StepClock()
        folder = Path(cfg.out).with_name("paper-heads-probe")
        shutil.rmtree(folder, ignore_errors=True)  # a killed probe's: a fresh run would refuse its folder
        train(replace(cfg, out=str(folder), steps=4, eval_every=4, checkpoint_every=4, log_every=1, resume=False),
              callback=probe)  # fmt: skip
        shutil.rmtree(folder)
        costs["heads_step_cpu_s"] = probe.per_step
        write_json(costs_file, costs)
    steps = max(1, round(cpu_s / costs["heads_step_cpu_s"]))
    clock = StepClock()
    heads = train(replace(cfg, steps=steps, eval_every=steps), callback=clock)
    per_step = clock.per_step if clock.intervals else costs["heads_step_cpu_s"]
    found = scores(*heads_guesses(heads, heldout, args.prompt_len, args.k))
    return {"steps": steps, "cpu_s_per_step": per_step, "cpu_s": per_step * steps, "heldout": found}


def write_report(report: dict, out: Path) -> None:
    """mask_pilot.png and mask_pilot.json (last), replacing an earlier report as a whole."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("masks", "shipped_heads", "paper_heads"):
        if name in report:
            accuracy = report[name]["heldout"]["accuracy"]
            label = f"{name.replace('_', ' ')} (block {report[name]['heldout']['mean_block']:.2f})"
            left.plot([int(d) for d in accuracy], list(accuracy.values()), "o-", label=label)
    left.set_xlabel("offset d (token t+d guessed at t)")
    left.set_ylabel("held-out share of greedy's tokens guessed")
    left.legend(fontsize="small")
    curve = report["masks"]["curve"]
    right.plot([r["cpu_s"] / 60 for r in curve], [r["eval_block"] for r in curve], "o-", label="masks")
    right.axhline(report["shipped_heads"]["progress_rows"]["mean_block"], linestyle="--", color="grey",
                  label="shipped heads")  # fmt: skip
    right.set_xlabel("mask training, CPU minutes")
    right.set_ylabel(f"mean accepted block at k={report['config']['k']} ({PROGRESS_ROWS} held-out rows)")
    right.legend(fontsize="small")
    with saving_folder(out, REPORT) as staging:
        save_figure(fig, staging / "mask_pilot.png")
        write_json(staging / REPORT, report)


def summary(report: dict) -> str:
    lines = [f"{'':14} {'block':>6}  accuracy at offsets 2.."]
    for name in ("masks", "shipped_heads", "paper_heads"):
        if name in report:
            found = report[name]["heldout"]
            lines.append(
                f"{name:14} {found['mean_block']:6.3f}  " + " ".join(f"{a:.3f}" for a in found["accuracy"].values())
            )
    masks = report["masks"]
    lines.append(f"masks: {masks['steps']} steps, {masks['cpu_s'] / 60:.1f} CPU min ({masks['precision']}), "
                 f"{masks['row_tokens_per_cpu_s']:.0f} row tokens per CPU s")  # fmt: skip
    cost = report["call_cost"]["over_one_token"]
    lines.append("verify call / one-token call: " + ", ".join(f"{name} {r:.2f}" for name, r in cost.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
