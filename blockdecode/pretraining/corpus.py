"""The corpus every machine with Python already has: its standard library's source, and the
Python source of the large packages this project installs anyway (torch, transformers).

Also the byte-level BPE tokenizer trained on it, so nothing has to be downloaded."""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>",)
CORPUS_PACKAGES = ("torch", "transformers")
"""Installed packages whose source joins the standard library's in the built-in model's corpus."""
EVAL_PACKAGES = ("accelerate", "tqdm", "sacrebleu", "packaging")
"""Third-party code the built-in model must never see: the unseen prompt set of Table 1. A file under
a folder of one of these names (torch vendors `packaging`) is kept out of the corpus too."""


@dataclass(frozen=True)
class SourceFile:
    """One file of the corpus: where it lies, and the name its split is drawn from."""

    path: Path
    name: str  # relative to the stdlib root, or "<package>/..." for an installed package
    source: str  # "stdlib" or the package's name


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Every .py file of the running Python's standard library (site-packages excluded), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def package_root(package: str) -> Path:
    """The folder an installed package's source lies in."""
    if package in EVAL_PACKAGES:
        raise ValueError(f"{package} is a third-party evaluation package: it must stay out of the corpus")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed (or is not a package)")
    return Path(next(iter(spec.submodule_search_locations)))


def corpus_files(root: str | Path | None = None, packages: Iterable[str] = ()) -> list[SourceFile]:
    """The standard library's files (named as before, so its split is unchanged), then each package's,
    named from the folder the package is installed in; nothing under an evaluation package's name."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [SourceFile(p, str(p.relative_to(root)), "stdlib") for p in stdlib_files(root)]
    for package in packages:
        top = package_root(package)
        for p in sorted(top.rglob("*.py")):
            name = str(p.relative_to(top.parent))
            if p.is_file() and not set(Path(name).parts) & set(EVAL_PACKAGES):
                files.append(SourceFile(p, name, package))
    return files


def is_heldout(name: str, fraction: float = 0.05) -> bool:
    """Deterministic file-level split: a file is held out by the hash of its relative name, so the
    split is the same on every machine and does not shift when files are added."""
    digest = hashlib.sha256(name.encode()).digest()
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
