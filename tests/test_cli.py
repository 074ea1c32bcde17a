"""The `blockdecode` command as a user runs it: generate with --compare, and the demo."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockdecode import BlockwiseLM, demo
from blockdecode.cli import main
from blockdecode.corpus import train_tokenizer
from blockdecode.toy import toy_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved BlockwiseLM with its tokenizer, as `blockdecode generate --model` takes it."""
    text = "\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(200))
    tokenizer = train_tokenizer([text], vocab_size=300)
    base = toy_model("llama", vocab=len(tokenizer), context=256)
    directory = tmp_path_factory.mktemp("model")
    BlockwiseLM.from_base(base, k=4).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_generate_compare_reports_identical(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    main(["generate", "--model", str(model_dir), "--prompt", "def f(x):", "--max-new-tokens", "20", "--compare"])
    out, err = capsys.readouterr()
    assert out.startswith("def f(x):")
    assert "calls" in err and "mean accepted block" in err
    assert "identical: yes" in err


def test_generate_with_ngram_drafter_on_a_plain_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A transformers directory without heads gets untrained heads and a note saying so."""
    tokenizer = train_tokenizer(["a b c d e f g " * 50], vocab_size=270)
    toy_model("gpt2", vocab=len(tokenizer), context=128).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    main(["generate", "--model", str(tmp_path), "--prompt", "a b c", "--max-new-tokens", "12", "--drafter", "ngram"])
    err = capsys.readouterr().err
    assert "no trained heads" in err and "ngram" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "x", "--k", "9"], "k must be between 1 and the heads' block size 4"),
        (["--prompt", "x", "--max-new-tokens", "1000"], "exceeds the model's context of 256"),
        (["--prompt", ""], "prompt is empty"),
    ],
)
def test_generate_bad_input_exits_with_a_clear_message(model_dir: Path, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["generate", "--model", str(model_dir), *argv])


def test_generate_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no such directory"):
        main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"])


class Letters:
    """A tokenizer stand-in: token i is the i-th letter."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_block_printer_marks_every_block(capsys: pytest.CaptureFixture) -> None:
    for colour, expected in ((False, "a|bc|def|"), (True, f"{demo.COLOURS[0]}a{demo.RESET}{demo.COLOURS[1]}bc")):
        printer = demo.BlockPrinter(Letters(), colour)
        for block in ([0], [1, 2], [3, 4, 5]):
            printer(block)
        assert capsys.readouterr().out.startswith(expected)


@pytest.mark.parametrize("drafter", ["heads", "ngram"])
def test_demo_streams_blocks_and_prints_a_table(model_dir: Path, drafter: str, capsys: pytest.CaptureFixture) -> None:
    rows = demo.run_demo(str(model_dir), max_new_tokens=12, prompts=("def f(x):\n",), repeats=1, drafter=drafter)
    out = capsys.readouterr().out
    assert "identical" in out and "median speedup" in out and rows[0].prompt == "def f(x):\n"
    assert ("n-gram drafter" in out) == (drafter == "ngram")
    assert rows[0].new_tokens == 12 and rows[0].calls >= 1 and rows[0].mean_block >= 1.0
    assert rows[0].identical or "top-2 logit gap" in out


def test_train_with_a_missing_base_exits_with_a_clear_message(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("x = 1\n" * 100)
    with pytest.raises(SystemExit, match="error: .*nope"):
        main(["train", "--base", str(tmp_path / "nope"), "--data", str(corpus), "--out", str(tmp_path / "o")])


def test_threads_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        main(["--threads", "0", "demo"])


def test_demo_runs_on_a_plain_transformers_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A folder saved by transformers alone, no heads: the demo loads it through the same loader as
    generate, with untrained heads, and still decodes exactly."""
    tokenizer = train_tokenizer(["def f(x):\n    return x\n" * 50], vocab_size=270)
    toy_model("gpt2", vocab=len(tokenizer), context=128).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    main(["demo", "--model", str(tmp_path), "--max-new-tokens", "8", "--dtype", "fp32", "--k", "3"])
    out = capsys.readouterr().out
    assert f"from {tmp_path}" in out and "k=3" in out and "outputs identical: yes" in out


def row(**kw) -> demo.DemoRow:
    base = dict(prompt="def f():\n", greedy_tok_s=100.0, blockwise_tok_s=150.0, speedup=1.5, calls=10,
                new_tokens=20, mean_block=2.0, identical=True, divergence="", near_tie=False, dtype="bf16")  # fmt: skip
    return demo.DemoRow(**{**base, **kw})


def test_the_summary_tells_a_near_tie_from_a_real_divergence(capsys: pytest.CaptureFixture) -> None:
    tie = row(identical=False, near_tie=True, divergence="first differing token at position 9; gap 0")
    demo.print_table([row(), tie])
    out = capsys.readouterr().out
    assert "outputs identical: yes, but for 1 near-tie flip" in out and "within bf16 rounding" in out
    assert "REAL" not in out
    demo.print_table([row(), tie, row(identical=False, divergence="position 4; gap 3.2")])
    out = capsys.readouterr().out
    assert "outputs identical: NO" in out and "a REAL divergence" in out


def test_near_tie_is_judged_by_the_dtype_rounding() -> None:
    import torch

    from blockdecode.reference import Divergence

    assert Divergence(5, 0.05, 12.0).near_tie(torch.bfloat16)  # bf16's ulp at 12 is 0.0625
    assert not Divergence(5, 0.05, 12.0).near_tie(torch.float32)
    assert Divergence(5, 5e-5, 12.0).near_tie(torch.float32)
    assert not Divergence(5, 1.0, 12.0).near_tie(torch.bfloat16)


def test_calibrate_prints_the_budgets_and_caches_the_choice(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    main(["calibrate", "--model", str(model_dir), "--dtype", "fp32", "--drafter", "ngram", "--k", "3"])
    out = capsys.readouterr().out
    assert "chain:" in out and "tree of 64:" in out and "<- chosen" in out and "--tree auto decodes with" in out
    assert (tmp_path / "blockdecode" / "calibration.json").is_file()
    main(["generate", "--model", str(model_dir), "--prompt", "def f(x):", "--max-new-tokens", "8", "--tree", "auto",
          "--drafter", "ngram", "--k", "3", "--compare"])  # fmt: skip
    assert "identical: yes" in capsys.readouterr().err
