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
from blockdecode.loading import DFLASH_FOLDER, EAGLE3_FOLDER, HEADS_CONFIG
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


def install_drafter(run: str | Path, directory: str | Path, kind: str = "eagle3") -> Path:
    """Make a trained EAGLE-3 or DFlash run's drafter a built-in model's (`directory`/eagle3 or /dflash): in bf16,
    naming no verifier path (an export names the base it writes), with the run's record (training.json); the
    folder's other files stay as they are."""
    lm = BlockwiseLM.from_pretrained(run, dtype=torch.float32)
    drafter = lm.eagle3 if kind == "eagle3" else lm.dflash
    drafter.config = replace(drafter.config, verifier={"architectures": list(lm.base.config.architectures or [])})
    folder = Path(directory) / (EAGLE3_FOLDER if kind == "eagle3" else DFLASH_FOLDER)
    drafter.save(folder, dtype=torch.bfloat16)
    write_json(folder / "training.json", read_json(Path(run) / HEADS_CONFIG)["training"])
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="install a trained run's drafter as a built-in model's")
    parser.add_argument("--eagle3", help="an EAGLE-3 training run (blockdecode train --head-type eagle3)")
    parser.add_argument("--dflash", help="a DFlash training run (blockdecode train --head-type dflash)")
    parser.add_argument("directory", help="the built-in model's folder, e.g. blockdecode/builtin/default_model")
    args = parser.parse_args()
    if bool(args.eagle3) == bool(args.dflash):
        parser.error("give one of --eagle3 RUN and --dflash RUN")
    kind, run = ("eagle3", args.eagle3) if args.eagle3 else ("dflash", args.dflash)
    print(f"installed {run}'s drafter in {install_drafter(run, args.directory, kind)}")
