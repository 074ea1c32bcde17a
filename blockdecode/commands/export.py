"""`blockdecode export`: trained heads, an EAGLE-3 or a DFlash drafter in a serving engine's format."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from blockdecode.builtin import DEFAULT_MODEL
from blockdecode.core.hf import DTYPES
from blockdecode.loading import load_tokenizer
from blockdecode.serving.export import DRAFTER_FORMATS, EXPORT_FORMATS


def run(args: argparse.Namespace) -> None:
    from blockdecode.loading import DFLASH_FOLDER, EAGLE3_FOLDER
    from blockdecode.model import BlockwiseLM
    from blockdecode.serving.export import (
        check_destination,
        check_heads,
        export_heads,
        exported_drafter,
        saved_heads,
        serve_command,
    )

    heads, record = saved_heads(args.model)  # what the model holds, and whether it can go, before any weight loads
    held = {
        "eagle3": (Path(args.model) / EAGLE3_FOLDER).is_dir(),
        "dflash": (Path(args.model) / DFLASH_FOLDER).is_dir(),
    }
    check_heads(heads, args.format, held)
    kind = exported_drafter(args.format, held, args.drafter)
    check_destination(Path(args.out))
    dtype = saved_dtype(args.model) if args.dtype == "saved" else DTYPES[args.dtype]
    model = BlockwiseLM.from_pretrained(args.model, dtype=dtype).to(dtype).eval()
    has_tokenizer = (Path(args.model) / "tokenizer_config.json").is_file()  # written beside a base saved with it
    tokenizer = load_tokenizer(args.model) if has_tokenizer else None
    training = record.get("training")
    provenance = {"exported_from": str(Path(args.model).resolve()), **({"training": training} if training else {})}
    base = export_heads(model, args.out, args.format, tokenizer=tokenizer, provenance=provenance, drafter=kind)
    if kind == "eagle3":
        k = model.eagle3.config.speculative_tokens + 1
        print(f"exported an EAGLE-3 drafter ({args.format}) to {args.out}; serve it with one of:")
    elif kind == "dflash":
        k = model.dflash.config.block_size
        print(f"exported a DFlash drafter ({args.format}, blocks of {k}) to {args.out}; serve it with one of:")
    else:
        k = model.k
        print(f"exported {model.k - 1} medusa heads to {args.out}; serve them with:")
    print(serve_command(base, args.out, k, kind))


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write trained heads or an EAGLE-3 drafter in a serving engine's format",
        description="vllm-medusa writes medusa heads as vLLM loads a Medusa speculator (config.json, "
        "model.safetensors with the base's output layer once and the draft vocabulary as token_map). speculators "
        "writes the model's EAGLE-3 or DFlash drafter in vLLM's speculators format, eagle3 in the original "
        "LlamaForCausalLMEagle3 layout that SGLang and llama.cpp's converter read, dflash in z-lab's DFlashDraftModel "
        "layout (vLLM and SGLang read it; the drafter must share the base's output layer). Each is written whole or "
        "not at all, and the commands that serve it are printed. A base saved together with its heads is written to "
        "OUT/base as well.",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a saved BlockwiseLM with medusa heads, or an EAGLE-3 or DFlash drafter (default: the built-in model)",
    )
    p.add_argument("--format", choices=EXPORT_FORMATS, default="vllm-medusa")
    p.add_argument(
        "--drafter",
        choices=tuple(DRAFTER_FORMATS),
        default=None,
        help="the drafter speculators writes, where the model holds both (default: the one it holds)",
    )
    p.add_argument("--out", required=True, help="an empty folder, or an earlier export to replace")
    p.add_argument("--dtype", choices=("saved", *DTYPES), default="saved", help="saved: as the heads were saved")
    p.set_defaults(func=run)


def saved_dtype(model_dir: str) -> torch.dtype:
    """The dtype the heads were saved in (their safetensors), so an export changes no weight."""
    from safetensors import safe_open

    from blockdecode.loading import HEADS_WEIGHTS

    with safe_open(str(Path(model_dir) / HEADS_WEIGHTS), "pt") as f:
        names = [n for n in f.keys() if f.get_slice(n).get_dtype() != "I64"]
        return f.get_tensor(names[0]).dtype if names else torch.float32
