"""Batches of prompts: every row of a blockwise batch is transformers' batched greedy output for that
row, and what decoding that row alone gives, whatever each row's drafter gets right."""

from __future__ import annotations

import warnings
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, make_prompt, perturb_heads, tiny
from test_decode import sliding_window_model
from transformers import PreTrainedModel

from blockdecode import BlockwiseLM, NgramDrafter, blockwise_generate, decode, make_plan
from blockdecode.bench.batches import batch_rows, identical, new_tokens_of, padded_batch
from blockdecode.core.toy import TOY_ARCHITECTURES, TOY_SEQ2SEQ, toy_model
from blockdecode.decoding.calibrate import Calibration
from blockdecode.decoding.ranking import Ranking
from blockdecode.decoding.sampling import sampling_settings
from blockdecode.drafters.base import BaseDrafter
from blockdecode.drafters.heads import HeadsDrafter

LENGTHS = (5, 11, 2, 8)  # prompts of different lengths: every row but the longest is padded


class RowsScripted(BaseDrafter):
    """Proposes each row's known continuation, right with that row's own probability: one row always
    right, one always wrong, the others in between, so the rows accept different blocks each call."""

    def __init__(self, references: list[list[int]], accuracy: tuple[float, ...] = (1.0, 0.0, 0.5, 0.8), seed: int = 0):
        self.references, self.accuracy = references, accuracy
        self.rng = torch.Generator().manual_seed(seed)
        self.shown: list[tuple[int, list[int]]] = []  # (row, the tokens it was shown), per proposal

    def propose_rows(self, tokens, hidden, n, rows):
        chains = []
        for seq, row in zip(tokens, rows):
            self.shown.append((row, seq[0].tolist()))
            truth = (self.references[row][seq.shape[1] : seq.shape[1] + n] + [3] * n)[:n]
            wrong = torch.rand(n, generator=self.rng) >= self.accuracy[row % len(self.accuracy)]
            chains.append([(t + 1) % 512 if bad else t for t, bad in zip(truth, wrong.tolist())])
        return torch.tensor(chains, dtype=torch.long)


def padded(prompts: list[torch.LongTensor], pad: int, left: bool) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The prompts as one batch [B, T] and its attention mask, padded on the left (or right)."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        span = slice(width - p.shape[1], width) if left else slice(0, p.shape[1])
        ids[row, span], mask[row, span] = p[0], 1
    return ids, mask


def row_tokens(model: PreTrainedModel, sequences: torch.LongTensor, mask: torch.LongTensor, row: int, eos) -> list:
    """Row `row` of a batch's output without its padding: the prompt's tokens (a decoder's: all of them)
    and the new ones up to and including the first EOS."""
    start = 1 if model.config.is_encoder_decoder else mask.shape[1]
    seq = sequences[row].tolist()
    prompt = seq[:start] if model.config.is_encoder_decoder else [t for t, m in zip(seq, mask[row].tolist()) if m]
    new = seq[start:]
    end = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    return prompt + new[:end]


@torch.inference_mode()
def hf_batch(model: PreTrainedModel, ids, mask, new: int, eos=NO_EOS) -> torch.LongTensor:
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=eos)


def check_rows(model, prompts, mask, ours, ref, eos=NO_EOS, what: str = "") -> None:
    """Each row of `ours` is `ref`'s row (the batch's greedy output), or parts from it at a near-tie; when
    no row parts, the padded batches are equal, padding and all."""
    for row, prompt in enumerate(prompts):
        mine, theirs = (torch.tensor(row_tokens(model, s, mask, row, set(eos))) for s in (ours, ref))
        assert_greedy_equal(model, prompt, mine, theirs, what=f"{what} row {row}")
    if all(
        row_tokens(model, ours, mask, r, set(eos)) == row_tokens(model, ref, mask, r, set(eos))
        for r in range(len(prompts))
    ):
        assert torch.equal(ours, ref)


def causal_batch(arch: str, new: int = 24):
    model = tiny(arch)
    prompts = [make_prompt(n, 512, seed=n) for n in LENGTHS]
    ids, mask = padded(prompts, model.generation_config.pad_token_id, left=True)
    return model, prompts, ids, mask, hf_batch(model, ids, mask, new)


@pytest.mark.parametrize("arch", TOY_ARCHITECTURES)
def test_each_row_is_transformers_batched_greedy_and_decoded_alone(arch: str) -> None:
    model, prompts, ids, mask, ref = causal_batch(arch)
    drafter = RowsScripted([row_tokens(model, ref, mask, r, set()) for r in range(len(prompts))])
    out = blockwise_generate(model, ids, 24, drafter, 4, eos_token_id=NO_EOS, attention_mask=mask)
    check_rows(model, prompts, mask, out.sequences, ref, what=arch)
    assert len({tuple(s.block_sizes) for s in out.row_stats}) > 1, "the rows should accept different blocks"
    assert out.row_stats[0].block_sizes[0] == 4 and max(out.row_stats[1].block_sizes) == 1  # right; always wrong
    assert out.stats.new_tokens == 24 * len(prompts) and out.stats.calls == max(s.calls for s in out.row_stats)
    assert sum(out.stats.block_sizes) + len(prompts) == out.stats.new_tokens
    for row, prompt in enumerate(prompts):
        alone = blockwise_generate(model, prompt, 24, NgramDrafter(), 4, eos_token_id=NO_EOS).sequences
        mine = torch.tensor(row_tokens(model, out.sequences, mask, row, set()))
        assert_greedy_equal(model, prompt, mine, alone, what=f"{arch} row {row} against itself alone")


RANKED = Ranking(((1, 1.0), (8, 1.07), (16, 1.2), (32, 1.5), (64, 2.18)))  # this CPU's curve, one row


@pytest.mark.parametrize("arch", TOY_ARCHITECTURES)
def test_a_ranked_batch_is_transformers_batched_greedy_each_row_from_its_likelier_drafter(arch: str) -> None:
    """Each row's chain from the drafter it finds likelier (scripted at that row's accuracy, or n-gram
    lookup), all rows verified to one width a call."""
    model, prompts, ids, mask, ref = causal_batch(arch)
    rows = [row_tokens(model, ref, mask, r, set()) for r in range(len(prompts))]
    plan = make_plan(model, [RowsScripted(rows), NgramDrafter()], 6, eos_token_id=NO_EOS, ranking=RANKED)
    out = decode(model, ids, 24, plan, attention_mask=mask)
    check_rows(model, prompts, mask, out.sequences, ref, what=f"{arch} ranked")
    calls = [s.verified for s in out.row_stats]
    assert all(a == b for row in calls for a, b in zip(row, calls[0]))  # one width for all rows a call


def test_a_ranked_batch_verifies_whole_chains_where_they_stand_and_none_where_they_fall() -> None:
    model, prompts, ids, mask, ref = causal_batch("llama", new=40)
    rows = [row_tokens(model, ref, mask, r, set()) for r in range(len(prompts))]
    for accuracy, widths in ((1.0, {6}), (0.0, {1, 2})):  # all of k - 1; none, or one guess the decay retries
        plan = make_plan(model, RowsScripted(rows, (accuracy,)), 6, eos_token_id=NO_EOS, ranking=RANKED)
        out = decode(model, ids, 40, plan, attention_mask=mask)
        check_rows(model, prompts, mask, out.sequences, ref, what=f"ranked, scripted {accuracy}")
        assert out.row_stats[0].verified[len(out.row_stats[0].verified) // 2] in widths  # the newest token and those


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_static_cache_batch(arch: str) -> None:
    """Masked entries fill a static cache faster than the rows grow: it is compacted before it overflows."""
    model, prompts, ids, mask, ref = causal_batch(arch, new=40)
    drafter = RowsScripted([row_tokens(model, ref, mask, r, set()) for r in range(len(prompts))])
    out = blockwise_generate(
        model, ids, 40, drafter, 6, eos_token_id=NO_EOS, attention_mask=mask, cache_implementation="static"
    )
    check_rows(model, prompts, mask, out.sequences, ref, what=f"{arch} static")


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_sliding_window_batch(arch: str) -> None:
    """A sliding window counts cache slots: each row's entries are kept contiguous, so the window is
    the row's own (Mistral: every layer slides; Gemma 3: some)."""
    model = sliding_window_model() if arch == "mistral" else tiny(arch)
    prompts = [make_prompt(n, 512, seed=n) for n in LENGTHS]
    ids, mask = padded(prompts, 1, left=True)
    ref = hf_batch(model, ids, mask, 30)
    drafter = RowsScripted([row_tokens(model, ref, mask, r, set()) for r in range(len(prompts))])
    out = blockwise_generate(model, ids, 30, drafter, 4, eos_token_id=NO_EOS, attention_mask=mask)
    check_rows(model, prompts, mask, out.sequences, ref, what=f"{arch}, window 8")


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_rows_end_at_different_calls(arch: str) -> None:
    """One row's first token is EOS, another's a later one: each stops there, padded as transformers pads,
    while the rest go on."""
    model, prompts, ids, mask, free = causal_batch(arch)
    new = [row_tokens(model, free, mask, r, set())[-24:] for r in range(len(prompts))]
    eos = [new[2][0], new[0][9]]
    ref = hf_batch(model, ids, mask, 24, eos=eos)
    drafter = RowsScripted([row_tokens(model, free, mask, r, set()) for r in range(len(prompts))])
    out = blockwise_generate(model, ids, 24, drafter, 4, eos_token_id=eos, attention_mask=mask)
    check_rows(model, prompts, mask, out.sequences, ref, eos, what=arch)
    ended = [s.new_tokens for s in out.row_stats]
    assert ended[2] == 1 and ended[0] <= 10 and len(set(ended)) > 2, ended
    assert out.row_stats[2].calls == 1  # finished on the prefill's token: never verified


def test_a_ranked_batch_asks_for_each_rows_own_chain_after_the_others_end() -> None:
    """Once all rows but one have ended, the drafter is still asked for that row's chain by its number (a
    drafter that keeps each row's state, as EAGLE-3 and DFlash do, crashed when handed row 0's)."""
    model, prompts, ids, mask, free = causal_batch("llama")
    rows = [row_tokens(model, free, mask, r, set()) for r in range(len(prompts))]
    eos = [rows[r][-24:][1] for r in (0, 2, 3)]  # three rows end early; row 1 (always wrong) goes on alone
    eos = [t for t in eos if t not in rows[1][-24:]]
    ref = hf_batch(model, ids, mask, 24, eos=eos)
    drafter = RowsScripted(rows)
    plan = make_plan(model, [drafter, NgramDrafter()], 4, eos_token_id=eos, ranking=RANKED)
    out = decode(model, ids, 24, plan, attention_mask=mask)
    check_rows(model, prompts, mask, out.sequences, ref, eos, what="ranked, rows ending")
    assert out.row_stats[1].new_tokens == 24 and min(s.new_tokens for s in out.row_stats) < 24
    assert all(rows[row][: len(seen)] == seen for row, seen in drafter.shown), "a row was asked for with another's"


@pytest.mark.parametrize("arch", TOY_SEQ2SEQ)
def test_encoder_decoder_batch(arch: str) -> None:
    """Right-padded sources of different lengths, each row its own decoder sequence."""
    model = tiny(arch)
    prompts = [make_prompt(n, 512, seed=n) for n in LENGTHS]
    ids, mask = padded(prompts, model.generation_config.pad_token_id, left=False)
    eos = sorted({model.generation_config.eos_token_id})
    ref = hf_batch(model, ids, mask, 20, eos=eos)
    drafter = RowsScripted([row_tokens(model, ref, mask, r, set(eos)) for r in range(len(prompts))])
    out = blockwise_generate(model, ids, 20, drafter, 4, eos_token_id=eos, attention_mask=mask)
    check_rows(model, prompts, mask, out.sequences, ref, eos, what=arch)
    ranked = make_plan(model, [drafter, NgramDrafter()], 4, eos_token_id=eos, ranking=RANKED)
    check_rows(model, prompts, mask, decode(model, ids, 20, ranked, attention_mask=mask).sequences, ref, eos, what=arch)
    for row, prompt in enumerate(prompts):
        alone = blockwise_generate(model, prompt, 20, NgramDrafter(), 4, eos_token_id=eos).sequences
        mine = torch.tensor(row_tokens(model, out.sequences, mask, row, set(eos)))
        assert_greedy_equal(model, prompt, mine, alone, what=f"{arch} row {row} against itself alone")


@pytest.mark.parametrize("head_type, rescore", [("paper", 0.0), ("paper", 1.0), ("hydra", 0.0)])
def test_heads_propose_for_every_row_in_one_call(head_type: str, rescore: float, monkeypatch) -> None:
    model, prompts, ids, mask, ref = causal_batch("llama")
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4, head_type=head_type))
    drafter = lm.drafter(rescore=rescore)
    batches = []
    rows_call = drafter.propose_rows

    def spy(tokens, hidden, n, rows):
        batches.append((len(tokens), hidden.shape[0]))
        return rows_call(tokens, hidden, n, rows)

    monkeypatch.setattr(drafter, "propose_rows", spy)
    monkeypatch.setattr(drafter, "propose", lambda *a: pytest.fail("the heads proposed row by row"))
    out = lm.generate(ids, 24, eos_token_id=NO_EOS, drafter=drafter, tree=None, attention_mask=mask)
    check_rows(model, prompts, mask, out.sequences, ref, what=f"{head_type} heads")
    assert batches and all(b == (4, 4) for b in batches)  # every row (all of them decode to the end) at once
    if rescore:  # each row's own context, fed what that row accepted
        assert [len(c.seq) for c in drafter._contexts] == [
            len(row_tokens(model, ref, mask, r, set())) for r in range(4)
        ]


def test_ngram_reads_each_rows_own_tokens() -> None:
    """Every proposal is made from its own row's tokens, without padding: what that row has decoded so far."""
    model, prompts, ids, mask, ref = causal_batch("gpt2")
    rows = [row_tokens(model, ref, mask, r, set()) for r in range(len(prompts))]
    drafter = RowsScripted(rows)
    out = blockwise_generate(model, ids, 24, drafter, 4, eos_token_id=NO_EOS, attention_mask=mask)
    check_rows(model, prompts, mask, out.sequences, ref, what="gpt2")
    assert {row for row, _ in drafter.shown} == {0, 1, 2, 3}
    assert all(rows[row][: len(seen)] == seen and len(seen) > LENGTHS[row] for row, seen in drafter.shown)
    ngram = blockwise_generate(model, ids, 24, NgramDrafter(), 4, eos_token_id=NO_EOS, attention_mask=mask)
    check_rows(model, prompts, mask, ngram.sequences, ref, what="gpt2 n-gram")


def test_a_padded_single_row_decodes_as_transformers_does() -> None:
    model = tiny("llama")
    prompt = make_prompt(5, 512, seed=5)
    ids, mask = padded([prompt, make_prompt(9, 512)], 1, left=True)
    ids, mask = ids[:1], mask[:1]  # one row, with the padding a batch gave it
    ref = hf_batch(model, ids, mask, 20)
    for given in (mask, mask.bool(), mask.float()):  # a mask of any dtype, as transformers takes it
        out = blockwise_generate(model, ids, 20, NgramDrafter(), 4, eos_token_id=NO_EOS, attention_mask=given)
        assert torch.equal(out.sequences, ref)


def test_a_tree_for_a_batch_decodes_chains_and_says_so() -> None:
    model, prompts, ids, mask, ref = causal_batch("llama")
    with pytest.warns(UserWarning, match="a batch verifies one chain a row"):
        out = blockwise_generate(model, ids, 24, NgramDrafter(), 4, eos_token_id=NO_EOS, tree=8, attention_mask=mask)
    assert "one chain a row" in out.stats.note and all(s.note == out.stats.note for s in out.row_stats)
    check_rows(model, prompts, mask, out.sequences, ref, what="tree asked")


def test_auto_for_a_batch_is_the_fastest_chain() -> None:
    lm = BlockwiseLM.from_base(tiny("llama"), k=4)
    prompts = [make_prompt(n, 512, seed=n) for n in LENGTHS]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tree asked for, so nothing to warn about
        plan = lm.plan(tree="auto", prompts=prompts, rows=4)
    assert plan.tree is None and len(plan.drafters) == 1
    curves = {"heads": {"0": 10.0, "4": 30.0}, "ngram": {"0": 20.0}, "heads+ngram": {"8": 40.0}}
    assert Calibration("key", "heads+ngram", 8, curves).best_chain() == "ngram"
    assert Calibration("key", "heads+ngram", 8, {}).best_chain() == "ngram"  # unmeasured: the first drafter


def test_sampling_a_batch_is_reproducible() -> None:
    model, prompts, ids, mask, _ = causal_batch("llama")

    def sample(seed: int) -> torch.LongTensor:
        generator = torch.Generator().manual_seed(seed)
        return blockwise_generate(
            model, ids, 16, NgramDrafter(), 4, eos_token_id=NO_EOS, attention_mask=mask, do_sample=True,
            temperature=0.7, top_k=0, generator=generator,
        ).sequences  # fmt: skip

    first = sample(1)
    assert torch.equal(first, sample(1)) and not torch.equal(first, sample(2))
    assert first.shape == (4, ids.shape[1] + 16) and torch.equal(first[:, : ids.shape[1]], ids)


@pytest.mark.parametrize(
    "mask, match",
    [
        (torch.ones(4, 3, dtype=torch.long), "must match input_ids"),
        (
            torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]),
            "row 1 of attention_mask is all padding",
        ),
        (torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]), "padded on the left"),
        (torch.full((4, 4), 2), "1 for tokens and 0 for padding"),
        (torch.full((4, 4), 0.5), "1 for tokens and 0 for padding"),
    ],
)
def test_bad_attention_mask_raises(mask: torch.Tensor, match: str) -> None:
    lm = BlockwiseLM.from_base(tiny("llama"), k=4)
    with pytest.raises(ValueError, match=match):
        lm.generate(torch.full((4, 4), 5), 5, tree=None, attention_mask=mask)


def test_streaming_a_batch_raises() -> None:
    ids = torch.full((2, 4), 5)
    with pytest.raises(ValueError, match="on_block streams one sequence"):
        blockwise_generate(tiny("llama"), ids, 5, NgramDrafter(), 4, on_block=print)


def test_a_right_padded_source_is_fine_for_an_encoder_decoder() -> None:
    """Padding after the tokens is how encoder inputs are padded; only a decoder-only model refuses it."""
    model = tiny("marian")
    ids, mask = padded([make_prompt(3, 512), make_prompt(6, 512)], 2, left=False)
    out = blockwise_generate(model, ids, 8, NgramDrafter(), 4, eos_token_id=NO_EOS, attention_mask=mask)
    assert torch.equal(out.sequences, hf_batch(model, ids, mask, 8))
    with pytest.raises(ValueError, match="padded on the left"):
        blockwise_generate(tiny("llama"), ids, 8, NgramDrafter(), 4, attention_mask=mask)


def test_heads_drafter_batches_its_rows() -> None:
    """The heads' chains for several rows at once are each row's chain alone."""
    lm = perturb_heads(BlockwiseLM.from_base(tiny("llama"), k=4))
    drafter: HeadsDrafter = lm.drafter()
    hidden = torch.randn(3, lm.config.hidden_size)
    tokens = [torch.tensor([[5, 6]]), torch.tensor([[7]]), torch.tensor([[8, 9, 10]])]
    together = drafter.propose_rows(tokens, hidden, 3, [0, 1, 2])
    alone = torch.cat([drafter.propose(t, hidden[i : i + 1], 3) for i, t in enumerate(tokens)])
    assert together.shape == (3, 3) and torch.equal(together, alone)


def test_bench_batch_rows_time_the_batch_and_compare_it_with_transformers() -> None:
    """`blockdecode bench`'s batch rows: the calls counted are the batch's (as many as its slowest
    row needs), and each drafter's output is transformers' batched greedy."""
    model, prompts, ids, mask, _ = causal_batch("llama")
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4))
    rows = batch_rows(lm, ids, mask, 12, ["heads", "ngram", "expected"], 4, repeats=1)
    plans = [("heads", "heads, chain"), ("ngram", "ngram, chain"), ("expected", "ngram+heads, ranked chain")]
    assert [(r["drafter"], r["plan"]) for r in rows] == plans
    assert all(r["batch"] == 4 for r in rows)
    for r in rows:
        assert r["identical"] and r["calls"] == r["slowest_row_calls"] <= r["greedy_calls"] == 12
        assert r["speedup"] == pytest.approx(r["greedy_seconds"] / r["seconds"])


def test_a_batch_row_that_differs_is_named_a_tie_only_at_a_near_tie() -> None:
    """The batch table's `identical`: a real divergence is NO, one at greedy's own near-tie a tie."""
    row = {"batch": 4, "identical": False, "divergences": [{"near_tie": True}, {"near_tie": True}]}
    assert identical(row) == "ties (2/4)"
    assert identical({**row, "divergences": [{"near_tie": True}, {"near_tie": False}]}) == "NO"
    assert identical({**row, "identical": True}) == "yes"
    assert new_tokens_of(torch.tensor([[1, 2, 3, 0, 9, 9], [1, 2, 4, 5, 6, 7]]), 2, {0}) == [[3, 0], [4, 5, 6, 7]]


def test_a_padded_batch_pads_where_transformers_expects() -> None:
    class Digits:
        """A tokenizer whose tokens are a text's digits."""

        pad_token_id = 0

        def __call__(self, text: str) -> SimpleNamespace:
            return SimpleNamespace(input_ids=[int(c) for c in text])

    tokenizer = Digits()
    ids, mask = padded_batch(tokenizer, ["123", "4"], seq2seq=False)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = padded_batch(tokenizer, ["123", "4"], seq2seq=True)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_sampling_a_padded_batch_matches_transformers_in_distribution() -> None:
    """Rows of a left-padded batch, sampled with a drafter that is often wrong (so rows keep different
    blocks, and rejected entries the mask must hide), each have the law of transformers' sampling of the
    unpadded prompt: the chi-square test of test_sampling, which rejects rejected entries left visible
    (p ~ 1e-27)."""
    from test_sampling import BUDGET, DRAFTERS, PROMPT, SETTINGS, SHOWN, homogeneity, reference, small

    model, setting = small(), "t1.3-k5-p0.8"
    sampling = sampling_settings(model, True, **SETTINGS[setting])
    plan = make_plan(model, DRAFTERS["random"](model), k=3, sampling=sampling)
    ids = torch.cat([torch.full((8, 2), 1), PROMPT.expand(8, -1)], dim=1)
    mask = torch.ones_like(ids).index_fill_(1, torch.tensor([0, 1]), 0)
    generator, samples = torch.Generator().manual_seed(0), Counter()
    for _ in range(75):
        out = decode(model, ids, BUDGET[setting], plan, generator=generator, attention_mask=mask)
        for row in out.sequences[:, ids.shape[1] :].tolist():
            samples[tuple((row + [1] * SHOWN)[:SHOWN])] += 1  # as transformers pads a finished row
    assert sum(samples.values()) == 600 and homogeneity(samples, reference(setting)) > 1e-3


def test_a_row_of_special_tokens_alone_is_refused_in_any_row_before_the_model_is_called() -> None:
    model = toy_model("llama")
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    lm = BlockwiseLM.from_base(model, k=4)
    ids, mask = torch.tensor([[5, 6, 7], [9, 9, 1]]), torch.tensor([[1, 1, 1], [0, 0, 1]])  # row 1: EOS after padding
    for run in (
        lambda: lm.generate(ids, 5, attention_mask=mask),
        lambda: blockwise_generate(model, ids, 5, NgramDrafter(), 4, attention_mask=mask),
        lambda: decode(model, ids, 5, make_plan(model, "ngram", 4), attention_mask=mask),
    ):
        with pytest.raises(ValueError, match=r"the prompt in row 1 is empty: it holds only special tokens \[1\]"):
            run()
    assert not calls
