"""The drafters known by name, as `generate`, `model.plan` and the CLI take them ("heads", "ngram",
"heads+suffix", ...): each made from a BlockwiseLM. Apart from the drafters themselves, so that suffix
lookup, which builds on `blockdecode.drafters.base`, is named here beside them."""

from __future__ import annotations

from collections.abc import Callable

from blockdecode.drafters.base import BaseDrafter
from blockdecode.drafters.ngram import NgramDrafter
from blockdecode.drafters.suffix import for_model

DRAFTERS: dict[str, Callable[[object], BaseDrafter]] = {
    "heads": lambda lm: lm.drafter(),
    "heads-rescored": lambda lm: lm.drafter(rescore=1.0),
    "ngram": lambda lm: NgramDrafter(),
    "suffix": for_model,
    "eagle3": lambda lm: lm.eagle3_drafter(),
    "dflash": lambda lm: lm.dflash_drafter(),
}
"""The drafters known by name. "a+b" names several sharing one tree."""
CHOICES = ("heads", "ngram", "heads+ngram")
"""What `drafter="auto"` chooses among (rescoring is opt-in: it lost the demo's median when chosen)."""
LOOKUPS = ("ngram", "suffix")  # cheap, and often long: asked first


def drafter_names(spec: str) -> list[str]:
    """The names in `spec` ("heads", "ngram+heads", ...), in the order they fill a tree and are asked:
    the lookups first (their few paths are cheap and often long), the heads filling the rest, asked only
    where they pay; one clear line for an unknown or repeated name, or auto (a choice, not a drafter)."""
    names = spec.split("+") if isinstance(spec, str) else []
    known = ", ".join(DRAFTERS) + " or several joined by + (heads+ngram)"
    if "auto" in names:  # resolved before a plan is made: here it names no drafter
        raise ValueError(f"drafter {spec!r}: auto is the choice among drafters, not one of them: name {known}")
    if not names or any(name not in DRAFTERS for name in names):
        raise ValueError(f"unknown drafter {spec!r}: choose {known}, or a Drafter object")
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"drafter {spec!r} names {twice} twice: name each drafter once")
    return sorted(names, key=lambda n: n not in LOOKUPS)
