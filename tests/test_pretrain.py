"""The built-in model's recipe end to end on a tiny setting: corpus, tokenizer, base, heads.

The full recipe (recipes/default_model.sh) runs the same code for two hours; here every stage
runs in seconds so none of it can silently rot."""

from __future__ import annotations

import json
import re
import shutil
import sysconfig
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from blockdecode.cli import main
from blockdecode.loading import model_folder
from blockdecode.model import BlockwiseLM
from blockdecode.pretraining.corpus import SPECIAL_TOKENS, corpus_files, is_heldout, stdlib_files
from blockdecode.pretraining.pretrain import (
    RESUME_MUST_MATCH,
    CorpusConfig,
    PretrainConfig,
    id_dtype,
    prepare_corpus,
    pretrain,
    windows,
)
from blockdecode.training import loop as training
from blockdecode.training.train import TrainConfig, train
from tests.conftest import NO_EOS, assert_greedy_equal, hf_greedy, keep_checkpoint_at, write_gemma3_gguf

TINY = dict(
    hidden_size=32,
    layers=1,
    heads=2,
    kv_heads=1,
    intermediate_size=64,
    context=64,
    steps=4,
    batch_size=4,
    seq_len=32,
    warmup_steps=1,
    eval_every=2,
    eval_batches=1,
    checkpoint_every=2,
    mixed_precision="no",
    compile=False,  # compiling would take longer than these steps
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight small stdlib modules in a folder of their own, split by file like the full corpus."""
    root = tmp_path_factory.mktemp("src")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("bisect", "colorsys", "keyword", "this", "fnmatch", "glob", "heapq", "shlex"):
        shutil.copy(stdlib / f"{name}.py", root / f"{name}.py")
    out = tmp_path_factory.mktemp("corpus")
    cfg = CorpusConfig(out=str(out), root=str(root), packages=(), vocab_size=320, heldout_fraction=0.3)
    prepare_corpus(cfg, show=False)
    return out


def test_corpus_is_split_by_file_and_tokenised_with_eos_between_files(corpus: Path) -> None:
    files = json.loads((corpus / "files.json").read_text())
    train, heldout = files["train"]["files"], files["heldout"]["files"]
    assert train and heldout and not set(train) & set(heldout)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(corpus)
    assert len(tokenizer) == 320
    eos = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    for split in ("train", "heldout"):
        ids = np.load(corpus / f"{split}.npy")
        assert ids.dtype == np.uint16
        assert int((ids == eos).sum()) == len(files[split]["files"])  # one EOS after each file
    assert "def " in tokenizer.decode(np.load(corpus / "train.npy").tolist())


def test_prepare_corpus_reuses_what_is_there(corpus: Path) -> None:
    before = (corpus / "train.npy").stat().st_mtime_ns
    saved = json.loads((corpus / "files.json").read_text())["prepared_with"]
    prepare_corpus(CorpusConfig(**{**saved, "out": str(corpus), "packages": ()}), show=False)
    assert (corpus / "train.npy").stat().st_mtime_ns == before


def test_heldout_split_depends_on_relative_paths_only_and_is_near_its_fraction() -> None:
    """A file is held out by its name relative to the root (so every machine splits alike), and
    the share held out is close to the fraction asked for."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files(root)
    assert [f.name for f in files] == [str(p.relative_to(root)) for p in stdlib_files(root)]
    held = {f.name for f in files if is_heldout(f.name, 0.05)}
    assert 0.02 < len(held) / len(files) < 0.08
    assert held < {f.name for f in files if is_heldout(f.name, 0.2)}  # a larger fraction adds files


def test_batches_depend_on_seed_and_step_only() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    a = windows(tokens, 3, 4, 16, seed=1)
    assert torch.equal(a, windows(tokens, 3, 4, 16, seed=1))
    assert not torch.equal(a, windows(tokens, 4, 4, 16, seed=1))
    assert torch.equal(a[:, 1:], a[:, :-1] + 1)  # contiguous windows of the stream


def test_pretrain_then_heads_end_to_end(corpus: Path, tmp_path: Path) -> None:
    """Base trained from scratch (loss drops, model + tokenizer saved), then heads trained on it
    from the corpus' token array, and the result decodes exactly like transformers' greedy."""
    model = pretrain(PretrainConfig(corpus=str(corpus), out=str(tmp_path / "base"), **{**TINY, "steps": 12}), False)
    rows = [json.loads(line) for line in (tmp_path / "base" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["heldout_loss"] for r in rows if "heldout_loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert (tmp_path / "base" / "pretrain.png").stat().st_size > 0
    saved = tmp_path / "base" / "model"
    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in model.parameters())
    assert len(PreTrainedTokenizerFast.from_pretrained(saved)) == 320

    cfg = TrainConfig(
        base=str(saved),
        data=[str(corpus / "train.npy")],
        out=str(tmp_path / "heads"),
        k=3,
        steps=2,
        batch_size=4,
        seq_len=32,
        eval_every=2,
        eval_prompts=1,
        eval_prompt_len=8,
        eval_new_tokens=8,
        checkpoint_every=2,
    )
    train(cfg)
    lm = BlockwiseLM.from_pretrained(tmp_path / "heads")
    ids = torch.from_numpy(np.load(corpus / "heldout.npy")[:10].astype(np.int64)).unsqueeze(0)
    out = lm.generate(ids, 20, eos_token_id=NO_EOS, tree=None)
    assert_greedy_equal(lm.base, ids, out.sequences, hf_greedy(lm.base, ids, 20, eos_token_id=None))


def test_pretrain_resumes_to_the_same_weights(corpus: Path, tmp_path: Path, monkeypatch) -> None:
    keep_checkpoint_at(monkeypatch, training, 2, tmp_path / "b" / "checkpoint")  # as a kill at step 3 left it
    whole = pretrain(PretrainConfig(corpus=str(corpus), out=str(tmp_path / "a"), **TINY), False)
    resumed = pretrain(PretrainConfig(corpus=str(corpus), out=str(tmp_path / "b"), resume=True, **TINY), False)
    for (name, p), q in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4]  # the resumed run logs only the steps after its checkpoint
    # finished, it keeps its last step: resumed again it trains nothing and keeps its weights
    again = pretrain(PretrainConfig(corpus=str(corpus), out=str(tmp_path / "b"), resume=True, **TINY), False)
    for (name, p), q in zip(whole.state_dict().items(), again.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)
    assert (tmp_path / "b" / "metrics.jsonl").read_text().count("\n") == 1


def test_resume_refuses_a_different_shape(corpus: Path, tmp_path: Path) -> None:
    pretrain(PretrainConfig(corpus=str(corpus), out=str(tmp_path), **TINY), False)
    with pytest.raises(ValueError, match="hidden_size=32"):
        pretrain(PretrainConfig(corpus=str(corpus), out=str(tmp_path), resume=True, **{**TINY, "hidden_size": 64}))


def test_a_damaged_corpus_array_is_named_with_what_to_do(corpus: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "corpus"
    shutil.copytree(corpus, damaged)
    (damaged / "heldout.npy").write_bytes((damaged / "heldout.npy").read_bytes()[:-2])
    with pytest.raises(ValueError, match="heldout.npy is not a readable .npy array .*: delete .* prepares the corpus"):
        pretrain(PretrainConfig(corpus=str(damaged), out=str(tmp_path / "out"), **TINY), False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq_len": 128}, "exceeds the model's context"),
        ({"heads": 3}, "must divide"),
        ({"steps": 0}, "steps must be positive"),
        ({"lr": 0.0}, "lr must be a finite number > 0"),
        ({"lr": 1e-3, "min_lr": 2e-3}, r"min_lr must lie in \[0, lr=0.001\], got 0.002"),
        ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
        ({"mixed_precision": "fp8"}, "unknown mixed precision 'fp8'"),
    ],
)
def test_bad_pretrain_configs_fail_clearly(change: dict, message: str) -> None:
    """Refused when the config is made, so the CLI can make it before it prepares any corpus."""
    with pytest.raises(ValueError, match=message):
        PretrainConfig(corpus="c", out="o", **{**TINY, **change})


def test_a_prepared_corpus_is_reused_only_with_the_settings_it_was_prepared_with(corpus: Path) -> None:
    files = json.loads((corpus / "files.json").read_text())
    same = CorpusConfig(**{**files["prepared_with"], "out": str(corpus), "packages": ()})
    assert len(prepare_corpus(same, show=False)) == 320  # reused as it is
    for change, flag in (({"vocab_size": 512}, "--vocab-size 320, this run asks for 512"),
                         ({"max_files": 3}, "--max-files None, this run asks for 3")):  # fmt: skip
        with pytest.raises(ValueError, match=f"--corpus {corpus} was prepared with {flag}: give another --corpus"):
            prepare_corpus(replace(same, **change), show=False)
    assert json.loads((corpus / "files.json").read_text()) == files  # nothing rewritten


def test_a_vocab_size_below_the_byte_alphabet_is_refused_naming_the_least() -> None:
    """The BPE gave 257 tokens for --vocab-size 10, without a word."""
    with pytest.raises(ValueError, match=r"^--vocab-size 10 must lie in \[257, 65536\]: the byte-level BPE holds"):
        CorpusConfig(out="c", vocab_size=10)
    with pytest.raises(ValueError, match=r"^--vocab-size 70000 must lie in \[257, 65536\]"):
        CorpusConfig(out="c", vocab_size=70000)
    assert CorpusConfig(out="c", vocab_size=10, tokenizer="t").vocab_size == 10  # a given tokenizer decides


@pytest.mark.parametrize("root", ["missing", "no .py files"])
def test_a_root_without_python_files_is_refused_before_anything_is_written(tmp_path: Path, root: str) -> None:
    """Else the default --packages (torch's source) silently made the whole corpus."""
    folder = tmp_path / "src"
    if root == "no .py files":
        folder.mkdir()
        (folder / "notes.txt").write_text("no code here")
    with pytest.raises(SystemExit, match=f"^error: --root {re.escape(str(folder))} is not a folder of .py files$"):
        main(["pretrain", "--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--root", str(folder)])
    assert sorted(p.name for p in tmp_path.iterdir()) == (["src"] if folder.exists() else [])


def test_every_setting_is_checked_on_resume_or_allowed_to_change() -> None:
    may_change = {"steps", "eval_every", "log_every", "checkpoint_every", "compile"}
    others = {"corpus", "out", "resume"}  # the corpus is checked by its content and vocabulary
    must = set(RESUME_MUST_MATCH)
    assert not must & may_change and must | may_change | others == set(PretrainConfig.__dataclass_fields__)


def test_an_out_or_corpus_that_cannot_be_written_is_refused_before_the_corpus_is_read(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    args = ["--root", str(tmp_path / "no-sources")]  # reading it would fail: "no .py files under ..."
    for corpus, out, flag in (
        (tmp_path / "c", tmp_path / "file" / "o", "--out"),
        (tmp_path / "file", tmp_path / "o", "--corpus"),
    ):
        with pytest.raises(SystemExit, match=f"^error: {flag} {tmp_path / 'file'}.* cannot be written"):
            main(["pretrain", "--corpus", str(corpus), "--out", str(out), *args])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_cli_pretrain_runs_the_recipe(tmp_path: Path) -> None:
    root = tmp_path / "src"
    root.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("bisect", "colorsys", "keyword", "heapq"):
        shutil.copy(stdlib / f"{name}.py", root / f"{name}.py")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in {**TINY, "vocab_size": 300}.items() if k != "compile"]
    args += ["--no-compile", "--packages"]  # the stdlib slice alone
    main(["pretrain", "--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--root", str(root), *args])
    assert (tmp_path / "o" / "model" / "model.safetensors").is_file()
    assert (tmp_path / "o" / "model" / "tokenizer.json").is_file()


def test_a_large_vocabulary_keeps_its_ids_and_its_own_eos(tmp_path: Path) -> None:
    """A pretrained model's tokenizer (Gemma's: 262,144 ids, EOS "<eos>") tokenizes the corpus as it is: ids past
    65,535 are not wrapped by uint16, and files end in its own EOS."""
    assert id_dtype(2**16) is np.uint16 and id_dtype(262_144) is np.uint32
    assert np.asarray([70_000, 262_143], dtype=id_dtype(262_144)).tolist() == [70_000, 262_143]
    gguf = tmp_path / "toy.gguf"
    write_gemma3_gguf(gguf)
    root = tmp_path / "src"
    root.mkdir()
    for i in range(3):
        (root / f"m{i}.py").write_text(f"def f{i}(self):\n    return self\n")
    tokenizer = prepare_corpus(CorpusConfig(out=str(tmp_path / "c"), root=str(root), packages=(),
                                            tokenizer=str(model_folder(gguf))), show=False)  # fmt: skip
    ids = np.load(tmp_path / "c" / "train.npy")
    assert tokenizer.eos_token == "<eos>" and ids[-1] == tokenizer.eos_token_id == 1
