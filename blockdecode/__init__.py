"""blockdecode: exact Blockwise Parallel Decoding (Stern, Shazeer & Uszkoreit, 2018) for transformers models."""

from blockdecode.builtin import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, DEFAULT_TRANSLATION_MODEL
from blockdecode.core import moved
from blockdecode.decoding.healing import Healing, heal_prompts
from blockdecode.decoding.loop import blockwise_generate, decode
from blockdecode.decoding.output import BlockwiseOutput, DecodeStats
from blockdecode.decoding.plan import DecodePlan, make_plan
from blockdecode.drafters.base import BaseDrafter, Drafter, ScriptedDrafter
from blockdecode.drafters.heads import HeadsConfig, HeadsDrafter
from blockdecode.drafters.ngram import NgramDrafter
from blockdecode.drafters.suffix import SuffixDrafter
from blockdecode.model import BlockwiseLM, CheckpointError, load
from blockdecode.serving.export import export_heads

moved.install()  # the module paths from before the package had folders still import

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
