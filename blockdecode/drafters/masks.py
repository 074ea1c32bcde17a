"""Mask drafting (Samragh et al., 2025, "Your LLM Knows the Future"): the whole network drafts.

k-1 learned mask embeddings follow a position t; the mask at offset j (j = 1..k-1) predicts the
base's greedy token at t+1+j, while the real position t predicts t+1 as ever. A LoRA on the base's
linear layers is gated by position: it adds B(A(x))·scale to the rows of mask positions alone,
computed from those rows alone, so no LoRA term ever reaches a real token: its hidden states, keys,
values and logits are the original base's (a forward without masks runs the base bit for bit; one
with masks can differ only in summation order, as any pass of more tokens does). Drafting this way
can never change what decoding verifies.

Nothing of the base is modified. In `input_ids` mask j is the id V + j - 1 (V: the decoder's input
vocabulary). While `attached` is open, hooks of this thread's forwards only (`hf.own_thread_hook`)
clamp those ids before the decoder's input embedding and put the mask embeddings in their rows, and
hooks on the adapted linear layers add the LoRA to those rows. `mask_batch` packs a row's real tokens
and a group of masks after every s-th position into one forward for training; see docs/design.md,
"Mask drafting"."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from blockdecode.core.hf import at_least, integer, is_seq2seq, own_thread_hook
from blockdecode.core.io import CheckpointError, atomic_write, read_json, reading_folder, saving_folder, write_json
from blockdecode.core.loss import IGNORE, linear_cross_entropy

MASKS_CONFIG = "masks.json"
MASKS_WEIGHTS = "masks.safetensors"
LINEARS = (nn.Linear, Conv1D)  # GPT-2's Conv1D is a linear layer with its weight stored [in, out]


@dataclass
class MasksConfig:
    """Shape of the masks and their LoRA; saved beside their weights. No dropout: the LoRA is gated
    to rows that exist only to be trained on."""

    k: int = 8  # the block: the base's own next token and k-1 masks
    rank: int = 16
    alpha: float = 32.0  # the LoRA's output is scaled by alpha / rank
    layers: list[str] | None = None  # linear layers adapted, by name inside the decoder; None: all (`stream_linears`)
    vocab_size: int = 0  # V, rows of the decoder's input embedding: mask j is id V + j - 1
    hidden_size: int = 0  # width of that embedding
    draft_vocab: int = 0  # > 0: the masks score only this many tokens (`token_map`), 0: the whole vocabulary

    def __post_init__(self) -> None:
        self.k = at_least(self.k, 2, "k must be an integer >= 2 (the base's next token and at least one mask)")
        self.rank = at_least(self.rank, 1, "rank must be an integer >= 1")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0 < self.alpha < math.inf:
            raise ValueError(f"alpha must be a positive number, got {self.alpha!r}")
        for name in ("vocab_size", "hidden_size", "draft_vocab"):
            setattr(self, name, integer(getattr(self, name), name))
        if self.vocab_size < 0 or self.hidden_size < 0:
            raise ValueError(f"vocab_size and hidden_size must be >= 0, got {self.vocab_size}, {self.hidden_size}")
        if not 0 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(f"draft_vocab must lie in [0, vocab_size={self.vocab_size}], got {self.draft_vocab}")
        if self.layers is not None and (
            not isinstance(self.layers, list | tuple) or not all(isinstance(n, str) and n for n in self.layers)
        ):
            raise ValueError(f"layers must be a list of layer names (or None for all), got {self.layers!r}")
        if self.layers is not None:
            self.layers = list(self.layers)


class LoRA(nn.Module):
    """B(A(x))·scale added to a layer's output, B zero-initialised: nothing is added until training moves it."""

    def __init__(self, d_in: int, d_out: int, rank: int, scale: float):
        super().__init__()
        self.a = nn.Parameter(torch.empty(rank, d_in))
        self.b = nn.Parameter(torch.zeros(d_out, rank))
        self.scale = scale
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))  # nn.Linear's own init, as LoRA's authors use

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out += B(A(x))·scale, in place: `out`, the rows of a layer's output that `x` produced."""
        out.add_(F.linear(F.linear(x.to(self.a.dtype), self.a), self.b), alpha=self.scale)


class MaskDrafts(nn.Module):
    """The k-1 mask embeddings and a LoRA per adapted linear layer (in `config.layers` order); with a
    draft vocabulary, its `token_map` buffer (the ids the masks score), saved with the weights."""

    def __init__(self, cfg: MasksConfig, widths: list[tuple[int, int]]):
        """`widths`: (in, out) of each layer of cfg.layers."""
        super().__init__()
        if cfg.layers is None or len(widths) != len(cfg.layers):
            raise ValueError("MaskDrafts needs the widths of every layer its config names (build_masks finds them)")
        self.config = cfg
        self.embeddings = nn.Parameter(torch.zeros(cfg.k - 1, cfg.hidden_size))
        self.lora = nn.ModuleList(LoRA(d_in, d_out, cfg.rank, cfg.alpha / cfg.rank) for d_in, d_out in widths)
        if cfg.draft_vocab:
            self.register_buffer("token_map", torch.arange(cfg.draft_vocab))

    def draft(self, states: torch.Tensor, projection: nn.Module) -> torch.LongTensor:
        """The masks' guesses from their decoder states [..., D]: the argmax of `projection`, the output
        projection's rows of the draft vocabulary (`heads.short_projection`) or the whole of it."""
        best = projection(states).argmax(-1)
        return self.token_map[best] if self.config.draft_vocab else best


def layer_widths(layer: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear layer."""
    if isinstance(layer, Conv1D):
        return tuple(layer.weight.shape)
    return layer.in_features, layer.out_features


@torch.no_grad()
def stream_linears(model: PreTrainedModel) -> list[str]:
    """The linear layers inside the decoder's layers (not the output projection) that read the
    decoder's own token rows, by name inside `model.get_decoder()`. Found by one forward of two decoder
    tokens (over three source tokens): an encoder-decoder's cross-attention keys and values read the
    encoder's rows, which are no mask positions, and are left out."""
    decoder = model.get_decoder()
    lists = [name for name, m in decoder.named_modules() if isinstance(m, nn.ModuleList)]
    candidates = {
        name: m
        for name, m in decoder.named_modules()
        if isinstance(m, LINEARS) and any(name.startswith(f"{prefix}.") for prefix in lists)
    }
    rows: dict[str, int] = {}
    with ExitStack() as stack:
        for name, layer in candidates.items():

            def seen(_module, args, _out, name=name) -> None:
                rows[name] = args[0].shape[:-1].numel()

            stack.enter_context(own_thread_hook(layer, seen, after=True))
        ids = torch.tensor([[1, 2]], device=model.device)
        if is_seq2seq(model):
            model(input_ids=torch.tensor([[1, 2, 3]], device=model.device), decoder_input_ids=ids, use_cache=False)
        else:
            model(input_ids=ids, use_cache=False)
    return [name for name in candidates if rows.get(name) == ids.numel()]


def build_masks(
    model: PreTrainedModel,
    k: int = 8,
    rank: int = 16,
    alpha: float = 32.0,
    layers: list[str] | None = None,
    draft_vocab: int = 0,
) -> MaskDrafts:
    """Untrained masks for `model` (a causal LM, or an encoder-decoder's decoder), in fp32 on its
    device: every mask starts as the mean input embedding, an average token that each mask's position
    and training then tell apart, and the LoRA adds nothing (B = 0)."""
    embed = model.get_decoder().get_input_embeddings()
    found = stream_linears(model)
    unknown = sorted(set(layers or ()) - set(found))
    if unknown:
        raise ValueError(f"no linear layer {unknown[0]!r} reads the decoder's tokens; choose among {', '.join(found)}")
    cfg = MasksConfig(
        k=k,
        rank=rank,
        alpha=alpha,
        layers=list(layers) if layers else found,
        vocab_size=embed.num_embeddings,
        hidden_size=embed.embedding_dim,
        draft_vocab=draft_vocab,
    )
    masks = MaskDrafts(cfg, adapted_widths(model, cfg)).to(embed.weight.device)
    with torch.no_grad():
        masks.embeddings.copy_(embed.weight.float().mean(0).expand_as(masks.embeddings))
    return masks


def adapted_widths(model: PreTrainedModel, cfg: MasksConfig) -> list[tuple[int, int]]:
    """(in, out) of each layer cfg.layers names, checked against the model: a clear error for a model
    the masks were not made for."""
    embed = model.get_decoder().get_input_embeddings()
    if (embed.num_embeddings, embed.embedding_dim) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"masks made for an input embedding of {cfg.vocab_size} x {cfg.hidden_size}; this model's is "
            f"{embed.num_embeddings} x {embed.embedding_dim}"
        )
    modules = dict(model.get_decoder().named_modules())
    missing = [name for name in cfg.layers if not isinstance(modules.get(name), LINEARS)]
    if missing:
        raise ValueError(f"this model's decoder has no linear layer {missing[0]!r}, which the masks adapt")
    return [layer_widths(modules[name]) for name in cfg.layers]


class _Gate(NamedTuple):
    """Where one forward's masks are: the same run of `width` positions from `first` in each of `rows`
    rows of `length` ids, and which mask each is (offsets [rows, width], 0 for mask 1)."""

    first: int
    width: int
    rows: int
    length: int
    offsets: torch.LongTensor

    def part(self, tensor: torch.Tensor) -> torch.Tensor:
        """The masks' rows of a [..., D] tensor over the forward's ids: a view, [rows, width, D]."""
        return tensor.view(self.rows, self.length, tensor.shape[-1])[:, self.first : self.first + self.width]


@contextmanager
def attached(model: PreTrainedModel, masks: MaskDrafts) -> Iterator[None]:
    """`model` with `masks` applied to this thread's forwards while the context is open: ids >= V in
    the decoder's input are masks, which must fill the same run of adjacent positions in every row
    (a training batch's groups follow its rows; a verify call's follow its candidates). The rows of real
    tokens are computed exactly as without them: the masks' embeddings and LoRA outputs are written
    into the masks' rows of the embedding's and each layer's output, in place.

    Each forward finds its masks once, from its input ids (one host sync); a forward with none runs the
    base untouched. Other threads' forwards of the same model never see the hooks."""
    decoder = model.get_decoder()
    embed = decoder.get_input_embeddings()
    widths = adapted_widths(model, masks.config)
    modules = dict(decoder.named_modules())
    for name, lora, (d_in, d_out) in zip(masks.config.layers, masks.lora, widths):
        if (lora.a.shape[1], lora.b.shape[0]) != (d_in, d_out):
            raise ValueError(
                f"the masks' LoRA of {name} is {lora.a.shape[1]} -> {lora.b.shape[0]}, the layer {d_in} -> {d_out}"
            )
    vocab, count = masks.config.vocab_size, masks.config.k - 1
    current: list[_Gate | None] = [None]  # this forward's masks

    def reset(_module, _args) -> None:  # a forward given embeddings, not ids, has no masks
        current[0] = None

    def clamp(_module, args: tuple) -> tuple | None:
        ids = args[0]
        length = ids.shape[-1]
        flags = ids.reshape(-1, length) >= vocab
        columns = flags.any(0)
        runs = columns[0].long() + (columns[1:] & ~columns[:-1]).sum()
        found = torch.stack([flags.sum(), columns.sum(), runs, columns.long().argmax(), ids.max() - vocab])
        total, width, runs, first, top = found.tolist()
        if not total:
            return None
        if runs != 1 or total != width * len(flags):
            raise ValueError("mask ids must fill the same run of adjacent positions in every row: put them last")
        if top >= count:
            raise ValueError(f"token id {vocab + top} is past the {count} mask ids {vocab}..{vocab + count - 1}")
        offsets = ids.reshape(-1, length)[:, first : first + width] - vocab
        current[0] = _Gate(first, width, len(flags), length, offsets)
        return (ids.masked_fill(ids >= vocab, 0), *args[1:])

    def place(_module, _args, out: torch.Tensor) -> None:
        gate = current[0]
        if gate is not None:
            gate.part(out).copy_(masks.embeddings[gate.offsets])

    def gated(name: str, lora: LoRA):
        def adapt(_module, args: tuple, out: torch.Tensor) -> None:
            gate = current[0]
            if gate is None:
                return
            x = args[0]
            if x.shape[:-1].numel() != gate.rows * gate.length:
                raise ValueError(f"{name} reads {tuple(x.shape)}, not the decoder's token rows: it cannot be gated")
            lora.add_to(gate.part(out), gate.part(x))

        return adapt

    with ExitStack() as stack:
        stack.enter_context(own_thread_hook(decoder, reset))
        stack.enter_context(own_thread_hook(embed, clamp))
        stack.enter_context(own_thread_hook(embed, place, after=True))
        for name, lora in zip(masks.config.layers, masks.lora):
            stack.enter_context(own_thread_hook(modules[name], gated(name, lora), after=True))
        yield


@dataclass
class MaskBatch:
    """Token rows and their mask groups, packed for one forward: the rows' T tokens first (each sees
    its row's tokens up to itself), then G groups of the k-1 mask ids, group g after position
    `anchors[g]` (mask j sees the row's tokens up to its anchor and its group's masks up to itself, at
    position anchor + j). The same as inserting each group after its anchor, given those positions and
    that mask; kept after the rows, the real tokens stay one causal prefix."""

    input_ids: torch.LongTensor  # [B, T + G(k-1)]
    position_ids: torch.LongTensor  # [1, T + G(k-1)]
    allowed: torch.Tensor  # [L, L] bool, L = T + G(k-1): allowed[i, j] says position i may attend to j
    anchors: torch.LongTensor  # [G]
    targets: torch.LongTensor  # [B, G, k-1]: the token mask j of group g predicts, IGNORE past a row's end

    @property
    def length(self) -> int:
        """T, the rows' own tokens."""
        return self.input_ids.shape[1] - self.targets.shape[1] * self.targets.shape[2]

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, L, L] additive: 0 where allowed, the dtype's minimum elsewhere (a bool mask is
        silently misread under eager attention)."""
        full = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
        full.masked_fill_(~self.allowed, torch.finfo(dtype).min)
        return full[None, None].expand(self.input_ids.shape[0], -1, -1, -1)


def anchor_targets(
    rows: torch.LongTensor, k: int, prompt_len: int, every: int = 1
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Where mask groups go in `rows` [B, T] of distilled tokens (a prompt of `prompt_len`, then the base's
    greedy continuation; -1 after an EOS), and what they learn: anchors [G], every `every`-th position
    from the prompt's last on, and targets [B, G, k-1], the token at anchor + 1 + j for mask j, IGNORE
    past a row's end or on padding. Anchors start there because decoding anchors there: from then on
    every token is the base's own, so the tokens the masks learn are what greedy says after the anchor,
    and the real position predicts the next one itself."""
    length = rows.shape[1]
    every = at_least(every, 1, "every must be an integer >= 1 (a mask group every that many positions)")
    anchors = torch.arange(prompt_len - 1, length - 2, every, device=rows.device)
    if prompt_len < 1 or not len(anchors):
        raise ValueError(f"rows of {length} tokens hold no continuation of 2+ tokens after a prompt of {prompt_len}")
    where = anchors[:, None] + 1 + torch.arange(1, k, device=rows.device)  # [G, k-1]: the position each mask predicts
    targets = rows[:, where.clamp(max=length - 1)]
    return anchors, targets.masked_fill((where >= length) | (targets < 0), IGNORE)


def mask_batch(rows: torch.LongTensor, k: int, vocab_size: int, prompt_len: int, every: int = 1) -> MaskBatch:
    """`rows` [B, T] of distilled tokens with a group of k-1 masks (ids vocab_size..vocab_size+k-2) at
    each of their `anchor_targets`, packed for one forward."""
    b, length = rows.shape
    anchors, targets = anchor_targets(rows, k, prompt_len, every)
    groups, n = len(anchors), k - 1
    offsets = torch.arange(1, k, device=rows.device)
    ids = torch.cat([rows.clamp(min=0), (vocab_size + offsets - 1).repeat(groups).expand(b, -1)], dim=1)
    real = torch.arange(length, device=rows.device)
    positions = torch.cat([real, (anchors[:, None] + offsets).flatten()])[None]
    total = length + groups * n
    sees_to = torch.cat([real, anchors.repeat_interleave(n)])  # the last real position each position sees
    group = length + n * torch.arange(groups, device=rows.device).repeat_interleave(n)
    first = torch.cat([torch.full_like(real, total), group])  # each position's group's first mask (none: total)
    i, j = torch.arange(total, device=rows.device)[:, None], torch.arange(total, device=rows.device)[None]
    allowed = ((j < length) & (j <= sees_to[:, None])) | ((j >= first[:, None]) & (j <= i))
    return MaskBatch(ids, positions, allowed, anchors, targets)


def mask_states(model: PreTrainedModel, masks: MaskDrafts, batch: MaskBatch) -> torch.Tensor:
    """The decoder outputs of every mask, [B, G, k-1, D], from one forward of the packed batch: the
    input of the output projection, which every causal LM here applies to its base model's last hidden
    state (tested), so the vocabulary is never projected over the batch."""
    if is_seq2seq(model):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder: mask batches are built for causal LMs")
    b, (groups, n) = batch.input_ids.shape[0], batch.targets.shape[1:]
    with attached(model, masks):
        hidden = model.base_model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids.expand(b, -1),
            attention_mask=batch.attention_mask(model.dtype),
            use_cache=False,
        ).last_hidden_state
    return hidden[:, batch.length :].unflatten(1, (groups, n))


def mask_loss(
    states: torch.Tensor, targets: torch.LongTensor, projection: nn.Module, chunk: int = 2048
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and argmax hits per mask offset, [k-1] each, of `states` [..., k-1, D]
    through `projection` against `targets` [..., k-1] (rows of the projection; IGNORE skipped), a chunk
    of rows at a time (`loss.linear_cross_entropy`)."""
    sums, hits = zip(
        *(linear_cross_entropy(states[..., j, :], projection, targets[..., j], chunk) for j in range(states.shape[-2]))
    )
    return torch.stack(sums), torch.stack(hits)


def write_masks(masks: MaskDrafts, folder: Path) -> None:
    """The masks' weights (safetensors) and config (JSON, last) into `folder`, each written atomically:
    for a caller that replaces the folder as a whole itself (`save_masks`, a training run's save)."""
    tensors = {name: t.detach().contiguous().cpu() for name, t in masks.state_dict().items()}
    atomic_write(Path(folder) / MASKS_WEIGHTS, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    write_json(Path(folder) / MASKS_CONFIG, asdict(masks.config))


def save_masks(masks: MaskDrafts, folder: str | Path) -> None:
    """Write the masks into `folder`, replacing an earlier save as a whole (`io.saving_folder`)."""
    with saving_folder(Path(folder), MASKS_CONFIG) as staging:
        write_masks(masks, staging)


def load_masks(folder: str | Path, model: PreTrainedModel) -> MaskDrafts:
    """Masks saved by `save_masks`, for `model`, on its device; a missing, damaged or mismatched save
    is one CheckpointError naming its file."""
    folder = Path(folder)
    config = folder / MASKS_CONFIG
    if not config.is_file():
        raise CheckpointError(f"{folder} holds no {MASKS_CONFIG}: no masks were saved there")
    with reading_folder(folder, MASKS_CONFIG):
        fields = read_json(config, CheckpointError)
        try:
            cfg = MasksConfig(**fields)
            widths = adapted_widths(model, cfg)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"{config} does not describe masks for this model: {err}") from err
        masks = MaskDrafts(cfg, widths)
        weights = folder / MASKS_WEIGHTS
        try:
            state = load_file(str(weights))
        except (FileNotFoundError, SafetensorError, OSError) as err:
            raise CheckpointError(f"{weights} is missing, corrupt or truncated: {err}") from err
    expected = masks.state_dict()
    if set(state) != set(expected) or any(state[n].shape != expected[n].shape for n in expected):
        raise CheckpointError(f"{weights} does not hold the tensors {config} describes")
    masks.load_state_dict(state)
    return masks.to(model.get_decoder().get_input_embeddings().weight.device)
