"""Acceptance rules: hand-built logits decide each case; relaxed rules never accept less than exact;
exact stays greedy; bad specifications fail clearly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from blockdecode import BlockwiseLM
from blockdecode.cli import main
from blockdecode.core.toy import toy_model
from blockdecode.decoding.acceptance import EXACT, Acceptance, parse_acceptance
from blockdecode.decoding.loop import blockwise_generate
from blockdecode.drafters.base import ScriptedDrafter
from blockdecode.pretraining.corpus import train_tokenizer
from tests.conftest import NO_EOS, hf_greedy, make_prompt, perturb_heads, tiny

# Four positions of a 6-token vocabulary. Row i scores the token proposal i stands in for; the last
# row only yields the base model's own next token. Per row: best, second, third (tied with second
# in row 2).
LOGITS = torch.tensor(
    [
        [5.0, 4.0, 3.0, 0.0, 0.0, 0.0],  # best 0, second 1, third 2
        [0.0, 1.0, 9.0, 2.0, 0.0, 0.0],  # best 2, second 3, third 1
        [0.0, 0.0, 3.0, 7.0, 3.0, 1.0],  # best 3, then 2 and 4 tied
        [0.0, 0.0, 0.0, 0.0, 0.0, 8.0],  # best 5 (the token after a full block)
    ]
)
GREEDY = LOGITS.argmax(-1)


def accepted(spec: str | Acceptance, draft: list[int], values=None) -> int:
    rule = parse_acceptance(spec, values)
    n = len(draft)
    return rule.accepted(torch.tensor(draft), LOGITS[: n + 1], GREEDY[: n + 1])


@pytest.mark.parametrize(
    ("spec", "draft", "expected"),
    [
        ("exact", [0, 2, 3], 3),  # every proposal is the argmax: the full block
        ("exact", [0, 3, 3], 1),  # stops at the first disagreement...
        ("exact", [1, 2, 3], 0),  # ...even the first
        ("exact", [], 0),
        ("topk:1", [0, 3, 3], 1),  # top-1 is exact
        ("topk:2", [1, 3, 3], 3),  # second-best tokens are in
        ("topk:2", [2, 2, 3], 0),  # a third-best is out
        ("topk:2", [0, 2, 4], 3),  # tied with the second-best: in
        ("topk:2", [0, 2, 5], 2),  # below the tie: out
        ("topk:3", [2, 1, 3], 3),
        ("topk:100", [4, 4, 0], 3),  # N beyond the vocabulary takes everything
        ("min-block:1", [1, 2, 3], 0),  # L=1 is exact
        ("min-block:3", [4, 4, 0], 2),  # the first L-1 proposals, whatever they are...
        ("min-block:2", [4, 2, 3], 3),  # ...then exact from there on
        ("min-block:4", [4, 4], 2),  # a budget-truncated block: all there is
    ],
)
def test_rules_decide_hand_built_cases(spec: str, draft: list[int], expected: int) -> None:
    assert accepted(spec, draft) == expected


def test_last_row_never_decides_acceptance() -> None:
    """The block's last row scores the token after the last proposal, not a proposal: changing it
    changes no decision."""
    draft = torch.tensor([0, 2, 3])
    other = LOGITS.clone()
    other[-1] = torch.tensor([9.0, 0, 0, 0, 0, 0])
    for spec in ("exact", "topk:2", "min-block:2"):
        rule = parse_acceptance(spec)
        assert rule.accepted(draft, LOGITS, GREEDY) == rule.accepted(draft, other, other.argmax(-1)) == 3


def test_distance_rule_uses_the_value_map() -> None:
    values = [0.0, 1.0, 2.0, 3.0, 10.0, math.nan]  # token 5 has no value
    assert accepted("distance:1", [1, 3, 4], values) == 2  # |1-0|, |3-2| <= 1; |10-3| is not
    assert accepted("distance:0", [1, 2, 3], values) == 0  # 0 is exact on values
    assert accepted("distance:7", [1, 3, 4], values) == 3
    # A valueless token matches only itself: exact there.
    nan_row = LOGITS.clone()
    nan_row[0] = torch.tensor([0, 0, 0, 0, 0, 9.0])
    rule = parse_acceptance("distance:100", values)
    assert rule.accepted(torch.tensor([5, 2]), nan_row[:3], nan_row[:3].argmax(-1)) == 2
    assert rule.accepted(torch.tensor([4, 2]), nan_row[:3], nan_row[:3].argmax(-1)) == 0


@pytest.mark.parametrize("spec", ["topk:2", "topk:5", "min-block:2", "min-block:4", "distance:1.5"])
def test_relaxed_rules_never_accept_less_than_exact(spec: str) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    rule = parse_acceptance(spec, values=torch.arange(vocab, dtype=torch.float32))
    more = 0
    for _ in range(500):
        n = int(torch.randint(0, 6, (1,), generator=gen))
        logits = torch.randn(n + 1, vocab, generator=gen)
        greedy = logits.argmax(-1)
        guess = torch.randint(0, vocab, (n,), generator=gen)
        draft = torch.where(torch.rand(n, generator=gen) < 0.7, greedy[:n], guess)
        strict, relaxed = EXACT.accepted(draft, logits, greedy), rule.accepted(draft, logits, greedy)
        assert relaxed >= strict
        more += relaxed > strict
    assert more > 0  # and the relaxation does something


def test_exact_is_bit_identical_to_greedy_and_says_so() -> None:
    base = tiny("llama")
    lm = perturb_heads(BlockwiseLM.from_base(base, k=4))
    ids = make_prompt(5, 512)
    out = lm.generate(ids, 30, eos_token_id=NO_EOS, acceptance="exact", tree=None)
    assert torch.equal(out.sequences, hf_greedy(base, ids, 30, eos_token_id=None))
    assert out.stats.exact and out.stats.to_dict()["acceptance"] == "exact"


class SecondBest:
    """Proposes the base model's second choice for the next token, n times: exact never accepts it."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        second = self.model(tokens).logits[0, -1].topk(2).indices[1]
        return second.repeat(1, n)


@pytest.mark.parametrize("spec", ["topk:2", "min-block:3"])
def test_relaxed_decoding_is_labelled_and_gains_blocks(spec: str) -> None:
    base = tiny("llama")
    ids = make_prompt(5, 512, seed=1)
    runs = {
        rule: blockwise_generate(base, ids, 30, SecondBest(base), 4, NO_EOS, acceptance=rule)
        for rule in ("exact", spec)
    }
    assert set(runs["exact"].stats.block_sizes) == {1}
    assert runs["exact"].stats.exact and not runs[spec].stats.exact and runs[spec].stats.acceptance == spec
    assert min(runs[spec].stats.block_sizes[:-1]) >= 2
    assert runs[spec].sequences.shape == runs["exact"].sequences.shape  # the budget still holds


def test_eos_cuts_a_relaxed_block() -> None:
    """A forced proposal that is EOS ends decoding there, as an EOS from the base model would."""
    base = tiny("llama")
    ids = make_prompt(5, 512, seed=2)
    first = int(hf_greedy(base, ids, 1, eos_token_id=None)[0, -1])
    eos = (first + 1) % 512
    script = torch.cat([ids[0], torch.full((20,), eos)])  # proposes nothing but EOS
    out = blockwise_generate(base, ids, 20, ScriptedDrafter(script, 512), 4, eos_token_id=eos, acceptance="min-block:4")
    assert out.sequences[0, 5:].tolist() == [first, eos]
    assert out.stats.block_sizes == [1]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("topk:0", "topk:N needs an integer N >= 1"),
        ("topk:two", "topk needs a number"),
        ("topk:1.5", "topk needs a number"),
        ("distance:-0.5", "EPS >= 0"),
        ("distance:nan", "EPS >= 0"),
        ("distance:1", "needs a token -> value map"),
        ("min-block:0", "L >= 1"),
        ("greedy", "unknown acceptance 'greedy'"),
        ("exact:1", "unknown acceptance"),
    ],
)
def test_bad_specifications_fail_clearly(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_acceptance(spec)


def test_rules_that_do_not_fit_the_decode_are_refused() -> None:
    base = tiny("llama")
    lm = BlockwiseLM.from_base(base, k=8)
    ids = make_prompt(3, 512)
    with pytest.raises(ValueError, match="min-block:9 asks for more tokens per call than the block size k=8"):
        lm.generate(ids, 10, acceptance="min-block:9", tree=None)
    with pytest.raises(ValueError, match="value map covers 3 tokens, the model's vocabulary 512"):
        lm.generate(ids, 10, acceptance=parse_acceptance("distance:1", values=[0, 1, 2]), tree=None)


def test_cli_says_when_the_output_is_not_greedy(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tokenizer = train_tokenizer(["\n".join(f"x{i} = {i}" for i in range(300))], vocab_size=300)
    base = toy_model("llama", vocab=len(tokenizer), context=128)
    perturb_heads(BlockwiseLM.from_base(base, k=4)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    common = [
        "generate",
        "--model",
        str(tmp_path),
        "--prompt",
        "x1 = 1",
        "--max-new-tokens",
        "16",
        "--tree",
        "off",
        "--dtype",
        "fp32",
    ]
    main([*common, "--acceptance", "topk:3", "--compare"])
    err = capsys.readouterr().err
    assert "topk:3: approximate, this is NOT the exact greedy output" in err
    main([*common, "--compare"])
    err = capsys.readouterr().err
    assert "NOT" not in err and "identical: yes" in err
    values = tmp_path / "values.json"
    values.write_text(json.dumps([float(i) if i % 2 else None for i in range(len(tokenizer))]))
    main([*common, "--acceptance", "distance:2", "--value-map", str(values)])
    assert "distance:2: approximate" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="topk:N needs an integer N >= 1"):
        main([*common, "--acceptance", "topk:0"])
    with pytest.raises(SystemExit, match="needs a token -> value map"):
        main([*common, "--acceptance", "distance:1"])
    values.write_text('{"a": 1}')
    with pytest.raises(SystemExit, match="must hold a JSON list"):
        main([*common, "--acceptance", "distance:1", "--value-map", str(values)])
