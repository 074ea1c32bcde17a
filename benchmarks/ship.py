"""Installing a trained run as one of the package's built-in models (`blockdecode.builtin`).

The Table 1 scripts (`paper_table.py --ship`, `translation_table.py --ship`) choose the run; this
writes it into the package's folder."""

from __future__ import annotations

import argparse
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoTokenizer

from blockdecode.core.io import read_json, write_json
from blockdecode.loading import EAGLE3_FOLDER, HEADS_CONFIG
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


def install_eagle3(run: str | Path, directory: str | Path) -> None:
    """Make a trained EAGLE-3 run's drafter a built-in model's (`directory`/eagle3): in bf16, naming no verifier
    path (an export names the base it writes), with the run's record (eagle3/training.json); the folder's other
    files stay as they are."""
    lm = BlockwiseLM.from_pretrained(run, dtype=torch.float32)
    drafter = lm.eagle3
    drafter.config = replace(drafter.config, verifier={"architectures": list(lm.base.config.architectures or [])})
    folder = Path(directory) / EAGLE3_FOLDER
    drafter.save(folder, dtype=torch.bfloat16)
    write_json(folder / "training.json", read_json(Path(run) / HEADS_CONFIG)["training"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="install a trained run's EAGLE-3 drafter as a built-in model's")
    parser.add_argument("--eagle3", required=True, help="the training run (blockdecode train --head-type eagle3)")
    parser.add_argument("directory", help="the built-in model's folder, e.g. blockdecode/builtin/default_model")
    args = parser.parse_args()
    install_eagle3(args.eagle3, args.directory)
    print(f"installed {args.eagle3}'s EAGLE-3 drafter in {Path(args.directory) / EAGLE3_FOLDER}")
