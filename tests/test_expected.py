"""Ranked trees (blockdecode/decoding/ranking.py): candidates ranked by their chance to stand, the size chosen
from the cost curve, estimates learnt from what stood, and decoding with them exactly greedy's output."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_prompt, perturb_heads, tiny, vocab_size

from blockdecode import BaseDrafter, BlockwiseLM, BlockwiseOutput, NgramDrafter, ScriptedDrafter
from blockdecode.core.hf import weights_signature
from blockdecode.core.toy import TOY_ARCHITECTURES, toy_model
from blockdecode.core.tree import Tree
from blockdecode.decoding import choice
from blockdecode.decoding import ranking as expected
from blockdecode.decoding.calibrate import explain_ranking, record_rates
from blockdecode.decoding.estimates import PRIOR_WEIGHT, PRIORS, Estimates, shipped_rates
from blockdecode.decoding.plan import make_plan
from blockdecode.decoding.ranking import Part, Ranker, Ranking, batch_width
from blockdecode.decoding.sampling import sampling_settings
from blockdecode.drafters.heads import HeadsDrafter
from blockdecode.drafters.proposals import Lattice, Scored, Source

FLAT = {1: 1.0, 8: 1.0, 16: 2.0, 64: 8.0}  # a call of up to 8 tokens costs what one does, then more


def scored(tokens: list[int], drafter: str, prior: float) -> Scored:
    return Scored(tokens, [Source(drafter, ("any",), prior)] * len(tokens))


def test_the_tree_keeps_the_most_probable_nodes_and_stops_where_a_node_costs_more_than_it_gains():
    ranker = Ranker(FLAT)
    good, poor = scored([1, 2, 3], "a", 0.9), scored([4, 5], "b", 0.1)
    tree = ranker.tree([poor, good], cap=64)
    # 7 nodes fit in the flat part: all five are kept, best first (the 0.9 path, then the 0.1 one)
    assert tree.tokens == [1, 2, 3, 4, 5] and tree.parents == [0, 1, 2, 0, 4]
    assert ranker.tree([poor, good], cap=2).tokens == [1, 2]  # the cap holds the best two
    steep = Ranker({1: 1.0, 2: 1.2, 64: 13.4})  # every node costs a fifth of a call
    assert steep.tree([poor, good], cap=64).tokens == [1, 2, 3]  # 0.9, 0.81, 0.73 gain more than they cost
    assert steep.tree([poor], cap=64).tokens == []  # 0.1 does not: no tree at all


def test_shared_prefixes_are_one_node_that_teaches_the_source_that_placed_it():
    ranker = Ranker(FLAT)
    tree = ranker.tree([scored([1, 2], "a", 0.9), scored([1, 7], "b", 0.2)], cap=64)
    assert tree.tokens == [1, 2, 7] and tree.parents == [0, 1, 1]
    ranker.observe([0, 1, 2])  # node 1 (a's and b's, placed by a's 0.9) and its child 2 (a's) stood, 7 (b's) did not
    chance = ranker.estimates.chance
    assert chance(Source("a", ("any",), 0.9)) == pytest.approx((0.9 * PRIOR_WEIGHT + 2) / (PRIOR_WEIGHT + 2))
    assert chance(Source("b", ("any",), 0.2)) == pytest.approx((0.2 * PRIOR_WEIGHT + 0) / (PRIOR_WEIGHT + 1))


def test_estimates_converge_to_a_drafters_true_acceptance_within_a_few_dozen_calls():
    gen = torch.Generator().manual_seed(0)
    for truth in (0.1, 0.5, 0.9):
        ranker = Ranker(FLAT)
        source = Source("s", ("any",), 0.5)
        estimates = []
        for _ in range(80):
            ranker.tree([Scored([1], [source])], cap=64)
            ranker.observe([0, 1] if torch.rand((), generator=gen) < truth else [0])
            estimates.append(ranker.estimates.chance(source))
        assert sum(estimates[20:]) / 60 == pytest.approx(truth, abs=0.1)  # from the 20th call on


def test_a_drafter_that_turns_wrong_loses_its_nodes_and_is_tried_again_later():
    ranker = Ranker({1: 1.0, 2: 1.2, 64: 20.0})  # a node costs a fifth of a call more than the last
    path = scored([1, 2, 3, 4], "s", 0.5)
    sizes = []
    for call in range(120):
        tree = ranker.tree([path], cap=64)
        sizes.append(len(tree))
        right = call < 30  # always right, then always wrong
        ranker.observe(list(range(len(tree) + 1)) if right else [0])
    assert sizes[:8] == sorted(sizes[:8]) and sizes[29] == 4  # grown to the whole path
    assert sizes[30:50] == sorted(sizes[30:50], reverse=True) and sizes[49] <= 1  # shrunk within 20 calls
    assert 0 in sizes[80:] and 1 in sizes[80:]  # dropped, and tried again as the past fades


def test_a_sibling_a_relaxed_rule_keeps_stands_too():
    """Under topk:2 two children of one node may both stand: each is a hit for its source, though only one
    is on the accepted path (issue 47: the ranking learns what stands under the rule decoded with)."""
    ranker = Ranker(FLAT)
    tree = ranker.tree([scored([1], "a", 0.9), scored([2], "b", 0.2)], cap=64)
    assert tree.parents == [0, 0]
    ranker.observe([0, 1], stood=[0, 1, 2])
    hit = (0.2 * PRIOR_WEIGHT + 1) / (PRIOR_WEIGHT + 1)
    assert ranker.estimates.chance(Source("b", ("any",), 0.2)) == pytest.approx(hit)


class RunnerUp(BaseDrafter):
    """Stands in for the heads: proposes the base model's second choice at every depth, so exact acceptance
    never keeps one and topk:2 keeps them all."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @property
    def name(self) -> str:
        return "heads"

    def propose(self, tokens: torch.LongTensor, hidden: torch.Tensor, n: int) -> torch.LongTensor:
        ids = tokens
        for _ in range(n):
            ids = torch.cat([ids, self.model(ids).logits[:, -1].topk(2).indices[:, 1:]], dim=1)
        return ids[:, tokens.shape[1] :]


def test_the_default_under_topk_ranks_the_heads_and_accepts_at_least_what_exact_does(monkeypatch):
    """Issue 47: topk:2 used to fall back to a calibration of exact acceptance, which dropped the heads whose
    second guesses are what topk:2 keeps. The default now ranks n-gram lookup's and the heads' candidates by
    what stands under topk:2, and learns it: on heads whose guesses are all second choices, it takes them."""
    model = tiny("llama")
    lm = BlockwiseLM.from_base(model, k=6)
    lm.heads_trained = True  # the heads below stand for trained ones: the default asks them
    monkeypatch.setattr(BlockwiseLM, "drafter", lambda self, rescore=0.0: RunnerUp(self.base))
    monkeypatch.setattr(choice, "model_ranking", lambda lm, context, cache="dynamic": Ranking(tuple(FLAT.items())))
    prompts = [make_prompt(10, vocab_size(model), seed=s) for s in range(3)]
    blocks = {}
    for rule in ("exact", "topk:2"):
        plan = lm.plan(acceptance=rule, eos_token_id=NO_EOS, prompts=prompts)
        assert plan.ranking is not None and plan.drafter_name == "ngram+heads" and plan.acceptance.spec == rule
        outs = [lm.generate(ids, 30, plan=plan) for ids in prompts]
        blocks[rule] = sum(sum(o.stats.block_sizes) for o in outs) / sum(len(o.stats.block_sizes) for o in outs)
        if rule == "topk:2":
            assert sum(o.stats.supplied.get("heads", 0) for o in outs) > 0.6 * sum(o.stats.new_tokens for o in outs)
            rows, _ = explain_ranking(lm, plan, prompts[0], 30)
            assert dict((name, after) for name, _, after, _ in rows)["heads any"] > 0.9  # learnt: they stand
    assert blocks["topk:2"] >= blocks["exact"] and blocks["topk:2"] > 4


def test_untried_estimates_start_at_the_prior_and_a_prior_counts_a_few_trials():
    estimates = Estimates()
    source = Source("s", ("k",), 0.3)
    assert estimates.chance(source) == pytest.approx(0.3)
    estimates.update(source, True)
    assert estimates.chance(source) == pytest.approx((0.3 * PRIOR_WEIGHT + 1) / (PRIOR_WEIGHT + 1))


def test_a_cost_curve_must_be_positive():
    with pytest.raises(ValueError, match="cost curve"):
        Ranker({})
    with pytest.raises(ValueError, match="cost curve"):
        Ranker({0: 1.0})


def test_a_ranking_takes_any_rule_but_min_block_and_ranks_a_chain_under_sampling():
    model = toy_model("llama")
    ranking = Ranking(((1, 1.0), (8, 1.0)))
    assert make_plan(model, NgramDrafter(), 4, 8, acceptance="topk:2", ranking=ranking).acceptance.spec == "topk:2"
    with pytest.raises(ValueError, match="min-block:2 forces a chain's first proposals, and a ranking chooses"):
        make_plan(model, NgramDrafter(), 4, acceptance="min-block:2", ranking=ranking)
    with pytest.warns(UserWarning, match="sampling verifies one chain"):
        plan = make_plan(model, NgramDrafter(), 4, 8, ranking=ranking, sampling=sampling_settings(model, True))
    assert plan.tree is None and plan.ranking is ranking and plan.setting == "ranked chain"


@pytest.mark.parametrize("arch", TOY_ARCHITECTURES)
def test_ranked_trees_match_transformers_generate(arch: str):
    """Heads and n-gram lookup ranked into one tree, and scripted drafters of any accuracy beside
    n-gram lookup, with the measured cost curve or a flat one: greedy's own output."""
    model = tiny(arch)
    ids = make_prompt(12, vocab_size(model), seed=5)
    ref = hf_greedy(model, ids, 32)
    lm = perturb_heads(BlockwiseLM.from_base(model, k=6), seed=3, std=0.3)
    out = lm.generate(ids, 32, eos_token_id=NO_EOS, tree="expected")
    assert_greedy_equal(model, ids, out.sequences, ref, what="expected tree of heads and n-gram")
    for accuracy in (0.0, 0.6, 1.0):
        drafters = [ScriptedDrafter(ref, vocab_size(model), accuracy, seed=4), NgramDrafter()]
        plan = make_plan(model, drafters, 6, 16, eos_token_id=NO_EOS, ranking=Ranking(tuple(FLAT.items())))
        out = lm.generate(ids, 32, plan=plan)
        assert_greedy_equal(model, ids, out.sequences, ref, what=f"scripted {accuracy} + n-gram, ranked")
        assert all(v <= 17 for v in out.stats.verified)


def test_a_ranked_chain_takes_a_prefix_of_the_drafters_chain_and_stays_greedy():
    """A chain plan with a ranking verifies a prefix of the chain whose length the estimates choose: all
    of it for a drafter that is always right, none of it for one that is always wrong."""
    model = tiny("llama")
    ids = make_prompt(8, vocab_size(model), seed=2)
    ref = hf_greedy(model, ids, 40)
    lm = BlockwiseLM.from_base(model, k=6)
    for accuracy, longest in ((1.0, 6), (0.0, 1)):
        steep = Ranking(((1, 1.0), (2, 1.2), (64, 13.6)))  # a token costs a fifth of a call; nothing learnt before
        plan = make_plan(model, ScriptedDrafter(ref, vocab_size(model), accuracy), 6, eos_token_id=NO_EOS,
                         ranking=steep)  # fmt: skip
        out = lm.generate(ids, 40, plan=plan)
        assert_greedy_equal(model, ids, out.sequences, ref, what=f"ranked chain, scripted {accuracy}")
        middle = out.stats.verified[len(out.stats.verified) // 2]  # away from the budget's end, which cuts chains
        assert middle == longest  # the whole chain and the newest token, or the newest token alone


def test_a_batch_or_sampling_with_tree_expected_verifies_chains():
    model = tiny("llama")
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4), seed=1, std=0.3)
    ids = make_prompt(8, vocab_size(model), seed=1)
    batch = torch.cat([ids, ids])
    out = lm.generate(batch, 16, k=4, eos_token_id=NO_EOS, tree="expected", attention_mask=torch.ones_like(batch))
    for row in range(2):
        assert_greedy_equal(model, ids, out.sequences[row : row + 1], hf_greedy(model, ids, 16), what=f"row {row}")
    verified = [row.verified for row in out.row_stats]
    assert verified[0] == verified[1] and all(v <= 4 for v in verified[0])  # one width a call, a chain of k - 1 at most
    out = lm.generate(ids, 8, k=4, eos_token_id=NO_EOS, tree="expected", do_sample=True)
    assert all(v <= 4 for v in out.stats.verified) and out.stats.sampling
    # k not given: the default's lookup drafts deeper, in a tree deeper still (its size is chosen each call)
    assert lm.plan(prompts=[ids]).k == choice.TREE_DEPTH > choice.LOOKUP_DEPTH
    assert lm.plan(prompts=[ids], do_sample=True).k == choice.LOOKUP_DEPTH  # a sampled chain: deeper was slower
    assert lm.plan(prompts=[ids], rows=2).k == choice.LOOKUP_DEPTH  # so is a batch's


def test_under_sampling_each_node_whose_parent_stood_learns_its_chance_not_one_draw():
    ranker = Ranker(FLAT)
    chain = scored([1, 2, 3], "d", 0.5)
    assert len(ranker.take(chain, 3)) == 3
    ranker.observe([0, 1], chances=[0.3, 0.6, 0.9])  # node 3's parent fell: it teaches nothing
    assert ranker.estimates.counts[("d", ("any",))] == pytest.approx([0.9, 2.0])
    ranker = Ranker(FLAT, decay=1.0)  # nothing forgotten: the estimate converges
    for _ in range(200):  # each guess stands with p(x) = 0.3: the estimate goes there, whatever the draws were
        ranker.take(chain, 1)
        ranker.observe([0], chances=[0.3])
    assert ranker.estimates.chance(chain.sources[0]) == pytest.approx(0.3, abs=0.01)


def test_a_batch_verifies_one_width_for_all_rows_shorter_the_more_rows_and_the_less_that_stands():
    steep = {1: 1.0, 2: 1.2, 64: 13.6}  # a token costs a fifth of a call

    def width(rows: int, prior: float) -> int:
        return batch_width([Ranker(steep) for _ in range(rows)], [scored(list(range(7)), "d", prior)] * rows, 7)

    assert [width(1, p) for p in (0.99, 0.6, 0.05)] == [7, 2, 0]
    assert [width(rows, 0.9) for rows in (1, 2, 4, 8)] == [7, 5, 3, 2]  # a wide batch pays more per position
    sure, unsure = scored(list(range(7)), "d", 0.99), scored(list(range(7)), "d", 0.05)
    assert batch_width([Ranker(steep), Ranker(steep)], [sure, unsure], 7) == 7  # one sure row carries the width


def test_rates_recorded_beside_a_model_are_its_priors_for_these_weights_only(tmp_path, capsys):
    model = tiny("llama")
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4), seed=1, std=0.3)
    prompts = [make_prompt(10, vocab_size(model), seed=s) for s in range(2)]
    rates = record_rates(lm, prompts, tmp_path, new_tokens=16)
    assert rates and all(0 <= r <= 1 for r in rates.values())
    assert shipped_rates(tmp_path, weights_signature(lm)) == rates
    other = copy.deepcopy(lm)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(2)
    assert shipped_rates(tmp_path, weights_signature(other)) == {}  # other weights' rates are not their priors
    name, rate = next(iter(rates.items()))
    drafter, *key = name.split(" ")
    source = Source(drafter, tuple(int(x) if x.isdigit() else x for x in key), 0.5)
    assert Ranking(((1, 1.0),), tuple(rates.items())).start().estimates.chance(source) == pytest.approx(rate)
    (tmp_path / PRIORS).write_text('{"rates": {"heads confidence 1": 7}}')
    assert shipped_rates(tmp_path, weights_signature(lm)) == {}
    assert "holds no acceptance rates between 0 and 1" in capsys.readouterr().err
    assert shipped_rates(tmp_path / "nowhere", weights_signature(lm)) == {}


def test_a_noisy_cost_curve_is_made_non_decreasing():
    assert Ranker({1: 1.0, 2: 1.5, 4: 1.0, 8: 1.2}).points == [(1, 1.0), (2, 1.0), (4, 1.0), (8, 1.2)]


def test_a_lattice_hangs_its_guesses_under_any_node_and_learns_apart_what_follows_another_drafters_node():
    """The heads guess each depth alone, so their depth-2 guesses may follow n-gram lookup's first token
    too; there they stand less often, and learn under their own ("aside") source."""
    on, aside = Source("heads", ("confidence", 9), 0.9), Source("heads", ("confidence", 9, "aside"), 0.45)
    lattice = Lattice([[1], [3]], [[on], [on]], [[aside], [aside]])
    ranker = Ranker(FLAT)
    tree = ranker.tree([scored([5], "ngram", 0.6), lattice], cap=64)
    nodes = set(zip(tree.parents, tree.tokens, tree.owners))
    assert {(0, 5, "ngram"), (0, 1, "heads")} <= nodes  # both first tokens (1's chance capped to what 5 leaves)
    under = {tree.tokens[p - 1]: t for p, t in zip(tree.parents, tree.tokens) if p}
    assert under == {5: 3, 1: 3}  # the heads' depth-2 guess after each
    after_ngram = 1 + next(
        i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if p and tree.tokens[p - 1] == 5
    )
    ranker.observe([0, tree.tokens.index(5) + 1, after_ngram])
    assert ranker.estimates.chance(aside) > 0.45  # 3 after 5 stood: a hit of its own source
    assert ranker.estimates.chance(on) < 0.9  # 1 did not: a miss of the heads' first guess


def test_ngram_candidates_at_a_fork_say_whose_branch_they_are():
    """Where earlier occurrences went on differently, the branch of the occurrence whose context matches
    longest (here a tie: the newest) and the others are sources of their own: the first is the likelier."""
    seq = torch.tensor([[1, 2, 3, 7, 1, 2, 4, 9, 1, 2]])
    paths = NgramDrafter(max_ngram=2, min_ngram=2).propose_scored(seq, torch.zeros(1, 4), 3, 8)
    assert [p.tokens for p in paths] == [[4, 9, 1], [3, 7, 1]]
    assert [s.key for s in paths[0].sources] == [("match", 2, "fork"), ("match", 2, "then"), ("match", 2, "then")]
    assert paths[1].sources[0].key == ("match", 2, "fork", "other")


def test_a_drafter_whose_proposals_stand_keeps_being_asked():
    ranker = Ranker(FLAT)
    ranker.timed("heads", 0.05)
    guess = Source("heads", ("confidence", 2), 0.25)
    weak = [scored([1, 2, 3, 4], "ngram", 0.3)]
    for _ in range(10):  # each call the heads' guess, not n-gram lookup's, is greedy's next token
        assert ranker.worth_asking("heads", weak, 4, 64)
        tree = ranker.tree([*weak, Lattice([[9]], [[guess]], [[guess]])], cap=64)
        ranker.observe([0, tree.tokens.index(9) + 1])
    assert ranker.yields["heads"] > 0.2


def test_a_costly_drafter_is_asked_only_where_its_guesses_would_pay_for_its_time():
    ranker = Ranker(FLAT)
    assert ranker.worth_asking("heads", [scored([1, 2, 3, 4], "ngram", 0.99)], 4, 64)  # never timed: asked
    ranker.timed("heads", 0.5)  # half a call
    assert not ranker.worth_asking("heads", [scored([1, 2, 3, 4], "ngram", 0.99)], 4, 64)  # little left to add
    assert ranker.worth_asking("heads", [], 4, 64)  # nothing else to verify
    weak = [scored([1, 2, 3, 4], "ngram", 0.3)]
    assert ranker.worth_asking("heads", weak, 4, 64)
    asked = 0
    while ranker.worth_asking("heads", weak, 4, 64):  # the heads propose nothing the tree keeps
        asked += 1
        ranker.tree(weak, cap=64)
        ranker.observe([0, 1])  # n-gram lookup's first token stood, nothing of the heads'
    assert 2 <= asked <= 15  # their yield falls a miss at a time: one miss is no verdict
    later = []
    for _ in range(50):  # still useless: asked now and then, as a drafter not asked drifts back to be tried again
        later.append(ranker.worth_asking("heads", weak, 4, 64))
        if later[-1]:
            ranker.tree(weak, cap=64)
            ranker.observe([0, 1])
    assert 0 < sum(later) <= 15


def test_a_drafter_is_asked_one_token_past_the_deepest_its_nodes_were_kept_lately():
    ranker = Ranker(FLAT)
    assert ranker.reach("heads", 6) == 6  # never ranked: asked all of it
    sure, long_shot = Source("heads", ("confidence", 9), 0.95), Source("heads", ("confidence", 0), 0.01)
    sources = [[sure], [sure], [long_shot], [long_shot]]
    lattice = Lattice([[1], [2], [3], [4]], sources, sources)
    tree = Ranker({1: 1.0, 2: 1.2, 64: 13.4}).tree([lattice], cap=64)  # a node costs a fifth of a call
    assert tree.tokens == [1, 2]  # the long shots at depths 3 and 4 are not kept
    ranker = Ranker({1: 1.0, 2: 1.2, 64: 13.4})
    ranker.tree([lattice], cap=64)
    assert ranker.reach("heads", 6) == 3 and ranker.reach("ngram", 6) == 6
    for _ in range(10):  # lately nothing of theirs kept: one token is still asked for, so they may come back
        ranker.tree([Lattice([[1]], [[long_shot]], [[long_shot]])], cap=64)
    assert ranker.reach("heads", 6) == 1


def test_a_drafter_whose_whole_reach_stood_is_asked_twice_as_deep_next():
    match = [Source("suffix", ("match", 8), 0.9)] * 16
    ranker = Ranker({1: 1.0, 16: 1.1, 64: 2.0})  # each node nearly free: the tree keeps all it is offered
    ranker.tree([Scored(list(range(1, 5)), match[:4])], cap=64)  # a lookup asked 4 deep, as reach allowed
    assert ranker.reach("suffix", 16) == 5
    ranker.observe([0, 1, 2, 3, 4])  # all 4 stood: the match goes on, and is followed at once, not a token a call
    assert ranker.reach("suffix", 16) == 9
    ranker.tree([Scored(list(range(1, 9)), match[:8])], cap=64)
    ranker.observe([0, 1, 2])  # a miss: one past the deepest kept, as before
    assert ranker.reach("suffix", 16) == 9


def test_the_next_sequence_starts_from_what_the_last_learnt_of_each_drafters_time_and_yield():
    ranking = Ranking(tuple(FLAT.items()))
    first = ranking.start()
    assert first.yields == {} and first.seconds_of == {}
    first.timed("heads", 0.5)
    first.yields["heads"] = 0.01  # the heads did not pay
    first.estimates.update(Source("heads", ("any",), 0.5), 0.0)
    ranking.keep(first)
    second = ranking.start()
    assert second.yields == {"heads": 0.01} and second.seconds_of == {"heads": 0.5}
    assert not second.worth_asking("heads", [scored([1, 2, 3, 4], "ngram", 0.6)], 4, 64)  # not asked at once
    assert second.estimates.counts == {}  # its own outcomes start afresh, from the last sequence's chances as priors
    source = Source("heads", ("any",), 0.5)
    assert second.estimates.chance(source) == pytest.approx(0.5 * PRIOR_WEIGHT / (PRIOR_WEIGHT + 1))  # one miss
    assert Ranking(tuple(FLAT.items()), drafting=()).start().estimates.chance(source) == 0.5  # sampling: the prior


def test_a_source_that_seldom_stood_in_the_last_sequence_is_not_offered_at_its_prior_again():
    """Open chat on a step-shaped cost curve (fp32: 1 token a GEMV, 2-8 one GEMM at 1.5x): a lookup's paths at their
    prior of 0.5 looked worth a call of 8 where a tenth stood; the next sequence starts from what the last found."""
    ranking = Ranking(((1, 1.0), (2, 1.53), (8, 1.53), (64, 4.0)))
    paths = [scored([1, 2, 3, 4, 5, 6, 7], "ngram", 0.5)]
    first = ranking.start()
    assert len(first.tree(paths, 16)) == 7
    for _ in range(12):
        first.tree(paths, 16)
        first.observe([0])  # its first node never stood
    ranking.keep(first)
    assert len(ranking.start().tree(paths, 16)) == 0


def test_a_ranked_chain_of_two_drafters_takes_each_call_the_one_expected_to_stand():
    """n-gram lookup's chain and a perfect drafter's, on a prompt n-gram lookup cannot continue: the
    ranked chain learns to verify the perfect one, and stays greedy's output."""
    model = tiny("llama")
    ids = make_prompt(8, vocab_size(model), seed=2)
    ref = hf_greedy(model, ids, 40)
    lm = BlockwiseLM.from_base(model, k=6)
    drafters = [NgramDrafter(), ScriptedDrafter(ref, vocab_size(model), 1.0)]
    plan = make_plan(model, drafters, 6, eos_token_id=NO_EOS, ranking=Ranking(tuple(FLAT.items())))
    out = lm.generate(ids, 40, plan=plan)
    assert_greedy_equal(model, ids, out.sequences, ref, what="ranked chain of n-gram lookup and a perfect drafter")
    assert out.stats.supplied.get("ScriptedDrafter", 0) > 0.8 * sum(out.stats.supplied.values())


def test_a_sequence_falls_back_to_its_cheapest_part_where_its_chain_alone_gains_more_a_second_and_returns():
    """The tree spends a slow drafter's time each call for nothing n-gram lookup's chain does not give: once judged
    over enough calls, the sequence decodes with the n-gram chain alone; once that chain stops paying (a loop
    ends), the tree decodes again."""
    ranker = Ranker(FLAT)
    ngram, heads = [scored([1, 2, 3], "ngram", 0.9)], [Lattice([[7], [8]], [[Source("heads", ("any",), 0.5)]] * 2,
                                                               [[Source("heads", ("any",), 0.5)]] * 2)]  # fmt: skip
    for _ in range(expected.FALLBACK_CALLS):
        assert ranker.fallen_to is None
        tree = ranker.tree([*ngram, *heads], cap=64)
        ranker.compare_parts({"ngram": ngram, "heads": heads}, {"ngram": 0.01, "heads": 2.0}, len(tree), "ngram")
        ranker.observe([0, 1, 2, 3], gained=[1, 2, 3, 4])  # the n-gram chain stood whole, then the model's token
    assert ranker.fallen_to == Part("ngram") and ranker.fell_at == expected.FALLBACK_CALLS
    assert ranker.news == [f"decoded with one part alone (ngram chain) from call {expected.FALLBACK_CALLS}, faster "
                           "for this sequence than the tree"]  # fmt: skip
    assert ranker.measured[Part("ngram")][0] == 4 * expected.FALLBACK_CALLS  # its chain of 3 stood whole, and 1 more
    assert not any(part and part.drafter == "heads" for part in ranker.measured)  # asked where it pays: never judged
    ranker.news.clear()
    for _ in range(expected.FALLBACK_CALLS):  # the chain alone still pays
        ranker.alone(3, 0.01)
        ranker.observe([0, 1, 2, 3], gained=[1, 2, 3, 4])
    assert ranker.fallen_to == Part("ngram") and not ranker.news
    for _ in range(2 * expected.FALLBACK_CALLS):  # the loop ended: one token a call
        ranker.alone(3, 0.01)
        ranker.observe([0], gained=[5])
    assert ranker.fallen_to is None and ranker.news[0].startswith("back to the tree from call")
    assert ranker.judged < expected.FALLBACK_CALLS  # judged afresh since


def test_a_part_only_a_little_faster_alone_is_not_fallen_back_to():
    """A fallback on a close call cost more than it saved (a few calls' noise; a text that turns, where the costlier
    drafter pays again): a part alone is taken only once it gained `FALLBACK_MARGIN` times as much a second."""
    ngram, heads = [scored([1, 2, 3], "ngram", 0.9)], [Lattice([[7], [8]], [[Source("heads", ("any",), 0.5)]] * 2,
                                                               [[Source("heads", ("any",), 0.5)]] * 2)]  # fmt: skip
    for heads_seconds, fallen in ((0.2, None), (0.4, Part("ngram"))):  # the chain alone: 1.2x, then 1.4x as fast
        ranker = Ranker(FLAT)
        for _ in range(expected.FALLBACK_CALLS):
            tree = ranker.tree([*ngram, *heads], cap=64)
            ranker.compare_parts({"ngram": ngram, "heads": heads}, {"ngram": 0.01, "heads": heads_seconds}, len(tree),
                                 "ngram")  # fmt: skip
            ranker.observe([0, 1, 2, 3], gained=[1, 2, 3, 4])  # the n-gram chain stood whole: the heads added nothing
        assert ranker.fallen_to == fallen, heads_seconds


def test_the_time_a_tree_takes_to_rank_counts_against_it():
    """A tree whose heads' guess adds a token to the n-gram chain's (3 a call against 2) keeps deciding while ranking
    it is taken to cost nothing; once the second a call spent ranking it is counted (a part alone is not ranked), the
    chain alone gains more a second and the sequence falls back to it."""
    ngram, heads = [scored([1, 2, 3], "ngram", 0.9)], [Lattice([[7], [8]], [[Source("heads", ("any",), 0.5)]] * 2,
                                                               [[Source("heads", ("any",), 0.5)]] * 2)]  # fmt: skip
    for ranking, fallen in ((0.0, None), (1.0, Part("ngram"))):
        ranker = Ranker(FLAT)
        for _ in range(expected.FALLBACK_CALLS):
            tree = ranker.tree([*ngram, *heads], cap=64)
            spent = {"ngram": 0.01, "heads": 0.01}
            ranker.compare_parts({"ngram": ngram, "heads": heads}, spent, len(tree), "ngram", ranking)
            ranker.observe([0, 1, tree.tokens.index(8) + 1], gained=[1, 8, 9])
        assert ranker.fallen_to == fallen


def test_a_sequence_falls_back_to_its_cheapest_parts_own_tree_where_its_second_path_is_the_one_that_stands():
    """N-gram lookup's first path misses and its second stands: its chain alone gains a token a call, a tree of
    its own paths gains four, without the heads' two seconds a call; the sequence falls back to that tree, and
    decodes it ranked from the n-gram candidates alone."""
    ranker = Ranker(FLAT)
    ngram = [scored([9, 9, 9], "ngram", 0.9), scored([1, 2, 3], "ngram", 0.9)]
    heads = [Lattice([[7], [8]], [[Source("heads", ("any",), 0.5)]] * 2, [[Source("heads", ("any",), 0.5)]] * 2)]
    for _ in range(expected.FALLBACK_CALLS):
        tree = ranker.tree([*ngram, *heads], cap=64)
        ranker.compare_parts({"ngram": ngram, "heads": heads}, {"ngram": 0.01, "heads": 2.0}, len(tree), "ngram")
        ranker.observe([0, *(tree.tokens.index(t) + 1 for t in (1, 2, 3))], gained=[1, 2, 3, 4])
    assert ranker.fallen_to == Part("ngram", tree=True)
    assert ranker.measured[Part("ngram")][0] == expected.FALLBACK_CALLS  # its chain [9, 9, 9] gained one a call
    assert ranker.measured[Part("ngram", tree=True)][0] == 4 * expected.FALLBACK_CALLS


def test_a_tree_of_paths_in_order_holds_at_most_its_budget_and_confirms_the_path_greedy_took():
    tree = Tree.of_paths([scored([1, 2, 3], "a", 0.5), scored([1, 4], "a", 0.5), scored([5], "a", 0.5)], 4)
    assert tree.tokens == [1, 2, 3, 4] and tree.parents == [0, 1, 2, 1]  # [5] found no room
    assert tree.confirmed([1, 4, 7]) == 2 and tree.confirmed([1, 2, 3]) == 3 and tree.confirmed([5]) == 0


def fall_back_at_call_3(monkeypatch, part: Part) -> None:
    """Every sequence judges `part` faster after three calls, and never finds it to stop paying."""
    judge = Ranker._judge_parts

    def early(self, gained):
        judge(self, gained)
        if self.judged == 3 and self.fallen_to is None:
            self.fallen_to, self.fell_at, self._tree_rate = part, 3, 0.0
            self.news.append(f"decoded with one part alone ({part}) from call 3")

    monkeypatch.setattr(Ranker, "_judge_parts", early)


def fallen_back_decode(monkeypatch, part: Part, seed: int) -> tuple[BlockwiseOutput, list[int]]:
    """An ngram+heads decode whose sequence falls back to `part` at call 3 (`fall_back_at_call_3`), checked against
    `transformers`' greedy; with a mark for each call that asked the heads."""
    model = tiny("llama")
    lm = perturb_heads(BlockwiseLM.from_base(model, k=6))
    ids = make_prompt(12, 512, seed=seed)
    ref = hf_greedy(model, ids, 60, eos_token_id=NO_EOS)
    fall_back_at_call_3(monkeypatch, part)
    asked = []
    ask = HeadsDrafter.propose_scored
    monkeypatch.setattr(HeadsDrafter, "propose_scored", lambda *a: asked.append(1) or ask(*a))
    out = lm.generate(ids, 60, drafter="ngram+heads", k=6, eos_token_id=NO_EOS)
    assert_greedy_equal(model, ids, out.sequences, ref)
    return out, asked


def test_a_sequence_fallen_back_to_a_parts_tree_is_still_greedy_and_says_so(monkeypatch):
    ranked = []  # each ranked tree: the part fallen back to, if any
    rank = Ranker.tree
    monkeypatch.setattr(Ranker, "tree", lambda self, *a: ranked.append(self.fallen_to) or rank(self, *a))
    out, asked = fallen_back_decode(monkeypatch, Part("ngram", tree=True), seed=6)
    assert "decoded with one part alone (ngram tree) from call 3" in out.stats.note
    assert len(asked) <= 3 and ranked.count(Part("ngram", tree=True)) > 40  # n-gram trees ranked without the heads


def test_a_tree_that_gains_more_than_its_cheapest_part_keeps_deciding():
    ngram, heads = [scored([1, 2, 3], "ngram", 0.9)], [Lattice([[7], [8]], [[Source("heads", ("any",), 0.5)]] * 2,
                                                               [[Source("heads", ("any",), 0.5)]] * 2)]  # fmt: skip
    ranker = Ranker(FLAT)  # the heads' second guess follows n-gram lookup's first: the tree gains more
    for _ in range(2 * expected.FALLBACK_CALLS):
        tree = ranker.tree([*ngram, *heads], cap=64)
        ranker.compare_parts({"ngram": ngram, "heads": heads}, {"ngram": 0.01, "heads": 0.01}, len(tree), "ngram")
        ranker.observe([0, 1, tree.tokens.index(8) + 1], gained=[1, 8, 9])
    assert ranker.fallen_to is None and ranker.measured[Part("ngram")][0] == 2 * 2 * expected.FALLBACK_CALLS


def test_a_sequence_fallen_back_to_a_part_is_still_greedy_and_says_so(monkeypatch):
    out, asked = fallen_back_decode(monkeypatch, Part("ngram"), seed=5)
    assert "decoded with one part alone (ngram chain) from call 3" in out.stats.note
    assert len(asked) <= 3 and out.stats.calls > 10  # the heads are not asked once the n-gram chain alone is


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_drafter_beside_the_heads_drafts_past_their_block_and_stays_greedy(arch: str):
    """k past the heads' block: the heads guess their k-1 (a chain of a batch's width pads past them), the other
    drafter the rest; trees, a batch's chains and sampling's chains decode as greedy's, and a call gains past k."""
    model = tiny(arch)
    ids = make_prompt(10, vocab_size(model), seed=7)
    ref = hf_greedy(model, ids, 40)
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4), seed=2, std=0.3)
    heads = lm.drafter()
    (lattice,) = heads.propose_scored(ids, torch.zeros(1, model.config.hidden_size), 9, 8)
    assert heads.deepest == 3 and len(lattice.tokens) == 3  # the heads are asked no deeper than their k-1
    (padded,) = heads.rows_scored([ids], torch.zeros(1, model.config.hidden_size), 9, [0])
    assert len(padded.tokens) == 9 and padded.sources[-1].key == ("padding",)
    scripted = ScriptedDrafter(ref, vocab_size(model), 1.0)
    plan = make_plan(model, [scripted, heads], 10, 16, eos_token_id=NO_EOS, ranking=Ranking(tuple(FLAT.items())))
    out = lm.generate(ids, 40, plan=plan)
    assert_greedy_equal(model, ids, out.sequences, ref, what="a sure drafter past the heads' block")
    assert max(out.stats.block_sizes) > 4
    out = lm.generate(ids, 40, drafter="heads+ngram", k=10, eos_token_id=NO_EOS)
    assert_greedy_equal(model, ids, out.sequences, ref, what="heads+ngram ranked at k=10")
    batch = torch.cat([ids, ids])
    mask = torch.ones_like(batch)
    out = lm.generate(batch, 24, drafter="heads+ngram", k=10, eos_token_id=NO_EOS, attention_mask=mask)
    for row in range(2):
        assert_greedy_equal(model, ids, out.sequences[row : row + 1], ref[:, : ids.shape[1] + 24], what=f"row {row}")
    sampled = []
    for _ in range(2):
        torch.manual_seed(3)
        sampled.append(lm.generate(ids, 16, drafter="heads+ngram", k=10, do_sample=True).sequences)
    assert torch.equal(*sampled)
    with pytest.raises(ValueError, match="heads' block size 4, got 10"):
        lm.generate(ids, 8, drafter="heads", k=10)


def test_read_drafting_costs_decide_alone_and_nothing_carries_over_between_sequences():
    """With `Ranking.drafting` (sampling), a drafter is weighed by its cached seconds, never by this process's
    timings, and one without a cached cost is asked every call; greedy's ranking measures as it goes."""
    found = [scored([1, 2], "ngram", 0.5)]
    ranker = Ranking(tuple(FLAT.items()), drafting=(("heads", 10.0),)).start()
    ranker.timed("heads", 1e-9)
    assert not ranker.worth_asking("heads", found, 7, 8)  # ten seconds of heads never pay for a 1-second call
    ranker.timed("eagle3", 1e3)
    assert ranker.worth_asking("eagle3", found, 7, 8)  # no cached cost: asked, whatever it took here
    cheap = Ranking(tuple(FLAT.items()), drafting=(("heads", 1e-4),))
    cheap.learnt.update(yields={"heads": 0.0})  # what an earlier sequence learnt is not where a sampled one starts
    assert cheap.start().worth_asking("heads", found, 7, 8)
    measured = Ranking(tuple(FLAT.items())).start()
    measured.timed("heads", 10.0)
    assert not measured.worth_asking("heads", found, 7, 8)
