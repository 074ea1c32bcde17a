"""The frozen base's outputs on the training rows, computed once and stored memory-mapped.

Heads trained on a frozen base (`frozen`, `distill`) see the same decoder outputs in every epoch, so a
step need not run the base at all: it reads each row's decoder output (the input of the output
projection, what the heads read), and the base's own argmax and loss at each position (head 1's
accuracy and loss, which the metrics report). The cache is keyed by the base's weights and the rows,
filled in chunks whose rows are marked done only once written, so a killed fill resumes where it
stopped; and every run on the same base and rows shares it (the modes, widths and draft vocabularies
a study compares).

A damaged cache is computed again, with a warning, never trained on: a file that is not the array
these rows need (a broken header, cut short, another shape or dtype) is made anew, and a row marked
done whose CRC-32, written with its done flag, no longer matches its bytes (zeroed, stale) is
refilled. The check reads the cache once as it is opened (CRC-32 runs at about 1.7 GB/s on one core)."""

from __future__ import annotations

import hashlib
import warnings
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from blockdecode.core.hf import decoder_output, layer_inputs, weights_digest
from blockdecode.core.io import cached_npy
from blockdecode.core.loss import IGNORE
from blockdecode.decoding.adapter import sequence_logits
from blockdecode.training.data import Pairs, decoder_rows, fingerprint

FEATURES = ("hidden", "argmax", "loss")  # per row; what its checksum covers (and "aux", where layers are read)


@dataclass
class Features:
    """Per training row: decoder outputs [N, L, D], the base's argmax [N, L] and its cross-entropy
    against the next token [N, L] (0 where there is none)."""

    hidden: np.ndarray
    argmax: np.ndarray
    loss: np.ndarray
    aux: np.ndarray | None = None  # [N, L, 3D]: the inputs of the layers an EAGLE-3 drafter reads

    def rows(self, idx: torch.LongTensor, length: int, device, names: tuple[str, ...] = FEATURES) -> tuple:
        """The rows `idx` of the arrays `names`, cut to `length` positions (a batch of pairs is cut to its
        longest)."""
        picked = np.sort(idx.numpy())
        order = torch.from_numpy(np.searchsorted(picked, idx.numpy()))  # memmaps read fastest in order
        return tuple(
            torch.from_numpy(np.ascontiguousarray(getattr(self, name)[picked, :length]))[order].to(device)
            for name in names
        )


def features_key(base: PreTrainedModel, rows: torch.LongTensor | Pairs) -> str:
    """The base's weights and the rows, their shape included (one stream packed at two lengths holds
    the same tokens): what the features are a function of."""
    if isinstance(rows, Pairs):
        content, shape = rows.content(), [*rows.source.shape, *rows.decoder.shape]
    else:
        content, shape = rows, list(rows.shape)
    return hashlib.sha256(f"{weights_digest(base)}|{shape}|{fingerprint(content)}".encode()).hexdigest()[:20]


def row_checksum(arrays: dict[str, np.ndarray], row: int) -> int:
    """The CRC-32 of one row's features, every array's."""
    crc = 0
    for name in (*FEATURES, "aux"):
        if name in arrays:
            crc = zlib.crc32(arrays[name][row], crc)
    return crc


def open_arrays(where: Path, layout: dict[str, tuple[tuple, type]]) -> dict[str, np.ndarray]:
    """The cache's arrays, memory-mapped for update; one that is missing, or damaged (with a warning
    naming it), is made anew, and then no row counts as done."""
    arrays, remade = {}, False
    for name, (shape, dtype) in layout.items():
        path = where / f"{name}.npy"
        arrays[name] = cached_npy(path, shape, dtype, mmap_mode="r+")
        if arrays[name] is None:
            arrays[name] = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
            remade = True
    if remade:
        arrays["done"][:] = False
    return arrays


def whole_layer_caches(folder: Path, key: str) -> list[tuple[int, ...]]:
    """The layers of each cache in `folder` of the rows `key` names that also holds some layers' inputs, filled
    whole (its checksums are checked as it is opened, as any cache's)."""
    held = []
    for where in sorted(folder.glob(f"{key}-layers-*")):
        try:
            layers = tuple(int(i) for i in where.name.removeprefix(f"{key}-layers-").split("-"))
            whole = bool(np.load(where / "done.npy", mmap_mode="r").all())
        except (OSError, ValueError):
            continue
        if whole:
            held.append(layers)
    return held


def row_logits(base: PreTrainedModel, rows: torch.LongTensor | Pairs) -> torch.Tensor:
    """The base's teacher-forced logits [N, L, V] on `rows` (-1 as padding): a causal LM's rows, or pairs' decoder
    rows with their sources encoded."""
    if not isinstance(rows, Pairs):
        return sequence_logits(base, rows.clamp(min=0))
    return sequence_logits(base, rows.decoder.clamp(min=0), rows.source.clamp(min=0), (rows.source >= 0).long())


@torch.inference_mode()
def cached_features(
    base: PreTrainedModel,
    rows: torch.LongTensor | Pairs,
    folder: str | Path,
    chunk: int = 16,
    show: bool = True,
    layers: tuple[int, ...] = (),
) -> Features:
    """The features of `rows` ([N, L] token rows, -1 as padding, or an encoder-decoder's pairs), from
    `folder`/<key> where a fill left them whole, computing what is missing or damaged; with `layers`, also
    the inputs of those decoder layers (`hf.layer_inputs`), in a cache of their own."""
    decoder = decoder_rows(rows)
    n, length = decoder.shape
    width = base.get_output_embeddings().weight.shape[1]
    key = features_key(base, rows)
    if not layers and (fuller := whole_layer_caches(Path(folder), key)):
        layers = fuller[0]  # a cache of some layers' inputs on these rows holds the outputs too: one pass, not two
    where = Path(folder) / (key + ("-layers-" + "-".join(map(str, layers)) if layers else ""))
    where.mkdir(parents=True, exist_ok=True)
    layout = {"hidden": ((n, length, width), np.float32), "argmax": ((n, length), np.int32)}
    layout |= {"loss": ((n, length), np.float32), "checksum": ((n,), np.uint32), "done": ((n,), np.bool_)}
    if layers:
        layout["aux"] = ((n, length, len(layers) * base.get_input_embeddings().weight.shape[1]), np.float32)
    arrays = open_arrays(where, layout)
    done, checksum = arrays["done"], arrays["checksum"]
    damaged = [i for i in np.flatnonzero(done) if row_checksum(arrays, i) != checksum[i]]
    if damaged:
        warnings.warn(
            f"{where}: {len(damaged)} of the {n} rows marked done no longer match their checksums: "
            "computing them again",
            stacklevel=2,
        )
        done[damaged] = False
    todo = [start for start in range(0, n, chunk) if not done[start : start + chunk].all()]
    device = next(base.parameters()).device
    for start in tqdm(todo, desc="base features", disable=not show or not todo):
        part = rows[start : start + chunk].to(device)
        ids = decoder_rows(part)
        reading = layer_inputs(base, layers) if layers else nullcontext([])
        with decoder_output(base) as hidden, reading as aux:
            logits = row_logits(base, part)
        target = torch.full_like(ids, IGNORE)
        target[:, :-1] = ids[:, 1:].masked_fill(ids[:, 1:] < 0, IGNORE)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE, reduction="none")
        end, cut = start + len(ids), ids.shape[1]
        computed = {"hidden": hidden[0].float(), "argmax": logits.argmax(-1).int(), "loss": loss.view_as(ids)}
        if layers:
            computed["aux"] = aux[0].float()
        for name in computed:
            arrays[name][start:end, :cut] = computed[name].cpu().numpy()
            arrays[name][start:end, cut:] = 0  # a pair's padding: a refilled row's old bytes must not stay
            arrays[name].flush()
        checksum[start:end] = [row_checksum(arrays, i) for i in range(start, end)]
        checksum.flush()
        done[start:end] = True  # only once the rows and their checksums are on disk
        done.flush()
    return Features(arrays["hidden"], arrays["argmax"], arrays["loss"], arrays.get("aux"))
