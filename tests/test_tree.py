"""Tree verification: the trie of candidates, its mask and accepted path, and decoding with trees
against transformers' own greedy generate, whatever the candidates."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_prompt, perturb_heads, tiny, vocab_size
from test_decode import sliding_window_model

from blockdecode import BaseDrafter, BlockwiseLM, NgramDrafter, ScriptedDrafter, blockwise_generate
from blockdecode.core.toy import TOY_ARCHITECTURES, toy_model
from blockdecode.core.tree import Tree, best_path, lattice_paths
from blockdecode.decoding.adapter import takes_tree_masks

NEW = 32


def test_paths_merge_into_a_trie_within_the_budget_and_depth() -> None:
    tree = Tree()
    tree.add_path([5, 6, 7], budget=10, max_depth=8)
    tree.add_path([5, 9], budget=10, max_depth=8)  # shares the node for 5
    tree.add_path([4, 1, 2, 3], budget=10, max_depth=2)  # cut at depth 2
    assert tree.tokens == [5, 6, 7, 9, 4, 1] and tree.parents == [0, 1, 2, 1, 0, 5]
    assert tree.depths == [1, 2, 3, 2, 1, 2]
    tree.add_path([5, 6, 8, 8], budget=7, max_depth=8)  # one new node fits, then the budget is spent
    assert len(tree) == 7 and tree.tokens[-1] == 8 and tree.parents[-1] == 2
    mask = tree.ancestry()
    assert mask.shape == (8, 8) and mask[:, 0].all() and mask.diagonal().all()
    assert mask[3].nonzero().flatten().tolist() == [0, 1, 2, 3]  # 7 sees 5, 6 and itself
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 4]  # 9 sees 5 but not 6


def test_the_accepted_path_is_the_deepest_all_right_one() -> None:
    tree = Tree()
    for path in ([5, 6, 7], [5, 9], [4]):
        tree.add_path(path, 10, 8)
    assert tree.accepted_path([True, True, True, True, True]) == [0, 1, 2, 3]
    assert tree.accepted_path([True, True, False, True, False]) == [0, 1, 2]  # ties: the first
    assert tree.accepted_path([True, False, True, True, False]) == [0, 1, 4]  # 7 is right, its parent not
    assert tree.accepted_path([False, True, True, True, True]) == [0, 5]
    assert tree.accepted_path([False] * 5) == [0]
    assert Tree().accepted_path([]) == [0]


def test_every_node_right_down_its_whole_path_stands_siblings_too() -> None:
    """What a ranking learns from (issue 47): under a relaxed rule a sibling of the accepted path may stand."""
    tree = Tree()
    for path in ([5, 6, 7], [5, 9], [4]):
        tree.add_path(path, 10, 8)
    assert tree.standing([True, True, False, True, True]) == [True, True, True, False, True, True]
    assert tree.standing([True, False, True, True, False]) == [True, True, False, False, True, False]
    assert Tree().standing([]) == [True]


def test_lattice_paths_come_best_first_and_prefix_closed() -> None:
    probs = torch.tensor([[0.6, 0.3], [0.9, 0.05], [0.5, 0.4]])
    tokens = torch.tensor([[1, 2], [3, 4], [5, 6]])
    paths = list(lattice_paths(probs, tokens, 6))
    assert [p for p, _ in paths] == [[1], [1, 3], [2], [1, 3, 5], [2, 3], [1, 3, 6]]
    scores = [s for _, s in paths]
    assert scores == sorted(scores, reverse=True) and scores[1] == pytest.approx(0.54)
    seen = set()
    for path, _ in paths:  # each path extends one already yielded, so the tree grows node by node
        assert len(path) == 1 or tuple(path[:-1]) in seen
        seen.add(tuple(path))


def test_a_rescoring_factor_reorders_the_lattice_and_keeps_it_prefix_closed() -> None:
    """Kim et al.'s rescoring: a path's score is the heads' product times the factor of each token
    given the path before it; 3 after 2 is favoured, 3 after 1 is not."""
    probs = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
    tokens = torch.tensor([[1, 2], [3, 4]])
    favour = {(2,): {3: 1.0, 4: 0.1}, (1,): {3: 0.1, 4: 0.2}}
    factor = lambda path, token: favour.get(path, {}).get(token, 1.0)  # noqa: E731
    paths = list(lattice_paths(probs, tokens, 4, factor))
    assert [p for p, _ in paths] == [[1], [2], [2, 3], [1, 4]]
    assert [s for _, s in paths] == pytest.approx([0.6, 0.4, 0.2, 0.06])
    assert best_path(probs, tokens, factor) == [2, 3]
    assert best_path(probs, tokens, lambda path, token: 1.0) == [1, 3]  # no rescoring: each head's argmax


@functools.cache
def case(arch: str):
    model = tiny(arch, seed=1)
    ids = make_prompt(6, vocab_size(model), seed=2)
    return model, ids, hf_greedy(model, ids, NEW, eos_token_id=NO_EOS)


@pytest.mark.parametrize("arch", TOY_ARCHITECTURES)
def test_trees_match_transformers_generate(arch: str) -> None:
    """Every tree size and source, good or bad candidates, gives transformers' greedy output (Gemma 3:
    a window of 8 crossed many times, each layer kind with its own mask)."""
    model, ids, ref = case(arch)
    lm = perturb_heads(BlockwiseLM.from_base(model, k=6), seed=3, std=0.3)
    for budget in (1, 2, 5, 16, 64):
        for drafter in ("heads", "heads-rescored", "ngram", "heads+ngram"):
            out = lm.generate(ids, NEW, eos_token_id=NO_EOS, drafter=drafter, tree=budget)
            assert_greedy_equal(model, ids, out.sequences, ref, what=f"{drafter}, tree of {budget}")
            assert all(1 <= b <= 6 for b in out.stats.block_sizes)
            assert all(v <= budget + 1 for v in out.stats.verified)
    for accuracy in (0.0, 0.5, 1.0):  # a scripted chain and n-gram candidates sharing one tree
        drafters = [ScriptedDrafter(ref, vocab_size(model), accuracy, seed=4), NgramDrafter()]
        out = lm.generate(ids, NEW, eos_token_id=NO_EOS, drafter=drafters, tree=12)
        assert_greedy_equal(model, ids, out.sequences, ref, what=f"scripted {accuracy} + n-gram tree")
    hydra = perturb_heads(BlockwiseLM.from_base(model, k=6, head_type="hydra"), seed=3, std=0.3)
    for budget in (1, 5, 16, 64):  # sequential heads: each node's children grown from its own path
        for drafter in ("heads", "heads+ngram"):
            out = hydra.generate(ids, NEW, eos_token_id=NO_EOS, drafter=drafter, tree=budget)
            assert_greedy_equal(model, ids, out.sequences, ref, what=f"hydra {drafter}, tree of {budget}")
            assert all(v <= budget + 1 for v in out.stats.verified)


def test_a_tree_sees_only_its_window_where_every_layer_slides() -> None:
    """Mistral's layers all slide: the one mask a tree hands them carries the window, as a chain sees it."""
    model = sliding_window_model()
    ids = make_prompt(6, vocab_size(model), seed=2)
    ref = hf_greedy(model, ids, NEW, eos_token_id=NO_EOS)
    for accuracy in (0.5, 1.0):
        drafters = [ScriptedDrafter(ref, vocab_size(model), accuracy, seed=4), NgramDrafter()]
        out = BlockwiseLM.from_base(model, k=6).generate(ids, NEW, eos_token_id=NO_EOS, drafter=drafters, tree=12)
        assert_greedy_equal(model, ids, out.sequences, ref, what=f"window 8, scripted {accuracy} + n-gram tree")
        assert max(out.stats.block_sizes) > 2


class Candidates(BaseDrafter):
    """A drafter that offers fixed paths: wrong branches beside (or without) the right one."""

    def __init__(self, ref: torch.LongTensor, depth_right: int, wrong: int):
        self.ref, self.depth_right, self.wrong = ref[0].tolist(), depth_right, wrong

    def propose(self, tokens, hidden, n):
        raise AssertionError("a tree asks for paths")

    def propose_paths(self, tokens, hidden, depth, budget):
        start = tokens.shape[1]
        truth = self.ref[start : start + depth]
        paths = [[(t + 1 + j) % 512 for t in truth] for j in range(self.wrong)]  # all wrong from the root
        right = truth[: self.depth_right] + [(t + 7) % 512 for t in truth[self.depth_right :]]
        paths.insert(len(paths) // 2, right)
        return paths


@pytest.mark.parametrize("depth", [0, 1, 3, 5])
def test_a_tree_holding_greedy_to_depth_d_gains_d_plus_one(depth: int) -> None:
    """The right path hidden among wrong branches, right for d tokens: every call gains d + 1."""
    model, ids, ref = case("llama")
    out = blockwise_generate(model, ids, NEW, Candidates(ref, depth, wrong=3), 6, eos_token_id=NO_EOS, tree=64)
    assert_greedy_equal(model, ids, out.sequences, ref)
    assert all(b == depth + 1 for b in out.stats.block_sizes[:-1])
    assert out.stats.verified[0] == 1 + 4 * 5  # four paths of depth 5, none sharing a node


def test_eos_on_the_accepted_path_and_the_budget_inside_it() -> None:
    model, ids, ref = case("gpt2")
    new = ref[0, ids.shape[1] :].tolist()
    j = next(j for j in range(3, len(new)) if new.index(new[j]) == j)  # first use of this token
    perfect = Candidates(ref, 5, wrong=2)
    out = blockwise_generate(model, ids, NEW, perfect, 6, eos_token_id=new[j], tree=32)
    assert torch.equal(out.sequences, ref[:, : ids.shape[1] + j + 1])
    for budget_tokens in (1, 2, 9, 13):  # max_new_tokens ends inside a path
        out = blockwise_generate(model, ids, budget_tokens, perfect, 6, eos_token_id=NO_EOS, tree=32)
        assert torch.equal(out.sequences, ref[:, : ids.shape[1] + budget_tokens])


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_tree_budget(bad: object) -> None:
    model, ids, _ = case("llama")
    with pytest.raises(ValueError, match="tree must be a node budget >= 1"):
        BlockwiseLM.from_base(model, k=4).generate(ids, 5, tree=bad)


def test_what_a_tree_cannot_take_is_refused() -> None:
    model, ids, _ = case("llama")
    lm = BlockwiseLM.from_base(model, k=4)
    with pytest.raises(ValueError, match="min-block:L forces the first proposals of a chain"):
        lm.generate(ids, 5, tree=8, acceptance="min-block:2")
    with pytest.raises(ValueError, match="2 drafters need a tree to share"):
        lm.generate(ids, 5, drafter="heads+ngram", tree=None)
    with pytest.raises(ValueError, match="unknown drafter 'beam'"):
        lm.generate(ids, 5, drafter="beam", tree=4)


def test_auto_among_drafters_and_a_name_given_twice_are_refused_for_what_they_are() -> None:
    """auto is the choice among drafters, so where one is named (joined to another, or a saved default) it is
    refused without being offered back as a choice; a name given twice is called repeated, not unknown."""
    model, ids, _ = case("llama")
    lm = BlockwiseLM.from_base(model, k=4)
    with pytest.raises(ValueError, match="^drafter 'ngram\\+ngram' names ngram twice: name each drafter once$"):
        lm.generate(ids, 5, drafter="ngram+ngram", tree=4)
    with pytest.raises(ValueError, match="^drafter 'auto\\+ngram': auto is the choice among drafters") as refused:
        lm.generate(ids, 5, drafter="auto+ngram", tree=4)
    assert "auto" not in str(refused.value).split(": name ")[1]
    lm = perturb_heads(lm)
    lm.default_drafters = "auto"  # what "auto" stands for on this model (trained heads): not itself
    with pytest.raises(ValueError, match="^drafter 'auto': auto is the choice among drafters") as refused:
        lm.plan("auto", prompts=[ids])
    assert "auto" not in str(refused.value).split(": name ")[1]


def test_relaxed_acceptance_on_a_tree_never_gains_less() -> None:
    model, ids, ref = case("qwen2")
    lm = perturb_heads(BlockwiseLM.from_base(model, k=6), seed=5, std=0.3)
    exact = lm.generate(ids, NEW, eos_token_id=NO_EOS, tree=16)
    loose = lm.generate(ids, NEW, eos_token_id=NO_EOS, tree=16, acceptance="topk:3")
    assert_greedy_equal(model, ids, exact.sequences, ref)
    # The first call sees the same tree from the same state: the relaxed rule keeps a superset.
    assert loose.stats.block_sizes[0] >= exact.stats.block_sizes[0] and not loose.stats.exact


@pytest.mark.parametrize("arch", TOY_ARCHITECTURES)
def test_every_toy_architecture_takes_tree_masks(arch: str) -> None:
    assert takes_tree_masks(tiny(arch, seed=1))


def test_a_model_that_ignores_the_mask_falls_back_to_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Detected from its logits, said once, and the output stays exact."""
    model = toy_model("llama", seed=6)  # private copy: its forward is patched
    forward = model.forward

    @functools.wraps(forward)  # the same signature, so the cache goes in under the same name
    def without_mask(*args, attention_mask=None, **kwargs):
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", without_mask)
    assert not takes_tree_masks(model)
    ids = make_prompt(6, 512, seed=7)
    ref = hf_greedy(model, ids, 20, eos_token_id=NO_EOS)
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4))
    with pytest.warns(UserWarning, match="does not score a tree as given .* one chain from NgramDrafter"):
        out = lm.generate(ids, 20, eos_token_id=NO_EOS, drafter="heads+ngram", tree=16)
    assert_greedy_equal(model, ids, out.sequences, ref)
    assert max(out.stats.verified) <= 4  # chains of k-1 proposals, not trees


def test_a_tree_past_what_a_forward_scores_is_refused_before_any_forward_in_bounded_memory(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """--tree 100000 with k=8 heads, whose lattice holds that many nodes, is refused by the parser (past
    the 1,024 of any model), and --tree 1000 by the plan (past this model's context): one line naming the
    limit each (the last line), before any module's forward runs or a tree gains a node (counted), and in a
    process whose address space is capped at 6 GiB (the masks of such a tree want more than 10 GB). The Python
    API refuses the same budget."""
    import os
    import resource
    import subprocess
    import sys
    from pathlib import Path

    from blockdecode.cli import main
    from blockdecode.pretraining.corpus import train_tokenizer

    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n" * 40], vocab_size=300)
    base = toy_model("llama", vocab=len(tokenizer), context=256)
    BlockwiseLM.from_base(base, k=8).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    cases = (
        ("100000", 2, "blockdecode generate: error: argument --tree: must be off, auto, expected or a budget"),
        ("1000", 1, "error: tree=1000 exceeds the 256 candidate tokens"),
    )
    argv = ["generate", "--model", str(tmp_path), "--prompt", "def f(x):", "--max-new-tokens", "16"]
    argv += ["--drafter", "heads", "--dtype", "fp32", "--tree"]
    forwards, nodes, add_path = [], [], Tree.add_path
    monkeypatch.setattr(Tree, "add_path", lambda tree, *a, **kw: nodes.append(a) or add_path(tree, *a, **kw))
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: forwards.append(module))
    try:
        for tree, code, refusal in cases:
            with pytest.raises(SystemExit) as refused:
                main([*argv, tree])
            said = refused.value.code if code == 1 else capsys.readouterr().err.splitlines()[-1]
            assert said.startswith(refusal) and forwards == [] and nodes == [], said
    finally:
        hook.remove()
    for tree, code, refusal in cases:
        proc = subprocess.run([sys.executable, "-m", "blockdecode.cli", *argv, tree], capture_output=True, text=True,
                              timeout=600, preexec_fn=limit_memory, cwd=Path(__file__).parents[1],
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert proc.returncode == code and proc.stdout == "", proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert proc.stderr.splitlines()[-1].startswith(refusal)
    lm = BlockwiseLM.from_base(base, k=8)
    with pytest.raises(ValueError, match="tree=257 exceeds the 256"):
        lm.generate(make_prompt(4, vocab_size(base)), 4, drafter="heads", tree=257)
