"""The corpus every machine with Python already has: its standard library's source.

Also the byte-level BPE tokenizer trained on it, so nothing has to be downloaded."""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>",)


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Every .py file of the running Python's standard library (site-packages excluded), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def read_text(path: Path) -> str:
    """A source file as text; some stdlib test files are not valid UTF-8."""
    return path.read_bytes().decode("utf-8", errors="replace")


def is_heldout(path: Path, root: Path, fraction: float = 0.05) -> bool:
    """Deterministic file-level split: a file is held out by the hash of its relative path,
    so the split is the same on every machine and does not shift when files are added."""
    digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 8192, special_tokens: tuple[str, ...] = SPECIAL_TOKENS
) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained on `texts`: every string round-trips. The first
    special token is its EOS, the last its pad token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special_tokens[0], pad_token=special_tokens[-1])
