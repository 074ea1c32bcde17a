"""One loading path: a name (a folder, or a hub name where the hub is allowed) resolved to a folder, and what the
folder holds read from it: the base, its tokenizer, the heads, the prompts it ships, the drafters beside them."""

from __future__ import annotations

import importlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError, StrictDataclassError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

from blockdecode import builtin
from blockdecode.core.hf import (
    check_dtype,
    same_weights,
    weights_signature,
)
from blockdecode.core.io import (
    CheckpointError,
    one_line,
    read_json,
    read_prompts,
    read_tensors,
    reading_folder,
)
from blockdecode.drafters.dflash.model import DFlash
from blockdecode.drafters.eagle3.model import Eagle3
from blockdecode.drafters.heads import HeadsConfig
from blockdecode.drafters.registry import drafter_names
from blockdecode.gguf_cache import GGUF_MAGIC, gguf_folder, magic

# What transformers raises for config values it refuses, or that cannot build a model from the weights given.
CONFIG_FAULTS = (StrictDataclassError, ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, RuntimeError)


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)


HUB_TIMEOUT = 5
"""Seconds the hub has to say whether it holds a model: a name it lacks, or a hub out of reach, fails soon,
where huggingface_hub's own downloads retry for about 25 s."""


HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
"""What a model is fetched with: its configs, weights and tokenizer, not other frameworks' copies of the weights."""


def model_folder(name: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """The folder a model name stands for, as every loader resolves one: a folder as it is, a GGUF file
    dequantized once into a folder in the cache (`gguf_folder`, in `dtype`), else a hub name fetched into
    huggingface_hub's cache where the hub is allowed (HF_HUB_OFFLINE=0; the CLI stays offline unless told).
    Anything else fails in one line: another file, a path that does not exist, a hub name offline, one the
    hub lacks or keeps private, or a hub that does not answer within HUB_TIMEOUT seconds."""
    path = Path(name)
    if path.is_dir():
        return path
    if path.is_file() and (path.suffix.lower() == ".gguf" or magic(path) == GGUF_MAGIC):
        return gguf_folder(path, dtype)
    if path.exists():
        raise CheckpointError(
            f"{path} is a file, not a model folder (one with config.json and the weights) nor a GGUF file"
        )
    try:
        validate_repo_id(str(name))
    except HFValidationError:  # a path, not a hub name
        raise CheckpointError(f"no such directory: {path} does not exist{_not_installed(path)}") from None
    if constants.is_offline_mode():
        raise CheckpointError(
            f"{name} is not a folder here, and blockdecode stays offline: download it yourself, or set "
            f"HF_HUB_OFFLINE=0 to let it be fetched from the hub"
        )
    hub = constants.ENDPOINT
    try:  # asked once, without retries; then fetched at the commit it named
        sha = HfApi(endpoint=hub).model_info(str(name), timeout=HUB_TIMEOUT).sha
        return Path(snapshot_download(str(name), revision=sha, allow_patterns=HUB_FILES, etag_timeout=HUB_TIMEOUT))
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{name} is not a folder here, nor a model the hub ({hub}) lets this machine read (missing, private or "
            "gated)"
        ) from None
    except HfHubHTTPError as err:
        status = f"HTTP {err.response.status_code} ({type(err).__name__})"
        raise CheckpointError(f"{name} is not a folder here, and the hub ({hub}) answered {status}") from None
    except (*transport_errors(), OSError) as err:
        raise CheckpointError(
            f"{name} is not a folder here, and the hub ({hub}) cannot be reached ({type(err).__name__}: "
            f"{one_line(err)}): check the connection, or download the model yourself"
        ) from None


def transport_errors() -> tuple[type[Exception], ...]:
    """What huggingface_hub's HTTP client raises when a hub is out of reach: httpx2's from huggingface_hub 2
    on, httpx's before (transformers takes either)."""
    for client in ("httpx2", "httpx"):
        try:
            return (importlib.import_module(client).HTTPError,)
        except ImportError:
            continue
    return ()


def _not_installed(path: Path) -> str:
    """How to build `path` if it is a built-in model's folder."""
    hints = {
        builtin.DEFAULT_MODEL: ": the built-in model is not installed; `make default-model` builds it",
        builtin.DEFAULT_TRANSLATION_MODEL: ": the built-in translation model is not installed; "
        "`bash recipes/translation.sh` builds one (then pass its folder with --model)",
    }
    return hints.get(str(path), "")


def load_base(path: str, dtype: torch.dtype = torch.float32, **kwargs) -> PreTrainedModel:
    """A causal LM, or an encoder-decoder (seq2seq) LM, from a folder (or a hub name, where the hub
    is allowed: `model_folder`). A damaged or inconsistent file (weights cut short, a config.json that
    is not JSON, holds values transformers refuses or does not fit the weights) is one CheckpointError
    naming it, not a traceback or transformers' load report."""
    check_dtype(dtype)
    given, path = path, str(model_folder(path, dtype))
    config = load_config(path)
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    try:
        with _quiet("transformers.modeling_utils"):  # its load report: `_check_weights` says what matters
            model, info = auto.from_pretrained(
                path, config=config, dtype=dtype, ignore_mismatched_sizes=True, output_loading_info=True, **kwargs
            )
    except SafetensorError as err:
        raise CheckpointError(f"{path}: the model weights are corrupt or truncated ({err})") from err
    except torch.OutOfMemoryError:
        raise
    except CONFIG_FAULTS as err:
        raise CheckpointError(
            f"{path}: no model can be built from its config.json and weights ({type(err).__name__}: {one_line(err)})"
        ) from err
    _check_weights(path, info)
    if Path(given).is_file():  # a GGUF's base is found again by its file, not the cache's folder
        model.name_or_path = model.config._name_or_path = str(Path(given).resolve())
    return model


def load_config(path: str) -> PretrainedConfig:
    """A model's config; a config.json that is not a JSON object, or holds values transformers
    refuses (a string for a width, say), is a CheckpointError naming the file."""
    file = Path(path) / "config.json"
    if not file.is_file():  # else transformers calls it invalid
        raise CheckpointError(f"{path} holds no config.json: not a model folder")
    if not isinstance(read_json(file, CheckpointError), dict):
        raise CheckpointError(f"{file} does not hold a JSON object")
    try:
        return AutoConfig.from_pretrained(path)
    except (StrictDataclassError, ValueError, TypeError, KeyError) as err:
        raise CheckpointError(f"{file} is invalid: {one_line(err)}") from err


def _check_weights(path: str, info: dict) -> None:
    """Weights that the config does not fit are refused: a tensor of another shape than the config
    gives it (a vocab_size that is not the weights'), or one the config needs and the files lack,
    would be decoded with random values. Tensors the config does not use are left out, with a warning."""
    where = f"{Path(path) / 'config.json'} does not fit the weights in {path}"
    if info["mismatched_keys"]:
        key, saved, built = min(info["mismatched_keys"], key=lambda m: m[0])
        raise CheckpointError(f"{where}: {key} is {tuple(saved)} in the weights, {tuple(built)} by the config")
    if info["missing_keys"]:
        n, key = len(info["missing_keys"]), min(info["missing_keys"])
        raise CheckpointError(f"{where}: the weights lack {n} tensor(s) the config asks for, e.g. {key}")
    if info["unexpected_keys"]:
        n, key = len(info["unexpected_keys"]), min(info["unexpected_keys"])
        warnings.warn(
            f"{path}: {n} tensor(s) of its weights are not in its config.json's model, e.g. {key}: left out",
            stacklevel=3,
        )


@contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """The logger's records below ERROR dropped for the block. A filter, not a level: transformers
    reads its logger's level to decide what else to check and print."""

    def errors_only(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    log = logging.getLogger(logger)
    log.addFilter(errors_only)
    try:
        yield
    finally:
        log.removeFilter(errors_only)


def load_tokenizer(path: str | Path, kind: type = AutoTokenizer):
    """A tokenizer of class `kind` from a folder (or a hub name: `model_folder`); a damaged file is a
    CheckpointError naming it."""
    path = model_folder(path)
    try:
        return kind.from_pretrained(path)
    except Exception as err:  # the tokenizers library raises a bare Exception for a damaged file
        raise CheckpointError(f"{_tokenizer_file(Path(path))} cannot be read: {one_line(err)}") from err


def _tokenizer_file(folder: Path) -> Path:
    """The tokenizer file to blame: the first that is not valid JSON, else tokenizer.json (the one
    the tokenizers library parses), else the folder."""
    for name in TOKENIZER_FILES:
        try:
            if (folder / name).is_file():
                read_json(folder / name)
        except ValueError:
            return folder / name
    return folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else folder


HEADS_CONFIG = "blockdecode.json"
HEADS_WEIGHTS = "heads.safetensors"
EAGLE3_FOLDER = "eagle3"  # a saved model's EAGLE-3 drafter, in the speculators format
DFLASH_FOLDER = "dflash"  # a saved model's DFlash drafter, in z-lab's layout or the speculators format


@dataclass
class Saved:
    """What a model folder holds, read in one pass: the base and where it can be read again, the heads' config
    and weights (None for a plain `transformers` model), the EAGLE-3 and DFlash drafters beside them, the
    tokenizer (None where neither the folder nor its base has one) and the prompts it ships."""

    folder: Path
    base: PreTrainedModel
    base_location: str | None
    heads: HeadsConfig | None = None
    heads_state: dict[str, torch.Tensor] | None = None
    eagle3: Eagle3 | None = None
    dflash: DFlash | None = None
    default_drafters: str | None = None  # what drafter="auto" ranks for this model, where it was measured and saved
    tokenizer: object | None = None
    prompts: list[torch.LongTensor] = field(default_factory=list)

    @property
    def heads_file(self) -> Path:
        return self.folder / HEADS_WEIGHTS

    @property
    def eagle3_folder(self) -> Path:
        return self.folder / EAGLE3_FOLDER

    @property
    def dflash_folder(self) -> Path:
        return self.folder / DFLASH_FOLDER


def read_model(name: str | os.PathLike, base: PreTrainedModel | None = None, **base_kwargs) -> Saved:
    """Everything a model name stands for (`model_folder`): a saved BlockwiseLM's base (`base`, if given, in
    its place), heads and drafters, read while no save replaces the folder (`io.reading_folder`); or a plain
    `transformers` model. `base_kwargs` go to `load_base` (dtype=...)."""
    folder = model_folder(name, base_kwargs.get("dtype"))
    if has_heads(folder):
        with reading_folder(folder, HEADS_CONFIG):
            saved = _read_saved(folder, base, **base_kwargs)
    elif (folder / HEADS_WEIGHTS).is_file():
        raise CheckpointError(f"{folder} holds no {HEADS_CONFIG} beside its {HEADS_WEIGHTS}: not a saved BlockwiseLM")
    else:
        base = load_base(str(name if Path(name).is_file() else folder), **base_kwargs) if base is None else base
        location = _location(getattr(base, "name_or_path", "")) or str(folder.resolve())
        shipped = shipped_drafters(base)
        if shipped is None:
            saved = Saved(folder, base, location)
        else:  # drafters trained for this base, shipped in the package: attached by its weights
            with reading_folder(shipped, HEADS_CONFIG):
                saved = _read_saved(shipped, base)
            saved.base_location = location
    for source in (folder, saved.base_location):  # the folder's own tokenizer, else its base's
        if source is not None and Path(source).is_dir() and _has_tokenizer(Path(source)):
            saved.tokenizer = load_tokenizer(source)
            saved.prompts = model_prompts(folder, saved.tokenizer)
            break
    return saved


def _read_saved(folder: Path, base: PreTrainedModel | None, **base_kwargs) -> Saved:
    """A saved BlockwiseLM's parts, each checked against the others and named in one line where it is damaged."""
    config_path = folder / HEADS_CONFIG
    try:
        meta = json.loads(config_path.read_text())
        cfg = HeadsConfig(**meta["heads"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{config_path} is corrupt: {err}") from err
    if "export" in meta:
        raise CheckpointError(
            f"{folder} is an export for serving engines, not a BlockwiseLM: load the folder it was exported from"
        )
    location = meta.get("base_model")
    if location is None:
        if base is None:
            raise CheckpointError(
                f"{folder} holds heads only, saved from a base model that was never on disk: pass base="
            )
    elif not isinstance(location, str) or not location:
        raise CheckpointError(f"{config_path} has an invalid base_model entry {location!r}")
    elif location == ".":
        location = str(folder.resolve())
    elif (folder / location).exists():  # a relative folder (or GGUF file) is read from the checkpoint's
        location = str((folder / location).resolve())
    given_base = base is not None
    if base is None:
        if Path(location).is_absolute() and not Path(location).exists():
            raise CheckpointError(f"{config_path} names the base model {location}, which does not exist")
        base = load_base(location, **base_kwargs)
    signature = meta.get("base_signature")
    if not given_base and signature is not None and not same_weights(signature, weights_signature(base)):
        raise CheckpointError(
            f"{location} does not hold the base these heads were saved with (its weights differ): "
            f"pass the right base with base="
        )
    saved = Saved(folder, base, location, cfg, read_tensors(folder / HEADS_WEIGHTS))
    saved.default_drafters = meta.get("default_drafters")
    if saved.default_drafters is not None:
        try:
            names = drafter_names(saved.default_drafters)
        except ValueError as err:
            raise CheckpointError(f"{config_path}: default_drafters: {err}") from err
        for name, drafter_folder in (("eagle3", saved.eagle3_folder), ("dflash", saved.dflash_folder)):
            if name in names and not drafter_folder.is_dir():  # else the first generate fails, far from this file
                raise CheckpointError(
                    f"{config_path}: default_drafters names {name}, and the model holds no {drafter_folder}: save it "
                    f"with its {name} drafter, or name drafters it holds"
                )
    if saved.eagle3_folder.is_dir():
        saved.eagle3 = Eagle3.load(saved.eagle3_folder)
    if saved.dflash_folder.is_dir():
        saved.dflash = DFlash.load(saved.dflash_folder)
    return saved


def shipped_drafters(base: PreTrainedModel) -> Path | None:
    """The folder of `builtin.SHIPPED_DRAFTERS` whose heads were trained on `base`: same width, and weights whose
    signature matches the one saved with them. None where none was."""
    folders = sorted(p for p in builtin.SHIPPED_DRAFTERS.glob("*") if (p / HEADS_CONFIG).is_file())
    width = getattr(base.config.get_text_config(decoder=True), "hidden_size", None)
    signature = None
    for folder in folders:
        meta = read_json(folder / HEADS_CONFIG, CheckpointError)
        if not isinstance(meta, dict) or meta.get("heads", {}).get("hidden_size") != width:
            continue
        signature = weights_signature(base) if signature is None else signature
        if same_weights(meta.get("base_signature") or [], signature):
            return folder
    return None


def _location(name: str) -> str | None:
    """An absolute path if `name` is a folder or file, else the hub-style name as given, else None."""
    if not name:
        return None
    return str(Path(name).resolve()) if Path(name).exists() else name


def has_heads(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a saved BlockwiseLM rather than a plain transformers model."""
    return (Path(directory) / HEADS_CONFIG).is_file()


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def model_prompts(directory: str | os.PathLike, tokenizer, n: int = 4) -> list[torch.LongTensor]:
    """The first `n` held-out prompts shipped beside a model (prompts.json), as [1, T] token ids; none
    if it has none."""
    path = Path(directory) / "prompts.json"
    texts = read_prompts(path)[:n] if path.is_file() else []
    return [tokenizer(t, return_tensors="pt").input_ids for t in texts]
