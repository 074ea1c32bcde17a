"""The frozen base's outputs on the training rows, computed once and stored memory-mapped.

Heads trained on a frozen base (`frozen`, `distill`) see the same decoder outputs in every epoch, so a
step need not run the base at all: it reads each row's decoder output (the input of the output
projection, what the heads read), and the base's own argmax and loss at each position (head 1's
accuracy and loss, which the metrics report). The cache is keyed by the base's weights and the rows,
filled in chunks whose rows are marked done only once written, so a killed fill resumes where it
stopped; and every run on the same base and rows shares it (the modes, widths and draft vocabularies
a study compares)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from blockdecode.adapter import sequence_logits
from blockdecode.data import Pairs, fingerprint
from blockdecode.hf import decoder_output, weights_digest

IGNORE = -100


@dataclass
class Features:
    """Per training row: decoder outputs [N, L, D], the base's argmax [N, L] and its cross-entropy
    against the next token [N, L] (0 where there is none)."""

    hidden: np.ndarray
    argmax: np.ndarray
    loss: np.ndarray

    def rows(self, idx: torch.LongTensor, length: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows `idx`, cut to `length` positions (a batch of pairs is cut to its longest)."""
        picked = np.sort(idx.numpy())
        order = torch.from_numpy(np.searchsorted(picked, idx.numpy()))  # memmaps read fastest in order
        return tuple(
            torch.from_numpy(np.ascontiguousarray(array[picked, :length]))[order].to(device)
            for array in (self.hidden, self.argmax, self.loss)
        )


def features_key(base: PreTrainedModel, rows: torch.LongTensor | Pairs) -> str:
    """The base's weights and the rows: what the features are a function of."""
    content = rows.content() if isinstance(rows, Pairs) else rows
    return hashlib.sha256(f"{weights_digest(base)}|{fingerprint(content)}".encode()).hexdigest()[:20]


@torch.inference_mode()
def cached_features(
    base: PreTrainedModel, rows: torch.LongTensor | Pairs, folder: str | Path, chunk: int = 16, show: bool = True
) -> Features:
    """The features of `rows` ([N, L] token rows, -1 as padding, or an encoder-decoder's pairs), from
    `folder`/<key> where a fill left them, computing what is missing."""
    decoder = rows.decoder if isinstance(rows, Pairs) else rows
    n, length = decoder.shape
    width = base.get_output_embeddings().weight.shape[1]
    where = Path(folder) / features_key(base, rows)
    where.mkdir(parents=True, exist_ok=True)
    shapes = {"hidden": ((n, length, width), np.float32), "argmax": ((n, length), np.int32)}
    shapes |= {"loss": ((n, length), np.float32), "done": ((n,), np.bool_)}
    arrays = {}
    for name, (shape, dtype) in shapes.items():
        path = where / f"{name}.npy"
        fresh = not path.is_file()
        arrays[name] = np.lib.format.open_memmap(path, mode="w+" if fresh else "r+", dtype=dtype, shape=shape)
        if arrays[name].shape != shape:
            raise ValueError(f"{path} holds features of shape {arrays[name].shape}, these rows need {shape}")
    done = arrays["done"]
    todo = [start for start in range(0, n, chunk) if not done[start : start + chunk].all()]
    device = next(base.parameters()).device
    for start in tqdm(todo, desc="base features", disable=not show or not todo):
        part = rows[start : start + chunk] if isinstance(rows, Pairs) else rows[start : start + chunk]
        ids = (part.decoder if isinstance(part, Pairs) else part).to(device)
        source = part.source.to(device) if isinstance(part, Pairs) else None
        with decoder_output(base) as hidden:
            logits = sequence_logits(
                base,
                ids.clamp(min=0),
                None if source is None else source.clamp(min=0),
                None if source is None else (source >= 0).long(),
            )
        target = torch.full_like(ids, IGNORE)
        target[:, :-1] = ids[:, 1:].masked_fill(ids[:, 1:] < 0, IGNORE)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE, reduction="none")
        end, cut = start + len(ids), ids.shape[1]
        arrays["hidden"][start:end, :cut] = hidden[0].float().cpu().numpy()
        arrays["argmax"][start:end, :cut] = logits.argmax(-1).int().cpu().numpy()
        arrays["loss"][start:end, :cut] = loss.view_as(ids).cpu().numpy()
        for name in ("hidden", "argmax", "loss"):
            arrays[name].flush()
        done[start:end] = True  # only once the rows are on disk
        done.flush()
    return Features(arrays["hidden"], arrays["argmax"], arrays["loss"])
