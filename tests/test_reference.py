"""The greedy reference every exactness claim is checked against, and how divergences are reported."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import NO_EOS, make_prompt, tiny
from transformers import AutoModelForCausalLM

from blockdecode import NgramDrafter, blockwise_generate
from blockdecode.core.toy import toy_model
from blockdecode.decoding.reference import first_divergence, greedy_generate


def test_reference_is_greedy_whatever_the_checkpoint_searches_with() -> None:
    """Checkpoints ship beam search (Marian: num_beams=4) or sampling settings; the reference, like
    blockdecode, is greedy all the same, and keeps the rules greedy obeys (here a forced EOS)."""
    model = toy_model("llama", seed=3)
    ids = make_prompt(8, 512)
    plain = greedy_generate(model, ids, 30, NO_EOS)
    model.generation_config.num_beams = 4
    model.generation_config.do_sample = True
    model.generation_config.top_k = 5
    assert torch.equal(greedy_generate(model, ids, 30, NO_EOS), plain)
    model.generation_config.forced_eos_token_id = 7
    ref = greedy_generate(model, ids, 30, NO_EOS)
    assert int(ref[0, -1]) == 7 and torch.equal(ref[:, :-1], plain[:, :-1])
    ours = blockwise_generate(model, ids, 30, NgramDrafter(), 4, eos_token_id=NO_EOS)
    assert first_divergence(model, ref, ours.sequences) is None


def test_first_divergence_names_the_position_and_the_gap() -> None:
    model = tiny("gpt2")
    ref = greedy_generate(model, make_prompt(5, 512), 12, NO_EOS)
    other = ref.clone()
    other[0, 9] = (other[0, 9] + 1) % 512
    found = first_divergence(model, ref, other)
    assert found is not None and found.position == 9
    with torch.no_grad():
        logits = model(ref[:, :9].clone()).logits[0, -1]
    top = logits.topk(2).values
    assert found.top2_gap == pytest.approx(float(top[0] - top[1]), rel=1e-5)
    assert "position 9" in str(found)
    assert first_divergence(model, ref, ref.clone()) is None


def test_recurrent_layers_are_refused_clearly() -> None:
    """A convolution/SSM state cannot be cropped back after a rejected proposal."""
    config = transformers.Lfm2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"],
        max_position_embeddings=128,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="cannot roll back"):
        blockwise_generate(model, torch.tensor([[3, 4, 5]]), 10, NgramDrafter(), 4)


@pytest.mark.parametrize("which", ["built-in translation model", "marian", "llama"])
def test_the_reference_call_says_nothing_whatever_length_the_checkpoint_names(which: str, capsys) -> None:
    """A generation config with its own max_length (Marian's, the built-in translation model's) meets
    the reference's length without a word from transformers: no log record, no warning, no stderr;
    and the length is still max_new_tokens new tokens."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    from blockdecode import DEFAULT_TRANSLATION_MODEL
    from blockdecode.loading import load_base

    if which == "built-in translation model":
        model = load_base(DEFAULT_TRANSLATION_MODEL).eval()
    else:
        model = toy_model(which)
        model.generation_config.max_length = 256
    ids = make_prompt(6, model.config.vocab_size)
    capsys.readouterr()  # what loading printed is not the reference call's
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = hf_logging.get_logger("transformers")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = greedy_generate(model, ids, 9, eos_token_id=NO_EOS)
    finally:
        logger.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    assert [r.getMessage() for r in records] == []
    assert [str(w.message) for w in caught] == []
    assert capsys.readouterr().err == ""
    start = 1 if model.config.is_encoder_decoder else ids.shape[1]
    assert out.shape[1] <= start + 9 and (out.shape[1] == start + 9 or int(out[0, -1]) in (0, 1))
