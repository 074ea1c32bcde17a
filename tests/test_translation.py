"""The built-in translation model's recipe: a shared tokenizer, length-bucketed batches, a Marian
trained from scratch that resumes exactly, and blockwise decoding of it equal to greedy's."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_greedy_equal, hf_greedy, keep_checkpoint_at
from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

from blockdecode import BlockwiseLM, ScriptedDrafter
from blockdecode.cli import main
from blockdecode.pretraining.bible import read_tsv
from blockdecode.pretraining.corpus import train_tokenizer
from blockdecode.pretraining.translation import (
    EOS,
    PAD,
    RESUME_MUST_MATCH,
    TranslationConfig,
    collate,
    epoch_batches,
    train_translation,
    translation_tokenizer,
)
from blockdecode.training import loop as training

CORPUS = Path(__file__).parent / "data" / "bible"
TINY = dict(
    vocab_size=400,
    hidden_size=32,
    encoder_layers=1,
    decoder_layers=1,
    heads=2,
    intermediate_size=64,
    context=128,
    steps=4,
    batch_tokens=600,
    warmup_steps=2,
    eval_every=2,
    eval_verses=3,
    checkpoint_every=2,
)


def test_one_tokenizer_for_both_languages_ending_each_text_with_eos() -> None:
    pairs = read_tsv(CORPUS / "train.tsv")
    tokenizer = translation_tokenizer([t for p in pairs for t in (p.source, p.target)], 500)
    for text in (pairs[0].source, pairs[0].target, "¿Qué dijo Jehová á Moisés?"):
        ids = tokenizer(text).input_ids
        assert ids[-1] == tokenizer.convert_tokens_to_ids(EOS)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.pad_token == PAD and tokenizer.eos_token == EOS


def test_an_epoch_is_every_pair_once_in_batches_within_the_token_budget() -> None:
    lengths = [3, 9, 4, 4, 17, 2, 8, 8, 8, 30, 1, 5] * 5
    batches = epoch_batches(lengths, 40, seed=1, epoch=2)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(max(lengths[i] for i in b) * len(b) <= 40 for b in batches)
    assert batches == epoch_batches(lengths, 40, seed=1, epoch=2)
    assert batches != epoch_batches(lengths, 40, seed=1, epoch=3)


def test_collate_shifts_the_target_behind_the_start_token() -> None:
    batch = collate([([5, 6, 0], [7, 8, 9, 0]), ([5, 0], [7, 0])], pad=1)
    assert batch["decoder_input_ids"].tolist() == [[1, 7, 8, 9], [1, 7, 1, 1]]
    assert batch["labels"].tolist() == [[7, 8, 9, 0], [7, 0, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_trained_from_scratch_saved_like_a_marian_and_decoded_exactly(tmp_path: Path) -> None:
    cfg = TranslationConfig(corpus=str(CORPUS), out=str(tmp_path), **{**TINY, "steps": 6})
    train_translation(cfg, show=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "bleu" in r]
    assert len(evals) == 3 and evals[-1]["heldout_loss"] < evals[0]["heldout_loss"]
    assert (tmp_path / "translation.png").stat().st_size > 0
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "model").eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path / "model")
    assert model.config.scale_embedding  # tokens must not drown under the sinusoidal positions
    rules = model.generation_config
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    assert (rules.decoder_start_token_id, rules.forced_eos_token_id, rules.bad_words_ids) == (pad, eos, [[pad]])
    source = tokenizer(read_tsv(CORPUS / "valid.tsv")[0].source, return_tensors="pt").input_ids
    ref = hf_greedy(model, source, 24)
    lm = BlockwiseLM.from_base(model, k=4)
    for drafter in ("heads", "ngram", ScriptedDrafter(ref, len(tokenizer), 0.6)):
        out = lm.generate(source, 24, drafter=drafter, tree=None)
        assert_greedy_equal(model, source, out.sequences, ref, what=str(drafter))


def test_a_resumed_run_ends_with_the_same_weights(tmp_path: Path, monkeypatch) -> None:
    keep_checkpoint_at(monkeypatch, training, 2, tmp_path / "b" / "checkpoint")  # as a kill at step 3 left it
    whole = train_translation(TranslationConfig(corpus=str(CORPUS), out=str(tmp_path / "a"), **TINY), show=False)
    shutil.copytree(tmp_path / "a" / "tokenizer", tmp_path / "b" / "tokenizer")
    cfg = TranslationConfig(corpus=str(CORPUS), out=str(tmp_path / "b"), resume=True, **TINY)
    resumed = train_translation(cfg, show=False)
    for (name, p), q in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4]  # the resumed run logs only the steps after its checkpoint
    with pytest.raises(ValueError, match="hidden_size=32"):
        train_translation(TranslationConfig(corpus=str(CORPUS), out=str(tmp_path / "b"), resume=True,
                                            **{**TINY, "hidden_size": 64}), show=False)  # fmt: skip


def test_cli_trains_the_translation_model_and_a_draft_that_shares_its_tokenizer(tmp_path: Path) -> None:
    """The draft for transformers' assisted generation (Table 4) must speak its target's token ids."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    main(["pretrain-translation", "--corpus", str(CORPUS), "--out", str(tmp_path / "main"), *args])
    assert (tmp_path / "main" / "model" / "config.json").is_file()
    draft_args = [*args, "--vocab-size=50", "--decoder-layers=1", "--tokenizer", str(tmp_path / "main" / "model")]
    main(["pretrain-translation", "--corpus", str(CORPUS), "--out", str(tmp_path / "draft"), *draft_args])
    target_tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "main" / "model")
    draft_tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "draft" / "model")
    assert draft_tok.get_vocab() == target_tok.get_vocab()
    target = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "main" / "model").eval()
    draft = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "draft" / "model").eval()
    assert draft.config.vocab_size == target.config.vocab_size  # --vocab-size yields to the tokenizer's
    source = target_tok(read_tsv(CORPUS / "valid.tsv")[1].source, return_tensors="pt").input_ids
    assisted = target.generate(source, assistant_model=draft, do_sample=False, max_new_tokens=12)
    torch.testing.assert_close(assisted, hf_greedy(target, source, 12))

    other = tmp_path / "causal-tokenizer"
    train_tokenizer(["def f():\n    return 1\n"] * 20, 300).save_pretrained(other)
    with pytest.raises(SystemExit, match="has no </s> or <pad> token"):
        main(["pretrain-translation", "--corpus", str(CORPUS), "--out", str(tmp_path / "x"), *args, "--tokenizer",
              str(other)])  # fmt: skip
    assert not (tmp_path / "x").exists()


def test_a_vocab_size_below_the_byte_alphabet_is_refused() -> None:
    with pytest.raises(ValueError, match="^--vocab-size 10 is below 258: the byte-level BPE holds its 256 bytes"):
        TranslationConfig(corpus="c", out="o", vocab_size=10)
    assert TranslationConfig(corpus="c", out="o", vocab_size=10, tokenizer="t").vocab_size == 10  # the tokenizer's


def test_every_setting_is_checked_on_resume_or_allowed_to_change() -> None:
    may_change = {"steps", "eval_every", "log_every", "checkpoint_every"}
    others = {"corpus", "out", "resume", "tokenizer"}  # the pairs by their tokens; a resume reads its saved tokenizer
    must = set(RESUME_MUST_MATCH)
    assert not must & may_change and must | may_change | others == set(TranslationConfig.__dataclass_fields__)


def test_a_context_no_training_pair_fits_is_one_line(tmp_path: Path) -> None:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in {**TINY, "context": 4}.items()]
    train = re.escape(str(CORPUS / "train.tsv"))
    with pytest.raises(SystemExit, match=f"^error: no training pair in {train} fits --context 4: the shortest has"):
        main(["pretrain-translation", "--corpus", str(CORPUS), "--out", str(tmp_path), *args])
