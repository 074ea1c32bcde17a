"""Where the models shipped inside the package live: importable from any layer (it imports none).

`benchmarks/ship.py` installs a trained run into one of these folders."""

from pathlib import Path

DEFAULT_MODEL = str(Path(__file__).parent / "default_model")
"""The built-in model: a small Llama trained on the standard library's source, with trained heads."""
DEFAULT_DRAFT_MODEL = str(Path(__file__).parent / "draft_model")
"""A much smaller Llama on the same corpus and tokenizer: the draft model for assisted generation."""
DEFAULT_TRANSLATION_MODEL = str(Path(__file__).parent / "translation_model")
"""The built-in English-Spanish Marian (`recipes/translation.sh`), with trained heads, once shipped."""
SHIPPED_DRAFTERS = Path(__file__).parent / "drafters"
"""Drafters trained for bases that users install themselves (a GGUF from the package registry): one folder each of
heads and the drafters beside them (eagle3/, dflash/), saved without their base and attached by `load()` to a base
whose weights match its `base_signature`. The bases are never here."""
