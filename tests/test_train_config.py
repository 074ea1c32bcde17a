"""A head-training run's config: every bad setting is refused when the config is made, before
anything loads or is written."""

from __future__ import annotations

import re

import pytest
from conftest import make_cfg


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(mode="bogus"), "mode"),
        (dict(head_loss="bogus"), "head loss"),
        (dict(head_weights=[1.0, 1.0]), "head_weights"),
        (dict(head_weights=[1.0] * 4), "head_weights"),
        (dict(k=1), "k must"),
        (dict(seq_len=4), "seq_len"),
        (dict(steps=0), "steps"),
        (dict(batch_size=0), "batch_size"),
        (dict(data=[]), "no training data"),
        (dict(targets="fuzzy"), "unknown targets 'fuzzy'"),
        (dict(base_loss_on="elsewhere"), "unknown base_loss_on"),
        (dict(mode="finetune", base_loss_on="data"), "for finetune\\+distill"),
        (dict(mode="frozen", distill_sources=["more.txt"]), "for the distill modes, not frozen"),
        (dict(mode="finetune", feature_cache="f"), "--feature-cache is for the frozen-base modes"),
        (dict(mode="finetune+distill", feature_cache="f"), "--feature-cache is for the frozen-base modes"),
        (dict(draft_vocab=1), "--draft-vocab must be 0 .* or at least 2, got 1: heads that score one token"),
        (dict(draft_vocab=-4), "--draft-vocab must be 0 .* or at least 2, got -4"),
        (dict(head_type="eagle3", aux_layers=[3, 2, 1]), "ascending order .*, got 3 2 1"),  # not sorted silently
        (dict(head_type="dflash", mode="finetune"), "--head-type dflash trains on a frozen base"),
        (dict(head_type="dflash", anchors=0), "--anchors must be >= 1"),
        (dict(head_type="paper", aux_layers=[1]), "--aux-layers takes layer ids, for --head-type eagle3 or dflash"),
    ],
)
def test_config_rejects(tiny_base, tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        make_cfg(tiny_base, tmp_path / "out", **overrides)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, mode", [("--feature-cache", "frozen"), ("--distill-cache", "distill")])
def test_a_cache_folder_that_is_a_file_is_named_with_its_flag(tiny_base, tmp_path, flag, mode):
    """Not the bare "[Errno 20] Not a directory" it gave once the base had loaded."""
    cache = tmp_path / "cache"
    cache.write_text("")
    field = flag[2:].replace("-", "_")
    for given in (cache, cache / "sub"):
        with pytest.raises(OSError, match=f"^{flag} {re.escape(str(given))} cannot be written: .* not a writable"):
            make_cfg(tiny_base, tmp_path / "out", mode=mode, **{field: str(given)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
