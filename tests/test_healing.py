"""Token healing (blockdecode/decoding/healing.py): its specification on a toy vocabulary and on the built-in
model's tokenizer, and blockwise decoding with it equal, token for token, to transformers' own `generate`
with the same constraint (`prefix_allowed_tokens_fn`): chains, trees, batches, the generation config's
rules, and sampling in distribution."""

from __future__ import annotations

import functools
import itertools
from collections import Counter

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, perturb_heads, tiny
from test_batch import check_rows, padded
from test_sampling import homogeneity
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from blockdecode import DEFAULT_MODEL, BlockwiseLM, NgramDrafter, ScriptedDrafter, decode, load, make_plan
from blockdecode.core.toy import toy_model
from blockdecode.decoding.healing import heal_prompts
from blockdecode.decoding.sampling import sampling_settings

NEW = 20


def toy_tokenizer(spellings: list[str]) -> PreTrainedTokenizerFast:
    """A tokenizer with ids 0 <bos> and 1 <eos> (the toy models' BOS, and EOS and pad), then `spellings`."""
    vocab = {s: i for i, s in enumerate(["<bos>", "<eos>", *spellings])}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<eos>")),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<eos>",
    )


@functools.cache
def layout() -> PreTrainedTokenizerFast:
    """Every text of 1 to 3 characters of "a", " " and "\\n", and indents of up to 8 spaces with and
    without a newline before them: runs of whitespace with longer and shorter tokens, as a BPE vocabulary
    of code has them (52 ids)."""
    short = ["".join(t) for n in range(1, 4) for t in itertools.product("a \n", repeat=n)]
    return toy_tokenizer(short + [f"\n{' ' * n}" for n in range(3, 9)] + [" " * n for n in range(4, 9)])


def ids_of(tokenizer, *spellings: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids(list(spellings))


def consistent(tokenizer, rest: str) -> set[int]:
    """The specification, by brute force: the ordinary tokens that start with `rest` or that it starts with."""
    special = set(tokenizer.all_special_ids)
    return {
        i for s, i in tokenizer.get_vocab().items() if i not in special and (s.startswith(rest) or rest.startswith(s))
    }


def test_a_prompt_ending_mid_token_loses_that_token_and_the_new_ones_write_its_text_again() -> None:
    tok = layout()
    ids = torch.tensor([ids_of(tok, "a", "aa", "\n  ")])
    healing = heal_prompts(tok, ids)
    assert healing.healed and healing.input_ids.tolist() == [ids_of(tok, "a", "aa")] and healing.attention_mask is None
    allowed = lambda *new: healing.allowed(0, ids_of(tok, *new))  # noqa: E731
    assert set(allowed()) == consistent(tok, "\n  ") >= set(ids_of(tok, "\n", "\n ", "\n  ", "\n   ", "\n        "))
    assert set(allowed("\n")) == consistent(tok, "  ")  # "\n" then "  a" is "\n  a" too
    assert set(allowed("\n", " ")) == consistent(tok, " ")
    for done in (["\n  "], ["\n    "], ["\n", "  "], ["\n ", " \n"], ["\n", " ", "a  "]):
        assert allowed(*done) is None, done
    assert 1 not in allowed() and 0 not in allowed()  # no EOS, no BOS while the prompt's text is not back
    assert "'\\n  '" in healing.note() and f"{len(allowed())} tokens" in healing.note()


@pytest.mark.parametrize(
    "spellings",
    [("a", "aaa"), ("a", "<eos>"), ("\n",), ("<bos>", "\n")],
    ids=["no longer token", "an added token", "one token", "nothing ordinary before"],
)
def test_a_prompt_that_does_not_end_mid_token_is_kept(spellings: tuple[str, ...]) -> None:
    tok = layout()
    ids = torch.tensor([ids_of(tok, *spellings)])
    healing = heal_prompts(tok, ids)
    assert not healing.healed and torch.equal(healing.input_ids, ids) and healing.attention_mask is None
    assert healing.allowed(0, []) is None


def test_a_batch_heals_each_row_on_its_own_and_pads_again_on_the_left() -> None:
    tok = layout()
    rows = [ids_of(tok, "a", " "), ids_of(tok, "aa", "a", "aaa"), ids_of(tok, "a", "\n")]
    ids, mask = padded([torch.tensor([r]) for r in rows], pad=1, left=True)
    healing = heal_prompts(tok, ids, mask)
    assert healing.dropped == (rows[0][-1], None, rows[2][-1])
    assert healing.input_ids.tolist() == [[1, 1, rows[0][0]], rows[1], [1, 1, rows[2][0]]]
    assert healing.attention_mask.tolist() == [[0, 0, 1], [1, 1, 1], [0, 0, 1]]
    assert healing.allowed(1, []) is None and set(healing.allowed(2, [])) == consistent(tok, "\n")


@functools.cache
def built_in() -> tuple[BlockwiseLM, PreTrainedTokenizerFast]:
    return load(DEFAULT_MODEL)


@pytest.mark.parametrize(
    ("prompt", "dropped"),
    [("def fib(n):\n", "\n"), ("class MLP(nn.Module):\n    ", "\n    "), ("x = 1 ", " "), ("x = 1  ", "  ")],
)
def test_the_built_in_tokenizers_newlines_and_spaces_are_healed(prompt: str, dropped: str) -> None:
    """Every first token the healing allows decodes to text that the dropped text starts, or that starts
    it; none is EOS, which 8 of 20 windows of code ending in a newline got first without healing."""
    _, tok = built_in()
    ids = tok(prompt, return_tensors="pt").input_ids
    healing = heal_prompts(tok, ids)
    assert healing.input_ids.tolist() == [ids[0, :-1].tolist()] and tok.decode(healing.dropped[0]) == dropped
    allowed = healing.allowed(0, [])
    assert (
        set(allowed) == consistent(tok, tok.convert_ids_to_tokens(healing.dropped[0]))
        and tok.eos_token_id not in allowed
    )
    assert all(t.startswith(dropped) or dropped.startswith(t) for t in tok.batch_decode([[i] for i in allowed]))


@pytest.mark.parametrize("prompt", ["class MLP(nn.Module):", "import torch", "import os"])
def test_the_built_in_tokenizers_closed_tokens_are_kept(prompt: str) -> None:
    _, tok = built_in()
    assert not heal_prompts(tok, tok(prompt, return_tensors="pt").input_ids).healed


@pytest.mark.parametrize("prompt", ["class MLP(nn.Module):\n", "class MLP(nn.Module):\n    "])
def test_healing_gives_the_built_in_model_its_indentation_back(prompt: str) -> None:
    """The README's first example and the same prompt indented: the continuation is the class's
    __init__, indented as code is, and transformers' greedy output under the same constraint."""
    lm, tok = built_in()
    ids = tok(prompt, return_tensors="pt").input_ids
    out = lm.generate(ids, 12, heal=tok, eos_token_id=NO_EOS, drafter="heads", tree=None)
    assert tok.decode(out.sequences[0]).startswith("class MLP(nn.Module):\n    def __init__(self")
    healing = heal_prompts(tok, ids)
    constraint = healing.prefix_allowed_tokens_fn(tok.vocab_size)
    ref = hf_greedy(lm.base, healing.input_ids, 12, eos_token_id=None, prefix_allowed_tokens_fn=constraint)
    assert torch.equal(out.sequences, ref)


def prompts(tok, n: int = 8) -> list[torch.LongTensor]:
    """Random toy prompts that end in a run of whitespace with longer and shorter tokens than itself."""
    gen = torch.Generator().manual_seed(0)
    ends = ids_of(tok, "\n      ", "       ", "\n    ", "      ")
    return [torch.tensor([[*torch.randint(2, len(tok), (5,), generator=gen).tolist(), ends[i % 4]]]) for i in range(n)]


def constrained(healing, new: list[int]) -> int:
    """How many of the new tokens the healing constrained: one, or more where the first wrote only part of
    the dropped token's text."""
    return next(n for n in range(len(new) + 1) if n == len(new) or healing.allowed(0, new[:n]) is None)


DECODERS = {  # each from transformers' output for the prompt: a perfect drafter proposes it
    "heads chain": lambda ref: dict(drafter="heads", tree=None),
    "n-gram chain": lambda ref: dict(drafter=NgramDrafter(), k=3),
    "perfect chain": lambda ref: dict(drafter=ScriptedDrafter(ref, len(layout())), k=4),
    "heads+n-gram tree": lambda ref: dict(drafter="heads+ngram", tree=8),
    "tree with a good drafter": lambda ref: dict(
        drafter=[NgramDrafter(), ScriptedDrafter(ref, len(layout()), 0.7)], tree=8
    ),
}


@pytest.mark.parametrize("decoder", list(DECODERS))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_healed_decoding_is_transformers_with_the_same_constraint(arch: str, decoder: str) -> None:
    """Prompts whose new tokens are constrained for one to several steps: a proposal after a constrained
    token is verified under the constraint too, or not at all."""
    tok = layout()
    model = tiny(arch, vocab=len(tok))
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4))
    steps = []
    for ids in prompts(tok):
        healing = heal_prompts(tok, ids)
        constraint = healing.prefix_allowed_tokens_fn(len(tok))
        ref = hf_greedy(model, healing.input_ids, NEW, eos_token_id=None, prefix_allowed_tokens_fn=constraint)
        out = lm.generate(ids, NEW, heal=tok, eos_token_id=NO_EOS, **DECODERS[decoder](ref))
        assert_greedy_equal(model, healing.input_ids, out.sequences, ref, what=decoder)
        steps.append(constrained(healing, ref[0, healing.input_ids.shape[1] :].tolist()))
    assert max(steps) >= 3, f"constrained steps {steps}: no prompt constrained a call's proposals"


def test_a_healed_batch_is_transformers_batched_greedy_with_the_same_constraint() -> None:
    tok = layout()
    model = tiny("llama", vocab=len(tok))
    rows = [p[:, -n:] for p, n in zip(prompts(tok, 3), (6, 3, 5))] + [torch.tensor([ids_of(tok, "a", "aa", "aaa")])]
    ids, mask = padded(rows, pad=1, left=True)
    healing = heal_prompts(tok, ids, mask)
    assert healing.dropped.count(None) == 1
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4))
    out = lm.generate(ids, NEW, attention_mask=mask, heal=tok, drafter="heads", tree=None, eos_token_id=NO_EOS)
    constraint = healing.prefix_allowed_tokens_fn(len(tok))
    healed_mask = torch.ones_like(healing.input_ids) if healing.attention_mask is None else healing.attention_mask
    with torch.inference_mode():
        ref = model.generate(
            healing.input_ids,
            attention_mask=healed_mask,
            do_sample=False,
            max_new_tokens=NEW,
            eos_token_id=NO_EOS,
            prefix_allowed_tokens_fn=constraint,
        )
    alone = [r[:, :-1] if d is not None else r for r, d in zip(rows, healing.dropped)]
    check_rows(model, alone, healed_mask, out.sequences, ref)


RULES = {  # each sets what the constraint must come before or after, as transformers orders its processors
    "forced EOS at the budget's end": (dict(forced_eos_token_id=1), 1),
    "every allowed token banned": (dict(bad_words_ids="allowed"), 3),
    "every allowed token suppressed": (dict(suppress_tokens="allowed"), 3),
    "the best allowed token suppressed at the start": (dict(begin_suppress_tokens="best"), 3),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_healing_takes_its_place_among_the_generation_configs_rules(rule: str) -> None:
    tok = layout()
    model = toy_model("llama", vocab=len(tok))  # its generation config is edited
    ids = prompts(tok, 1)[0]
    healing = heal_prompts(tok, ids)
    allowed = healing.allowed(0, [])
    with torch.inference_mode():
        logits = model(healing.input_ids).logits[0, -1]
    best = max(allowed, key=lambda t: float(logits[t]))
    settings, new = RULES[rule]
    for name, value in settings.items():
        value = {"allowed": allowed, "best": [best]}.get(value, value) if isinstance(value, str) else value
        setattr(model.generation_config, name, [[t] for t in value] if name == "bad_words_ids" else value)
    constraint = healing.prefix_allowed_tokens_fn(len(tok))
    ref = hf_greedy(model, healing.input_ids, new, prefix_allowed_tokens_fn=constraint)
    plan = make_plan(model, NgramDrafter(), k=3)
    out = decode(model, healing.input_ids, new, plan, healing=healing)
    assert torch.equal(out.sequences, ref), (out.sequences.tolist(), ref.tolist())


SAMPLED = ["a", "b", "ab", "aba", "ba", "bb"]  # with <bos> and <eos>: the 8 ids of test_sampling's model
SHOWN = 3


@pytest.mark.slow
def test_healed_sampling_matches_transformers_in_distribution() -> None:
    """The joint law of the first three sampled tokens after "b", "ab" healed (the first may be "a",
    and then the second must start with "b"), against transformers' sampling with the constraint, by
    test_sampling's chi-square test."""
    tok = toy_tokenizer(SAMPLED)
    model = tiny("llama", vocab=8, width=32, layers=1)
    healing = heal_prompts(tok, torch.tensor([ids_of(tok, "b", "ab")]))
    constraint = healing.prefix_allowed_tokens_fn(8)
    torch.manual_seed(0)
    rows = healing.input_ids.expand(20_000, -1)
    with torch.inference_mode():
        ref = model.generate(
            rows,
            attention_mask=torch.ones_like(rows),
            do_sample=True,
            temperature=1.3,
            max_new_tokens=SHOWN,
            prefix_allowed_tokens_fn=lambda _, sequence: constraint(0, sequence),
        )
    reference = Counter(map(tuple, ref[:, rows.shape[1] :].tolist()))
    plan = make_plan(model, NgramDrafter(), k=3, sampling=sampling_settings(model, True, temperature=1.3))
    generator, ours = torch.Generator().manual_seed(0), Counter()
    for _ in range(600):
        out = decode(model, healing.input_ids, SHOWN, plan, generator=generator, healing=healing)
        ours[tuple((out.sequences[0, rows.shape[1] :].tolist() + [1] * SHOWN)[:SHOWN])] += 1
    assert all(first in healing.allowed(0, []) for first, *_ in ours)
    assert homogeneity(ours, reference) > 1e-3


def test_healing_an_encoder_decoders_source_is_refused_before_planning() -> None:
    tok = layout()
    lm = BlockwiseLM.from_base(tiny("marian", vocab=len(tok)), k=3)
    with pytest.raises(ValueError, match="encoder-decoder, whose output does not continue its source"):
        lm.generate(prompts(tok, 1)[0], 4, heal=tok)  # tree "auto" would measure first


def test_decoding_other_prompts_than_the_healed_ones_is_refused() -> None:
    tok = layout()
    model = tiny("llama", vocab=len(tok))
    ids = prompts(tok, 1)[0]
    healing = heal_prompts(tok, ids)
    with pytest.raises(ValueError, match="healing was made for other prompts"):
        decode(model, ids, 4, make_plan(model, NgramDrafter(), k=3), healing=healing)


@pytest.mark.parametrize("heal", [True, "tok"])
def test_healing_takes_the_tokenizer_only(heal: object) -> None:
    lm = BlockwiseLM.from_base(tiny("llama"), k=4)
    with pytest.raises(TypeError, match=rf"token healing takes the model's tokenizer .*got \w+ {heal!r}$"):
        lm.generate(torch.tensor([[1, 2, 3]]), 8, heal=heal)
