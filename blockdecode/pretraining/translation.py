"""Training the built-in translation model from scratch: a small Marian on English-Spanish Bible verses.

The paper's own task is translation with an encoder-decoder. This is the recipe behind a model of
that kind that anyone can rebuild offline: a byte-level BPE shared by both languages, trained on
the training verses only, and a `MarianMTModel` trained with label smoothing on batches of verses
of similar length. Each step's batch is a function of (seed, step), so a stopped run resumes
exactly. Its generation config is a real Marian's: decoding starts with the pad token, EOS is
forced at the length limit and the pad token is banned, rules blockwise decoding applies exactly."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sacrebleu
import torch
import torch.nn.functional as F
from tokenizers import processors
from transformers import GenerationConfig, MarianConfig, MarianMTModel, PreTrainedTokenizerFast

from blockdecode.core import plots
from blockdecode.core.hf import generate_length
from blockdecode.core.io import saving_folder
from blockdecode.loading import load_tokenizer
from blockdecode.pretraining.bible import read_tsv
from blockdecode.pretraining.corpus import train_tokenizer
from blockdecode.training import loop as training
from blockdecode.training.data import fingerprint

EOS, PAD = "</s>", "<pad>"


def translation_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """One byte-level BPE for both languages (Marian's shared vocabulary); every encoding ends
    with </s>, as Marian's sources and targets do."""
    tokenizer = train_tokenizer(texts, vocab_size, special_tokens=(EOS, PAD))
    eos = tokenizer.convert_tokens_to_ids(EOS)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", special_tokens=[(EOS, eos)]
    )
    return tokenizer


@dataclass
class TranslationConfig:
    """The translation model's shape and its training run."""

    corpus: str  # a folder of train.tsv / valid.tsv from `blockdecode bible`
    out: str
    tokenizer: str | None = None  # a folder whose tokenizer to use (a draft model shares its target's)
    vocab_size: int = 8000
    hidden_size: int = 256
    encoder_layers: int = 4
    decoder_layers: int = 4
    heads: int = 4
    intermediate_size: int = 1024
    context: int = 256  # positions per side; longer training pairs are skipped
    steps: int = 6000
    batch_tokens: int = 4096  # target tokens per batch, padding included
    lr: float = 7e-4
    min_lr: float = 5e-5
    warmup_steps: int = 800
    weight_decay: float = 0.01
    label_smoothing: float = 0.1
    eval_every: int = 250
    eval_verses: int = 200  # validation verses translated greedily for BLEU at each evaluation
    checkpoint_every: int = 50
    log_every: int = 10
    mixed_precision: str = "auto"  # bf16 autocast where the device computes bf16 natively
    resume: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "encoder_layers", "decoder_layers", "heads", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.tokenizer is None and self.vocab_size < 258:  # else the tokenizer silently has 258
            raise ValueError(
                f"--vocab-size {self.vocab_size} is below 258: the byte-level BPE holds its 256 bytes, {EOS} and {PAD} "
                "before any merge"
            )
        if self.hidden_size % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden_size ({self.hidden_size})")
        if self.batch_tokens < self.context:
            raise ValueError(f"batch_tokens ({self.batch_tokens}) must hold one pair of up to {self.context} tokens")


RESUME_MUST_MATCH = (
    *("vocab_size", "hidden_size", "encoder_layers", "decoder_layers", "heads", "intermediate_size", "context"),
    *("batch_tokens", "lr", "min_lr", "warmup_steps", "weight_decay", "label_smoothing"),
    *("mixed_precision", "seed"),
    "eval_verses",  # the held-out BLEU's verses: others make its curve jump mid-run
)
"""What a resume must keep; steps and the cadence of logs, evaluations and checkpoints may change, and a
resumed run reads the tokenizer it saved, whatever --tokenizer says."""


def prepare(cfg: TranslationConfig, show: bool = True) -> tuple[PreTrainedTokenizerFast, dict[str, list]]:
    """The tokenizer (the one a resumed run saved, else cfg.tokenizer's, else one trained on the
    training verses) and each split's (source ids, target ids) pairs."""
    corpus, data = Path(cfg.corpus), Path(cfg.out) / "tokenizer"
    pairs = {name: read_tsv(corpus / f"{name}.tsv") for name in ("train", "valid")}
    if not pairs["train"] or not pairs["valid"]:
        raise ValueError(f"{corpus} needs verse pairs in both train.tsv and valid.tsv")
    if (data / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(data, PreTrainedTokenizerFast)
    elif cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer, PreTrainedTokenizerFast)
        missing = [t for t in (EOS, PAD) if t not in tokenizer.get_vocab()]
        if missing:
            raise ValueError(
                f"--tokenizer {cfg.tokenizer} has no {' or '.join(missing)} token: not a translation tokenizer"
            )
        with saving_folder(data, "tokenizer.json") as staging:
            tokenizer.save_pretrained(staging)
    else:
        texts = [text for p in pairs["train"] for text in (p.source, p.target)]
        tokenizer = translation_tokenizer(texts, cfg.vocab_size)
        with saving_folder(data, "tokenizer.json") as staging:
            tokenizer.save_pretrained(staging)
    encoded = {}
    for name, split in pairs.items():
        src = tokenizer([p.source for p in split]).input_ids
        tgt = tokenizer([p.target for p in split]).input_ids
        lengths = [max(len(s), len(t)) for s, t in zip(src, tgt)]
        keep = [i for i, n in enumerate(lengths) if n <= cfg.context]
        if not keep:  # nothing to train on, or to evaluate
            kind = "training" if name == "train" else "validation"
            raise ValueError(
                f"no {kind} pair in {corpus / f'{name}.tsv'} fits --context {cfg.context}: the shortest has "
                f"{min(lengths)} tokens"
            )
        encoded[name] = [(src[i], tgt[i]) for i in keep]
        encoded[f"{name}_text"] = [split[i] for i in keep]
    return tokenizer, encoded


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches: pairs sorted by length (ties broken at random), cut into batches of at
    most `batch_tokens` padded target tokens, in a random order; a function of (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    order = np.lexsort((rng.random(len(lengths)), np.asarray(lengths)))
    batches, current, longest = [], [], 0
    for i in order.tolist():
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    return [batches[j] for j in rng.permutation(len(batches))]


def collate(pairs: list[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    """Padded source, decoder input (start token = pad, then the target shifted) and labels (-100 on padding)."""
    src_len, tgt_len = max(len(s) for s, _ in pairs), max(len(t) for _, t in pairs)
    src = torch.full((len(pairs), src_len), pad, dtype=torch.long)
    dec = torch.full((len(pairs), tgt_len), pad, dtype=torch.long)
    labels = torch.full((len(pairs), tgt_len), -100, dtype=torch.long)
    for row, (s, t) in enumerate(pairs):
        src[row, : len(s)] = torch.tensor(s)
        dec[row, 1 : len(t)] = torch.tensor(t[:-1])
        labels[row, : len(t)] = torch.tensor(t)
    return {"input_ids": src, "attention_mask": (src != pad).long(), "decoder_input_ids": dec, "labels": labels}


def marian_config(cfg: TranslationConfig, tokenizer: PreTrainedTokenizerFast) -> MarianConfig:
    eos, pad = tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(PAD)
    return MarianConfig(
        vocab_size=len(tokenizer),
        d_model=cfg.hidden_size,
        encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.heads,
        decoder_attention_heads=cfg.heads,
        encoder_ffn_dim=cfg.intermediate_size,
        decoder_ffn_dim=cfg.intermediate_size,
        max_position_embeddings=cfg.context,
        dropout=0.1,
        # Token embeddings times sqrt(d), as a real Marian (and the paper's Transformer) has them:
        # unscaled, at init they are ~27x weaker than the sinusoidal positions, and a run stalled at
        # the unigram loss (6.6 nats) for 400 steps.
        scale_embedding=True,
        eos_token_id=eos,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        forced_eos_token_id=eos,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
    )


def marian_generation_config(tokenizer: PreTrainedTokenizerFast, context: int) -> GenerationConfig:
    """A real Marian checkpoint's rules, with greedy decoding: start with pad, force EOS at the
    limit, never emit pad."""
    eos, pad = tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(PAD)
    return GenerationConfig(
        decoder_start_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        forced_eos_token_id=eos,
        bad_words_ids=[[pad]],
        max_length=context,
        num_beams=1,
        do_sample=False,
    )


@torch.inference_mode()
def evaluate(
    model: MarianMTModel,
    tokenizer: PreTrainedTokenizerFast,
    pairs: list[tuple[list[int], list[int]]],
    references: list[str],
    batch_tokens: int,
    autocast=contextlib.nullcontext,
) -> dict[str, float]:
    """Held-out loss (nats/token, no smoothing) on every pair, and BLEU of greedy translations of
    the first `len(references)` pairs against their reference text."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    total, count = 0.0, 0
    for batch in epoch_batches([len(t) for _, t in pairs], batch_tokens, 0, 0):
        inputs = {k: v.to(device) for k, v in collate([pairs[i] for i in batch], pad).items()}
        labels = inputs.pop("labels")
        with autocast():
            logits = model(**inputs, use_cache=False).logits
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"))
        count += int((labels != -100).sum())
    hypotheses = translate(model, tokenizer, [s for s, _ in pairs[: len(references)]], autocast=autocast)
    model.train(was_training)
    return {"heldout_loss": total / count, "bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score}


@torch.inference_mode()
def translate(
    model: MarianMTModel,
    tokenizer: PreTrainedTokenizerFast,
    sources: list[list[int]],
    batch_size: int = 32,
    autocast=contextlib.nullcontext,
) -> list[str]:
    """Greedy translations of tokenised sources (transformers' generate, padded batches)."""
    device = next(model.parameters()).device
    pad, out = tokenizer.pad_token_id, []
    for start in range(0, len(sources), batch_size):
        chunk = sources[start : start + batch_size]
        ids = torch.full((len(chunk), max(map(len, chunk))), pad, dtype=torch.long)
        for row, s in enumerate(chunk):
            ids[row, : len(s)] = torch.tensor(s)
        limit = min(model.config.max_position_embeddings - 1, int(1.5 * ids.shape[1]) + 10)
        with autocast():
            generated = model.generate(
                ids.to(device),
                attention_mask=(ids != pad).long().to(device),
                num_beams=1,
                **generate_length(model, ids.shape[1], limit),
            )
        out += tokenizer.batch_decode(generated, skip_special_tokens=True)
    return [text.strip() for text in out]


class TranslationTraining(training.Task):
    """The translation model trained from scratch on length-bucketed batches of verse pairs, for
    `training.Loop`."""

    name, png, rate, last = "translation model", "translation.png", "target_tokens_per_s", "model"
    curves = plots.Curves(
        train="train loss (smoothed labels)", heldout={"heldout_loss": "held-out loss"}, side=plots.bleu
    )

    def __init__(self, cfg: TranslationConfig, device: torch.device, autocast, show: bool = True):
        self.config, self.device, self.autocast = cfg, device, autocast
        self.tokenizer, data = prepare(cfg, show)
        self.pairs, self.valid = data["train"], data["valid"]
        self.references = [p.target for p in data["valid_text"][: cfg.eval_verses]]
        self.lengths = [len(t) for _, t in self.pairs]
        tokens = [tok for s, t in self.pairs for tok in (*s, -1, *t, -2)]
        self.data_digest = fingerprint(np.asarray(tokens, dtype=np.int32))
        self.per_epoch = len(epoch_batches(self.lengths, cfg.batch_tokens, cfg.seed, 0))
        self.epoch, self.batches = -1, []
        torch.manual_seed(cfg.seed)
        self.model = MarianMTModel(marian_config(cfg, self.tokenizer))
        self.model.generation_config = marian_generation_config(self.tokenizer, cfg.context)
        self.optimizer = training.adamw(self.model, cfg.lr, cfg.weight_decay, betas=(0.9, 0.98))
        self.scheduler = training.scheduler(self.optimizer, cfg.warmup_steps, cfg.steps, floor=cfg.min_lr / cfg.lr)

    def loss(self, model, step: int) -> tuple[torch.Tensor, int]:
        """Label-smoothed cross-entropy of the step's batch; its tokens are the targets'."""
        if step // self.per_epoch != self.epoch:  # an epoch's batches are drawn once, when it begins
            self.epoch = step // self.per_epoch
            self.batches = epoch_batches(self.lengths, self.config.batch_tokens, self.config.seed, self.epoch)
        batch = [self.pairs[i] for i in self.batches[step % self.per_epoch]]
        inputs = {k: v.to(self.device) for k, v in collate(batch, self.tokenizer.pad_token_id).items()}
        labels = inputs.pop("labels")
        logits = model(**inputs, use_cache=False).logits
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), label_smoothing=self.config.label_smoothing
        )
        return loss, int((labels != -100).sum())

    def progress(self, done: int) -> dict:
        return {"epoch": round(done / self.per_epoch, 3)}

    def evaluate(self, model: MarianMTModel) -> dict:
        batch_tokens = self.config.batch_tokens
        return evaluate(model, self.tokenizer, self.valid, self.references, batch_tokens, self.autocast)

    def state(self, model: MarianMTModel) -> dict:
        return {"model": model.state_dict()}

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])

    def save(self, model: MarianMTModel, records: list[dict], folder: Path) -> None:
        """model/: the weights, Marian's generation config and the tokenizer."""
        self.tokenizer.save_pretrained(folder / "model")
        model.save_pretrained(folder / "model")


def train_translation(cfg: TranslationConfig, show: bool = True) -> MarianMTModel:
    """Train the translation model as cfg says; metrics.jsonl, translation.png, atomic checkpoints
    and the final model (safetensors, tokenizer, Marian's generation config) go to cfg.out."""
    loop = training.Loop(training.LoopConfig.of(cfg, max_norm=1.0), show=show)
    task = TranslationTraining(cfg, loop.device, loop.precision.autocast, show)
    return loop.fit(task, loop.resume(cfg, RESUME_MUST_MATCH, task.data_digest))
