"""Training data for the heads: text or token arrays packed into fixed-length sequences, or, for an
encoder-decoder, source/target pairs."""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from blockdecode.core.hf import context_length
from blockdecode.core.io import load_npy, read_text, read_utf8

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
            ids = load_npy(path).reshape(-1)
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


def split(sequences: torch.LongTensor | Pairs, holdout: float) -> tuple:
    """Deterministic split: the last `holdout` fraction of sequences (at least one) is held out,
    a contiguous tail so no held-out text sits between training sequences."""
    if not 0 < holdout < 1:
        raise ValueError(f"holdout must lie in (0, 1), got {holdout}")
    if len(sequences) < 2:
        raise ValueError(f"need at least 2 sequences to hold some out, got {len(sequences)}")
    n_held = min(len(sequences) - 1, max(1, round(len(sequences) * holdout)))
    return sequences[:-n_held], sequences[-n_held:]


@dataclass
class Pairs:
    """An encoder-decoder's training pairs: sources and decoder sequences (its start token, then the
    target and EOS), each padded with -1. Indexed like a tensor of rows."""

    source: torch.LongTensor  # [N, S]
    decoder: torch.LongTensor  # [N, T]

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, rows) -> Pairs:
        """The rows chosen, cut to the longest of them."""
        return Pairs(_trim(self.source[rows]), _trim(self.decoder[rows]))

    def to(self, device) -> Pairs:
        return Pairs(self.source.to(device), self.decoder.to(device))

    def numel(self) -> int:
        return self.decoder.numel()

    def content(self) -> torch.LongTensor:
        """Both sides in one stream, for `fingerprint`."""
        return torch.cat([self.source.flatten(), torch.tensor([-2]), self.decoder.flatten()])


def decoder_rows(rows: torch.LongTensor | Pairs) -> torch.LongTensor:
    """The token rows a drafter learns and the base's features are read at: a causal LM's rows, or an
    encoder-decoder's decoder side."""
    return rows.decoder if isinstance(rows, Pairs) else rows


def _trim(rows: torch.LongTensor) -> torch.LongTensor:
    used = (rows >= 0).any(0).nonzero()
    return rows[:, : int(used.max()) + 1 if len(used) else 0]


def padded(rows: list[list[int]]) -> torch.LongTensor:
    """Rows of ids as one tensor, -1 after each row's end."""
    out = torch.full((len(rows), max(map(len, rows), default=0)), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        out[r, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def read_parallel(paths: list[str | Path]) -> list[tuple[str, str]]:
    """(source, target) texts from one TSV (its last two columns, as `blockdecode bible` writes
    them) or from two aligned text files, one sentence a line."""
    files = [Path(p) for p in paths]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"training data {f} does not exist (pairs come as one .tsv or two aligned files)")
    if len(files) == 1:
        pairs = []
        for n, line in enumerate(_lines(files[0]), start=1):
            fields = line.split("\t")
            if len(fields) < 2:
                raise ValueError(f"{files[0]}:{n}: expected tab-separated source and target")
            pairs.append((fields[-2], fields[-1]))
        return pairs
    if len(files) == 2:
        sources, targets = (_lines(f) for f in files)
        if len(sources) != len(targets):
            raise ValueError(f"{files[0]} has {len(sources)} lines, {files[1]} {len(targets)}: they must align")
        return list(zip(sources, targets))
    raise ValueError(f"pairs come as one .tsv or two aligned files, got {len(files)} paths")


def _lines(path: Path) -> list[str]:
    """A file's lines, split at newlines only (str.splitlines would also split at form feeds and
    Unicode separators inside a sentence)."""
    text = read_utf8(path)
    return [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")] if text else []


def load_pairs(paths: list[str | Path], tokenizer, start: int, eos: int | None, max_len: int) -> Pairs:
    """Tokenised pairs; a target gets EOS if the tokenizer did not add it; pairs longer than
    `max_len` tokens on either side are left out, with a warning."""
    if tokenizer is None:
        raise ValueError("the base model has no tokenizer to read the parallel text with")
    texts = read_parallel(paths)
    if not texts:
        raise ValueError("the training data holds no pairs")
    sources = tokenizer([s for s, _ in texts]).input_ids
    targets = tokenizer(text_target=[t for _, t in texts]).input_ids  # a target-side tokenizer, where there is one
    decoder = [[start, *t] if eos is None or (t and t[-1] == eos) else [start, *t, eos] for t in targets]
    keep = [i for i in range(len(texts)) if len(sources[i]) <= max_len and len(decoder[i]) <= max_len]
    if len(keep) < len(texts):
        warnings.warn(f"left out {len(texts) - len(keep)} pair(s) longer than {max_len} tokens", stacklevel=2)
    if not keep:
        raise ValueError(f"every pair is longer than {max_len} tokens (--seq-len)")
    return Pairs(padded([sources[i] for i in keep]), padded([decoder[i] for i in keep]))


def load_sources(paths: list[str | Path], tokenizer, max_len: int) -> list[list[list[int]]]:
    """Each file's source sentences (one a line, blank lines skipped) as token ids, for distillation,
    which needs no targets; lines longer than `max_len` tokens are left out, with a warning."""
    found = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"distillation sources {path} do not exist (a text file, one source a line)")
        lines = [line for line in _lines(path) if line.strip()]
        ids = [row for row in (tokenizer(lines).input_ids if lines else []) if len(row) <= max_len]
        if len(ids) < len(lines):
            warnings.warn(
                f"left out {len(lines) - len(ids)} source(s) of {path} longer than {max_len} tokens", stacklevel=2
            )
        if not ids:
            raise ValueError(f"{path} holds no source sentence of at most {max_len} tokens")
        found.append(ids)
    return found


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> torch.LongTensor:
    """The global batch at `step`: epochs of a seeded permutation, so any step can be found
    again on resume without replaying the ones before it."""
    per_epoch = max(1, n // batch_size)
    epoch, b = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64))
    if n < batch_size:
        perm = perm.repeat(math.ceil(batch_size / n))
    return perm[b * batch_size : (b + 1) * batch_size]


def eval_prompts(base, held_out: torch.LongTensor | Pairs, cfg) -> tuple[list, int, list[int] | None]:
    """The held-out prompts a drafter's evaluation decodes, their budget of new tokens and the EOS ids that stop
    them: the first `eval_prompt_len` tokens of held-out rows, decoded on past EOS (none stops them); an
    encoder-decoder's held-out sources, translated to EOS as real use does (None: its generation config's)."""
    limit = context_length(base)
    if isinstance(held_out, Pairs):
        prompts = [held_out[i : i + 1].source for i in range(min(cfg.eval_prompts, len(held_out)))]
        return prompts, cfg.eval_new_tokens if limit is None else min(cfg.eval_new_tokens, limit - 1), None
    prompts = [row[: cfg.eval_prompt_len].unsqueeze(0) for row in held_out[: cfg.eval_prompts]]
    budget = cfg.eval_new_tokens if limit is None else min(cfg.eval_new_tokens, limit - cfg.eval_prompt_len)
    return prompts, budget, []
