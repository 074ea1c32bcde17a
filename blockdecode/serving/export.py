"""Trained heads in a serving engine's own format, so that an engine can run the chain of heads
at scale: vLLM's Medusa speculator (`config.json` and `model.safetensors`), its layout taken from
vLLM's loader (`transformers_utils/configs/medusa.py`, `model_executor/models/medusa.py`).

Per head vLLM computes x + SiLU(W x + b) on the target's final hidden state, then the target's
output layer; with a `token_map` only those ids get logits. That is what `MedusaHeads` and the
draft vocabulary compute, so an export is a renaming of weights, checked by a reader written from
the format alone (tests/test_export.py)."""

from __future__ import annotations

import copy
import json
import os
import warnings
from dataclasses import asdict, replace
from pathlib import Path

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors.torch import save_file

from blockdecode.core.hf import is_seq2seq, weights_signature
from blockdecode.core.io import CheckpointError, check_writable, read_json, saving_folder, write_text
from blockdecode.drafters.heads import HeadsConfig
from blockdecode.loading import GGUF_MAGIC, HEADS_CONFIG, TOKENIZER_FILES, has_heads, load_tokenizer
from blockdecode.model import BlockwiseLM

EXPORT_FORMATS = ("vllm-medusa", "speculators", "eagle3", "dflash")
DRAFTER_FORMATS = {  # the formats of a drafter of its own: vLLM's speculators format, and each one's original layout
    "eagle3": ("speculators", "eagle3"),
    "dflash": ("speculators", "dflash"),
}
EAGLE3_FORMATS = DRAFTER_FORMATS["eagle3"]
DRAFTER_NAMES = {"eagle3": "an EAGLE-3", "dflash": "a DFlash"}
ENGINE_CONFIG = "config.json"  # written last: the file that marks an export whole
ENGINE_WEIGHTS = "model.safetensors"
BASE_FOLDER = "base"  # the base, written here when it has no folder of its own


def check_heads(heads: HeadsConfig, format: str, held: dict[str, bool] | None = None) -> None:
    """Refuse, in one line, heads the format cannot hold: from their config alone, so that a saved
    model's are refused before any weight loads. A model that holds a drafter of its own (`held`) is pointed
    at the formats that export it, since that, not its untrained heads, is what it was trained for."""
    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    if format != "vllm-medusa":
        return
    drafters = [kind for kind in DRAFTER_FORMATS if (held or {}).get(kind)]
    if heads.head_type != "medusa" and drafters:
        raise ValueError(
            f"this model holds {held_drafters(drafters)}, and {heads.head_type} heads, which {format} (medusa heads) "
            f"cannot hold: export {'the' if len(drafters) == 1 else 'a'} drafter with {drafter_formats(drafters)}"
        )
    if heads.head_type != "medusa":
        raise ValueError(
            f"{heads.head_type} heads have no serving-engine format: {format} holds medusa heads (x + SiLU(Wx) "
            f"per head); train with --head-type medusa to serve them"
        )
    if heads.k < 2:
        raise ValueError("k=1: these heads propose nothing, so there is nothing to export")


def held_drafters(kinds: list[str]) -> str:
    """ "an EAGLE-3 drafter", or "an EAGLE-3 and a DFlash drafter"."""
    return " and ".join(DRAFTER_NAMES[kind] for kind in kinds) + " drafter"


def drafter_formats(kinds: list[str]) -> str:
    """The --format choices that export the drafters `kinds`, as a command line says them."""
    if len(kinds) > 1:
        return "--format speculators (--drafter eagle3 or dflash), eagle3 or dflash"
    return "--format " + " or ".join(reversed(DRAFTER_FORMATS[kinds[0]]))


def exported_drafter(format: str, held: dict[str, bool], asked: str | None = None) -> str | None:
    """Which drafter of its own `format` writes ("eagle3", "dflash"; None: the heads), of those the model holds
    (`held`) and the one `asked` for; refused in one line where the model holds none (naming the formats of the
    drafter it holds instead), or two and none was asked."""
    kinds = [kind for kind, formats in DRAFTER_FORMATS.items() if format in formats]
    if asked is not None:
        if asked not in kinds:
            raise ValueError(
                f"{format} does not hold a {asked} drafter: choose --format {' or '.join(DRAFTER_FORMATS[asked])}"
            )
        kinds = [asked]
    if not kinds:
        return None
    found = [kind for kind in kinds if held.get(kind)]
    if not found:
        wanted = " or ".join(DRAFTER_NAMES[k] for k in kinds)
        others = [kind for kind in DRAFTER_FORMATS if held.get(kind)]
        instead = (f"it holds {held_drafters(others)}, which {drafter_formats(others)} exports" if others
                   else f"train one with --head-type {' or '.join(kinds)}")  # fmt: skip
        raise ValueError(f"{format} holds {wanted} drafter, and this model has none: {instead}")
    if len(found) > 1:
        raise ValueError(f"this model holds both an EAGLE-3 and a DFlash drafter: say which {format} writes "
                         "(--drafter eagle3 or dflash)")  # fmt: skip
    return found[0]


def check_exportable(model: BlockwiseLM, format: str, drafter: str | None = None) -> str | None:
    """Refuse, in one line, what the format cannot hold, before anything is written; the drafter it writes."""
    held = {"eagle3": model.eagle3 is not None, "dflash": model.dflash is not None}
    check_heads(model.config, format, held)
    kind = exported_drafter(format, held, drafter)
    if kind == "dflash" and format == "dflash":
        model.dflash.config.zlab()  # refused here if it has its own output layer
    if is_seq2seq(model.base):
        raise ValueError(f"{format} serves decoder-only models, and this base is an encoder-decoder")
    if getattr(model.base.get_output_embeddings(), "bias", None) is not None:
        raise ValueError(f"the base's output layer has a bias, which {format}'s loader does not read")
    return kind


def saved_heads(folder: str | Path) -> tuple[HeadsConfig, dict]:
    """The config of the heads saved in `folder` and their whole record (blockdecode.json), read
    before any weight loads; a folder that is not there, or holds no heads, is refused in one line."""
    folder = Path(folder)
    if folder.is_file() and is_gguf(folder):
        raise CheckpointError(
            f"{folder} is a GGUF file: it holds a base, and no drafter to export. Train one on it (`blockdecode "
            f"train --base {folder} --data DATA --out RUN`), then export RUN"
        )
    if folder.is_file():
        raise CheckpointError(f"{folder} is a file: --model takes the folder `blockdecode train` saved")
    if not folder.is_dir():
        raise CheckpointError(f"no such folder: {folder}")
    drafter = drafter_kind(folder)  # a drafter's own folder, or its export (whose record names where it came from)
    if drafter and not (has_heads(folder) and "heads" in read_json(folder / HEADS_CONFIG, CheckpointError)):
        raise CheckpointError(f"{folder} is {drafter} drafter's folder, not a model's: --model takes the folder "
                              "that holds it, as `blockdecode train` saved it")  # fmt: skip
    if not has_heads(folder):
        raise CheckpointError(f"{folder} holds no trained heads ({HEADS_CONFIG}): train them with `blockdecode train`")
    path = folder / HEADS_CONFIG
    record = read_json(path, CheckpointError)
    try:
        return HeadsConfig(**record["heads"]), record
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path} is corrupt: {err}") from err


def is_gguf(path: Path) -> bool:
    """Whether the file `path` is a GGUF file (llama.cpp's), by its name or its first bytes."""
    with open(path, "rb") as f:
        return path.suffix.lower() == ".gguf" or f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def drafter_kind(folder: Path) -> str | None:
    """ "an EAGLE-3" or "a DFlash" where `folder` holds such a drafter by itself (its config.json in any layout)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    named = " ".join([str(config.get("speculators_model_type", "")), *map(str, config.get("architectures") or [])])
    return "an EAGLE-3" if "eagle3" in named.lower() else "a DFlash" if "dflash" in named.lower() else None


def check_destination(out: Path) -> None:
    """Refuse, before any work, a folder an export cannot be written to: one that cannot be made or
    written, or that holds files other than an earlier export's (the source model, say)."""
    check_writable(out)
    if out.is_dir() and not is_export(out) and any(out.iterdir()):
        raise ValueError(f"{out} holds other files: export into an empty folder or over an earlier export")


def vllm_medusa(model: BlockwiseLM, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """The weights and config.json of vLLM's Medusa speculator for `model`'s medusa heads: one
    residual layer per head with its bias, the base's output layer once (`original_lm_head`), and
    the draft vocabulary as `token_map` with `truncated_vocab_size`."""
    cfg, projection = model.config, model.base.get_output_embeddings().weight
    tensors = {"lm_heads.0.weight": projection}
    for i, block in enumerate(model.heads.blocks):
        tensors[f"blocks.{i}.layers.0.weight"] = block.weight
        tensors[f"blocks.{i}.layers.0.bias"] = block.bias
    tensors = {name: t.detach().to(dtype).contiguous().cpu() for name, t in tensors.items()}
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": cfg.hidden_size,
        "vocab_size": projection.shape[0],
        "medusa_num_heads": cfg.k - 1,
        "medusa_num_layers": 1,
        "medusa_fc_bias": True,
        "original_lm_head": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if model.token_map is not None:
        tensors["token_map"] = model.token_map.detach().to(torch.int64).contiguous().cpu()
        config["truncated_vocab_size"] = len(model.token_map)
    return tensors, config


def export_heads(
    model: BlockwiseLM,
    out: str | Path,
    format: str = "vllm-medusa",
    dtype: torch.dtype | None = None,
    tokenizer: object | None = None,
    provenance: dict | None = None,
    drafter: str | None = None,
) -> Path:
    """Write `model`'s heads to `out` in `format` (default dtype: the heads' own), whole or not at
    all, replacing an earlier export as a whole, with blockdecode.json saying what they are and
    where they came from (`provenance`: e.g. the source's training record). A base saved in one
    folder with its heads is also written, unchanged and with `tokenizer`, to out/base: engines load
    the base from a folder of its own. Returns the folder the engine should load as its target model."""
    kind = check_exportable(model, format, drafter)
    out = Path(out)
    check_destination(out)
    location = model.base_location
    base_apart = location is not None and Path(location).is_dir() and not has_heads(location)
    if kind is not None:
        module = model.eagle3 if kind == "eagle3" else model.dflash
        dtype = dtype or module.fc.weight.dtype
        module = copy.copy(module)  # the export names its base as the verifier, the model keeps its own
        verifier = {
            "name_or_path": verifier_name(location, out, base_apart),
            "architectures": list(model.base.config.architectures or [type(model.base).__name__]),
        }
        module.config = replace(module.config, verifier=verifier)
        tensors, config = module.files(format, dtype)
        if kind == "dflash":
            name_mask(config, format, engine_tokenizer(location if base_apart else None, tokenizer))
        if kind == "dflash" and format == "speculators" and module.config.shared_head:  # its output layer written
            tensors["lm_head.weight"] = model.base.get_output_embeddings().weight.detach().to(dtype).contiguous().cpu()
        described = {kind: asdict(module.config)}
    else:
        dtype = dtype or next(model.heads.parameters()).dtype
        tensors, config = vllm_medusa(model, dtype)
        described = {"heads": model.config.to_dict()}
    record = {
        "export": {"format": format, "base_model": location if base_apart else BASE_FOLDER},
        **described,
        "base_signature": weights_signature(model.base),
        **(provenance or {}),
    }
    with saving_folder(out, ENGINE_CONFIG, whole=True) as staging:  # no earlier base/ beside another base
        if not base_apart:
            model.base.save_pretrained(staging / BASE_FOLDER)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging / BASE_FOLDER)
        save_file(tensors, str(staging / ENGINE_WEIGHTS), metadata={"format": "pt"})
        write_text(staging / HEADS_CONFIG, json.dumps(record, indent=2) + "\n")
        write_text(staging / ENGINE_CONFIG, json.dumps(config, indent=2) + "\n")
    return Path(location) if base_apart else out / BASE_FOLDER


def verifier_name(location: str | None, out: Path, base_apart: bool) -> str:
    """How an export names its base (the speculators format's verifier): its hub name where it came from the hub,
    else its folder relative to the export (`base`, written beside it, or where it lies), so that the name holds
    wherever the two folders are copied together; never this machine's absolute path."""
    hub = hub_name(location) if location else None
    if hub is not None:
        return hub
    return os.path.relpath(Path(location).resolve(), out.resolve()) if base_apart else BASE_FOLDER


def hub_name(location: str) -> str | None:
    """The hub name of a base given as one, or read from huggingface_hub's cache
    (.../models--org--name/snapshots/<commit>); None for any other folder or file."""
    path = Path(location)
    if path.exists():
        parts = path.resolve().parts
        is_snapshot = len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--")
        return parts[-3].removeprefix("models--").replace("--", "/") if is_snapshot else None
    try:
        validate_repo_id(location)
    except HFValidationError:
        return None
    return location


def engine_tokenizer(base_folder: str | None, tokenizer: object | None) -> object | None:
    """The tokenizer an engine reads beside the base it serves: that of the base's own folder, where it has one,
    else the one written beside the export's copy of the base."""
    if base_folder is not None and any((Path(base_folder) / name).is_file() for name in TOKENIZER_FILES):
        return load_tokenizer(base_folder)
    return tokenizer


def name_mask(config: dict, format: str, tokenizer: object | None) -> None:
    """Name the DFlash mask by its token string as well as its id (`mask_token`: in dflash_config for z-lab's
    layout, beside mask_token_id for the speculators format): SGLang looks the string up in the base's tokenizer,
    and one it lacks (its default "<|MASK|>") it adds as a new token, at an id past the base's vocabulary. Where no
    string resolves to the id, the id alone names it, with a warning."""
    fields = config["dflash_config"] if format == "dflash" else config
    mask_id = fields["mask_token_id"]
    token = mask_string(tokenizer, mask_id) if tokenizer is not None else None
    if token is not None:
        fields["mask_token"] = token
    elif tokenizer is not None:
        warnings.warn(
            f"the base's tokenizer has no token for the DFlash mask id {mask_id}: the export names it by id alone "
            "(SGLang versions that look the mask up by its string cannot serve it)",
            stacklevel=3,
        )


def mask_string(tokenizer, mask_id: int) -> str | None:
    """The token string `tokenizer` resolves back to `mask_id` (as SGLang does, through its vocabulary); None where
    the id has none (an id past the tokenizer's, in a vocabulary padded for the hardware)."""
    try:
        token = tokenizer.convert_ids_to_tokens(mask_id)
    except (IndexError, KeyError, OverflowError):
        return None
    return token if isinstance(token, str) and tokenizer.get_vocab().get(token) == mask_id else None


def is_export(folder: str | Path) -> bool:
    """Whether `folder` holds an earlier export (which an export may replace)."""
    try:
        return "export" in json.loads((Path(folder) / HEADS_CONFIG).read_text())
    except (OSError, ValueError, TypeError):
        return False


def serve_command(base: str | Path, out: str | Path, k: int, drafter: str | None = None) -> str:
    """The command lines that serve `base` with the export proposing k-1 tokens a step: vLLM's for every format,
    SGLang's for a drafter of its own (`drafter`: "eagle3", "dflash"; None: medusa heads), and llama.cpp's for
    an EAGLE-3 drafter."""
    method = drafter or "medusa"
    spec = json.dumps({"method": method, "model": str(out), "num_speculative_tokens": k - 1})
    lines = [f"vllm serve {base} --speculative-config '{spec}'"]
    if drafter == "dflash":
        lines.append(f"python -m sglang.launch_server --model-path {base} --speculative-algorithm DFLASH "
                     f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {k}")  # fmt: skip
    if drafter == "eagle3":
        lines += [
            f"python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {out} --speculative-num-steps {k - 1} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {k}",
            f"python convert_hf_to_gguf.py {out} --target-model-dir {base} --outfile draft.gguf && "
            f"llama-server -m base.gguf -md draft.gguf --spec-type draft-eagle3 --spec-draft-n-max {k - 1}",
        ]
    return "\n".join(lines)
