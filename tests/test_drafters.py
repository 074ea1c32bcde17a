"""Drafters on their own: what each proposes, and how bad proposals are caught before verification."""

from __future__ import annotations

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_prompt, perturb_heads, tiny

from blockdecode import BlockwiseLM, Drafter, HeadsDrafter, NgramDrafter, ScriptedDrafter
from blockdecode.core.toy import toy_model
from blockdecode.drafters.base import check_ids, check_proposal
from blockdecode.drafters.ngram import ContextNgram

NO_HIDDEN = torch.zeros(1, 8)  # n-gram and scripted drafters ignore the hidden state


def ngram(tokens: list[int], n: int, **kwargs: int) -> list[int]:
    """NgramDrafter's proposal for `tokens`, as a list; checks the shape and dtype on the way."""
    out = NgramDrafter(**kwargs).propose(torch.tensor([tokens]), NO_HIDDEN, n)
    assert out.shape == (1, n) and out.dtype == torch.long
    return out[0].tolist()


def test_ngram_proposes_what_followed_the_most_recent_match() -> None:
    assert ngram([1, 2, 3, 9, 1, 2, 4, 1, 2], 3, max_ngram=2) == [4, 1, 2]


def test_ngram_follows_the_occurrence_whose_context_matches_longest() -> None:
    """Lines that alternate, a b x / c b y: after "c b" the newest "b" went on with x, but the one after
    "c" went on with y, and so does this one."""
    a, b, c, x, y = 1, 2, 3, 4, 5
    seq = [a, b, x, c, b, y, a, b, x, c, b]
    assert ngram(seq, 1, max_ngram=1) == [y]
    assert ngram([a, b, x, c, b, y, a, b], 1, max_ngram=1) == [x]  # after "a b": the other occurrence


def test_ngram_prefers_the_longest_match() -> None:
    """The tail [1, 2] matched early beats the more recent single-token match of [2]."""
    assert ngram([5, 1, 2, 7, 3, 2, 8, 1, 2], 2) == [7, 3]
    assert ngram([5, 1, 2, 7, 3, 2, 8, 1, 2], 2, max_ngram=1) == [7, 3]  # "1 2" again: its context
    assert ngram([5, 1, 2, 7, 3, 2, 8, 9, 2], 2, max_ngram=1) == [8, 9]  # no context matches: the newest


def test_ngram_goes_on_with_a_loop_that_runs_into_the_present() -> None:
    assert ngram([1, 2, 3, 1, 2], 7) == [3, 1, 2, 3, 1, 2, 3]  # "1 2" went on with 3 1 2: the text's period, 3
    assert ngram([4, 9, 9], 4) == [9, 9, 9, 9]
    drafter, tokens = NgramDrafter(), torch.tensor([[1, 2, 3, 1, 2]])
    assert [s.key[0] for s in drafter.chain_scored(tokens, NO_HIDDEN, 5).sources] == ["match"] * 3 + ["loop"] * 2
    paths = drafter.propose_scored(torch.tensor([[5, 6, 5, 7, 5]]), NO_HIDDEN, 5, 8)
    assert [p.tokens for p in paths] == [[7, 5, 7, 5, 7], [6, 5, 7, 5, 6]]  # each occurrence its own period


def test_ngram_without_a_match_repeats_the_newest_token() -> None:
    assert ngram([1, 2, 3], 3) == [3, 3, 3]
    assert ngram([7], 2) == [7, 7]
    assert ngram([4, 5, 6, 5], 2, min_ngram=2) == [5, 5]  # only a 1-gram would match
    assert ngram([4, 5, 6, 5], 2, min_ngram=1) == [6, 5]


def test_ngram_leaves_its_input_alone() -> None:
    tokens = torch.tensor([[1, 2, 3, 1, 2]])
    NgramDrafter().propose(tokens, NO_HIDDEN, 3)
    assert tokens.tolist() == [[1, 2, 3, 1, 2]]


@pytest.mark.parametrize("max_ngram, min_ngram", [(3, 0), (2, 3), (0, 0)])
def test_ngram_rejects_bad_sizes(max_ngram: int, min_ngram: int) -> None:
    with pytest.raises(ValueError, match="need 1 <= min_ngram <= max_ngram"):
        NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)


REFERENCE = torch.arange(100, 140)[None]  # a stand-in "greedy sequence" of 40 tokens


def test_scripted_perfect_returns_the_reference() -> None:
    drafter = ScriptedDrafter(REFERENCE, accuracy=1.0, vocab_size=512)
    for length in (1, 10, 33):
        guess = drafter.propose(REFERENCE[:, :length], NO_HIDDEN, 5)
        assert guess.tolist() == REFERENCE[:, length : length + 5].tolist()
    assert drafter.propose(REFERENCE[:, :38], NO_HIDDEN, 4).tolist() == [[138, 139, 0, 0]]  # past the end


def test_scripted_zero_accuracy_is_never_right() -> None:
    drafter = ScriptedDrafter(REFERENCE, accuracy=0.0, vocab_size=140)
    for length in range(1, 40):
        guess = drafter.propose(REFERENCE[:, :length], NO_HIDDEN, 8)[0]
        truth = REFERENCE[0, length : length + 8].tolist()
        truth += [0] * (8 - len(truth))
        assert all(g != t and 0 <= g < 140 for g, t in zip(guess.tolist(), truth))


def test_scripted_errors_are_seeded_and_at_the_requested_rate() -> None:
    """Same seed, same errors (tests are reproducible); about `accuracy` of the tokens are right."""

    def hits(seed: int) -> list[bool]:
        drafter = ScriptedDrafter(REFERENCE, accuracy=0.7, seed=seed, vocab_size=512)
        out: list[bool] = []
        for _ in range(100):
            out += (drafter.propose(REFERENCE[:, :10], NO_HIDDEN, 8) == REFERENCE[:, 10:18])[0].tolist()
        return out

    assert hits(1) == hits(1) != hits(2)
    assert 0.6 < sum(hits(1)) / 800 < 0.8


def test_scripted_accuracy_per_depth_follows_its_profile() -> None:
    drafter = ScriptedDrafter(REFERENCE, vocab_size=512, accuracy=[1.0, 0.5, 0.0], seed=3)
    prefix = REFERENCE.reshape(1, -1)[:, :2]
    guesses = torch.cat([drafter.propose(prefix, torch.zeros(1, 4), 4) for _ in range(400)])
    right = (guesses == REFERENCE.reshape(-1)[2:6]).float().mean(0).tolist()
    assert right[0] == 1.0 and 0.4 < right[1] < 0.6 and right[2] == right[3] == 0.0  # the last rate goes on


@pytest.mark.parametrize("accuracy", [-0.1, 1.5, [0.5, 2.0], []])
def test_scripted_rejects_bad_accuracy(accuracy: float) -> None:
    with pytest.raises(ValueError, match="accuracy must lie in \\[0, 1\\]"):
        ScriptedDrafter(REFERENCE, vocab_size=512, accuracy=accuracy)


@pytest.mark.parametrize("head_type", ["paper", "medusa", "hydra"])
def test_untrained_heads_propose_the_next_token_repeated(head_type: str) -> None:
    """Zero-init heads pass h through: every head predicts what the base model's own head 1 does."""
    model = tiny("llama")
    lm = BlockwiseLM.from_base(model, k=6, head_type=head_type)
    drafter = lm.drafter()
    hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    next_token = model.get_output_embeddings()(hidden).argmax(-1)
    for n in (1, 3, 5):
        assert torch.equal(drafter.propose(torch.tensor([[2]]), hidden, n), next_token.repeat(1, n))


def sequential_argmax(lm: BlockwiseLM, newest: int, hidden: torch.Tensor, n: int) -> list[int]:
    """Hydra's chain the slow way: all heads run on the path so far (later slots 0), head i's argmax taken."""
    path = [newest]
    for i in range(n):
        tokens = torch.tensor([path + [0] * (lm.k - 1 - len(path))])
        path.append(int(lm.head_logits(hidden, tokens)[0, i].argmax()))
    return path[1:]


@pytest.mark.parametrize("head_type", ["paper", "medusa", "hydra"])
def test_random_heads_propose_their_own_argmax(head_type: str) -> None:
    """Perturbed heads give arbitrary proposals: head i's argmax, heads beyond n unused; hydra's head i
    reads the guesses of the heads before it."""
    model = tiny("llama")
    lm = perturb_heads(BlockwiseLM.from_base(model, k=6, head_type=head_type))
    drafter = lm.drafter()
    hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if head_type == "hydra":
            expected = torch.tensor([sequential_argmax(lm, 2, hidden, 5)])
        else:
            expected = lm.head_logits(hidden).argmax(-1)  # [1, 5]
        assert torch.equal(drafter.propose(torch.tensor([[7, 2]]), hidden, 5), expected)
        assert torch.equal(drafter.propose(torch.tensor([[7, 2]]), hidden, 2), expected[:, :2])
    assert len(set(expected[0].tolist())) > 1, "random heads should not all agree"


class Successors(torch.nn.Module):
    """Scripted sequential heads over one-hot embeddings: each head's logits are a fixed table's row for
    the token before its own, so a node's children are known from that node alone."""

    takes_tokens = True

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def step(self, i: int, state: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        return embed @ self.table


def test_sequential_heads_grow_each_node_from_its_own_path() -> None:
    """A tree of hydra-style heads: the children of token x are x+1 and x+3 (scripted by the token
    before, not by depth), so two nodes at one depth have different children, and each path reads on."""
    v = 12
    table = torch.full((v, v), -10.0)
    for x in range(v):
        table[x, (x + 1) % v], table[x, (x + 3) % v] = 2.0, 1.0
    identity = torch.nn.Linear(v, v, bias=False)
    embeddings = torch.nn.Embedding(v, v)
    with torch.no_grad():
        identity.weight.copy_(torch.eye(v))
        embeddings.weight.copy_(torch.eye(v))
    drafter = HeadsDrafter(Successors(table), identity, width=3, embeddings=embeddings)
    newest = torch.tensor([[5, 0]])
    assert drafter.propose(newest, torch.zeros(1, v), 3).tolist() == [[1, 2, 3]]
    paths = drafter.propose_paths(newest, torch.zeros(1, v), 3, budget=6)
    assert paths[0] == [1, 2, 3]  # the most probable path first
    nodes = {tuple(p[:j]) for p in paths for j in range(1, len(p) + 1)}
    assert len(nodes) <= 6
    for path in paths:
        for before, after in zip([0, *path], path):
            assert after in ((before + 1) % v, (before + 3) % v), f"{path}: {after} does not follow {before}"
    assert {(1, 2), (1, 4), (3, 4)} <= nodes  # node 1's children are 2 and 4, node 3's start with 4


def test_hydra_heads_need_embeddings_and_refuse_rescoring() -> None:
    lm = BlockwiseLM.from_base(tiny("llama"), k=4, head_type="hydra")
    with pytest.raises(ValueError, match="need the base's input embeddings"):
        HeadsDrafter(lm.heads, lm.base.get_output_embeddings())
    with pytest.raises(ValueError, match="hydra heads already see their path"):
        lm.drafter(rescore=1.0)


def test_the_context_ngram_model_prefers_what_followed_before() -> None:
    lm = ContextNgram([5, 6, 7, 5, 6, 8, 5, 6])
    after = {t: lm.prob((), t) for t in (7, 8, 9)}  # the context ends 5 6: 7 and 8 followed it
    assert after[7] == pytest.approx(after[8]) and after[7] > 10 * after[9] > 0
    assert lm.prob((7,), 5) > lm.prob((7,), 6)  # a path continues the history: 6 7 was followed by 5
    assert all(0 < lm.prob((), t) < 1 for t in range(12))
    grown = ContextNgram([5, 6, 7])
    assert grown.prob((), 5) > 0  # memoised: what is appended next must not be answered from the memo
    grown.extend([5, 6, 8])  # as a decode's calls append their tokens
    grown.extend([5, 6])
    assert (grown.counts, grown.totals) == (lm.counts, lm.totals)
    assert grown.prob((7,), 5) == lm.prob((7,), 5) and grown.prob((), 5) == lm.prob((), 5)
    other = ContextNgram([9, 9])
    assert other.prob((), 9) > other.prob((), 5)


def test_rescored_heads_choose_the_path_the_context_supports() -> None:
    """Heads that rank a wrong token first by a hair: an n-gram model of a repetitive context turns
    the chain to what followed before; without rescoring, the argmax stands."""
    model = tiny("llama")
    lm = BlockwiseLM.from_base(model, k=3)
    hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = lm.head_logits(hidden)[0]  # [2, V] (zero-init heads: both the base's own logits)
    top2 = logits[0].topk(2).indices.tolist()
    first, second = top2
    context = torch.tensor([[second, 3, second, 3, second, 3]])  # `second` always follows 3
    plain = lm.drafter().propose(context, hidden, 2)
    rescored = lm.drafter(rescore=1.0).propose(context, hidden, 2)
    assert plain[0, 0].item() == first
    assert 0 < float(logits[0, first] - logits[0, second]) < 1  # a small gap, which the n-gram outweighs
    assert rescored[0, 0].item() == second
    with pytest.raises(ValueError, match="rescore must be >= 0"):
        lm.drafter(rescore=-1.0)


def test_every_drafter_satisfies_the_protocol() -> None:
    lm = BlockwiseLM.from_base(tiny("llama"), k=2)
    drafters = [
        NgramDrafter(),
        ScriptedDrafter(REFERENCE, vocab_size=512),
        HeadsDrafter(lm.heads, lm.base.get_output_embeddings()),
    ]
    assert all(isinstance(d, Drafter) for d in drafters)


@pytest.mark.parametrize(
    "draft, n",
    [
        (torch.zeros(1, 3, dtype=torch.long), 3),
        (torch.zeros(1, 3, dtype=torch.int32), 3),
        (torch.full((1, 2), 99), 2),
        (torch.zeros(1, 0, dtype=torch.long), 0),
    ],
)
def test_check_proposal_accepts_good_drafts(draft: torch.Tensor, n: int) -> None:
    assert check_ids(check_proposal(draft, n)[0], 100) == draft[0].tolist()


@pytest.mark.parametrize(
    "draft, error, match",
    [
        ([1, 2, 3], TypeError, "returned list; it must return a LongTensor of shape \\[1, 3\\]"),
        (torch.zeros(3, dtype=torch.long), ValueError, "returned shape \\(3,\\); expected \\[1, 3\\]"),
        (torch.zeros(1, 2, dtype=torch.long), ValueError, "returned shape \\(1, 2\\)"),
        (torch.zeros(2, 3, dtype=torch.long), ValueError, "returned shape \\(2, 3\\)"),
        (torch.zeros(1, 3), TypeError, "dtype torch.float32; token ids must be integers"),
        (torch.zeros(1, 3, dtype=torch.bool), TypeError, "token ids must be integers"),
        (torch.tensor([[1, 100, 2]]), ValueError, "outside the vocabulary \\[0, 100\\)"),
        (torch.tensor([[1, -1, 2]]), ValueError, "outside the vocabulary"),
    ],
)
def test_check_proposal_rejects_bad_drafts(draft: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        check_ids(check_proposal(draft, 3)[0], 100)


def test_half_precision_heads_propose_through_fp32_copies_when_those_are_faster(monkeypatch) -> None:
    """On a CPU, bf16 heads may run as fp32 copies (timed once); a weight changed in place is
    copied again, fp32 weights are used as they are, and the proposals are the heads' own."""
    from blockdecode.drafters import heads as drafters

    lm = perturb_heads(BlockwiseLM.from_base(toy_model("llama", seed=2), k=5), seed=1)
    hidden = torch.randn(1, lm.config.hidden_size)
    fp32 = lm.drafter()
    assert fp32._run == (lm.heads, lm.base.get_output_embeddings())  # nothing to copy or time
    reference = fp32.propose(None, hidden, 4)
    lm.to(torch.bfloat16)
    monkeypatch.setattr(drafters, "_seconds", lambda pair, rows: float(pair[1].weight.dtype != torch.float32))
    drafter = lm.drafter()
    heads, project = drafter._run
    assert project.weight.dtype == torch.float32 and heads is not lm.heads and drafter.heads is lm.heads
    assert torch.equal(project.weight, lm.base.get_output_embeddings().weight.float())
    proposed = drafter.propose(None, hidden.bfloat16(), 4)
    assert (proposed == reference).float().mean() >= 0.75  # bf16 weights: the same guesses, but for near ties
    assert lm.drafter()._run[0] is heads  # cached
    with torch.no_grad():
        lm.heads.up.weight.mul_(2)
    again = lm.drafter()._run[0]
    assert again is not heads and torch.equal(again.up.weight, lm.heads.up.weight.float())


@pytest.mark.parametrize("form", ["loaded", "cast"])
def test_a_model_made_under_inference_mode_decodes_as_one_made_outside_it(tmp_path, monkeypatch, form: str) -> None:
    """Serving code loads, or casts, a model under torch.inference_mode: its tensors then track no version,
    which the drafters' copies (and calibration's fingerprint, test_calibrate) must not need. Every way of
    decoding (the heads' chain and tree over a draft vocabulary, rescored, a batch, sampling), in the mode
    or out of it, gives what the same model made outside inference mode gives."""
    from blockdecode.drafters import heads as drafters

    monkeypatch.setattr(drafters, "_seconds", lambda pair, rows: float(pair[1].weight.dtype != torch.float32))
    made = perturb_heads(BlockwiseLM.from_base(toy_model("llama", seed=2), k=4, draft_vocab=64), seed=1)
    made.save_pretrained(tmp_path)
    dtype = torch.float32 if form == "loaded" else torch.bfloat16  # bf16 heads propose through fp32 copies
    reference, lm = BlockwiseLM.from_pretrained(tmp_path).to(dtype), BlockwiseLM.from_pretrained(tmp_path)
    with torch.inference_mode():
        lm = BlockwiseLM.from_pretrained(tmp_path) if form == "loaded" else lm.to(dtype)
    assert all(p.is_inference() for p in lm.heads.parameters()) and lm.base.dtype == dtype
    ids = make_prompt(6, 512, seed=3)
    batch = torch.cat([ids, torch.cat([torch.ones(1, 2, dtype=torch.long), ids[:, 2:]], dim=1)])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    cases = [
        dict(drafter="heads", tree=None),
        dict(drafter="heads", tree=12),
        dict(drafter="heads-rescored", tree=None),
        dict(input_ids=batch, attention_mask=mask, drafter="heads", tree=None),
        dict(drafter="heads", tree=None, do_sample=True, temperature=0.7),
    ]
    for case in cases:
        case = {"input_ids": ids, "max_new_tokens": 20, "eos_token_id": NO_EOS, **case}
        with torch.inference_mode():  # as serving code runs it
            ours = lm.generate(generator=torch.Generator().manual_seed(0), **case)
        theirs = reference.generate(generator=torch.Generator().manual_seed(0), **case)
        assert torch.equal(ours.sequences, theirs.sequences), case
        assert ours.stats.block_sizes == theirs.stats.block_sizes, case  # the same proposals
    chain = lm.generate(ids, 20, eos_token_id=NO_EOS, drafter="heads", tree=None).sequences  # and outside the mode
    assert_greedy_equal(lm.base, ids, chain, hf_greedy(lm.base, ids, 20, eos_token_id=NO_EOS))


def test_the_built_in_model_loaded_under_inference_mode_decodes_exactly() -> None:
    from blockdecode import DEFAULT_MODEL, load

    with torch.inference_mode():
        lm, tokenizer = load(DEFAULT_MODEL)
    ids = tokenizer("def mean(values):\n", return_tensors="pt").input_ids
    for tree in (None, 16):
        out = lm.generate(ids, 24, eos_token_id=NO_EOS, drafter="heads", tree=tree)
        assert_greedy_equal(lm.base, ids, out.sequences, hf_greedy(lm.base, ids, 24, eos_token_id=NO_EOS))


def test_drafters_given_the_wrong_way_are_one_clear_error() -> None:
    lm = BlockwiseLM.from_base(tiny("llama"), k=4)
    with pytest.raises(TypeError, match=r"reference must be a LongTensor of token ids .*got list \[1, 2, 3\]"):
        ScriptedDrafter([1, 2, 3], 512)
    with pytest.raises(TypeError, match=r"holds Drafter objects, not names: .* in one string, .heads\+ngram."):
        lm.generate(make_prompt(4, 512), 8, drafter=["heads", "ngram"])
