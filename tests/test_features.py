"""The feature cache: a frozen base's outputs on the training rows, filled once, resumed after a kill,
and computed again wherever its files or rows are damaged, never trained on as they are."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny

from blockdecode.training import features as features_module
from blockdecode.training.data import Pairs
from blockdecode.training.features import FEATURES, cached_features, features_key

ROWS = torch.randint(0, 60, (40, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> features_module.Features:
    """The features of ROWS, filled in one go."""
    return cached_features(tiny("llama"), ROWS, tmp_path_factory.mktemp("whole"), chunk=8, show=False)


def counting_forwards(monkeypatch) -> list[int]:
    """The rows each base forward of the fill runs on, from now on."""
    seen, real = [], features_module.sequence_logits
    monkeypatch.setattr(
        features_module, "sequence_logits", lambda m, ids, *a: seen.append(len(ids)) or real(m, ids, *a)
    )
    return seen


def assert_same(features: features_module.Features, whole: features_module.Features) -> None:
    for name in FEATURES:
        assert np.array_equal(getattr(features, name), getattr(whole, name)), name


def test_a_killed_feature_fill_resumes_where_it_stopped(whole, tmp_path, monkeypatch):
    real = features_module.sequence_logits
    calls = []

    def killed_on_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(features_module, "sequence_logits", killed_on_third)
    with pytest.raises(KeyboardInterrupt):
        cached_features(tiny("llama"), ROWS, tmp_path, chunk=8, show=False)
    seen = counting_forwards(monkeypatch)
    assert_same(cached_features(tiny("llama"), ROWS, tmp_path, chunk=8, show=False), whole)
    assert seen == [8, 8, 8]  # the three chunks the kill left


@pytest.mark.parametrize("name", FEATURES)
@pytest.mark.parametrize("damage", ["zeroed", "stale"])
def test_rows_marked_done_whose_bytes_changed_are_refilled(whole, tmp_path, monkeypatch, name, damage):
    """Zeroed (a lost write) or other bytes (a stale page) under an intact header: the rows' checksums
    no longer match, so they are computed again, with a warning, rather than trained on."""
    cached_features(tiny("llama"), ROWS, tmp_path, chunk=8, show=False)
    folder = tmp_path / features_key(tiny("llama"), ROWS)
    array = np.load(folder / f"{name}.npy", mmap_mode="r+")
    array[10:13] = 0 if damage == "zeroed" else array[20:23]
    array.flush()
    del array
    seen = counting_forwards(monkeypatch)
    with pytest.warns(UserWarning, match=f"{re.escape(str(folder))}: 3 of the 40 rows .* computing them again"):
        refilled = cached_features(tiny("llama"), ROWS, tmp_path, chunk=8, show=False)
    assert_same(refilled, whole)
    assert seen == [8]  # only the chunk holding rows 10..12
    assert_same(cached_features(tiny("llama"), ROWS, tmp_path, chunk=8, show=False), whole)  # whole again


@pytest.mark.parametrize(
    "damage, match",
    [
        ("truncated", "hidden.npy is not a readable .npy array"),
        ("header", "hidden.npy is not a readable .npy array \\(the magic string is not correct"),
        ("dtype", "hidden.npy holds float64 \\(40, 16, 64\\), not float32 \\(40, 16, 64\\)"),
        ("shape", "hidden.npy holds float32 \\(40, 16, 32\\), not float32 \\(40, 16, 64\\)"),
    ],
)
def test_a_damaged_feature_file_is_named_and_computed_again(whole, tmp_path, damage, match):
    """A file cut short is not grown back with zeros (numpy's "r+" would), and one of another layout
    or with a broken header is named: each is made anew and every row computed again."""
    cached_features(tiny("llama"), ROWS, tmp_path, chunk=8, show=False)
    path = tmp_path / features_key(tiny("llama"), ROWS) / "hidden.npy"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "header":
        path.write_bytes(b"\0" + path.read_bytes()[1:])
    else:
        np.save(path, {"dtype": np.ones((40, 16, 64)), "shape": np.ones((40, 16, 32), np.float32)}[damage])
    with pytest.warns(UserWarning, match=f"{match}.*: computing it again"):
        assert_same(cached_features(tiny("llama"), ROWS, tmp_path, chunk=8, show=False), whole)
    assert path.stat().st_size == Path(whole.hidden.filename).stat().st_size


def test_rows_of_another_shape_get_their_own_cache(tmp_path):
    """One token stream packed at two lengths holds the same tokens: the rows' shape is in the key,
    so --seq-len 32 and 48 do not share (and collide in) one cache."""
    stream = torch.randint(0, 60, (96,))
    short, long = stream.view(3, 32), stream.view(2, 48)
    assert features_key(tiny("llama"), short) != features_key(tiny("llama"), long)
    first = cached_features(tiny("llama"), short, tmp_path, show=False)
    second = cached_features(tiny("llama"), long, tmp_path, show=False)
    assert first.hidden.shape == (3, 32, 64) and second.hidden.shape == (2, 48, 64)


def test_a_refilled_pair_leaves_nothing_of_its_old_bytes_in_its_padding(tmp_path):
    """A chunk of pairs is computed at its own longest width: a damaged row refilled there must have
    the rest of its row cleared too, or the loss after its end would be stale bytes."""
    base = tiny("marian")
    decoder = torch.randint(3, 60, (16, 12), generator=torch.Generator().manual_seed(1))
    decoder[:8, 6:] = -1  # the first chunk is 6 positions wide
    pairs = Pairs(torch.randint(3, 60, (16, 5), generator=torch.Generator().manual_seed(2)), decoder)
    whole = cached_features(base, pairs, tmp_path / "whole", chunk=8, show=False)
    cached_features(base, pairs, tmp_path / "damaged", chunk=8, show=False)
    loss = np.load(tmp_path / "damaged" / features_key(base, pairs) / "loss.npy", mmap_mode="r+")
    loss[2, 8:] = 1.0
    loss.flush()
    del loss
    with pytest.warns(UserWarning, match="1 of the 16 rows"):
        assert_same(cached_features(base, pairs, tmp_path / "damaged", chunk=8, show=False), whole)


def test_the_outputs_are_read_from_a_whole_cache_of_layers_on_the_same_rows(whole, tmp_path, monkeypatch):
    """EAGLE-3's cache (its layers' inputs, and the outputs beside them) serves the heads' run on the same rows
    without another pass of the base; a cache of other rows, or one not yet whole, does not."""
    seen = counting_forwards(monkeypatch)
    with_layers = cached_features(tiny("llama"), ROWS, tmp_path, chunk=8, show=False, layers=(0, 1))
    assert with_layers.aux is not None and len(seen) == 5
    assert_same(cached_features(tiny("llama"), ROWS, tmp_path, chunk=8, show=False), whole)
    assert len(seen) == 5 and [p.name.count("-layers-") for p in tmp_path.iterdir()] == [1]  # no pass, no new cache
    cached_features(tiny("llama"), ROWS[:24], tmp_path, chunk=8, show=False)  # other rows: a cache of their own
    assert len(seen) == 8
    (layered,) = tmp_path.glob("*-layers-*")
    done = np.load(layered / "done.npy", mmap_mode="r+")
    done[-1] = False  # a fill of the layers stopped short: the outputs alone are computed, apart
    done.flush()
    assert_same(cached_features(tiny("llama"), ROWS, tmp_path, chunk=8, show=False), whole)
    assert len(seen) == 13 and len(list(tmp_path.iterdir())) == 3
