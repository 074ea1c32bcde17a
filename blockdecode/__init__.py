"""blockdecode: exact Blockwise Parallel Decoding (Stern, Shazeer & Uszkoreit, 2018) for transformers models."""

from blockdecode.builtin import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, DEFAULT_TRANSLATION_MODEL
from blockdecode.decode import BlockwiseOutput, DecodeStats, blockwise_generate, decode
from blockdecode.drafters import BaseDrafter, Drafter, HeadsDrafter, NgramDrafter, ScriptedDrafter
from blockdecode.export import export_heads
from blockdecode.heads import HeadsConfig
from blockdecode.healing import Healing, heal_prompts
from blockdecode.model import BlockwiseLM, CheckpointError, load
from blockdecode.plan import DecodePlan, make_plan
from blockdecode.suffix import SuffixDrafter

__all__ = [
    "BaseDrafter",
    "DEFAULT_DRAFT_MODEL",
    "DEFAULT_MODEL",
    "DEFAULT_TRANSLATION_MODEL",
    "BlockwiseLM",
    "BlockwiseOutput",
    "CheckpointError",
    "DecodePlan",
    "DecodeStats",
    "Drafter",
    "HeadsConfig",
    "HeadsDrafter",
    "Healing",
    "NgramDrafter",
    "ScriptedDrafter",
    "SuffixDrafter",
    "blockwise_generate",
    "decode",
    "export_heads",
    "heal_prompts",
    "load",
    "make_plan",
]
