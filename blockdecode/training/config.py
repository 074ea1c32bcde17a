"""What a head-training run is asked to do: its mode, targets and losses, and every setting,
checked once, when the config is made, so a bad one fails before anything loads."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from blockdecode.core.io import check_writable
from blockdecode.drafters.heads import HEAD_TYPES

MODES = {
    "frozen": "base frozen (inference mode), heads trained on the data; decoding stays the original model's",
    "finetune": "base and heads trained together, the base's own loss kept in the objective; the result is a new base",
    "distill": "frozen base, heads trained on the base model's own greedy/beam continuations of data prompts",
    "finetune+distill": "fine-tune base and heads on the base model's own continuations (the paper's best)",
}
HEAD_LOSSES = ("all", "random")
BASE_LOSS_ON = {
    "rows": "the rows the heads learn from (in finetune+distill, the base's own greedy text)",
    "data": "rows of the real data, so the base keeps modelling real text while it learns its heads' way",
}
TARGETS = {
    "hard": "each head learns the data's token (the base's own argmax, in distill modes)",
    "soft": "each head learns the base's whole distribution where it predicts that token (Hydra++)",
}


POSITIVE_FIELDS = (
    "steps",
    "batch_size",
    "seq_len",
    "eval_every",
    "eval_prompts",
    "log_every",
    "checkpoint_every",
    "distill_prompts",
    "distill_new_tokens",
    "distill_beams",
    "distill_batch_size",
    "loss_chunk",
    "eval_new_tokens",
)
NON_NEGATIVE_FIELDS = ("patience", "min_delta", "doubling_gain")


TRAIN_HEAD_TYPES = (*HEAD_TYPES, "eagle3", "dflash")  # what `blockdecode train` trains
DRAFTER_TYPES = ("eagle3", "dflash")  # drafters of their own that read the frozen base's layers


@dataclass
class TrainConfig:
    """One training run. `batch_size` is the global batch, split across processes."""

    base: str
    data: list[str]
    out: str
    k: int = 8
    mode: str = "frozen"
    head_type: str = "paper"  # or "eagle3": an EAGLE-3 drafter (`blockdecode.drafters.eagle3.model`) on the frozen base
    aux_layers: list[int] | None = (
        None  # eagle3 (three), dflash: the layers whose inputs it reads (default: vLLM's rule)
    )
    dflash_layers: int = 1  # dflash: its decoder layers
    anchors: int = 16  # dflash: blocks a training row holds, after random positions
    gamma: float = 4.0  # dflash: block position i's loss weighs exp(-(i - 1) / gamma)
    head_hidden_size: int = 0
    draft_vocab: int = 0  # > 0: the heads score only the N tokens most frequent in their targets
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    base_lr: float = 5e-5
    weight_decay: float = 0.0
    warmup_steps: int = 20
    head_loss: str = "all"
    targets: str = "hard"
    head_weights: list[float] | None = None
    base_loss_weight: float = 1.0
    base_loss_on: str = "rows"  # finetune+distill: "data" measures the base's own loss on real data rows
    holdout: float = 0.05
    eval_every: int = 100
    eval_batches: int = 4
    eval_prompts: int = 4
    eval_prompt_len: int = 32
    eval_new_tokens: int = 64
    log_every: int = 10
    checkpoint_every: int = 100
    resume: bool = False
    seed: int = 0
    mixed_precision: str = "auto"  # bf16 autocast where the device computes bf16 natively
    distill_prompts: int = 256
    distill_prompt_len: int = 32
    distill_new_tokens: int = 128
    distill_beams: int = 1
    distill_batch_size: int = 16
    distill_cache: str | None = None
    # encoder-decoder distill modes: text files of more sources, one a line; distill_prompts are drawn
    # evenly from the training sources and these together, so each gives its share of the budget
    distill_sources: list[str] | None = None
    feature_cache: str | None = None  # frozen-base modes: the base's outputs on the rows, computed once, here
    loss_chunk: int = 2048  # rows of head logits held at once (memory only: the loss is the same)
    patience: int = 0  # stop after this many evaluations without a longer held-out block; 0: never
    init_heads: str | None = None  # a saved BlockwiseLM whose heads start the run (its base is not used)
    min_delta: float = 0.01  # what counts as longer
    doubling_gain: float = 0.0  # > 0: stop once the held-out block grew less than this over a doubling of steps

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.base_loss_on not in BASE_LOSS_ON:
            raise ValueError(f"unknown base_loss_on {self.base_loss_on!r}: choose one of {', '.join(BASE_LOSS_ON)}")
        if self.base_loss_on == "data" and self.mode != "finetune+distill":
            raise ValueError("base_loss_on='data' is for finetune+distill, whose rows are the base's own text")
        if self.targets not in TARGETS:
            raise ValueError(f"unknown targets {self.targets!r}: choose one of {', '.join(TARGETS)}")
        if self.head_type not in TRAIN_HEAD_TYPES:
            raise ValueError(f"unknown head_type {self.head_type!r}: choose one of {', '.join(TRAIN_HEAD_TYPES)}")
        if self.head_type in DRAFTER_TYPES and self.finetune:
            raise ValueError(
                f"--head-type {self.head_type} trains on a frozen base: choose --mode frozen or distill, "
                f"not {self.mode}"
            )
        if self.aux_layers is not None and self.head_type == "eagle3" and len(self.aux_layers) != 3:
            raise ValueError("--aux-layers takes three layer ids, for --head-type eagle3")
        if self.aux_layers is not None and (self.head_type not in DRAFTER_TYPES or not self.aux_layers):
            raise ValueError("--aux-layers takes layer ids, for --head-type eagle3 or dflash")
        if self.aux_layers is not None and list(self.aux_layers) != sorted(self.aux_layers):
            raise ValueError(
                f"--aux-layers takes layer ids in ascending order (the order their features are concatenated in), "
                f"got {' '.join(map(str, self.aux_layers))}"
            )
        if self.head_type == "dflash" and (self.dflash_layers < 1 or self.anchors < 1 or not self.gamma > 0):
            raise ValueError("--dflash-layers and --anchors must be >= 1, and --gamma > 0")
        if self.head_loss not in HEAD_LOSSES:
            raise ValueError(f"unknown head loss {self.head_loss!r}: choose one of {', '.join(HEAD_LOSSES)}")
        if not isinstance(self.k, int) or self.k < 2:
            raise ValueError(f"k must be an integer >= 2 to have heads to train, got {self.k!r}")
        if self.head_weights is not None and len(self.head_weights) != self.k - 1:
            raise ValueError(
                f"head_weights needs {self.k - 1} values (heads 2..{self.k}), got {len(self.head_weights)}"
            )
        if self.head_weights is not None and min(self.head_weights) <= 0:
            raise ValueError(f"head_weights must all be positive, got {self.head_weights}")
        for name in POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("lr", "base_lr", "weight_decay", "base_loss_weight"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        for name in NON_NEGATIVE_FIELDS:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.draft_vocab < 0 or self.draft_vocab == 1:
            raise ValueError(
                f"--draft-vocab must be 0 (the whole vocabulary) or at least 2, got {self.draft_vocab}: heads that "
                "score one token always propose it, and learn nothing"
            )
        if self.seq_len <= self.k:
            raise ValueError(f"seq_len ({self.seq_len}) must exceed k ({self.k}) for every head to have targets")
        if not self.data:
            raise ValueError("no training data given")
        out = Path(self.out).resolve()
        for item in map(Path, self.data):
            if item.is_dir() and out.is_relative_to(item.resolve()):
                raise ValueError(
                    f"--out {self.out} lies inside the data folder {item}: the run would train on its own files"
                )
        if self.feature_cache and self.finetune:
            raise ValueError(
                f"--feature-cache is for the frozen-base modes (frozen, distill): in {self.mode} the base trains, "
                "so its outputs change every step"
            )
        if self.distill_sources and not self.distill:
            raise ValueError(f"distill_sources are prompts to distil: for the distill modes, not {self.mode}")
        caches = {"--feature-cache": self.feature_cache, "--distill-cache": self.distill and self.distill_cache}
        for flag, folder in caches.items():
            if folder:  # a file there would fail only after the base loads, as a bare "Not a directory"
                check_writable(Path(folder), flag)
        if self.distill and self.distill_prompt_len + self.distill_new_tokens <= self.k:
            raise ValueError(
                f"distilled rows of {self.distill_prompt_len} + {self.distill_new_tokens} tokens are too short "
                f"for k={self.k}"
            )

    @property
    def finetune(self) -> bool:
        return self.mode.startswith("finetune")

    @property
    def distill(self) -> bool:
        return self.mode.endswith("distill")
