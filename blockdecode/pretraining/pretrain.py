"""Training the built-in base model from scratch: corpus, tokenizer and a small Llama.

The recipe behind `blockdecode.DEFAULT_MODEL`: the running Python's standard library is the
corpus (no download), split by file, tokenised with a byte-level BPE trained on the training
files only, and a `LlamaForCausalLM` trained on it with bf16 autocast. Every step's batch is a
function of (seed, step), so a stopped run resumes exactly where it was."""

from __future__ import annotations

import contextlib
import math
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from blockdecode.core import plots
from blockdecode.core.hardware import MIXED_PRECISIONS
from blockdecode.core.io import atomic_write, check_writable, load_npy, read_json, read_text, save_npy, write_json
from blockdecode.loading import load_tokenizer
from blockdecode.pretraining.corpus import (
    CORPUS_PACKAGES,
    SPECIAL_TOKENS,
    SourceFile,
    corpus_files,
    is_heldout,
    stdlib_files,
    train_tokenizer,
)
from blockdecode.training import loop as training
from blockdecode.training.data import fingerprint

SPLITS = ("train", "heldout", "heldout_packages")
"""`heldout` holds the standard library's held-out files alone (the same files as the first built-in
model's, so held-out losses stay comparable); `heldout_packages` the packages' held-out files."""


@dataclass
class CorpusConfig:
    """Which files, which split, which tokenizer."""

    out: str
    root: str | None = None  # default: the running Python's standard library
    packages: tuple[str, ...] = CORPUS_PACKAGES  # installed packages whose source joins it
    vocab_size: int = 8192
    heldout_fraction: float = 0.05
    max_files: int | None = None  # a small slice, for tests and quick trials
    tokenizer: str | None = None  # a folder with tokenizer.json to use instead of training one

    def __post_init__(self) -> None:
        least = 256 + len(SPECIAL_TOKENS)  # the byte-level BPE's alphabet and its special tokens, before any merge
        if self.tokenizer is None and not least <= self.vocab_size <= 65536:
            raise ValueError(
                f"--vocab-size {self.vocab_size} must lie in [{least}, 65536]: the byte-level BPE holds its 256 bytes "
                "and special tokens before any merge, and the corpus stores its ids as uint16"
            )
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must lie in [0, 1), got {self.heldout_fraction}")
        if self.max_files is not None and self.max_files < 1:
            raise ValueError(f"--max-files must be positive, got {self.max_files}")


def prepared_with(cfg: CorpusConfig) -> dict:
    """The settings that decide a corpus's files, split and tokens (its folder aside)."""
    return {k: v for k, v in asdict(cfg).items() if k != "out"} | {"packages": list(cfg.packages)}


def check_prepared_with(cfg: CorpusConfig, manifest: dict, out: Path) -> None:
    """A prepared corpus is reused only for the settings it was prepared with (one saved before they were recorded
    is taken as it is): another --vocab-size or --max-files over it is refused, not trained on the old corpus."""
    saved = manifest.get("prepared_with") if isinstance(manifest, dict) else None
    if not isinstance(saved, dict):
        return
    for name, value in prepared_with(cfg).items():
        if name in saved and saved[name] != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"--corpus {out} was prepared with {flag} {saved[name]}, this run asks for {value}: give "
                             "another --corpus folder, or the settings it was prepared with")  # fmt: skip


def split_of(f: SourceFile, fraction: float) -> str:
    if not is_heldout(f.name, fraction):
        return "train"
    return "heldout" if f.source == "stdlib" else "heldout_packages"


def id_dtype(vocab_size: int) -> type:
    """The narrowest unsigned integer that holds every id of a vocabulary: uint16 for the built-in models', uint32
    for a pretrained model's (Gemma's 262,144), which uint16 would wrap without a word."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def prepare_corpus(cfg: CorpusConfig, show: bool = True) -> PreTrainedTokenizerFast:
    """tokenizer.json and one .npy per split (token ids, `id_dtype`; EOS after each file) in cfg.out, and
    files.json: each split's files, bytes, tokens and bytes per token, which say what a per-token loss
    is worth. Files already there are reused, so a resumed recipe does not redo this."""
    out = Path(cfg.out)
    if (out / "tokenizer.json").is_file() and (out / "files.json").is_file():
        check_prepared_with(cfg, read_json(out / "files.json"), out)
        return load_tokenizer(out, PreTrainedTokenizerFast)
    check_writable(out, "--corpus")
    root = Path(cfg.root or sysconfig.get_paths()["stdlib"])
    if cfg.root and not stdlib_files(root):  # else --packages' source alone would be the corpus, unasked
        raise ValueError(f"--root {cfg.root} is not a folder of .py files")
    files = corpus_files(root, cfg.packages)[: cfg.max_files]
    if not files:
        raise ValueError(f"no .py files under {root}")
    split = {f: split_of(f, cfg.heldout_fraction) for f in files}
    if not any(s == "heldout" for s in split.values()) or all(s != "train" for s in split.values()):
        split[files[-1]] = "heldout"  # tiny slices: still one file each side
        split[files[0]] = "train"
    texts = {f: read_text(f.path) for f in tqdm(files, desc="reading", disable=not show)}
    if cfg.tokenizer:  # e.g. the built-in model's, to give its base more data in its own tokens
        tokenizer = load_tokenizer(cfg.tokenizer, PreTrainedTokenizerFast)
    else:
        tokenizer = train_tokenizer((texts[f] for f in files if split[f] == "train"), cfg.vocab_size)
    eos = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    if SPECIAL_TOKENS[0] not in tokenizer.get_vocab() and tokenizer.eos_token_id is not None:
        eos = tokenizer.eos_token_id  # a pretrained model's own tokenizer (Gemma's <eos>)
    kind = id_dtype(len(tokenizer))
    out.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name in SPLITS:
        chosen = [f for f in files if split[f] == name]
        ids: list[int] = []
        for start in tqdm(range(0, len(chosen), 64), desc=f"tokenising {name}", disable=not show):
            for row in tokenizer([texts[f] for f in chosen[start : start + 64]]).input_ids:
                ids += row + [eos]
        array = np.asarray(ids, dtype=kind)
        atomic_write(out / f"{name}.npy", lambda p, a=array: save_npy(p, a))
        size = sum(len(texts[f].encode()) for f in chosen)
        manifest[name] = {
            "files": [f.name for f in chosen],
            "sources": sorted({f.source for f in chosen}),
            "bytes": size,
            "tokens": len(ids),
            "bytes_per_token": size / max(1, len(ids) - len(chosen)),
        }
    tokenizer.save_pretrained(out)
    manifest["prepared_with"] = prepared_with(cfg)
    write_json(out / "files.json", manifest)  # last: its presence says the corpus is whole
    return tokenizer


@dataclass
class PretrainConfig:
    """The base model's shape and its training run."""

    corpus: str  # a folder prepared by `prepare_corpus`
    out: str
    hidden_size: int = 384
    layers: int = 6
    heads: int = 6
    kv_heads: int = 6
    intermediate_size: int = 1024
    context: int = 512
    tie_embeddings: bool = True
    steps: int = 1300
    batch_size: int = 16
    seq_len: int = 512
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 50
    log_every: int = 10
    mixed_precision: str = "auto"  # bf16 autocast where the device computes bf16 natively
    compile: bool = True  # torch.compile the training step: about 2x the tokens/s on 2 CPU cores
    resume: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "context", "steps")
        positive += ("batch_size", "seq_len", "eval_every", "eval_batches", "checkpoint_every", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must lie in [0, lr={self.lr}], got {self.min_lr}")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(
                f"unknown mixed precision {self.mixed_precision!r}: choose one of {', '.join(MIXED_PRECISIONS)}"
            )
        if self.seq_len > self.context:
            raise ValueError(f"seq_len {self.seq_len} exceeds the model's context of {self.context}")
        if self.hidden_size % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"heads ({self.heads}) must divide hidden_size ({self.hidden_size}) and kv_heads ({self.kv_heads}) "
                "must divide heads"
            )


def llama_config(cfg: PretrainConfig, vocab_size: int, eos: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.context,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def windows(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> torch.LongTensor:
    """The batch at `step`: random windows of the token stream, drawn from (seed, step) alone."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len] for s in starts]).astype(np.int64))


def heldout_batches(tokens: np.ndarray, cfg: PretrainConfig) -> list[torch.LongTensor]:
    """Fixed, evenly spread held-out windows: the same ones at every evaluation."""
    n = cfg.eval_batches * cfg.batch_size
    starts = np.linspace(0, len(tokens) - cfg.seq_len - 1, n).astype(np.int64)
    rows = torch.from_numpy(np.stack([tokens[s : s + cfg.seq_len] for s in starts]).astype(np.int64))
    return list(rows.split(cfg.batch_size))


@torch.inference_mode()
def heldout_loss(model: LlamaForCausalLM, batches: list[torch.LongTensor], autocast=contextlib.nullcontext) -> float:
    """Mean next-token cross-entropy (nats/token) on the held-out windows."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for batch in batches:
        batch = batch.to(device)
        with autocast():
            logits = model(input_ids=batch, use_cache=False).logits
        total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"))
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / count


RESUME_MUST_MATCH = (
    *("hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "context", "tie_embeddings"),
    *("batch_size", "seq_len", "lr", "min_lr", "warmup_steps", "weight_decay", "mixed_precision", "seed"),
    "eval_batches",  # the held-out measure: another makes the loss curve jump mid-run
)
"""What a resume must keep; steps, the cadence of logs, evaluations and checkpoints, and compile may change."""


def lm_loss(model: LlamaForCausalLM, batch: torch.LongTensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a batch of token windows: the step `compile` compiles."""
    logits = model(input_ids=batch, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())


class Pretraining(training.Task):
    """The base model trained from scratch on the corpus' token stream, for `training.Loop`."""

    name, png, last = "pretrain", "pretrain.png", "pretrain.json"
    curves = plots.Curves(
        heldout={"heldout_loss": "held-out stdlib", "heldout_packages_loss": "held-out torch + transformers"}
    )

    def __init__(self, cfg: PretrainConfig, device: torch.device, autocast):
        self.config, self.device, self.autocast = cfg, device, autocast
        self.corpus = Path(cfg.corpus)
        self.tokenizer = load_tokenizer(self.corpus, PreTrainedTokenizerFast)
        remedy = f"delete {self.corpus} and `blockdecode pretrain` prepares the corpus again"
        self.tokens = load_npy(self.corpus / "train.npy", "r", remedy=remedy)
        paths = {s: self.corpus / f"{s}.npy" for s in SPLITS[1:]}
        held = {s: load_npy(path, "r", remedy=remedy) for s, path in paths.items() if path.is_file()}
        held = {s: t for s, t in held.items() if s == "heldout" or len(t) > cfg.seq_len + 1}
        for name, tokens in (("train", self.tokens), ("heldout", held["heldout"])):
            if len(tokens) <= cfg.seq_len + 1:
                raise ValueError(f"the {name} split holds {len(tokens)} tokens, too few for seq_len {cfg.seq_len}")
        self.heldout = {s: heldout_batches(t, cfg) for s, t in held.items()}
        self.eos = self.tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[0])
        self.data_digest = fingerprint(self.tokens)
        torch.manual_seed(cfg.seed)
        self.model = LlamaForCausalLM(llama_config(cfg, len(self.tokenizer), self.eos))
        self.optimizer = training.adamw(self.model, cfg.lr, cfg.weight_decay, betas=(0.9, 0.95))
        self.scheduler = training.scheduler(self.optimizer, cfg.warmup_steps, cfg.steps, floor=cfg.min_lr / cfg.lr)
        self.step_loss = torch.compile(lm_loss) if cfg.compile else lm_loss

    def loss(self, model, step: int) -> tuple[torch.Tensor, int]:
        batch = windows(self.tokens, step, self.config.batch_size, self.config.seq_len, self.config.seed)
        return self.step_loss(model, batch.to(self.device)), batch.numel()

    def evaluate(self, model: LlamaForCausalLM) -> dict:
        return {f"{split}_loss": heldout_loss(model, batches, self.autocast) for split, batches in self.heldout.items()}

    def state(self, model: LlamaForCausalLM) -> dict:
        return {"model": model.state_dict(), "vocab_size": len(self.tokenizer)}

    def load_state(self, state: dict) -> None:
        if state.get("vocab_size", len(self.tokenizer)) != len(self.tokenizer):
            raise ValueError(
                f"--resume: the checkpoint was trained on a vocabulary of {state['vocab_size']}, this corpus has "
                f"{len(self.tokenizer)}"
            )
        self.model.load_state_dict(state["model"])

    def save(self, model: LlamaForCausalLM, records: list[dict], folder: Path) -> None:
        """model/ (safetensors, tokenizer, generation config), then pretrain.json."""
        eos = self.eos
        model.generation_config = GenerationConfig(
            bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False
        )
        model.save_pretrained(folder / "model")
        self.tokenizer.save_pretrained(folder / "model")
        write_json(folder / "pretrain.json", summary(self.config, records, self.corpus))


def pretrain(cfg: PretrainConfig, show: bool = True) -> LlamaForCausalLM:
    """Train the base model as cfg says; metrics.jsonl, pretrain.png, atomic checkpoints and the
    final model (safetensors, tokenizer, generation config) go to cfg.out, and pretrain.json says
    what it reached: held-out losses per token and per byte of text, and the tokens it saw."""
    loop = training.Loop(training.LoopConfig.of(cfg, max_norm=1.0), show=show)
    task = Pretraining(cfg, loop.device, loop.precision.autocast)
    return loop.fit(task, loop.resume(cfg, RESUME_MUST_MATCH, task.data_digest))


def summary(cfg: PretrainConfig, records: list[dict], corpus: Path) -> dict:
    """What the run reached: the last held-out losses in nats per token and per byte of text (the
    latter is what a different tokenizer cannot flatter), and the tokens it trained on."""
    stats = read_json(corpus / "files.json")
    last = next((r for r in reversed(records) if "heldout_loss" in r), {})
    reached = {"steps": cfg.steps, "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len}
    for split in SPLITS[1:]:
        if f"{split}_loss" in last and isinstance(stats.get(split), dict):
            per_token, bpt = last[f"{split}_loss"], stats[split]["bytes_per_token"]
            reached[split] = {"loss": per_token, "bytes_per_token": bpt, "loss_per_byte": per_token / bpt}
    return reached
