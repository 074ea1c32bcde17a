"""Training the proposal heads: frozen, fine-tuned or distilled (Stern et al., 2018, §5).

Head i at position t learns the token at t+i; head 1 is the base model's own next-token
prediction. The same code runs on one CPU or under `accelerate launch` on many devices."""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import DistributedDataParallelKwargs
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from blockdecode import plots, training
from blockdecode.adapter import decoder_prompt, sequence_logits
from blockdecode.data import Pairs, fingerprint, load_pairs, load_sources, load_tokens, pack, padded, split
from blockdecode.decode import blockwise_generate, decode_prompts
from blockdecode.drafters import NgramDrafter
from blockdecode.features import Features, cached_features
from blockdecode.heads import most_frequent, path_tokens
from blockdecode.hf import (
    context_length,
    decoder_output,
    generate_length,
    is_seq2seq,
    load_base,
    load_tokenizer,
    resolve_eos,
    vocab_size,
    weights_digest,
)
from blockdecode.io import CheckpointError, atomic_write, read_jsonl, save_npy, write_json
from blockdecode.loss import IGNORE, linear_cross_entropy
from blockdecode.model import HEADS_CONFIG, BlockwiseLM
from blockdecode.plan import make_plan
from blockdecode.reference import greedy_generate
from blockdecode.rules import greedy_rules

MODES = {
    "frozen": "base frozen (inference mode), heads trained on the data; decoding stays the original model's",
    "finetune": "base and heads trained together, the base's own loss kept in the objective; the result is a new base",
    "distill": "frozen base, heads trained on the base model's own greedy/beam continuations of data prompts",
    "finetune+distill": "fine-tune base and heads on the base model's own continuations (the paper's best)",
}
HEAD_LOSSES = ("all", "random")
BASE_LOSS_ON = {
    "rows": "the rows the heads learn from (in finetune+distill, the base's own greedy text)",
    "data": "rows of the real data, so the base keeps modelling real text while it learns its heads' way",
}
TARGETS = {
    "hard": "each head learns the data's token (the base's own argmax, in distill modes)",
    "soft": "each head learns the base's whole distribution where it predicts that token (Hydra++)",
}


POSITIVE_FIELDS = (
    "steps",
    "batch_size",
    "seq_len",
    "eval_every",
    "eval_prompts",
    "log_every",
    "checkpoint_every",
    "distill_prompts",
    "distill_new_tokens",
    "distill_beams",
    "distill_batch_size",
    "loss_chunk",
)
NON_NEGATIVE_FIELDS = ("patience", "min_delta")


@dataclass
class TrainConfig:
    """One training run. `batch_size` is the global batch, split across processes."""

    base: str
    data: list[str]
    out: str
    k: int = 8
    mode: str = "frozen"
    head_type: str = "paper"
    head_hidden_size: int = 0
    draft_vocab: int = 0  # > 0: the heads score only the N tokens most frequent in their targets
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    base_lr: float = 5e-5
    weight_decay: float = 0.0
    warmup_steps: int = 20
    head_loss: str = "all"
    targets: str = "hard"
    head_weights: list[float] | None = None
    base_loss_weight: float = 1.0
    base_loss_on: str = "rows"  # finetune+distill: "data" measures the base's own loss on real data rows
    holdout: float = 0.05
    eval_every: int = 100
    eval_batches: int = 4
    eval_prompts: int = 4
    eval_prompt_len: int = 32
    eval_new_tokens: int = 64
    log_every: int = 10
    checkpoint_every: int = 100
    resume: bool = False
    seed: int = 0
    mixed_precision: str = "auto"  # bf16 autocast where the device computes bf16 natively
    distill_prompts: int = 256
    distill_prompt_len: int = 32
    distill_new_tokens: int = 128
    distill_beams: int = 1
    distill_batch_size: int = 16
    distill_cache: str | None = None
    # encoder-decoder distill modes: text files of more sources, one a line; distill_prompts are drawn
    # evenly from the training sources and these together, so each gives its share of the budget
    distill_sources: list[str] | None = None
    feature_cache: str | None = None  # frozen-base modes: the base's outputs on the rows, computed once, here
    loss_chunk: int = 2048  # rows of head logits held at once (memory only: the loss is the same)
    patience: int = 0  # stop after this many evaluations without a longer held-out block; 0: never
    init_heads: str | None = None  # a saved BlockwiseLM whose heads start the run (its base is not used)
    min_delta: float = 0.01  # what counts as longer

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.base_loss_on not in BASE_LOSS_ON:
            raise ValueError(f"unknown base_loss_on {self.base_loss_on!r}: choose one of {', '.join(BASE_LOSS_ON)}")
        if self.base_loss_on == "data" and self.mode != "finetune+distill":
            raise ValueError("base_loss_on='data' is for finetune+distill, whose rows are the base's own text")
        if self.targets not in TARGETS:
            raise ValueError(f"unknown targets {self.targets!r}: choose one of {', '.join(TARGETS)}")
        if self.head_loss not in HEAD_LOSSES:
            raise ValueError(f"unknown head loss {self.head_loss!r}: choose one of {', '.join(HEAD_LOSSES)}")
        if not isinstance(self.k, int) or self.k < 2:
            raise ValueError(f"k must be an integer >= 2 to have heads to train, got {self.k!r}")
        if self.head_weights is not None and len(self.head_weights) != self.k - 1:
            raise ValueError(
                f"head_weights needs {self.k - 1} values (heads 2..{self.k}), got {len(self.head_weights)}"
            )
        if self.head_weights is not None and min(self.head_weights) <= 0:
            raise ValueError(f"head_weights must all be positive, got {self.head_weights}")
        for name in POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("lr", "base_lr", "weight_decay", "base_loss_weight"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        for name in NON_NEGATIVE_FIELDS:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.seq_len <= self.k:
            raise ValueError(f"seq_len ({self.seq_len}) must exceed k ({self.k}) for every head to have targets")
        if not self.data:
            raise ValueError("no training data given")
        out = Path(self.out).resolve()
        for item in map(Path, self.data):
            if item.is_dir() and out.is_relative_to(item.resolve()):
                raise ValueError(
                    f"--out {self.out} lies inside the data folder {item}: the run would train on its own files"
                )
        if self.distill_sources and not self.distill:
            raise ValueError(f"distill_sources are prompts to distil: for the distill modes, not {self.mode}")
        if self.distill and self.distill_prompt_len + self.distill_new_tokens <= self.k:
            raise ValueError(
                f"distilled rows of {self.distill_prompt_len} + {self.distill_new_tokens} tokens are too short "
                f"for k={self.k}"
            )

    @property
    def finetune(self) -> bool:
        return self.mode.startswith("finetune")

    @property
    def distill(self) -> bool:
        return self.mode.endswith("distill")


def head_targets(input_ids: torch.LongTensor, k: int) -> torch.LongTensor:
    """labels [B, L, k]: labels[b, t, i-1] is the token head i must predict at position t,
    input_ids[b, t+i], or IGNORE where that lies beyond the sequence or is padding (< 0)."""
    b, length = input_ids.shape
    labels = input_ids.new_full((b, length, k), IGNORE)
    for i in range(1, k + 1):
        labels[:, : max(0, length - i), i - 1] = input_ids[:, i:]
    return labels.masked_fill(labels < 0, IGNORE)


class Objective(nn.Module):
    """Base + heads -> the training loss and per-head accuracy; the module accelerate wraps."""

    def __init__(self, model: BlockwiseLM, cfg: TrainConfig):
        super().__init__()
        self.model = model
        self.cfg = cfg

    def train(self, mode: bool = True) -> Objective:
        """A frozen base stays in inference mode (no dropout) whatever the heads do."""
        super().train(mode)
        self.model.base.train(mode and self.cfg.finetune)
        return self

    def forward(
        self,
        batch: torch.LongTensor | Pairs,
        heads: list[int],
        features: tuple | None = None,
        anchor: torch.LongTensor | Pairs | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy per head [k] (head 1 is the base's own; heads 2..k not listed
        stay 0) and per-head [k, 2] (correct, count) tallies. `batch`: token rows of a causal LM,
        or an encoder-decoder's pairs, whose decoder sequences the heads learn. Sums, not means, so the loss can
        be normalised by the token count over all processes (`combine_loss`).

        A frozen base runs in inference mode, once per batch, with no autograd graph; the heads'
        k-1 projections through the vocabulary go chunk by chunk (`linear_cross_entropy`), so
        their [B, T, k-1, V] logits never exist at once. `features` (a frozen base's decoder outputs,
        argmax and loss on these rows, from `blockdecode.features`) spare the base's forward. `anchor`:
        other rows (real data) on which the base's own loss and accuracy (head 1's) are measured instead."""
        base, k = self.model.base, self.cfg.k
        input_ids, source, source_mask = decoder_inputs(batch)
        labels = head_targets(input_ids, k)
        counts = (labels != IGNORE).sum(dim=(0, 1)).float()  # [k]: target tokens per head
        target = labels[..., 0].flatten()
        tallies = torch.zeros(k, 2, device=input_ids.device)
        if features is not None:
            h, argmax, base_loss = features
            sums = [base_loss.sum()]  # already 0 where there is no target
        else:
            trains_base = self.cfg.finetune and self.training
            with decoder_output(base) as hidden, torch.enable_grad() if trains_base else torch.inference_mode():
                logits = sequence_logits(base, input_ids.clamp(min=0), source, source_mask)
            h = hidden[0] if trains_base else hidden[0].clone()  # an inference tensor cannot enter the graph
            argmax = logits.argmax(-1)
            sums = [F.cross_entropy(logits.flatten(0, 1).float(), target, ignore_index=IGNORE, reduction="sum")]
        tallies[0] = torch.stack([((argmax.flatten() == target) & (target != IGNORE)).sum(), counts[0]])
        if anchor is not None:
            sums[0], tallies[0] = self.base_loss(anchor)
        embeds = None
        if self.model.heads.takes_tokens:  # teacher forcing: the base's newest token, then the data's
            embeds = base.get_input_embeddings()(path_tokens(argmax, input_ids, k))
        # one [B, L, D] view per head: slicing each head's rows out of [B, L, k-1, D] would make every
        # head's backward fill and add a gradient of the whole stack
        states = self.model.heads(h, embeds).unbind(-2)
        project, short = draft_projection(base.get_output_embeddings(), self.model.token_map)
        soft = self.cfg.targets == "soft"
        for i in range(2, k + 1):
            if i not in heads:
                sums.append(sums[0].new_zeros(()))
                continue
            target = short(labels[:, : -(i - 1), i - 1])
            teacher = h[:, i - 1 :] if soft else None  # where the base itself predicts head i's token
            loss, hits = linear_cross_entropy(
                states[i - 2][:, : -(i - 1)], project, target, self.cfg.loss_chunk, teacher
            )
            sums.append(loss)
            tallies[i - 1] = torch.stack([hits.float(), counts[i - 1]])
        return torch.stack(sums), tallies

    def base_loss(self, batch: torch.LongTensor | Pairs) -> tuple[torch.Tensor, torch.Tensor]:
        """The base's own summed next-token loss on `batch`, and its (correct, count) tally."""
        ids, source, mask = decoder_inputs(batch)
        target = head_targets(ids, 1)[..., 0].flatten()
        with torch.enable_grad() if self.training else torch.inference_mode():
            logits = sequence_logits(self.model.base, ids.clamp(min=0), source, mask)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), target, ignore_index=IGNORE, reduction="sum")
        hits = ((logits.argmax(-1).flatten() == target) & (target != IGNORE)).sum()
        return loss, torch.stack([hits, (target != IGNORE).sum()]).float()


def decoder_inputs(batch: torch.LongTensor | Pairs) -> tuple[torch.LongTensor, torch.Tensor | None, ...]:
    """The token rows the heads learn (a causal LM's rows, or an encoder-decoder's decoder side), and for
    pairs the source ids and mask the encoder reads (padding -1 turned into id 0, masked out)."""
    if not isinstance(batch, Pairs):
        return batch, None, None
    return batch.decoder, batch.source.clamp(min=0), (batch.source >= 0).long()


def draft_projection(project: nn.Module, token_map: torch.LongTensor | None):
    """The projection the heads are trained through, and the map of targets into its rows: the full
    vocabulary, or the draft vocabulary's rows (gathered, so a fine-tuned projection still learns),
    where a target outside the map is IGNORE: never proposed, so never learnt, but still counted."""
    if token_map is None:
        return project, lambda target: target
    bias = project.bias[token_map] if project.bias is not None else None
    rows = SimpleNamespace(weight=project.weight[token_map], bias=bias)
    inverse = torch.full((project.weight.shape[0],), IGNORE, dtype=torch.long, device=token_map.device)
    inverse[token_map] = torch.arange(len(token_map), device=token_map.device)
    return rows, lambda target: torch.where(target == IGNORE, target, inverse[target.clamp(min=0)])


def combine_loss(sums: torch.Tensor, counts: torch.Tensor, heads: list[int], cfg: TrainConfig) -> torch.Tensor:
    """The objective: weighted mean over the heads scored of each head's per-token loss, plus
    the base's own loss in finetune modes. `counts` are target tokens per head over the whole
    global batch, so every token weighs the same however the batch is split over processes."""
    weights = cfg.head_weights or [1.0] * (cfg.k - 1)
    total = sum(weights[i - 2] for i in heads)
    per_token = sums / counts.clamp(min=1)
    loss = sum(per_token[i - 1] * (weights[i - 2] / total) for i in heads)
    if cfg.finetune:
        loss = loss + cfg.base_loss_weight * per_token[0]
    return loss


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> torch.LongTensor:
    """The global batch at `step`: epochs of a seeded permutation, so any step can be found
    again on resume without replaying the ones before it."""
    per_epoch = max(1, n // batch_size)
    epoch, b = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64))
    if n < batch_size:
        perm = perm.repeat(math.ceil(batch_size / n))
    return perm[b * batch_size : (b + 1) * batch_size]


def sampled_heads(step: int, cfg: TrainConfig) -> list[int]:
    """Heads whose loss this step computes: all of 2..k, or one drawn uniformly (the paper's
    memory saver), seeded by the step so resumed and multi-process runs draw alike."""
    if cfg.head_loss == "all":
        return list(range(2, cfg.k + 1))
    gen = torch.Generator().manual_seed((cfg.seed * 7919 + step) % 2**64)  # any seed torch takes, 0 to 2**64 - 1
    return [int(torch.randint(2, cfg.k + 1, (1,), generator=gen))]


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
    if path.is_file():
        return torch.from_numpy(np.load(path))
    parts = path.with_suffix(".parts")  # one file per finished batch
    starts = range(0, n, cfg.distill_batch_size)
    done = [s for s in starts if (parts / f"{s:09d}.npy").is_file()]
    bar = tqdm(starts, desc="distilling", unit="batch", initial=len(done), disable=not show)
    generated, began = 0, time.perf_counter()
    for start in sorted(set(starts) - set(done)):
        rows = generate(slice(start, start + cfg.distill_batch_size))
        array = rows.numpy()
        atomic_write(parts / f"{start:09d}.npy", lambda p, a=array: save_npy(p, a))
        generated += int((rows[:, first_new:] >= 0).sum())
        bar.update(1)
        bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - began):.0f}")
    bar.close()
    data = torch.cat([torch.from_numpy(np.load(parts / f"{s:09d}.npy")) for s in starts])
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
    limit = context_length(model.base)
    if isinstance(held_out, Pairs):  # translate held-out sources, stopping at EOS as real use does
        prompts = [held_out[i : i + 1].source for i in range(min(cfg.eval_prompts, len(held_out)))]
        budget = cfg.eval_new_tokens if limit is None else min(cfg.eval_new_tokens, limit - 1)
        eos = None
    else:
        prompts = [row[: cfg.eval_prompt_len].unsqueeze(0) for row in held_out[: cfg.eval_prompts]]
        budget = cfg.eval_new_tokens if limit is None else min(cfg.eval_new_tokens, limit - cfg.eval_prompt_len)
        eos = []
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
    one with tokenizer_config.json), refused by name if it is damaged."""
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
        rows = self.sequences.decoder if isinstance(self.sequences, Pairs) else self.sequences
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
        decoded = batch.decoder if isinstance(batch, Pairs) else batch
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
    state = loop.resume(cfg, RESUME_MUST_MATCH, data_digest)
    torch.manual_seed(cfg.seed)
    model = BlockwiseLM.from_base(
        base, k=cfg.k, head_type=cfg.head_type, head_hidden_size=cfg.head_hidden_size, draft_vocab=cfg.draft_vocab
    )
    if cfg.init_heads and state is None:
        model.heads.load_state_dict(trained_heads(cfg.init_heads, model))
    real_rows = train_seqs
    if cfg.distill:
        with accelerator.main_process_first():
            if isinstance(train_seqs, Pairs):
                train_seqs = distill_pairs(base.to(accelerator.device), train_seqs, cfg, loop.main, extra_rows)
            else:
                train_seqs = distill_sequences(base.to(accelerator.device), train_seqs, cfg, show=loop.main)
    coverage = None
    if cfg.draft_vocab:  # the targets the heads learn, distilled or not, decide what they may propose
        targets = train_seqs.decoder if isinstance(train_seqs, Pairs) else train_seqs
        token_map, coverage = most_frequent(targets, vocab, cfg.draft_vocab)
        model.heads.token_map.copy_(token_map)
    model.base.requires_grad_(cfg.finetune)
    objective = Objective(model, cfg).train()
    features = None
    if cfg.feature_cache and not cfg.finetune:  # a frozen base: its outputs on the rows never change
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
    saved = BlockwiseLM.from_pretrained(directory, base=model.base)
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
    evals = [r for r in read_jsonl(Path(out) / "metrics.jsonl") if "eval_base_loss" in r]
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


RESUME_MUST_MATCH = (
    "k",
    "mode",
    "head_type",
    "head_hidden_size",
    "draft_vocab",
    "targets",
    "base_loss_on",
    "seed",
    "batch_size",
    "seq_len",
    "init_heads",
    *("distill_prompts", "distill_prompt_len", "distill_new_tokens", "distill_beams"),  # the distilled data
    "distill_sources",  # the paths; their content is in the data digest
)
