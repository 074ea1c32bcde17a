"""Files that stay whole: atomic writes, JSONL logs, training checkpoints.

A reader, or a run killed mid-write, sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch


class CheckpointError(ValueError):
    """A saved model or checkpoint that cannot be loaded as it is: missing, corrupt or mismatched."""


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Call write(tmp_path), then rename over `path`: readers see the old file or the new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # on disk before the rename makes it visible
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make the result private
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_temporaries(folder: Path) -> int:
    """Delete what a killed `atomic_write` left in `folder` (`.NAME.*.tmp`); how many."""
    leftovers = list(Path(folder).glob(".*.tmp")) if Path(folder).is_dir() else []
    for path in leftovers:
        path.unlink(missing_ok=True)
    return len(leftovers)


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: Path(p).write_text(text))


def write_json(path: Path, data: object) -> None:
    write_text(path, json.dumps(data, indent=1) + "\n")


def save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object, so numpy adds no .npy to the temporary name
        np.save(f, array)


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(path: Path, state: dict) -> None:
    """A training state (tensors, optimizer, RNG) written atomically."""
    atomic_write(path, lambda p: torch.save(state, p))


def load_checkpoint(path: Path, cfg: object, must_match: Sequence[str]) -> dict:
    """A training checkpoint, refused with a clear error if damaged or saved by a run whose
    `must_match` settings differ from cfg's."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        saved = state["config"]
    except Exception as err:  # torch raises many types for a damaged file
        raise ValueError(f"--resume: the checkpoint {path} is corrupt: {err}") from err
    for name in must_match:
        if saved.get(name) != getattr(cfg, name):
            raise ValueError(
                f"--resume: the checkpoint in {Path(path).parent} has {name}={saved.get(name)!r}, this run asks "
                f"for {getattr(cfg, name)!r}"
            )
    return state
