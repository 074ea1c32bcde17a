"""Training data: finding files, reading text and token arrays, packing and the held-out split."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from blockdecode.pretraining.corpus import train_tokenizer  # noqa: E402
from blockdecode.training.data import data_files, load_tokens, pack, split  # noqa: E402

EOS = 0


@pytest.fixture(scope="module")
def tokenizer():
    text = "def add(a, b):\n    return a + b\n\nclass Thing:\n    pass\n" * 20
    return train_tokenizer([text], vocab_size=300)


# ----------------------------------------------------------------------------- data_files


def test_data_files_walks_folders_sorted_and_filters_suffixes(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    for name in ("b.txt", "a.py", "sub/c.md", "sub/deeper/d.npy", "sub/e.json"):
        (tmp_path / name).write_text("x")
    for name in ("skip.bin", "sub/skip.pyc", "sub/deeper/noext"):
        (tmp_path / name).write_text("x")
    found = data_files([tmp_path])
    assert found == sorted(found)
    assert [p.relative_to(tmp_path).as_posix() for p in found] == [
        "a.py",
        "b.txt",
        "sub/c.md",
        "sub/deeper/d.npy",
        "sub/e.json",
    ]


def test_data_files_named_files_and_order(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "z.txt").write_text("x")
    (folder / "y.txt").write_text("x")
    odd = tmp_path / "notes.bin"  # a file named explicitly is taken whatever its suffix
    odd.write_text("x")
    found = data_files([str(odd), folder])
    assert found == [odd, folder / "y.txt", folder / "z.txt"]  # arguments in order, each folder sorted


def test_data_files_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data_files([tmp_path / "missing"])
    (tmp_path / "only.bin").write_text("x")
    with pytest.raises(ValueError, match="no training data found"):
        data_files([tmp_path])
    with pytest.raises(ValueError, match="no training data found"):
        data_files([])


# ----------------------------------------------------------------------------- load_tokens


def test_load_tokens_npy_int_arrays(tmp_path):
    np.save(tmp_path / "a.npy", np.array([[3, 4], [5, 6]], dtype=np.int32))  # any shape: flattened
    np.save(tmp_path / "b.npy", np.array([7, 8, 9], dtype=np.uint16))
    tokens = load_tokens([tmp_path / "a.npy", tmp_path / "b.npy"])
    assert tokens.dtype == torch.long
    assert tokens.tolist() == [3, 4, 5, 6, 7, 8, 9]
    with_eos = load_tokens([tmp_path], eos_token_id=EOS)  # the folder: a.npy then b.npy
    assert with_eos.tolist() == [3, 4, 5, 6, EOS, 7, 8, 9, EOS]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_])
def test_load_tokens_rejects_non_integer_arrays(tmp_path, dtype):
    np.save(tmp_path / "x.npy", np.ones(10, dtype=dtype))
    with pytest.raises(ValueError, match="not integer token ids"):
        load_tokens([tmp_path / "x.npy"])


def test_a_damaged_npy_in_the_data_is_named_with_numpys_reason(tmp_path):
    """Not numpy's "this file contains pickled (object) data", which it says of any other bytes."""
    np.save(tmp_path / "x.npy", np.arange(10))
    (tmp_path / "x.npy").write_bytes(b"\0" + (tmp_path / "x.npy").read_bytes()[1:])
    with pytest.raises(ValueError, match="x.npy is not a readable .npy array \\(the magic string is not correct"):
        load_tokens([tmp_path / "x.npy"])


def test_load_tokens_text_with_tokenizer_and_eos(tmp_path, tokenizer):
    first, second = "def add(a, b):\n    return a + b\n", "class Thing:\n    pass\n"
    (tmp_path / "1.py").write_text(first)
    (tmp_path / "2.txt").write_text(second)
    ids_1, ids_2 = tokenizer(first).input_ids, tokenizer(second).input_ids
    assert load_tokens([tmp_path], tokenizer).tolist() == ids_1 + ids_2
    eos = tokenizer.eos_token_id
    assert load_tokens([tmp_path], tokenizer, eos).tolist() == ids_1 + [eos] + ids_2 + [eos]
    assert tokenizer.decode(load_tokens([tmp_path / "1.py"], tokenizer)) == first  # byte-level: round-trips


def test_load_tokens_mixes_text_and_arrays(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("pass\n")
    np.save(tmp_path / "b.npy", np.array([11, 12], dtype=np.int64))
    tokens = load_tokens([tmp_path], tokenizer, 5)
    assert tokens.tolist() == tokenizer("pass\n").input_ids + [5, 11, 12, 5]


def test_load_tokens_text_needs_a_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokens([tmp_path / "a.txt"])


def test_load_tokens_invalid_utf8_is_read(tmp_path, tokenizer):
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe ok")
    assert len(load_tokens([tmp_path / "bad.txt"], tokenizer)) > 0


def test_load_tokens_empty(tmp_path, tokenizer):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="no tokens"):
        load_tokens([tmp_path / "empty.txt"], tokenizer)
    np.save(tmp_path / "empty.npy", np.zeros(0, dtype=np.int64))
    with pytest.raises(ValueError, match="no tokens"):
        load_tokens([tmp_path / "empty.npy"])
    # with an EOS separator an empty document is one EOS: not an error here, pack() decides
    assert load_tokens([tmp_path / "empty.txt"], tokenizer, EOS).tolist() == [EOS]


# ----------------------------------------------------------------------------- pack


def test_pack_drops_the_ragged_tail():
    packed = pack(torch.arange(11), 3)
    assert packed.shape == (3, 3)
    assert packed.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert pack(torch.arange(12), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # exact multiple
    assert pack(torch.arange(5), 5).shape == (1, 5)


def test_pack_too_short():
    with pytest.raises(ValueError, match="fewer than one sequence of 8"):
        pack(torch.arange(7), 8)


# ----------------------------------------------------------------------------- split


def test_split_holds_out_the_tail_deterministically():
    sequences = torch.arange(100).view(20, 5)
    train, held = split(sequences, 0.2)
    assert len(train) == 16 and len(held) == 4
    assert torch.equal(held, sequences[-4:]) and torch.equal(train, sequences[:16])
    again_train, again_held = split(sequences.clone(), 0.2)
    assert torch.equal(again_train, train) and torch.equal(again_held, held)
    assert not set(train.flatten().tolist()) & set(held.flatten().tolist())


@pytest.mark.parametrize(
    "n, fraction, held", [(20, 0.001, 1), (2, 0.5, 1), (10, 0.05, 1), (40, 0.05, 2), (10, 0.25, 2)]
)
def test_split_sizes(n, fraction, held):
    train, out = split(torch.zeros(n, 4, dtype=torch.long), fraction)
    assert len(out) == held and len(train) == n - held


def test_split_never_leaves_training_empty():
    """A large fraction of few sequences must still leave something to train on."""
    train, held = split(torch.arange(12).view(3, 4), 0.9)
    assert len(train) >= 1 and len(held) >= 1, f"{len(train)} training sequences, {len(held)} held out"


@pytest.mark.parametrize("fraction", [0, 1, -0.1, 1.5])
def test_split_rejects_bad_fractions(fraction):
    with pytest.raises(ValueError, match="holdout must lie in"):
        split(torch.zeros(10, 4, dtype=torch.long), fraction)


def test_split_needs_two_sequences():
    with pytest.raises(ValueError, match="at least 2 sequences"):
        split(torch.zeros(1, 4, dtype=torch.long), 0.5)


def test_a_bad_npy_file_is_named(tmp_path) -> None:
    bad = tmp_path / "tokens.npy"
    bad.write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match="tokens.npy is not a readable .npy array"):
        load_tokens([bad])
