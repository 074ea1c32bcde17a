"""The generation config's rules that greedy obeys (forced BOS/EOS, banned tokens, minimum lengths),
applied at every verified position: blockwise output equals `generate(do_sample=False)` with the
checkpoint's own config, and rules that cannot be applied exactly are refused."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_greedy_equal, hf_greedy, make_prompt

from blockdecode import NgramDrafter, ScriptedDrafter, blockwise_generate
from blockdecode.core.toy import toy_model
from blockdecode.decoding.rules import GreedyRules, greedy_rules

NEW = 24


def decoded(model, ids: torch.LongTensor, **generate_kwargs) -> torch.LongTensor:
    return hf_greedy(model, ids, NEW, **generate_kwargs)


def assert_every_loop_matches(model, ids: torch.LongTensor, ref: torch.LongTensor, what: str) -> None:
    """A chain with a good, a poor and a perfect drafter, and a tree, each equal to greedy's."""
    vocab = model.get_output_embeddings().weight.shape[0]
    for accuracy in (1.0, 0.6, 0.0):
        out = blockwise_generate(model, ids, NEW, ScriptedDrafter(ref, vocab, accuracy, seed=3), 5)
        assert_greedy_equal(model, ids, out.sequences, ref, what=f"{what}, chain at accuracy {accuracy}")
    if not model.config.is_encoder_decoder:
        drafters = [NgramDrafter(), ScriptedDrafter(ref, vocab, 0.7, seed=4)]
        out = blockwise_generate(model, ids, NEW, drafters, 5, tree=12)
        assert_greedy_equal(model, ids, out.sequences, ref, what=f"{what}, tree")


def rule_cases(plain: torch.LongTensor, prompt_len: int) -> dict[str, dict]:
    """Generation-config settings that each change the unconstrained greedy output `plain`."""
    new = plain[0, prompt_len:].tolist()
    common = max(set(new), key=new.count)
    absent = next(t for t in range(3, 512) if t not in new)
    return {
        "bad_words_ids": {"bad_words_ids": [[common], [new[0]]]},
        "suppress_tokens": {"suppress_tokens": [common]},
        "begin_suppress_tokens": {"begin_suppress_tokens": [new[0]]},
        "forced_eos_token_id": {"forced_eos_token_id": absent, "eos_token_id": absent},
        "min_new_tokens": {"min_new_tokens": NEW - 2, "eos_token_id": new[1]},
        "min_length": {"min_length": prompt_len + 3, "eos_token_id": new[0]},
    }


@pytest.mark.parametrize("rule", list(rule_cases(torch.zeros(1, 10, dtype=torch.long), 2)))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_causal_rules_match_generate(arch: str, rule: str) -> None:
    model = toy_model(arch, seed=5)
    ids = make_prompt(6, 512, seed=2)
    plain = decoded(model, ids, eos_token_id=[])
    settings = rule_cases(plain, ids.shape[1])[rule]
    model.generation_config.eos_token_id = settings.pop("eos_token_id", model.generation_config.eos_token_id)
    before = decoded(model, ids)
    for name, value in settings.items():
        setattr(model.generation_config, name, value)
    ref = decoded(model, ids)
    assert ref.shape != before.shape or not torch.equal(ref, before), "the rule changed nothing"
    assert_every_loop_matches(model, ids, ref, rule)


def test_forced_bos_applies_to_the_first_token_of_a_one_token_prompt() -> None:
    model = toy_model("llama", seed=5)
    model.generation_config.forced_bos_token_id = 7
    ids = torch.tensor([[9]])
    ref = decoded(model, ids)
    assert int(ref[0, 1]) == 7
    assert_every_loop_matches(model, ids, ref, "forced BOS")


@pytest.mark.parametrize(
    ("name", "value"),
    [("repetition_penalty", 1.3), ("no_repeat_ngram_size", 2), ("encoder_repetition_penalty", 1.2)],
)
def test_rules_that_cannot_be_exact_are_refused_by_name(name: str, value: object) -> None:
    model = toy_model("llama", seed=5)
    setattr(model.generation_config, name, value)
    with pytest.raises(ValueError, match=f"{name}=.*cannot apply exactly"):
        blockwise_generate(model, make_prompt(4, 512), 8, NgramDrafter(), 4)


def test_banned_sequences_longer_than_one_token_are_refused() -> None:
    model = toy_model("llama", seed=5)
    model.generation_config.bad_words_ids = [[5, 6]]
    with pytest.raises(ValueError, match="longer than one token"):
        blockwise_generate(model, make_prompt(4, 512), 8, NgramDrafter(), 4)


def test_rules_follow_each_rows_length_in_a_chain_and_a_tree() -> None:
    """Row i of a chain stands at cur_len + i; a tree node at cur_len + its depth."""
    rules = GreedyRules(forced_eos=[3], max_length=12, eos=[3], min_length=10)
    chain = rules.apply(torch.zeros(4, 8), 8)  # lengths 8, 9, 10, 11
    assert chain[0, 3] == chain[1, 3] == -torch.inf  # EOS banned below the minimum length
    assert chain[2].tolist() == [0.0] * 8
    assert chain[3].argmax() == 3 and (chain[3] == -torch.inf).sum() == 7  # forced at max_length - 1
    tree = rules.apply(torch.zeros(4, 8), 10, depths=[0, 1, 1, 0])
    assert [int((row == -torch.inf).sum()) for row in tree] == [0, 7, 7, 0]
    assert not GreedyRules().active and torch.equal(GreedyRules().apply(torch.ones(2, 3), 5), torch.ones(2, 3))


def test_an_eos_ban_is_not_a_bad_word() -> None:
    """transformers drops bad words equal to an EOS id; so does blockdecode."""
    model = toy_model("llama", seed=5)
    model.generation_config.bad_words_ids = [[1], [9]]
    assert greedy_rules(model, 4, 8, {1}).bad == [9]


def test_min_new_tokens_takes_precedence_over_min_length_as_in_generate() -> None:
    """generate replaces min_length by prompt + min_new_tokens whenever the latter is set (even 0)."""
    model = toy_model("llama", seed=5)
    ids = make_prompt(6, 512, seed=2)
    plain = decoded(model, ids, eos_token_id=[])
    model.generation_config.eos_token_id = int(plain[0, 8])  # greedy's third new token
    model.generation_config.min_length = 16
    for min_new in (1, 0):
        model.generation_config.min_new_tokens = min_new
        ref = decoded(model, ids)
        assert ref.shape[1] == 9  # stopped at the EOS: min_length did not hold it back
        assert_every_loop_matches(model, ids, ref, f"min_new_tokens={min_new}")


def test_suppressed_ids_outside_the_vocabulary_have_no_effect_as_in_generate() -> None:
    model = toy_model("llama", seed=5)
    model.generation_config.suppress_tokens = [600, -1]
    model.generation_config.begin_suppress_tokens = [9999]
    ids = make_prompt(6, 512, seed=2)
    assert_every_loop_matches(model, ids, decoded(model, ids), "ids beyond the vocabulary")


def test_guidance_scale_of_one_is_no_guidance() -> None:
    model = toy_model("llama", seed=5)
    model.generation_config.guidance_scale = 1.0
    assert not greedy_rules(model, 4, 8, {1}).active
