"""Training data for the heads: text or token arrays, packed into fixed-length sequences."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import numpy as np
import torch

from blockdecode.corpus import read_text

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".js", ".ts", ".html", ".css"}
ARRAY_SUFFIXES = {".npy"}


def data_files(paths: list[str | Path]) -> list[Path]:
    """The files named, and the text or array files under each folder named, sorted."""
    files: list[Path] = []
    for item in map(Path, paths):
        if item.is_dir():
            files += sorted(p for p in item.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES | ARRAY_SUFFIXES)
        elif item.is_file():
            files.append(item)
        else:
            raise FileNotFoundError(f"training data {item} does not exist")
    if not files:
        raise ValueError(f"no training data found in {', '.join(map(str, paths))}")
    return files


def load_tokens(paths: list[str | Path], tokenizer=None, eos_token_id: int | None = None) -> torch.LongTensor:
    """One stream of token ids: .npy files are taken as token ids, anything else as text
    tokenised with `tokenizer`; documents are separated by EOS when the model has one."""
    parts: list[np.ndarray] = []
    files = data_files(paths)
    binary = [p for p in files if p.suffix not in ARRAY_SUFFIXES and b"\0" in p.read_bytes()[:8192]]
    if binary:
        warnings.warn(f"skipped {len(binary)} binary file(s) given as text data, e.g. {binary[0]}", stacklevel=2)
    for path in (p for p in files if p not in binary):
        if path.suffix in ARRAY_SUFFIXES:
            try:
                ids = np.load(path, allow_pickle=False).reshape(-1)
            except (OSError, ValueError) as err:
                raise ValueError(f"{path} is not a readable .npy array of token ids: {err}") from err
            if not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"{path} holds {ids.dtype}, not integer token ids")
        else:
            if tokenizer is None:
                raise ValueError(f"{path} is text, but the base model has no tokenizer to read it with")
            ids = np.asarray(tokenizer(read_text(path)).input_ids, dtype=np.int64)
        parts.append(ids.astype(np.int64))
        if eos_token_id is not None:
            parts.append(np.array([eos_token_id], dtype=np.int64))
    tokens = torch.from_numpy(np.concatenate(parts)) if parts else torch.empty(0, dtype=torch.long)
    if tokens.numel() == 0:
        raise ValueError("the training data holds no tokens")
    return tokens


def fingerprint(tokens: np.ndarray | torch.Tensor) -> str:
    """A short hash of a token stream's content: what a resumed run checks its data against."""
    array = tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def pack(tokens: torch.LongTensor, seq_len: int) -> torch.LongTensor:
    """Non-overlapping sequences [N, seq_len]; the ragged tail is dropped."""
    n = tokens.numel() // seq_len
    if n == 0:
        raise ValueError(f"the data holds {tokens.numel()} tokens, fewer than one sequence of {seq_len}")
    return tokens[: n * seq_len].view(n, seq_len)


def split(sequences: torch.LongTensor, holdout: float) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Deterministic split: the last `holdout` fraction of sequences (at least one) is held out,
    a contiguous tail so no held-out text sits between training sequences."""
    if not 0 < holdout < 1:
        raise ValueError(f"holdout must lie in (0, 1), got {holdout}")
    if len(sequences) < 2:
        raise ValueError(f"need at least 2 sequences to hold some out, got {len(sequences)}")
    n_held = min(len(sequences) - 1, max(1, round(len(sequences) * holdout)))
    return sequences[:-n_held], sequences[-n_held:]
