"""Where proposals come from: the `Drafter` protocol, what a drafter hands the loop (`proposals`), and one module
per drafter: the paper's heads, n-gram lookup, suffix lookup over its sources, mask drafts, the EAGLE-3 drafter.
`registry` names them. Exactness never depends on a drafter, only speed does."""

from blockdecode.drafters.base import BaseDrafter, ChainDrafter, Drafter, ScriptedDrafter, as_drafter, as_drafters
from blockdecode.drafters.heads import HeadsDrafter
from blockdecode.drafters.ngram import NgramDrafter
from blockdecode.drafters.suffix import SuffixDrafter

__all__ = [
    "BaseDrafter",
    "ChainDrafter",
    "Drafter",
    "HeadsDrafter",
    "NgramDrafter",
    "ScriptedDrafter",
    "SuffixDrafter",
    "as_drafter",
    "as_drafters",
]
