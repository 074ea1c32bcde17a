"""Where blockdecode wins, by model size (benchmarks/sizes.py): a tiny sweep writes every figure and its
plot, and (where llama.cpp is installed) a toy Llama written as GGUF decodes as transformers does."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import script

from blockdecode.core.hardware import auto_dtype
from blockdecode.core.hf import dtype_name
from blockdecode.decoding.reference import greedy_generate


@pytest.fixture(scope="module")
def sizes():
    return script("sizes")


def test_a_sweep_model_wins_its_argmax_by_a_wide_margin_so_engines_can_be_compared(sizes):
    model = sizes.build("tiny:64x2", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        top = model(ids).logits[0].float().topk(2, dim=-1).values
    assert (top[:, 0] - top[:, 1]).min() > 4.0  # far beyond bf16's rounding of logits this size


def test_a_tiny_sweep_writes_every_figure_and_its_plot(sizes, tmp_path):
    out = tmp_path / "sizes.json"
    report = sizes.main(["--sizes", "tiny:32x1,tiny:64x2", "--new-tokens", "12", "--prompts", "1", "--repeats", "1",
                         "--profile-prompts", "1", "--profile-tokens", "24", "--k", "4", "--tree", "6",
                         "--threads", "1", "--out", str(out)])  # fmt: skip
    assert set(report["profiles"]) == {"heads", "ngram"}
    assert report["dtype"] == dtype_name(auto_dtype()) and report["machine"]  # named in the JSON and the plot
    assert all(len(rates) == 3 and all(0 <= r <= 1 for r in rates) for rates in report["profiles"].values())
    rows = report["sizes"]
    assert [r["size"] for r in rows] == ["tiny:32x1", "tiny:64x2"] and rows[0]["parameters"] < rows[1]["parameters"]
    for row in rows:
        assert list(row["cost_ratio"]) == [1, 2, 4, 8, 16, 32] and row["cost_ratio"][1] == 1.0
        assert all(row["identical_to_greedy"].values())  # every engine continues as greedy does
        assert row["greedy_near_tie_share"] == 0.0  # so a drafter copying greedy's text can stand
        assert row["llama_cpp"] in ("measured", "not installed")
        assert len(row["speedup_over_transformers"]) == (4 if row["llama_cpp"] == "measured" else 3)
        if row["llama_cpp"] == "measured":  # one round: each over llama.cpp is its time against llama.cpp's
            theirs = row["speedup_over_transformers"]["llama.cpp greedy"]
            assert row["speedup_over_llama_cpp"]["transformers greedy"] == pytest.approx(1 / theirs)
    assert json.loads(out.read_text())["sizes"][1]["size"] == "tiny:64x2"
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("size", ["huge", "tiny:30x2", "tiny:64"])
def test_an_unknown_size_is_refused_by_name(sizes, size, capsys):
    with pytest.raises(SystemExit):
        sizes.parse_args(["--sizes", size])
    assert f"unknown size {size!r}" in capsys.readouterr().err


@pytest.mark.parametrize("bf16", [False, True])
def test_a_toy_llama_written_as_gguf_continues_as_transformers_does(sizes, tmp_path, bf16):
    """The GGUF writer's names, shapes and rotary permutation: llama.cpp's greedy tokens are
    transformers', in fp32 and in bf16 (the sweep's models win their argmax by a wide margin)."""
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = sizes.build("tiny:64x2", dtype, seed=3)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    ref = greedy_generate(model, ids, 24, eos_token_id=[])[0, 16:].tolist()
    path = tmp_path / "toy.gguf"
    sizes.write_gguf(model, path, bf16=bf16)
    got = sizes.llama_cpp_greedy(path, threads=1, context=64)(ids, 24).sequence
    assert got == ref


def test_a_gpu_asked_for_where_there_is_none_is_refused(sizes, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        sizes.parse_args(["--device", "cuda"])
    assert "--device cuda: this torch has no CUDA device" in capsys.readouterr().err


def test_an_unscaled_sweep_model_is_seen_to_tie(sizes):
    """The near-tie share tells a sweep model too flat to compare engines on: unscaled embeddings give ties."""
    model = sizes.build("tiny:64x2", torch.bfloat16, embed_scale=0.0)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    reference = greedy_generate(model, ids, 8, eos_token_id=[], min_new_tokens=8)
    assert sizes.near_tie_share(model, [reference], 24) > 0.5
    assert sizes.near_tie_share(sizes.build("tiny:64x2", torch.bfloat16), [reference], 24) == 0.0
