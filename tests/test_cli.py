"""The `blockdecode` command as a user runs it: generate with --compare, and the demo."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from blockdecode import BlockwiseLM, builtin
from blockdecode.cli import main
from blockdecode.commands import demo
from blockdecode.core.toy import toy_model
from blockdecode.pretraining.bible import HELD_OUT_VERSES
from blockdecode.pretraining.corpus import train_tokenizer


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
    main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "def f(x):",
            "--max-new-tokens",
            "20",
            "--compare",
            "--tree",
            "off",
            "--dtype",
            "fp32",
        ]
    )
    out, err = capsys.readouterr()
    assert out.startswith("def f(x):")
    assert "calls" in err and "mean accepted block" in err
    assert "identical: yes" in err


@pytest.mark.parametrize("heal", [True, False])
def test_generate_heals_a_prompt_that_ends_mid_token_and_says_so(
    model_dir: Path, heal: bool, capsys: pytest.CaptureFixture
) -> None:
    """A bare newline (which this tokenizer writes with the next line's indent) is written again by the
    model; --compare holds the output to transformers with the same constraint. --no-heal: as it is."""
    argv = ["generate", "--model", str(model_dir), "--prompt", "def f(x):\n", "--max-new-tokens", "12"]
    main([*argv, "--compare", "--tree", "off", "--dtype", "fp32", *([] if heal else ["--no-heal"])])
    out, err = capsys.readouterr()
    assert out.startswith("def f(x):\n") and "identical: yes" in err
    assert ("token healing: the prompt ends mid-token, in '\\n'" in err) == heal
    assert err.count("(--no-heal: off)") == heal


def test_generate_on_a_plain_model_dir_drafts_by_lookup(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A transformers directory without heads: the default drafts by suffix lookup and says why; n-gram lookup,
    which needs no heads, says nothing of them."""
    tokenizer = train_tokenizer(["a b c d e f g " * 50], vocab_size=270)
    toy_model("gpt2", vocab=len(tokenizer), context=128).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--prompt", "a b c", "--max-new-tokens", "12", "--tree", "off"]
    main([*argv, "--drafter", "ngram"])
    err = capsys.readouterr().err
    assert "no trained heads" not in err and "(ngram, k=16" in err
    main(argv)
    err = capsys.readouterr().err
    assert "no trained heads: the default drafts by suffix lookup" in err and "(suffix, k=16" in err


def test_generate_translates_with_an_encoder_decoder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A seq2seq folder: the prompt is the source, the output the decoder's text, exact by default."""
    tokenizer = train_tokenizer(["the cat sat on the mat and the dog sat on the log " * 40], vocab_size=280)
    toy_model("marian", vocab=len(tokenizer), context=128).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    main(["generate", "--model", str(tmp_path), "--prompt", "the cat sat", "--max-new-tokens", "16", "--compare",
          "--dtype", "fp32", "--k", "4"])  # fmt: skip
    out, err = capsys.readouterr()
    assert not out.startswith("the cat sat")  # a translation, not a continuation of the source
    assert "identical: yes" in err and "greedy (transformers): 16 tokens" in err


def test_the_code_demo_refuses_an_encoder_decoder_by_name(tmp_path: Path) -> None:
    toy_model("t5", vocab=64, context=32).save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="is an encoder-decoder model: translate with `blockdecode demo --task transl"):
        main(["demo", "--model", str(tmp_path)])


def test_demo_translates_verses_with_an_encoder_decoder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`demo --task translate`: each held-out verse, its translation streamed, then the table."""
    from blockdecode.pretraining.bible import read_tsv
    from blockdecode.pretraining.translation import marian_generation_config, translation_tokenizer

    verses = read_tsv(Path(__file__).parent / "data" / "bible" / "train.tsv")
    tokenizer = translation_tokenizer([t for p in verses for t in (p.source, p.target)], 400)
    model = toy_model("marian", vocab=len(tokenizer), context=128)
    model.config.decoder_start_token_id = tokenizer.pad_token_id
    model.generation_config = marian_generation_config(tokenizer, 128)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    rows = demo.run_demo(str(tmp_path), max_new_tokens=24, dtype=torch.float32, repeats=1, task="translate", k=4)
    out = capsys.readouterr().out
    assert HELD_OUT_VERSES[0] in out and "\n  -> " in out and "identical: yes" in out
    assert len(rows) == len(HELD_OUT_VERSES) and all(r.identical for r in rows)
    with pytest.raises(ValueError, match="--task code needs a causal LM"):
        demo.run_demo(str(tmp_path), task="code", dtype=torch.float32)


def test_demo_translate_refuses_a_causal_model(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="--task translate needs an encoder-decoder"):
        demo.run_demo(str(model_dir), task="translate", dtype=torch.float32)


def test_demo_translate_without_a_model_says_how_to_build_one(tmp_path: Path, monkeypatch) -> None:
    """An install without the built-in translation model (removed, or a source tree without it)."""
    missing = str(tmp_path / "translation_model")
    monkeypatch.setattr(builtin, "DEFAULT_TRANSLATION_MODEL", missing)
    monkeypatch.setattr(demo, "DEFAULT_TRANSLATION_MODEL", missing)
    with pytest.raises(SystemExit, match="translation model is not installed; `bash recipes/translation.sh`"):
        main(["demo", "--task", "translate"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "x", "--drafter", "heads", "--k", "9"], "k must be between 1 and the heads' block size 4"),
        (["--prompt", "x", "--max-new-tokens", "1000"], "exceeds the model's context of 256"),
        (["--prompt", ""], "prompt is empty"),
    ],
)
def test_generate_bad_input_exits_with_a_clear_message(model_dir: Path, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["generate", "--model", str(model_dir), *argv])  # with --tree auto: refused before calibrating


def test_generate_samples_reproducibly_with_a_seed(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    def run(*flags: str) -> tuple[str, str]:
        main(["generate", "--model", str(model_dir), "--prompt", "def f(x):", "--max-new-tokens", "16", *flags])
        return capsys.readouterr()

    settings = ["--sample", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9"]
    first, err = run(*settings, "--seed", "3")
    assert "sampled (temperature=0.7, top_k=5, top_p=0.9, --seed 3): exact in distribution" in err
    assert run(*settings, "--seed", "3")[0] == first != run(*settings, "--seed", "4")[0]
    assert run("--sample", "--top-k", "1")[0] == run("--tree", "off")[0]  # one token left: greedy's


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "0.7", "--seed", "1"], "--temperature, --seed applies only when sampling: add --sample"),
        (["--sample", "--compare"], "--compare checks the output against greedy decoding"),
        (["--sample", "--temperature", "0"], "argument --temperature: must be a number > 0, got 0 "),
        (["--sample", "--top-k", "-1"], r"argument --top-k: must be an integer >= 0 \(0: off\), got -1"),
        (["--sample", "--top-p", "1.5"], r"argument --top-p: must lie in \(0, 1\] \(1: off\)"),
        (["--sample", "--acceptance", "topk:2"], "--acceptance topk:2 is approximate, which has no exact meaning"),
        (
            ["--sample", "--seed", str(2**70)],
            rf"argument --seed: must be an integer from 0 to 2\*\*64 - 1, got {2**70}",
        ),
        (["--drafter", "heads+ngram", "--tree", "off"], r"--drafter heads\+ngram shares a tree among its drafters"),
        (["--tree", "2000"], "argument --tree: must be off, auto, expected or a budget from 1 to 1024, got 2000 "),
    ],
)
def test_generate_bad_settings_are_named_in_its_flags_before_loading(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    """In the command's own flags (not the Python API's do_sample=, top_p= or tree=), before any model
    folder is read."""
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--model", "/nonexistent", "--prompt", "x", *argv])
    said = f"{stop.value.code}\n{capsys.readouterr().err}"
    assert re.search(message, said), said
    assert "nonexistent" not in said and not re.search(r"\w=", said)  # no do_sample=False, top_p= or tree=N


def test_generate_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no such directory"):
        main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"])


class Letters:
    """A tokenizer stand-in: token i is the i-th letter."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_block_printer_marks_every_block(capsys: pytest.CaptureFixture) -> None:
    for colour, expected in ((False, "a|bc|def|"), (True, f"{demo.COLOURS[0]}a{demo.RESET}{demo.COLOURS[1]}bc")):
        printer = demo.BlockPrinter(Letters(), colour)
        for block in ([0], [1, 2], [3, 4, 5]):
            printer(block)
        assert capsys.readouterr().out.startswith(expected)


@pytest.mark.parametrize("drafter", ["heads", "ngram"])
def test_demo_streams_blocks_and_prints_a_table(model_dir: Path, drafter: str, capsys: pytest.CaptureFixture) -> None:
    rows = demo.run_demo(
        str(model_dir), max_new_tokens=12, prompts=("def f(x):\n",), repeats=1, drafter=drafter, tree=None
    )
    out = capsys.readouterr().out
    assert "identical" in out and "median speedup" in out and rows[0].prompt == "def f(x):\n"
    assert ("n-gram drafter" in out) == (drafter == "ngram")
    assert rows[0].new_tokens == 12 and rows[0].calls >= 1 and rows[0].mean_block >= 1.0
    assert rows[0].identical or "top-2 logit gap" in out


def test_demo_heals_a_prompt_that_ends_mid_token_and_says_so(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = ("def f(x):\n", "def f(x):")
    rows = demo.run_demo(str(model_dir), max_new_tokens=8, prompts=prompts, repeats=1, drafter="heads", tree=None)
    out = capsys.readouterr().out
    assert out.count("token healing: the prompt ends mid-token") == 1 and "outputs identical: yes" in out
    assert [r.new_tokens for r in rows] == [8, 8] and "(--no-heal: off)\ndef f(x):\n" in out
    assert "def f(x):\n\n" not in out.replace("|", "")  # the newline shown once: in the healed block


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
    main(["demo", "--model", str(tmp_path), "--max-new-tokens", "8", "--dtype", "fp32", "--k", "3", "--tree", "off"])
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

    from blockdecode.decoding.reference import Divergence

    assert Divergence(5, 0.05, 12.0).near_tie(torch.bfloat16)  # bf16's ulp at 12 is 0.0625
    assert not Divergence(5, 0.05, 12.0).near_tie(torch.float32)
    assert Divergence(5, 5e-5, 12.0).near_tie(torch.float32)
    assert not Divergence(5, 1.0, 12.0).near_tie(torch.bfloat16)


def test_calibrate_prints_the_budgets_and_caches_the_choice(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    main(["calibrate", "--model", str(model_dir), "--dtype", "fp32", "--k", "3"])
    out = capsys.readouterr().out
    for name in ("heads", "ngram", "heads+ngram"):  # --drafter auto predicts each, trees and chains
        assert re.search(rf"^ *{re.escape(name)}: .*\b1: \d+", out, re.M), out
    assert re.search(r"^ *heads: chain: \d+", out, re.M) and re.search(r"^ *ngram: chain: \d+", out, re.M), out
    assert not re.search(r"^ *heads\+ngram: chain", out, re.M)  # shared drafters have no chain
    assert out.count("*") == 3 and "--tree auto decodes with" in out  # each drafter's best marked
    assert "--tree expected ranks each call's candidates" in out  # and what a ranked tree starts from
    assert re.search(r"^ngram match \d [a-z ]+ +\d\.\d\d +\d\.\d\d +\d+\.\d$", out, re.M), out
    assert (tmp_path / "blockdecode" / "calibration.json").is_file()
    main(["generate", "--model", str(model_dir), "--prompt", "def f(x):", "--max-new-tokens", "8", "--tree", "auto",
          "--dtype", "fp32",
          "--drafter", "ngram", "--k", "3", "--compare"])  # fmt: skip
    assert "identical: yes" in capsys.readouterr().err


def test_value_map_that_is_not_a_list(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "v.json").write_text("3")
    with pytest.raises(SystemExit, match="must hold a JSON list of numbers"):
        main(["generate", "--model", str(model_dir), "--prompt", "x", "--acceptance", "distance:1",
              "--value-map", str(tmp_path / "v.json")])  # fmt: skip


def test_prompt_from_standard_input(model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("def g(y):"))
    main(["generate", "--model", str(model_dir), "--prompt", "-", "--max-new-tokens", "4", "--tree", "off"])
    assert capsys.readouterr().out.startswith("def g(y):")


def test_threads_beyond_the_machine_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--threads", "100000", "demo"])
    assert "--threads 100000: this machine has" in capsys.readouterr().err


def run_cli(args: list[str], env: dict | None = None, **kw):
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # Were the policy to fail, the hub would be this closed local port: nothing leaves the machine.
    base |= {"HF_ENDPOINT": "http://127.0.0.1:9", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "blockdecode.cli", *args]
    return subprocess.Popen(cmd, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_a_hub_name_offline_fails_without_reaching_the_hub(tmp_path: Path) -> None:
    """Without HF_HUB_OFFLINE set at all, the command still stays offline and names the model: the hub is a
    local port that listens and never answers, and no connection reaches it (one would sit in its queue)."""
    import socket

    (tmp_path / "c.txt").write_text("x = 1\n" * 50)
    with socket.create_server(("127.0.0.1", 0)) as hub:
        endpoint = f"http://127.0.0.1:{hub.getsockname()[1]}"
        proc = run_cli(["train", "--base", "someone/no-such-model", "--data", str(tmp_path / "c.txt"),
                        "--out", str(tmp_path / "o")], env={"HF_ENDPOINT": endpoint})  # fmt: skip
        _, err = proc.communicate(timeout=600)  # a guard against a hang, not a bound on speed
        hub.setblocking(False)
        with pytest.raises(BlockingIOError):
            hub.accept()  # nothing connected
    assert proc.returncode == 1 and "someone/no-such-model" in err and "Traceback" not in err
    assert "offline" in err and not (tmp_path / "o").exists()


def test_ctrl_c_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """SIGINT to a running demo: exit code 130, a single line on stderr, nothing written."""
    import signal

    # SIGINT handled as a terminal would, even when the tests themselves run as a background job (ignored there).
    restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = run_cli(["demo", "--dtype", "fp32", "--max-new-tokens", "400", "--tree", "off"], cwd=tmp_path,
                   preexec_fn=restore)  # fmt: skip
    line = proc.stdout.readline()  # the demo's header: the model is loaded and decoding
    assert line.startswith("blockdecode demo:"), line
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)  # a guard against a hang
    assert proc.returncode == 130
    assert err.strip().splitlines() == ["interrupted"]
    assert list(tmp_path.iterdir()) == []


def test_a_prompt_that_is_not_utf8_is_one_line(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(model_dir), "--prompt", b"\xff".decode("utf-8", "surrogateescape")])
    assert "--prompt is not valid UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_settings_are_checked_before_the_model_loads(command: str, capsys: pytest.CaptureFixture) -> None:
    """demo --k 0 no longer becomes k=10; a bad value fails with the model folder never read."""
    base = [command, "--model", "/nonexistent", *(["--prompt", "x"] if command == "generate" else [])]
    for flag in ("--k", "--max-new-tokens"):
        with pytest.raises(SystemExit):
            main([*base, flag, "0"])
        err = capsys.readouterr().err
        assert f"argument {flag}: must be an integer >= 1, got 0" in err and "nonexistent" not in err
    if command == "generate":
        with pytest.raises(SystemExit, match="topk:N needs an integer N >= 1"):
            main(["generate", "--model", "/nonexistent", "--prompt", "x", "--acceptance", "topk:0"])


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["demo"]])
@pytest.mark.parametrize("drafter", ["auto", "suffix"])
def test_an_empty_corpus_path_is_refused_not_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], drafter: str
) -> None:
    """--corpus "" would be Path(""), the current folder read whole: refused before loading, as the API refuses it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.txt").write_text("never drafted from")
    with pytest.raises(SystemExit, match="^error: --corpus: an empty path names nothing: give files or folders$"):
        main([*command, "--model", "/nonexistent", "--drafter", drafter, "--corpus", "notes.txt", "--corpus", ""])


def test_a_corrupt_tokenizer_names_its_file(model_dir: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "m"
    shutil.copytree(model_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(SystemExit, match="tokenizer.json cannot be read"):
        main(["generate", "--model", str(broken), "--prompt", "x"])


def test_the_first_generate_chooses_its_setting_without_decoding_to_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """By default the first `generate` decodes at once (each call's tree ranked as it goes). With `--tree
    auto` and an empty cache, it predicts its setting from the statistics shipped beside it and a few
    short timings: it decodes a few dozen tokens per drafter to time the loop, never the hundreds a search
    by decoding took, and says so in one line. Counted in decodes and tokens, not seconds: a busy machine
    is slower, never a reason to fail."""
    from blockdecode.decoding import calibrate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    decoded, real = [], calibrate.decode
    monkeypatch.setattr(
        calibrate, "decode", lambda model, ids, n, plan, **kw: decoded.append(n) or real(model, ids, n, plan, **kw)
    )
    # One thread, as each test worker has: two on a core another worker holds time a busy machine's curve, not cached
    main(["--threads", "1", "generate", "--prompt", "def fib(n):", "--max-new-tokens", "16"])
    assert not decoded and "ranked trees" in capsys.readouterr().err  # the default ranks: nothing to choose first
    main(["--threads", "1", "generate", "--prompt", "def fib(n):", "--max-new-tokens", "16", "--tree", "auto"])
    err = capsys.readouterr().err
    assert err.count("choosing drafters and tree") == 1
    entries = json.loads((tmp_path / "blockdecode" / "calibration.json").read_text())
    assert any(key.startswith("cost|") for key in entries), err  # the ranked default's cost curve, cached beside it
    (found,) = [entry for key, entry in entries.items() if not key.startswith("cost|")]
    assert found["statistics"] == "shipped"
    # Only the timing decodes: a warm-up and one timed decode per drafter, for its tree and its chain, a few
    # hundred tokens in all, where searching by decoding took thousands; the statistics decode nothing.
    assert set(decoded) <= {4, calibrate.COST_TOKENS} and len(decoded) <= len(calibrate.CHOICES) * 2 * 2
    assert sum(decoded) <= len(calibrate.CHOICES) * 2 * (4 + calibrate.COST_TOKENS)


def edit_config(folder: Path, **changes) -> None:
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


@pytest.mark.parametrize("command", [["generate", "--prompt", "the cat sat"], ["demo", "--task", "translate"]])
def test_an_encoder_decoder_config_with_a_value_transformers_refuses_is_one_line(
    tmp_path: Path, command: list[str]
) -> None:
    tokenizer = train_tokenizer(["the cat sat on the mat and the dog sat on the log " * 40], vocab_size=280)
    toy_model("marian", vocab=len(tokenizer), context=128).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    edit_config(tmp_path, d_model="abc")
    config = re.escape(str(tmp_path / "config.json"))
    with pytest.raises(SystemExit, match=f"^error: {config} is invalid: .*'d_model' expected int, got str[^\n]*$"):
        main([command[0], "--model", str(tmp_path), *command[1:]])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": 300}, r"\S+\.weight is \(\d+, 64\) in the weights, \(300, 64\) by the config$"),
        ({"num_hidden_layers": 3}, r"the weights lack \d+ tensor\(s\) the config asks for, e.g. model.layers.2\."),
    ],
    ids=["vocab_size", "more-layers"],
)
def test_a_config_that_does_not_fit_its_weights_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, change: dict, message: str
) -> None:
    """Not transformers' load report and a traceback, nor a model decoding with random weights."""
    tokenizer = train_tokenizer(["a b c d e f g " * 50], vocab_size=270)
    toy_model("llama", vocab=len(tokenizer), context=128).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    edit_config(tmp_path, **change)
    where = re.escape(f"{tmp_path / 'config.json'} does not fit the weights in {tmp_path}")
    with pytest.raises(SystemExit, match=f"^error: {where}: {message}"):
        main(["generate", "--model", str(tmp_path), "--prompt", "a b c", "--tree", "off"])
    assert "LOAD REPORT" not in capsys.readouterr().err


def test_weights_the_config_does_not_use_are_left_out_with_a_warning(tmp_path: Path) -> None:
    from blockdecode.loading import load_base

    toy_model("llama").save_pretrained(tmp_path)
    edit_config(tmp_path, num_hidden_layers=1)
    with pytest.warns(UserWarning, match=rf"^{re.escape(str(tmp_path))}: \d+ tensor\(s\) .* e.g. model.layers.1\."):
        assert load_base(str(tmp_path)).config.num_hidden_layers == 1


def damage(path: Path, how: str) -> None:
    """Bytes that are neither UTF-8 nor JSON in place of the file, or its first half only."""
    data = path.read_bytes()
    path.write_bytes(b"\x89PNG\xff\xfe\x00{" if how == "garbage" else data[: len(data) // 2])


@pytest.mark.parametrize(
    ("case", "how"),
    [
        ("model config", "garbage"),
        ("model config", "truncated"),
        ("model prompts", "garbage"),
        ("model prompts", "truncated"),
        ("train.tsv", "garbage"),
        ("tokenizer", "garbage"),
        ("tokenizer", "truncated"),
        ("bench prompts", "garbage"),
    ],
)
def test_a_damaged_file_is_one_line_naming_it(model_dir: Path, tmp_path: Path, case: str, how: str) -> None:
    model, corpus, prompts = tmp_path / "model", tmp_path / "corpus", tmp_path / "prompts.json"
    shutil.copytree(model_dir, model)
    shutil.copytree(Path(__file__).parent / "data" / "bible", corpus)
    for path in (model / "prompts.json", prompts):
        path.write_text(json.dumps(["def f(x):", "def g(y):"]))
    translation = ["pretrain-translation", "--corpus", str(corpus), "--out", str(tmp_path / "out"), "--steps", "1"]
    file, argv = {
        "model config": (model / "config.json", ["demo", "--model", str(model)]),
        "model prompts": (model / "prompts.json", ["generate", "--model", str(model), "--prompt", "def"]),
        "train.tsv": (corpus / "train.tsv", translation),
        "tokenizer": (model / "tokenizer_config.json", [*translation, "--tokenizer", str(model)]),
        "bench prompts": (prompts, ["bench", "--quick", "--model", str(model), "--prompts", str(prompts)]),
    }[case]
    damage(file, how)
    with pytest.raises(SystemExit, match=f"^error: {re.escape(str(file))}[: ][^\n]*$"):
        main(argv)


TRAIN = ["train", "--data", "x", "--out", "o"]
INT64 = "an integer from -2**63 to 2**63 - 1"
SEED = "an integer from 0 to 2**64 - 1"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        ([*TRAIN, "--draft-vocab", "2.5"], f"argument --draft-vocab: must be {INT64}, got 2.5"),
        ([*TRAIN, "--steps", str(2**63)], f"argument --steps: must be {INT64}, got {2**63}"),
        ([*TRAIN, "--seed", str(2**64)], f"argument --seed: must be {SEED}, got {2**64}"),
        (["pretrain", "--corpus", "c", "--out", "o", "--seed", "-1"], f"argument --seed: must be {SEED}, got -1"),
        (["pretrain-translation", "--corpus", "c", "--out", "o", "--heads", "1e3"],
         f"argument --heads: must be {INT64}, got 1e3"),
        (["bench", "--batches", "4,x"], "argument --batches: must be an integer >= 1, got x"),
        (["generate"], "one of the arguments --prompt --chat is required"),
    ],
)  # fmt: skip
def test_a_bad_flag_is_one_line_naming_it_and_the_help(argv: list[str], error: str, tmp_path, monkeypatch, capsys):
    """Not the whole usage. An integer beyond what torch takes (a seed beyond 0..2**64 - 1) is refused
    here, not by torch's "Overflow when unpacking long long" once the model has loaded."""
    monkeypatch.chdir(tmp_path)  # were a flag taken, the run writes here
    with pytest.raises(SystemExit) as stop:
        main(argv)
    command = f"blockdecode {argv[0]}"
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"{command}: error: {error} (see {command} --help)\n"


def test_a_seed_torch_takes_is_taken_whole(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    main(["generate", "--model", str(model_dir), "--prompt", "def f(x):", "--max-new-tokens", "4", "--sample",
          "--tree", "off", "--seed", str(2**64 - 1)])  # fmt: skip
    assert f"--seed {2**64 - 1}): exact in distribution" in capsys.readouterr().err


def test_a_tree_sampling_cannot_use_is_one_note_not_a_warning(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["generate", "--model", str(model_dir), "--prompt", "def f(x):", "--max-new-tokens", "4", "--sample",
              "--tree", "16"])  # fmt: skip
    err = capsys.readouterr().err
    assert not caught and "warning" not in err.lower()
    assert err.count("sampling verifies one chain") == 1 and "note: sampling verifies one chain" in err


def test_a_library_warning_is_one_line_of_the_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Without Python's file, line number and source line."""
    tokenizer = train_tokenizer(["a b c d e f g " * 50], vocab_size=270)
    toy_model("llama", vocab=len(tokenizer), context=128).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    edit_config(tmp_path, num_hidden_layers=1)  # the second layer's weights are left out, with a warning
    main(["generate", "--model", str(tmp_path), "--prompt", "a b c", "--max-new-tokens", "4", "--tree", "off"])
    lines = capsys.readouterr().err.splitlines()
    warned = [line for line in lines if "tensor(s)" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: {tmp_path}: ")
    assert not any("UserWarning" in line or ".py:" in line for line in lines)


def test_every_command_is_declared_beside_its_handler() -> None:
    """main() reads as a table: each command's module in commands/ holds its parser (add_parser) and
    the handler (run) that parser names, and cli.py holds nothing else of a command's."""
    import inspect

    from blockdecode import cli

    sub = argparse.ArgumentParser().add_subparsers()
    for command in cli.COMMANDS:
        before = set(sub.choices)
        command.add_parser(sub)
        (name,) = set(sub.choices) - before
        assert command.__name__ == f"blockdecode.commands.{name.replace('-', '_')}"
        assert sub.choices[name].get_default("func") is command.run
    assert len(inspect.getsource(cli).splitlines()) <= 150


def test_calibrate_refuses_a_k_beyond_the_heads_before_it_announces_anything(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit, match="k must be between 1 and the heads' block size 10, got 16"):
        main(["calibrate", "--k", "16"])
    assert "choosing" not in capsys.readouterr().err


def test_pretrain_checks_its_settings_before_it_writes_the_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    with pytest.raises(SystemExit, match="steps must be positive, got 0"):
        main(["pretrain", "--corpus", str(corpus), "--out", str(tmp_path / "run"), "--steps", "0"])
    assert not corpus.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["train", "pretrain", "pretrain-translation"])
def test_the_help_says_which_settings_may_change_on_resume(command: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    flags = " ".join(capsys.readouterr().out.split())  # argparse wraps the help: one line of it
    assert re.search(r"--steps STEPS[^-]*\(may change on --resume\)", flags)
    assert not re.search(r"--lr LR[^-]*\(may change on --resume\)", flags)


def test_generate_and_demo_draft_from_a_corpus(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--corpus (repeatable) with suffix lookup: exact, the corpus indexed into the cache under
    XDG_CACHE_HOME; with another drafter, or a path that is not there, one line before the model loads."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "a.py").write_text("def f(x):\n    return x + 1\n" * 5)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "c.py").write_text("def g(y):\n    return y * 2\n")
    corpus = ["--corpus", str(tmp_path / "a.py"), "--corpus", str(tmp_path / "b")]
    argv = ["generate", "--model", str(model_dir), "--prompt", "def f(x):", "--max-new-tokens", "12", "--dtype", "fp32"]
    main([*argv, "--drafter", "heads+suffix", "--tree", "8", "--compare", *corpus])
    err = capsys.readouterr().err
    assert "identical: yes" in err and "suffix+heads" in err  # the lookup first, as it is asked
    assert list((tmp_path / "cache" / "blockdecode" / "corpus").glob("*/index.json"))
    main(["demo", "--model", str(model_dir), "--max-new-tokens", "6", "--drafter", "suffix", "--tree", "off", *corpus])
    assert "outputs identical: yes" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="error: --corpus is read by suffix lookup, and --drafter ngram has none"):
        main([*argv, "--drafter", "ngram", *corpus])
    with pytest.raises(SystemExit, match=f"error: corpus: {tmp_path / 'nope'} does not exist"):
        main([*argv, "--drafter", "suffix", "--corpus", str(tmp_path / "nope")])
