"""The built-in model's corpus: the standard library with torch's and transformers' source, and never a
file of the third-party packages its unseen evaluation set is drawn from."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import pytest

from blockdecode.pretraining.corpus import CORPUS_PACKAGES, EVAL_PACKAGES, corpus_files, is_heldout, package_root


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_no_file_of_an_evaluation_package_enters_the_corpus() -> None:
    """By path (torch vendors `packaging` under torch/_vendor) and by content (a copy anywhere)."""
    files = corpus_files(packages=CORPUS_PACKAGES)
    assert {f.source for f in files} == {"stdlib", *CORPUS_PACKAGES}
    vendored = list((package_root("torch") / "_vendor" / "packaging").rglob("*.py"))
    assert vendored, "torch no longer vendors packaging: the path filter below is no longer exercised"
    assert not [f.name for f in files if set(Path(f.name).parts) & set(EVAL_PACKAGES)]
    evaluated = {digest(p) for name in EVAL_PACKAGES for p in package_root_unchecked(name).rglob("*.py")}
    evaluated -= {hashlib.sha256(b"").hexdigest()}  # empty __init__.py files are in every package
    leaked = [f.name for f in files if digest(f.path) in evaluated]
    assert not leaked, f"evaluation code in the corpus: {leaked[:5]}"


def package_root_unchecked(name: str) -> Path:
    import importlib.util

    return Path(next(iter(importlib.util.find_spec(name).submodule_search_locations)))


def test_an_evaluation_package_is_refused_as_a_corpus_package() -> None:
    for name in EVAL_PACKAGES:
        with pytest.raises(ValueError, match="evaluation package"):
            package_root(name)
    with pytest.raises(ValueError, match="not installed"):
        package_root("no_such_package_here")


def test_the_standard_library_keeps_its_names_and_split() -> None:
    """Its files are named relative to the stdlib root, as the first built-in model's were, so the
    held-out stdlib files (and a held-out loss on them) stay the same."""
    root = Path(sysconfig.get_paths()["stdlib"])
    stdlib = [f for f in corpus_files(root) if f.source == "stdlib"]
    assert stdlib and all(f.name == str(f.path.relative_to(root)) for f in stdlib)
    held = {f.name for f in stdlib if is_heldout(f.name)}
    assert 0.02 < len(held) / len(stdlib) < 0.08
