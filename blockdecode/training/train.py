"""Training the proposal heads: frozen, fine-tuned or distilled (Stern et al., 2018, §5).

A run (`TrainConfig`, `blockdecode.training.config`) trains heads on a base as `training.Loop` drives
the task here (`HeadTraining`): on the data's rows or on the base's own continuations
(`blockdecode.training.distill`), through the objective of `blockdecode.core.loss`. The same code runs on one CPU
or under `accelerate launch` on many devices."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from accelerate import DistributedDataParallelKwargs
from transformers import PreTrainedModel

from blockdecode.core import plots
from blockdecode.core.hf import context_length, is_seq2seq, resolve_eos, vocab_size
from blockdecode.core.io import CheckpointError, read_jsonl, write_json
from blockdecode.decoding.adapter import decoder_prompt
from blockdecode.decoding.loop import decode_prompts
from blockdecode.decoding.plan import make_plan
from blockdecode.decoding.rules import greedy_rules
from blockdecode.drafters.dflash.config import config_for as dflash_config_for
from blockdecode.drafters.eagle3.config import config_for as eagle3_config_for
from blockdecode.drafters.heads import most_frequent
from blockdecode.loading import HEADS_CONFIG, has_heads, load_base, load_tokenizer, read_model
from blockdecode.model import BlockwiseLM
from blockdecode.training import loop as training
from blockdecode.training.config import DRAFTER_TYPES, TrainConfig
from blockdecode.training.data import (
    Pairs,
    batch_indices,
    decoder_rows,
    eval_prompts,
    fingerprint,
    load_pairs,
    load_sources,
    load_tokens,
    pack,
    padded,
    split,
)
from blockdecode.training.dflash import train_dflash
from blockdecode.training.distill import distilled, sources_record
from blockdecode.training.eagle3 import train_eagle3
from blockdecode.training.features import Features, cached_features
from blockdecode.training.objective import Objective, combine_loss


def sampled_heads(step: int, cfg: TrainConfig) -> list[int]:
    """Heads whose loss this step computes: all of 2..k, or one drawn uniformly (the paper's
    memory saver), seeded by the step so resumed and multi-process runs draw alike."""
    if cfg.head_loss == "all":
        return list(range(2, cfg.k + 1))
    gen = torch.Generator().manual_seed((cfg.seed * 7919 + step) % 2**64)  # any seed torch takes, 0 to 2**64 - 1
    return [int(torch.randint(2, cfg.k + 1, (1,), generator=gen))]


@torch.inference_mode()
def evaluate(objective: Objective, held_out: torch.LongTensor, cfg: TrainConfig, device) -> dict:
    """Held-out loss and per-head top-1 accuracy, and the mean accepted block size measured by
    actually decoding held-out prompts with exact blockwise decoding."""
    model = objective.model
    was_training = objective.training
    objective.eval()
    tallies, sums = torch.zeros(cfg.k, 2), torch.zeros(cfg.k)
    heads = list(range(2, cfg.k + 1))
    for b in range(min(cfg.eval_batches, math.ceil(len(held_out) / cfg.batch_size))):
        batch = held_out[b * cfg.batch_size : (b + 1) * cfg.batch_size].to(device)
        s, t = objective(batch, heads)
        sums += s.float().cpu()
        tallies += t.cpu()
    prompts, budget, eos = eval_prompts(model.base, held_out, cfg)
    _, stats = decode_prompts(
        model.base, prompts, budget, make_plan(model.base, model.drafter(), cfg.k, eos_token_id=eos)
    )
    objective.train(was_training)
    return {
        "eval_base_loss": float(sums[0] / tallies[0, 1].clamp(min=1)),
        "eval_head_loss": (sums / tallies[:, 1].clamp(min=1)).tolist(),
        "eval_head_acc": (tallies[:, 0] / tallies[:, 1].clamp(min=1)).tolist(),
        "eval_mean_block_size": stats.mean_block_size,
    }


def base_and_tokenizer(cfg: TrainConfig) -> tuple[PreTrainedModel, object]:
    """The base model in fp32 and its tokenizer: None if the folder holds none (transformers saves
    one with tokenizer_config.json), refused by name if it is damaged. A saved BlockwiseLM's base is
    the one it names, wherever it is (heads saved apart from their base, a GGUF's)."""
    if has_heads(cfg.base):
        saved = read_model(cfg.base, dtype=torch.float32)
        return saved.base, saved.tokenizer
    base = load_base(cfg.base, torch.float32)
    folder = Path(cfg.base)
    saved = any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    return base, load_tokenizer(cfg.base) if saved or not folder.is_dir() else None


class HeadTraining(training.Task):
    """Proposal heads trained on a base (and the base too in finetune modes), for `training.Loop`:
    each process takes its share of the global batch, and the loss is the global batch's token mean."""

    evaluate_first = True  # the first evaluation is the original base's
    last = HEADS_CONFIG  # what write_save writes last, and what readers of the folder wait on
    curves = plots.Curves(heldout={"eval_base_loss": "held-out base loss"}, ylabel=None, side=plots.head_accuracy)

    def __init__(
        self,
        cfg: TrainConfig,
        objective: Objective,
        sequences,
        held_out,
        data_digest: str,
        tokenizer,
        acc,
        coverage: float | None = None,
        features: Features | None = None,
        anchor_rows=None,
        sources: dict | None = None,
    ):
        self.config, self.name, self.model, self.tokenizer, self.accelerator = cfg, cfg.mode, objective, tokenizer, acc
        self.sources = sources  # what the record keeps of --distill-sources (`sources_record`)
        self.coverage = coverage  # of the heads' targets by their draft vocabulary
        self.features = features  # the frozen base's outputs on `sequences`, read instead of computed
        self.anchor_rows = anchor_rows  # real data rows the base's own loss is measured on (base_loss_on="data")
        self.sequences, self.held_out, self.data_digest = sequences, held_out, data_digest
        # distilled rows end at their EOS and pairs are short: count the tokens a row really holds
        rows = decoder_rows(self.sequences)
        self.row_tokens = float((rows >= 0).sum()) / len(rows)
        groups = [{"params": list(objective.model.heads.parameters()), "lr": cfg.lr}]
        if cfg.finetune:
            groups.append({"params": list(objective.model.base.parameters()), "lr": cfg.base_lr})
        self.optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
        self.scheduler = training.scheduler(self.optimizer, cfg.warmup_steps, cfg.steps, floor=0.1)
        self.tallies = torch.zeros(cfg.k, 2)  # per head (correct, count) since the last log

    def loss(self, model, step: int) -> tuple[torch.Tensor, int]:
        cfg, acc = self.config, self.accelerator
        world = acc.num_processes
        idx = batch_indices(step, len(self.sequences), cfg.batch_size, cfg.seed)[acc.process_index :: world]
        batch = self.sequences[idx].to(acc.device)
        heads = sampled_heads(step, cfg)
        decoded = decoder_rows(batch)
        cached = self.features.rows(idx, decoded.shape[1], acc.device) if self.features is not None else None
        anchor = None
        if self.anchor_rows is not None:  # its own batch of real rows, drawn like the main one
            rows = batch_indices(step, len(self.anchor_rows), cfg.batch_size, cfg.seed + 1)[acc.process_index :: world]
            anchor = self.anchor_rows[rows].to(acc.device)
        sums, tallies = model(batch, heads, cached, anchor)
        counts = acc.reduce(tallies[:, 1], reduction="sum")
        self.tallies += acc.reduce(tallies.detach(), reduction="sum").cpu()
        # DDP averages gradients over processes; scaling by `world` turns that into the global token mean.
        return combine_loss(sums, counts, heads, cfg) * world, batch.numel()

    def logged(self) -> dict:
        accuracy = (self.tallies[:, 0] / self.tallies[:, 1].clamp(min=1)).tolist()
        self.tallies.zero_()
        return {"head_acc": accuracy}

    def evaluate(self, model: Objective) -> dict:
        return evaluate(model, self.held_out, self.config, self.accelerator.device)

    def stopped(self, records: list[dict]) -> str | None:
        cfg = self.config
        if cfg.patience and plateaued(records, cfg.patience, cfg.min_delta):
            return f"held-out block size has not grown for {cfg.patience} evaluations (--patience 0 trains on)"
        if cfg.doubling_gain and (gain := doubling_gain(records, cfg.eval_every)) is not None:
            if gain < cfg.doubling_gain:
                return (
                    f"held-out block size grew {gain:+.3f} over the last doubling of steps, less than "
                    f"--doubling-gain {cfg.doubling_gain}"
                )
        return None

    def state(self, model: Objective) -> dict:
        return {
            "heads": model.model.heads.state_dict(),
            "base": model.model.base.state_dict() if self.config.finetune else None,
            "python_rng": random.getstate(),
        }

    def load_state(self, state: dict) -> None:
        self.model.model.heads.load_state_dict(state["heads"])
        if self.config.finetune:
            self.model.model.base.load_state_dict(state["base"])
        random.setstate(state["python_rng"])

    def save(self, model: Objective, records: list[dict], folder: Path) -> None:
        """The heads (and in finetune modes the base), with the tokenizer and the run's record."""
        cfg, record = self.config, run_record(records, self.config, self.row_tokens, self.coverage, self.sources)
        model.model.write_save(folder, save_base=cfg.finetune, training=record, tokenizer=self.tokenizer)


def train(cfg: TrainConfig, callback: Callable[[int, dict], None] | None = None) -> BlockwiseLM:
    """Train heads as `cfg` says; write checkpoints, metrics.jsonl, training.png and the model to cfg.out."""
    ddp = DistributedDataParallelKwargs(find_unused_parameters=cfg.head_loss == "random")
    loop = training.Loop(training.LoopConfig.of(cfg), kwargs_handlers=[ddp])
    accelerator = loop.accelerator
    if cfg.batch_size % accelerator.num_processes:
        raise ValueError(
            f"batch_size {cfg.batch_size} does not split evenly over {accelerator.num_processes} processes"
        )
    base, tokenizer = base_and_tokenizer(cfg)
    limit = context_length(base)
    if limit is not None and cfg.seq_len > limit:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the base model's context of {limit} positions")
    if cfg.head_type == "eagle3" and is_seq2seq(base):
        raise ValueError(
            f"--head-type eagle3 reads a decoder-only base's layers, as the serving engines run it; "
            f"{cfg.base} is an encoder-decoder: train dflash, paper, medusa or hydra heads for it"
        )
    eos = sorted(resolve_eos(base, None))
    greedy_rules(base, 1, 1, set(eos))  # a generation config blockwise decoding cannot follow fails now, not later
    vocab = vocab_size(base)
    if cfg.distill_sources and not is_seq2seq(base):
        raise ValueError(
            f"--distill-sources are sources for an encoder-decoder to translate; {cfg.base} is a causal LM, whose "
            "distillation prompts are cut from --data: give the text as --data"
        )
    extra = load_sources(cfg.distill_sources or [], tokenizer, cfg.seq_len)  # per file
    extra_rows = [row for rows in extra for row in rows]
    if is_seq2seq(base):  # source/target pairs; the heads learn the decoder's side
        start = int(decoder_prompt(base, torch.zeros(1, 1, dtype=torch.long))[1])
        sequences = load_pairs(cfg.data, tokenizer, start, eos[0] if eos else None, cfg.seq_len)
        decoded = sequences.decoder
    else:
        sequences = decoded = pack(load_tokens(cfg.data, tokenizer, eos[0] if eos else None), cfg.seq_len)
        if int(sequences.min()) < 0:
            raise ValueError(f"the training data holds token ids outside the base model's vocabulary [0, {vocab})")
    if int(decoded.max()) >= vocab:
        raise ValueError(f"the training data holds token ids outside the base model's vocabulary [0, {vocab})")
    train_seqs, held_out = split(sequences, cfg.holdout)

    content = sequences.content() if isinstance(sequences, Pairs) else sequences
    if extra_rows:  # the sources' content too, so a run resumed on edited sources is refused
        content = torch.cat([content, torch.tensor([-3]), padded(extra_rows).flatten()])
    data_digest = fingerprint(content)
    state = loop.resume(cfg, RESUME_MUST_MATCH, data_digest, partial(setting_meaning, cfg, base))
    torch.manual_seed(cfg.seed)
    if cfg.head_type == "eagle3":
        return train_eagle3(cfg, loop, base, tokenizer, train_seqs, held_out, data_digest, state, callback)
    if cfg.head_type == "dflash":
        return train_dflash(cfg, loop, base, tokenizer, train_seqs, held_out, data_digest, state, callback, extra_rows)
    model = BlockwiseLM.from_base(
        base, k=cfg.k, head_type=cfg.head_type, head_hidden_size=cfg.head_hidden_size, draft_vocab=cfg.draft_vocab
    )
    model.heads_trained = True  # trained from here on: the default asks them
    if cfg.init_heads and state is None:
        model.heads.load_state_dict(trained_heads(cfg.init_heads, model))
    real_rows = train_seqs
    if cfg.distill:
        with accelerator.main_process_first():
            train_seqs = distilled(base.to(accelerator.device), train_seqs, cfg, loop.main, extra_rows)
    coverage = None
    if cfg.draft_vocab:  # the targets the heads learn, distilled or not, decide what they may propose
        targets = decoder_rows(train_seqs)
        token_map, coverage = most_frequent(targets, vocab, cfg.draft_vocab)
        model.heads.token_map.copy_(token_map)
    model.base.requires_grad_(cfg.finetune)
    objective = Objective(model, cfg).train()
    features = None
    if cfg.feature_cache:  # a frozen base (TrainConfig refuses others): its outputs on the rows never change
        if accelerator.num_processes > 1:
            raise ValueError("--feature-cache serves one process; several train with the base computed each step")
        features = cached_features(base.to(accelerator.device), train_seqs, cfg.feature_cache, show=loop.main)
    anchor = real_rows if cfg.base_loss_on == "data" else None
    sources = sources_record(cfg, len(real_rows), extra) if extra else None
    task = HeadTraining(
        cfg, objective, train_seqs, held_out, data_digest, tokenizer, accelerator, coverage, features, anchor, sources
    )
    if loop.main:
        write_json(Path(cfg.out) / "train_config.json", asdict(cfg))
    return loop.fit(task, state, callback).model


def trained_heads(directory: str, model: BlockwiseLM) -> dict[str, torch.Tensor]:
    """The heads saved in `directory`, checked to fit `model`'s: a fine-tuning run that starts from
    trained heads (Medusa-2's recipe) spares the base the large gradients of random ones."""
    try:
        saved = BlockwiseLM.from_pretrained(directory, base=model.base)
    except ValueError as err:  # CheckpointError among them: e.g. heads of a base of another width
        raise CheckpointError(f"--init-heads {directory}: {err}") from err
    fields = ("k", "head_type", "head_hidden_size", "hidden_size", "vocab_size", "draft_vocab")
    wrong = [
        f"{f} {getattr(saved.config, f)} (this run: {getattr(model.config, f)})"
        for f in fields
        if getattr(saved.config, f) != getattr(model.config, f)
    ]
    if wrong:
        raise CheckpointError(f"--init-heads {directory} holds heads that do not fit this run: {', '.join(wrong)}")
    return saved.heads.state_dict()


def plateaued(records: list[dict], patience: int, min_delta: float) -> bool:
    """Whether the held-out mean block size has not grown by more than min_delta for the last
    `patience` evaluations. Read from the metrics log, so a resumed run decides alike."""
    evals = [r["eval_mean_block_size"] for r in records if "eval_mean_block_size" in r]
    best, since = -math.inf, 0
    for value in evals:
        best, since = (value, 0) if value > best + min_delta else (best, since + 1)
    return since >= patience


def doubling_gain(records: list[dict], eval_every: int) -> float | None:
    """How much the best held-out block so far grew between half the steps and now (the plateau rule
    of a run trained until more data stops paying: a gain per doubling of tokens). None until half the
    steps reach the second evaluation after step 0, so one noisy early evaluation cannot stop a run.
    The best so far, not the last, so a dip does not count as a plateau, nor a spike as growth."""
    evals = [(r["step"], r["eval_mean_block_size"]) for r in records if "eval_mean_block_size" in r]
    if not evals:
        return None
    now = evals[-1][0]
    half = [block for step, block in evals if step <= now / 2]
    if now / 2 < 2 * eval_every or not half:
        return None
    return max(block for _, block in evals) - max(half)


def run_record(
    records: list[dict],
    cfg: TrainConfig,
    row_tokens: float,
    coverage: float | None = None,
    sources: dict | None = None,
) -> dict:
    """What blockdecode.json keeps of a training run: mode, size, how much it saw, and where it
    ended against where it began (held-out base loss on the --holdout split, decoded block size).
    `row_tokens`: the mean tokens of a training row (padding not counted); `coverage`: the share of
    the heads' targets their draft vocabulary holds; `sources`: its --distill-sources and their
    share of the distilled rows (`sources_record`)."""
    evals = [r for r in records if "eval_base_loss" in r]
    steps = max((r["step"] for r in records), default=0)
    return {
        "mode": cfg.mode,
        "k": cfg.k,
        "head_hidden_size": cfg.head_hidden_size,
        **({"draft_vocab": cfg.draft_vocab, "draft_vocab_coverage": coverage} if cfg.draft_vocab else {}),
        **(sources or {}),
        "steps": steps,
        "tokens_seen": round(steps * cfg.batch_size * row_tokens),
        "original_base_heldout_loss": evals[0]["eval_base_loss"] if evals else None,
        "base_heldout_loss": evals[-1]["eval_base_loss"] if evals else None,
        "mean_block_size": evals[-1]["eval_mean_block_size"] if evals else None,
    }


def training_summary(out: str | Path) -> str:
    """Held-out base loss, heads' accuracy and decoded mean accepted block size before and after a run."""
    records = read_jsonl(Path(out) / "metrics.jsonl")
    evals = [r for r in records if "eval_base_loss" in r]
    drafted = [r for r in records if "eval_loss" in r]  # an EAGLE-3 drafter's
    if drafted:
        last = drafted[-1]
        steps = ", ".join(f"{a:.3f}" for a in last["eval_head_acc"])
        return (
            f"held-out loss {last['eval_loss']:.3f}; top-1 accuracy by draft step {steps}; mean accepted block "
            f"size {last['eval_mean_block_size']:.2f} (step {last['step']})"
        )
    if not evals:
        return "no evaluation recorded"
    first, last = evals[0], evals[-1]

    def heads_acc(r: dict) -> float:
        return sum(r["eval_head_acc"][1:]) / max(1, len(r["eval_head_acc"]) - 1)

    return (
        f"held-out base loss {first['eval_base_loss']:.3f} -> {last['eval_base_loss']:.3f}; "
        f"heads 2..k top-1 accuracy {heads_acc(first):.3f} -> {heads_acc(last):.3f}; "
        f"mean accepted block size {first['eval_mean_block_size']:.2f} -> {last['eval_mean_block_size']:.2f} "
        f"(steps {first['step']} -> {last['step']})"
    )


def setting_meaning(cfg: TrainConfig, base, name: str, value: object) -> object:
    """What a saved or given setting means, so that a resume spelt otherwise matches: the base's path resolved, and
    the base's layers a drafter reads with the default filled in."""
    if name == "base" and isinstance(value, str) and Path(value).exists():
        return str(Path(value).resolve())
    if name == "aux_layers" and cfg.head_type in DRAFTER_TYPES:
        vocab = vocab_size(base)
        if cfg.head_type == "eagle3":
            return list(eagle3_config_for(base, vocab, value and tuple(value)).aux_layers)
        return list(dflash_config_for(base, vocab, 0, target_layer_ids=value and tuple(value)).target_layer_ids)
    return value


RESUME_MUST_MATCH = (
    "base",  # the path, as for init_heads: the features and distilled rows are its outputs
    "k",
    "mode",
    "head_type",
    "head_hidden_size",
    "draft_vocab",
    "aux_layers",
    *("dflash_layers", "anchors", "gamma"),
    "targets",
    "base_loss_on",
    "seed",
    "batch_size",
    "seq_len",
    "init_heads",
    "holdout",  # the split: another moves rows between training and held-out
    *("lr", "base_lr", "weight_decay", "warmup_steps", "mixed_precision"),  # the optimisation
    *("head_loss", "head_weights", "base_loss_weight"),  # the objective
    *("eval_batches", "eval_prompts", "eval_prompt_len", "eval_new_tokens"),  # the held-out measure the stop rules read
    *("distill_prompts", "distill_prompt_len", "distill_new_tokens", "distill_beams"),  # the distilled data
    "distill_sources",  # the paths; their content is in the data digest
)
"""What a resume must keep: everything that decides what is trained, on what, and how it is measured.
The rest may change (steps, the cadence of logs, evaluations and checkpoints, the stop rules, loss_chunk,
distill_batch_size and the cache folders): they change when and how fast, not what."""
