"""blockdecode: exact Blockwise Parallel Decoding (Stern, Shazeer & Uszkoreit, 2018) for transformers models."""

from pathlib import Path

from blockdecode.decode import BlockwiseOutput, DecodeStats, blockwise_generate
from blockdecode.drafters import Drafter, HeadsDrafter, NgramDrafter, ScriptedDrafter
from blockdecode.heads import HeadsConfig
from blockdecode.model import BlockwiseLM, CheckpointError

DEFAULT_MODEL = str(Path(__file__).parent / "default_model")
"""The built-in model: a small Llama trained on the standard library's source, with trained heads."""
DEFAULT_DRAFT_MODEL = str(Path(__file__).parent / "draft_model")
"""A much smaller Llama on the same corpus and tokenizer: the draft model for assisted generation."""

__all__ = [
    "DEFAULT_DRAFT_MODEL",
    "DEFAULT_MODEL",
    "BlockwiseLM",
    "BlockwiseOutput",
    "CheckpointError",
    "DecodeStats",
    "Drafter",
    "HeadsConfig",
    "HeadsDrafter",
    "NgramDrafter",
    "ScriptedDrafter",
    "blockwise_generate",
]
