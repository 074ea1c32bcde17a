"""What blockdecode needs to know about a `transformers` model: its dtype names, EOS ids, context
length, the name its forward takes the cache under, a cache that rolls back, and how to load one.

Nothing here knows about blockwise decoding; everything above goes through these helpers."""

from __future__ import annotations

import hashlib
import inspect
import operator
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
from transformers import (
    DynamicCache,
    EncoderDecoderCache,
    PreTrainedModel,
    StaticCache,
)

from blockdecode.core.hardware import auto_dtype

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)  # "auto": bf16 where the device computes it natively, else fp32
LOADABLE = (*DTYPES.values(), torch.float16)  # fp16 too from Python, for a GPU that lacks bf16
CACHE_IMPLEMENTATIONS = ("dynamic", "static")


def dtype_name(dtype: torch.dtype) -> str:
    """'fp32' / 'bf16' for the dtypes blockdecode names, torch's own name for any other."""
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def check_dtype(dtype: object) -> torch.dtype:
    """`dtype` if blockdecode loads models in it; else one error naming it before any file is read (transformers
    would blame the model's config.json)."""
    if dtype not in LOADABLE:
        error = ValueError if isinstance(dtype, torch.dtype) else TypeError
        accepted = ", ".join(map(str, LOADABLE))
        raise error(f"dtype must be {accepted}, got {dtype!r} (from a name: blockdecode.core.hf.dtype_for('bf16'))")
    return dtype


def dtype_for(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype a --dtype name stands for on `device` ("auto": `blockdecode.core.hardware.auto_dtype`)."""
    if name == "auto":
        return auto_dtype(device)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def is_seq2seq(model: PreTrainedModel) -> bool:
    """Whether the model is an encoder-decoder (Marian, T5, BART, ...): its input is a source to encode."""
    return bool(getattr(model.config, "is_encoder_decoder", False))


def decoder_depth(model: PreTrainedModel) -> int | None:
    """How many decoder layers the model has: an encoder-decoder's decoder_layers (its num_hidden_layers, and
    its decoder view's, name the encoder's), a causal LM's num_hidden_layers; None where its config names none."""
    if is_seq2seq(model) and getattr(model.config, "decoder_layers", None) is not None:
        return model.config.decoder_layers
    return getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)


def weights_signature(model: torch.nn.Module) -> list[float]:
    """The L1 norms of four of the model's weight tensors (first, two middle, last): enough to tell
    two sets of weights apart, and stable across fp32 / bf16 copies of the same ones (about 1e-3)."""
    params = [p for p in model.parameters() if p.dim() >= 2]
    picks = sorted({0, len(params) // 3, 2 * len(params) // 3, len(params) - 1}) if params else []
    with torch.no_grad():
        return [float(params[i].detach().float().abs().sum()) for i in picks]


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's name, shape, dtype and bytes: exact, and the same on any thread
    count, which a float sum of the weights is not (its reduction order follows the threads)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
            digest.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weights_key(tensors: Iterable[torch.Tensor]) -> tuple:
    """What tells whether tensors changed since, without reading them: each one's address, dtype and
    shape, and its version counter, which every in-place change (an optimizer's step) advances.
    Inference tensors (made, loaded or cast under torch.inference_mode) have no counter: one changed in
    place, which only that mode allows, keeps its key, so what is cached on it must cost speed when
    stale, never exactness."""
    return tuple((t.data_ptr(), t.dtype, t.shape, None if t.is_inference() else t._version) for t in tensors)


def same_weights(a: list[float], b: list[float], rtol: float = 2e-2) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(x), abs(y), 1e-6) for x, y in zip(a, b))


def output_projection(model: PreTrainedModel) -> torch.nn.Module:
    """The model's output projection (lm_head), which scores the vocabulary; a clear error for a model
    without one (not a causal LM, or its lm_head deleted or set to None)."""
    get = getattr(model, "get_output_embeddings", None)
    projection = get() if callable(get) else None
    if not isinstance(getattr(projection, "weight", None), torch.Tensor):
        raise ValueError(f"{type(model).__name__} has no output projection (lm_head); is it a causal LM?")
    return projection


def check_loaded(module: torch.nn.Module, what: str) -> None:
    """A clear error if `module`'s weights hold no values: on the meta device (`.to("meta")`, or a
    model built but never loaded), where any computation fails deep inside torch."""
    meta = next((name for name, p in module.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(f"{meta} of {what} is on the meta device, which holds no values: load the model again")


def check_model(model: object) -> None:
    """One clear error, before the model is called, unless it can be decoded: a torch module with an
    output projection, its weights in memory."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the model must be a transformers model, got {type(model).__name__}")
    output_projection(model)
    check_loaded(model, type(model).__name__)


def vocab_size(model: PreTrainedModel) -> int:
    """Rows of the output projection: the ids the model can score."""
    return output_projection(model).weight.shape[0]


def context_length(model: PreTrainedModel) -> int | None:
    """The longest sequence the base model can attend over, if its config names one."""
    cfg = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def as_integer(value: object) -> int | None:
    """The int an integral value stands for (Python and numpy integers, a 0-d integer tensor), else
    None: a bool, a float or a string is not a count, whatever int() would make of it."""
    if isinstance(value, bool | str | bytes):
        return None
    if isinstance(value, torch.Tensor) and (value.dim() != 0 or value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def integer(value: object, name: str) -> int:
    """An int from anything integral (`as_integer`), else a TypeError naming the argument."""
    result = as_integer(value)
    if result is None:
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return result


def at_least(value: object, low: int, message: str) -> int:
    """An int >= low from anything integral (`as_integer`), else a ValueError: `message`, got `value`."""
    result = as_integer(value)
    if result is None or result < low:
        raise ValueError(f"{message}, got {value!r}")
    return result


def resolve_eos(model: PreTrainedModel, eos_token_id: int | Sequence[int] | None) -> set[int]:
    """EOS ids as transformers' generate resolves them: the argument, else the generation config."""
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.reshape(-1).tolist()
    if isinstance(eos_token_id, Sequence) and not isinstance(eos_token_id, str | bytes):
        return {integer(t, "eos_token_id") for t in eos_token_id}
    return {integer(eos_token_id, "eos_token_id")}


def generate_length(model: PreTrainedModel, prompt_length: int, max_new_tokens: int) -> dict[str, int | None]:
    """transformers' generate arguments for `max_new_tokens` new tokens, given as max_length (the
    decoder's start token, or the prompt, plus max_new_tokens) with max_new_tokens cleared: a
    checkpoint whose generation config sets its own max_length (Marian's do) would otherwise meet
    max_new_tokens, and transformers warns of the clash on every call."""
    start = 1 if is_seq2seq(model) else prompt_length
    return {"max_length": start + max_new_tokens, "max_new_tokens": None}


def special_ids(model: PreTrainedModel) -> set[int]:
    """The ids that carry no text: EOS, BOS, padding and an encoder-decoder's decoder start token."""
    ids = resolve_eos(model, None)
    for cfg in (model.generation_config, model.config):
        for name in ("bos_token_id", "pad_token_id", "decoder_start_token_id"):
            value = as_integer(getattr(cfg, name, None))
            if value is not None:
                ids.add(value)
    return ids


def cache_argument(model: PreTrainedModel) -> str:
    """transformers renamed `past_key_values` to `cache` during 5.x: the name this model takes (a
    wrong name would be swallowed by **kwargs and every pass would run without its context)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def make_cache(model: PreTrainedModel, impl: str, max_len: int):
    """A transformers KV cache that can roll back: `dynamic` trims its tensors, `static`
    (preallocated, written by position) only moves its write position."""
    if impl not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"unknown cache implementation {impl!r}: choose one of {', '.join(CACHE_IMPLEMENTATIONS)}")
    if is_seq2seq(model):  # the decoder's own cache rolls back; the cross-attention one is written once
        if impl == "static":
            raise ValueError(f"{type(model).__name__} is an encoder-decoder model: use the dynamic cache")
        return EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
    if impl == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        if impl == "static":
            raise ValueError("a static cache cannot roll back sliding-window layers: use the dynamic cache")
        # A sliding layer keeps only its window and cannot roll back past it; full layers
        # can, and the model's own mask still limits attention to the window.
        cache = DynamicCache()
    if not all(getattr(layer, "is_croppable", False) and hasattr(layer, "crop") for layer in cache.layers):
        raise ValueError(
            f"{type(model).__name__} keeps state that this transformers version cannot roll back (recurrent or "
            f"linear-attention layers, or a {impl} cache without crop): blockwise decoding needs a croppable cache"
        )
    return cache


@contextmanager
def own_thread_hook(module: torch.nn.Module, hook, with_kwargs: bool = False, after: bool = False) -> Iterator[None]:
    """`hook` as a forward pre-hook of `module` (`after`: a forward hook) while the context is open, run
    only on forwards of the thread that opened it: threads sharing one model never see, or change,
    each other's calls."""
    owner = threading.get_ident()

    def own(*args):
        return hook(*args) if threading.get_ident() == owner else None

    register = module.register_forward_hook if after else module.register_forward_pre_hook
    handle = register(own, with_kwargs=with_kwargs)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def decoder_output(model: PreTrainedModel) -> Iterator[list[torch.Tensor]]:
    """Record the input of the model's output projection, the decoder output h that the heads
    read, for as long as the context is open, from this thread's forwards only.

    A hook on the projection works for every architecture (final norms, OPT's project_out,
    NeoX's embed_out, Phi's biased head, tied embeddings) without re-implementing any model's
    forward; it is removed on exit, also after an error."""
    box: list[torch.Tensor] = []

    def hook(_module: torch.nn.Module, args: tuple) -> None:
        box[:] = [args[0]]

    with own_thread_hook(output_projection(model), hook):
        yield box


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The model's list of decoder layers: the first list of as many modules as its config has layers (an
    encoder-decoder's, in its decoder: the encoder's list may be as long)."""
    n = decoder_depth(model)
    root = model.get_decoder() if is_seq2seq(model) else model
    found = [m for m in root.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    if not found:
        raise ValueError(f"{type(model).__name__}: found no list of its {n} decoder layers to read features from")
    return found[0]


@contextmanager
def layer_inputs(model: PreTrainedModel, ids: Sequence[int]) -> Iterator[list[torch.Tensor]]:
    """Record the residual stream entering each of the decoder layers `ids` (vLLM's numbering for EAGLE-3:
    id L is layer L's input, 0 the embeddings), concatenated in the order of `ids` [B, q, len(ids) * D], for
    as long as the context is open, from this thread's forwards only."""
    layers, seen, box = decoder_layers(model), {}, []

    def hook_for(i: int):
        def hook(_module, args: tuple, kwargs: dict) -> None:
            seen[i] = args[0] if args else kwargs["hidden_states"]
            if len(seen) == len(set(ids)):
                box[:] = [torch.cat([seen[j] for j in ids], dim=-1)]
                seen.clear()

        return hook

    with ExitStack() as stack:
        for i in sorted(set(ids)):
            stack.enter_context(own_thread_hook(layers[i], hook_for(i), with_kwargs=True))
        yield box


_EVALUATING = threading.Lock()
_HELD: dict[torch.nn.Module, int] = {}  # module in training mode -> blocks that hold it in eval mode


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` and its submodules in eval mode for the block, each put back as it was after: greedy's
    output is the model's without dropout (transformers' generate keeps the mode, and in training mode
    decodes at random). Threads sharing one model may overlap: a submodule returns to training mode when the last block
    that holds it ends (a thread that trains the model meanwhile would train it without dropout)."""
    with _EVALUATING:
        held = [m for m in model.modules() if m.training or m in _HELD]
        for m in held:
            _HELD[m] = _HELD.get(m, 0) + 1
            m.training = False
    try:
        yield
    finally:
        with _EVALUATING:
            for m in held:
                _HELD[m] -= 1
                if not _HELD[m]:
                    del _HELD[m]
                    m.training = True


def stay_offline() -> None:
    """A command never reaches a model hub unless HF_HUB_OFFLINE=0 says it may. The variable is
    read when huggingface_hub is imported, before this runs, so the setting goes to its module."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_OFFLINE") is None and os.environ.get("TRANSFORMERS_OFFLINE") is None:
        os.environ["HF_HUB_OFFLINE"] = "1"  # for child processes (torchrun, accelerate launch)
        constants.HF_HUB_OFFLINE = True
