"""Module paths from before the package had folders: `import blockdecode.suffix` still gives the module that now
lives at `blockdecode.drafters.suffix` (the very same object, so patching either patches both), with a
DeprecationWarning naming the new place."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "io": "core.io", "hf": "core.hf", "hardware": "core.hardware", "tree": "core.tree", "loss": "core.loss",
    "plots": "core.plots", "toy": "core.toy", "heads": "drafters.heads", "suffix": "drafters.suffix",
    "sources": "drafters.sources", "masks": "drafters.masks", "named": "drafters.registry", "eagle3": "drafters.eagle3",
    "adapter": "decoding.adapter", "rules": "decoding.rules", "reference": "decoding.reference",
    "timing": "decoding.timing", "expected": "decoding.ranking", "acceptance": "decoding.acceptance",
    "sampling": "decoding.sampling", "healing": "decoding.healing", "plan": "decoding.plan",
    "calibrate": "decoding.calibrate", "training": "training.loop", "train_config": "training.config",
    "objective": "training.objective", "distill": "training.distill", "features": "training.features",
    "data": "training.data", "train": "training.train", "pretrain": "pretraining.pretrain",
    "corpus": "pretraining.corpus", "bible": "pretraining.bible", "translation": "pretraining.translation",
    "export": "serving.export", "flags": "commands.flags", "demo": "commands.demo",
}  # fmt: skip
"""Old module name -> its place now, both under `blockdecode.`"""
GONE = {"decode": "blockdecode.decoding.loop (the loop) and blockdecode.decoding.output (DecodeStats)"}
"""Old modules that cannot be aliased: `blockdecode.decode` is the function the package exports."""


class Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and hands over the module at its new place."""

    def find_spec(self, fullname: str, path=None, target=None):
        package, _, old = fullname.partition(".")
        if package != "blockdecode" or "." in old or old not in MOVED | GONE:
            return None
        if old in GONE:
            raise ModuleNotFoundError(f"{fullname} has moved: import from {GONE[old]}", name=fullname)
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = f"blockdecode.{MOVED[spec.name.removeprefix('blockdecode.')]}"
        warnings.warn(f"{spec.name} has moved to {new}: import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.own_spec  # the import system set the old name's; the module keeps its own


def install() -> None:
    """Serve the old paths from now on (once per process)."""
    if not any(isinstance(finder, Moved) for finder in sys.meta_path):
        sys.meta_path.append(Moved())
