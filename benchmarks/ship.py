"""Installing a trained run as one of the package's built-in models (`blockdecode.builtin`).

The Table 1 scripts (`paper_table.py --ship`, `translation_table.py --ship`) choose the run; this
writes it into the package's folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer

from blockdecode.io import write_json
from blockdecode.model import BlockwiseLM


def install(run: str | Path, directory: str | Path, training: dict, prompts: list[str]) -> None:
    """Make a trained run a built-in model: base and heads in bf16 (half the bytes of the package),
    its tokenizer, how it was trained and what it measured (kept in blockdecode.json), and held-out
    prompts as text (prompts.json, which `bench` and `drafter="auto"` calibration use). What was
    there is moved aside only once the new copy is whole."""
    directory = Path(directory)
    model = BlockwiseLM.from_pretrained(run, dtype=torch.bfloat16).to(torch.bfloat16)
    staging = directory.with_name(directory.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, save_base=True, training=training, tokenizer=AutoTokenizer.from_pretrained(run))
    write_json(staging / "prompts.json", prompts)
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    staging.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
