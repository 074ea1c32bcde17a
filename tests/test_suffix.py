"""Suffix lookup: the automaton's counts and the drafter's continuations against a brute-force scan, and
decoding with it against transformers' greedy output (a chain, trees, a batch) and sampling."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_prompt, tiny
from test_batch import RANKED, causal_batch, check_rows, row_tokens
from test_sampling import BUDGET, PROMPT, RUNS, SETTINGS, SHOWN, homogeneity, reference, small

from blockdecode import BlockwiseLM, blockwise_generate, decode, make_plan
from blockdecode.decoding.sampling import sampling_settings
from blockdecode.drafters.proposals import looped
from blockdecode.drafters.suffix import SuffixDrafter, SuffixIndex

NO_HIDDEN = torch.zeros(1, 8)  # the drafter ignores the hidden state


def ends(docs: list[list[int]], s: list[int]) -> list[int]:
    """Where `s` ends in each of its occurrences, counting positions across `docs` one after another."""
    found, base = [], 0
    for doc in docs:
        found += [base + i + len(s) - 1 for i in range(len(doc) - len(s) + 1) if doc[i : i + len(s)] == s]
        base += len(doc)
    return found


def check_index(index: SuffixIndex, docs: list[list[int]], vocab: int) -> None:
    """Every string of at most `longest` tokens in `docs`: held, counted, last seen and continued as a scan says."""
    strings = {
        tuple(d[i:j]) for d in docs for i in range(len(d)) for j in range(i + 1, min(len(d), i + index.longest) + 1)
    }
    for s in map(list, strings):
        state, size = index.match(s, len(s))
        found = ends(docs, s)
        assert size == len(s) and index.count[state] == len(found) and index.newest[state] == max(found), s
        if len(s) < index.longest:
            assert set(index.next[state]) == {t for t in range(vocab) if ends(docs, s + [t])}, s
    assert index.match([vocab], 1) == (0, 0)  # never seen


@pytest.mark.parametrize("seed", range(4))
def test_the_index_counts_as_a_scan_does_as_tokens_arrive(seed: int) -> None:
    """Small vocabularies, so strings repeat; checked mid-document (the open one) and across documents."""
    rng = random.Random(seed)
    vocab, index = 2 + seed, SuffixIndex(longest=3 + 2 * seed)
    docs: list[list[int]] = []
    for _ in range(3):
        docs.append([])
        for _ in range(rng.randint(5, 25)):
            docs[-1].append(rng.randrange(vocab))
            index.append(docs[-1][-1])
            if rng.random() < 0.3:
                check_index(index, docs, vocab)
        index.close()
        check_index(index, docs, vocab)
    for loop in ([0] * 20, [0, 1] * 10):  # a model's loops, longer than the strings counted
        index.extend(loop)
        index.close()
        docs.append(loop)
        check_index(index, docs, vocab)


def scan(seq: list[int], corpus: list[list[int]], drafter: SuffixDrafter, depth: int) -> list[tuple[int, list]]:
    """The brute-force matches: each suffix of `seq` (at most max_match tokens, the longest first) whose
    occurrences before its end, in `seq` and in `corpus`, went on at least min_count times and more often
    than the longer one's, with what followed each occurrence (at most `depth` tokens)."""
    found: list[tuple[int, list]] = []
    for size in range(min(drafter.max_match, len(seq)), 0, -1):
        tail = seq[-size:]
        following = [
            doc[i + size : i + size + depth]
            for doc in [seq, *corpus]
            for i in range(len(doc) - size)
            if doc[i : i + size] == tail
        ]
        if len(following) >= max(drafter.min_count, len(found[-1][1]) + 1 if found else 0):
            found.append((size, following))
    return found


def count(following: list[list[int]], w: tuple[int, ...]) -> int:
    return sum(tuple(f[: len(w)]) == w for f in following)


def chance(following: list[list[int]], w: tuple[int, ...]) -> float:
    """How many occurrences went on with `w` over how many went on past its parent."""
    return count(following, w) / sum(len(f) >= len(w) and tuple(f[: len(w) - 1]) == w[:-1] for f in following)


def probability(following: list[list[int]], w: tuple[int, ...]) -> float:
    return torch.tensor([chance(following, w[: i + 1]) for i in range(len(w))], dtype=torch.float64).prod().item()


def trie(following: list[list[int]]) -> set[tuple[int, ...]]:
    return {tuple(f[:i]) for f in following for i in range(1, len(f) + 1)}


def check_continuations(drafter: SuffixDrafter, seq: list[int], corpus: list[list[int]], row: int | None) -> None:
    """The drafter's trie against the scan: the longest match's nodes are a best-first set (no node left
    out is likelier than one kept), each with its chance there (how many occurrences went on that way over
    how many went on past its parent); the budget they leave holds shorter matches' nodes, each with its
    chance in one of them; the chain is the longest match's most frequent token at each step."""
    depth, budget = 4, 7
    found = scan(seq, corpus, drafter, depth)
    assert [size for size, _ in drafter.matches(seq, row)] == [size for size, _ in found]
    paths = drafter.continuations(seq, depth, budget, row)
    chances = {tuple(p[: i + 1]): c for p, cs in paths for i, c in enumerate(cs)}
    taken, reach = set(), set()  # the nodes of the matches taken whole; with the last one asked
    for _, following in found:
        reach = taken | trie(following)
        if reach == taken or len(reach) >= budget:  # a match that adds nothing ends the search, as a full tree does
            break
        taken = reach
    assert taken <= set(chances) <= reach and len(chances) == min(budget, len(reach))
    first = found[0][1] if found else []
    longest = trie(first)
    for w, c in chances.items():
        assert (
            c == pytest.approx(chance(first, w))
            if w in longest
            else any(c == pytest.approx(chance(f, w)) for _, f in found if w in trie(f))
        )
    kept = set(chances) & longest
    left = [w for w in longest - kept if len(w) == 1 or w[:-1] in kept]  # what the tree could have grown next
    if left:
        assert min(probability(first, w) for w in kept) >= max(probability(first, w) for w in left) - 1e-12
    chain, step = drafter.chain(seq, depth, row)[0], ()
    while len(step) < depth and (
        options := {f[len(step)] for f in first if len(f) > len(step) and tuple(f[: len(step)]) == step}
    ):
        best = max(count(first, (*step, t)) for t in options)
        assert chain[len(step)] in {t for t in options if count(first, (*step, t)) == best}
        step = (*step, chain[len(step)])
    assert chain == list(step)


@pytest.mark.parametrize("seed", range(6))
def test_continuations_are_a_scans_counts_as_the_sequence_grows(seed: int) -> None:
    """A decode's row, fed by start and observe, and a sequence shown without either (indexed anew, then
    extended): the same match and counts as a scan of the sequence and corpus, after every append."""
    rng = random.Random(seed)
    vocab = 3 + seed % 3
    corpus = [[rng.randrange(vocab) for _ in range(rng.randint(0, 30))] for _ in range(seed % 3)]
    drafter = SuffixDrafter(corpus=corpus, max_match=2 + seed, min_count=1 + seed % 2)
    seq = [rng.randrange(vocab) for _ in range(3)]
    drafter.start([[9, 9], seq])
    loose = SuffixDrafter(corpus=[torch.tensor(doc) for doc in corpus], max_match=2 + seed, min_count=1 + seed % 2)
    for _ in range(20):
        check_continuations(drafter, seq, corpus, 1)
        check_continuations(loose, seq, corpus, None)
        gained = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        drafter.observe(1, gained)
        seq = seq + gained


def test_a_longer_match_here_beats_the_corpus_and_equal_ones_pool_their_counts() -> None:
    a, b, c, x, y, z = 1, 2, 3, 4, 5, 6
    corpus = [[b, c, x]] * 3
    drafter = SuffixDrafter(corpus=corpus)
    assert drafter.chain([a, b, c, y, a, b, c], 2) == ([y, a], [1.0, 1.0])  # "a b c" here, "b c" there
    assert drafter.continuations([b, c, y, b, c], 1, 4) == [([x], [0.75]), ([y], [0.25])]  # "b c" both: 3 to 1
    assert drafter.chain([b, c, y, b, c], 1) == ([x], [0.75])
    assert SuffixDrafter().chain([b, c, y, a, b, c, x, c, b, c], 1)[0] == [x]  # one each: the newest occurrence
    assert SuffixDrafter(corpus=[[b, c, x]]).chain([a, b, c, y, b, c], 1)[0] == [y]  # one here, one there: here
    assert SuffixDrafter(corpus=corpus, min_count=2).chain([a, b, c, y, a, b, c], 1) == ([x], [0.75])  # backs off
    ended = SuffixDrafter(corpus=[[x, b], [a, b, z]])  # "b" ends a document: it went on no more often than "a b"
    assert [size for size, _ in ended.matches([a, b, y, a, b])] == [2]
    assert ended.continuations([c, b, y, a, b], 2, 8) == [([z], [1.0]), ([y, a], [0.5, 1.0])]  # "a b", then "b"


def test_proposals_pad_a_short_or_missing_match() -> None:
    drafter = SuffixDrafter(corpus=[[8, 9, 4]])  # "8 9" goes on with 4 and the document ends
    assert drafter.propose(torch.tensor([[7]]), NO_HIDDEN, 3).tolist() == [[7, 7, 7]]
    assert drafter.propose(torch.tensor([[1, 8, 9]]), NO_HIDDEN, 4).tolist() == [[4, 4, 4, 4]]
    scored = drafter.chain_scored(torch.tensor([[1, 8, 9]]), NO_HIDDEN, 4)
    assert [s.key[0] for s in scored.sources] == ["confidence"] + ["padding"] * 3
    assert drafter.propose_paths(torch.tensor([[5, 6, 5, 7, 5]]), NO_HIDDEN, 2, 8) == [
        [7, 5],
        [6, 5],
    ]  # the newer first


def test_a_match_that_runs_into_the_present_goes_on_with_its_loop() -> None:
    drafter = SuffixDrafter()
    assert drafter.propose(torch.tensor([[1, 2, 3, 1, 2]]), NO_HIDDEN, 7).tolist() == [[3, 1, 2, 3, 1, 2, 3]]
    scored = drafter.chain_scored(torch.tensor([[1, 2, 3, 1, 2]]), NO_HIDDEN, 5)
    assert [s.key[0] for s in scored.sources] == ["confidence"] * 3 + ["loop"] * 2  # its own rate, learnt apart
    assert drafter.propose(torch.tensor([[4, 9, 9]]), NO_HIDDEN, 4).tolist() == [[9, 9, 9, 9]]  # a run of one token
    paths = drafter.propose_scored(torch.tensor([[5, 6, 5, 7, 5]]), NO_HIDDEN, 5, 8)
    assert [p.tokens for p in paths] == [[7, 5, 7, 5, 7], [6, 5, 7, 5, 6]]  # each path its own period (2, 4)
    assert looped([1, 2, 3], [2, 3], 2) == [] and looped([1, 2, 3], [3, 4], 5) == []  # deep enough; not the text's tail


@pytest.mark.parametrize("bad", [dict(max_match=0), dict(min_count=0), dict(corpus=[[1, -2]]), dict(corpus=[[1.5]])])
def test_bad_settings_are_one_clear_error(bad: dict) -> None:
    with pytest.raises(ValueError, match="max_match must be|min_count must be|a corpus is a list of token id"):
        SuffixDrafter(**bad)


@pytest.mark.parametrize("tree", [None, 8, "expected"])
def test_decoding_with_it_is_transformers_greedy(tree: int | str | None) -> None:
    """Alone, with a corpus holding the reference (long matches that stand) and with an unrelated one."""
    model = tiny("llama")
    lm = BlockwiseLM.from_base(model, k=4)
    ids = make_prompt(12, 512, seed=3)
    ref = hf_greedy(model, ids, 40, eos_token_id=NO_EOS)
    for corpus in ([], [ref[0].tolist()], [make_prompt(200, 512, seed=4)[0].tolist()]):
        out = lm.generate(ids, 40, eos_token_id=NO_EOS, drafter=SuffixDrafter(corpus=corpus), tree=tree)
        assert_greedy_equal(model, ids, out.sequences, ref, what=f"tree {tree}, {len(corpus)} documents")
        if corpus == [ref[0].tolist()]:
            assert out.stats.calls < 20, out.stats.block_sizes  # the reference's own text is proposed


@pytest.mark.parametrize("ranked", [False, True])
def test_a_batch_reads_each_rows_own_tokens(ranked: bool) -> None:
    model, prompts, ids, mask, ref = causal_batch("gpt2")
    drafter = SuffixDrafter()
    if ranked:
        plan = make_plan(model, [drafter], 4, eos_token_id=NO_EOS, ranking=RANKED)
        out = decode(model, ids, 24, plan, attention_mask=mask)
    else:
        out = blockwise_generate(model, ids, 24, drafter, 4, eos_token_id=NO_EOS, attention_mask=mask)
    check_rows(model, prompts, mask, out.sequences, ref, what=f"suffix, ranked {ranked}")
    assert [tokens for tokens, _ in drafter._rows] == [
        row_tokens(model, out.sequences, mask, r, set()) for r in range(4)
    ]


def test_sampling_with_it_keeps_transformers_distribution() -> None:
    """test_sampling's chi-square test of homogeneity (a vocabulary of 8, so the drafter's lookups often
    stand): not rejected at p < 0.001, where a wrong acceptance rule scores below 1e-6."""
    setting = "t1.3-k5-p0.8"
    model = small()
    plan = make_plan(model, [SuffixDrafter()], k=3, sampling=sampling_settings(model, True, **SETTINGS[setting]))
    generator, samples = torch.Generator().manual_seed(0), Counter()
    for _ in range(RUNS):
        new = decode(model, PROMPT, BUDGET[setting], plan, generator=generator).sequences[0, PROMPT.shape[1] :]
        samples[tuple((new.tolist() + [1] * SHOWN)[:SHOWN])] += 1  # as transformers pads a finished row
    assert homogeneity(samples, reference(setting)) > 1e-3
