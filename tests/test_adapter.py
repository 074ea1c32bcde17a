"""The base-model adapter driven directly: scoring a chain, scoring a tree with its mask and
positions, and keeping a non-contiguous set of cache positions, each checked against a plain
sequential run of the model over the same tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import make_prompt, tiny, vocab_size

from blockdecode.decoding.adapter import CausalAdapter, Seq2seqAdapter
from blockdecode.decoding.inputs import check_prompt

ARCHS = ("llama", "gpt2", "qwen2", "gpt_neox", "opt", "phi", "gemma3")
TOL = 1e-5

# A tree of candidates after the newest token (node 0): nodes 1 and 2 follow it, 3 follows 2,
# 4 follows 1, 5 follows 3. Its root-to-leaf path 0 -> 2 -> 3 -> 5 is the one kept below.
PARENTS = (-1, 0, 0, 2, 1, 3)
PATH = (0, 2, 3, 5)


def ancestors(parents: tuple[int, ...]) -> torch.Tensor:
    """mask[i, j]: node j is node i or one of its ancestors."""
    q = len(parents)
    mask = torch.zeros(q, q, dtype=torch.bool)
    for i in range(q):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def depths(parents: tuple[int, ...]) -> list[int]:
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def sequential(model, ids: torch.LongTensor, impl: str = "dynamic") -> tuple[CausalAdapter, torch.Tensor]:
    """The reference: the model over `ids` one token at a time; the adapter and every position's logits."""
    ref = CausalAdapter(model, impl, ids.shape[1] + 8)
    logits = [ref.prefill(ids[:, :1])[0][0, -1]]
    for t in range(1, ids.shape[1]):
        logits.append(ref.score(ids[:, t : t + 1])[0][0, -1])
    return ref, torch.stack(logits)


def cache_tensors(adapter: CausalAdapter) -> list[torch.Tensor]:
    n = adapter.length
    return [t[..., :n, :] for layer in adapter.cache.layers for t in (layer.keys, layer.values)]


def capped(model, logits: torch.Tensor) -> torch.Tensor:
    """What the model makes of its projection's output: Gemma's configs may cap it, tanh(x / c) * c."""
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def assert_no_hooks(model) -> None:
    assert not model.get_output_embeddings()._forward_pre_hooks, "the capture hook outlived the call"
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("arch", ARCHS)
def test_score_a_chain(arch: str) -> None:
    """Prefill then a chain of q tokens: the logits of a full forward, and h is the projection's input."""
    model = tiny(arch)
    ids = make_prompt(12, vocab_size(model), seed=3)
    with torch.inference_mode():  # the toy itself is built outside: it is cached for other tests
        full = model(ids, use_cache=False).logits[0]
    adapter = CausalAdapter(model, "dynamic", 16)
    logits, hidden = adapter.prefill(ids[:, :7])
    assert logits.shape[1] == hidden.shape[1] == 1 and adapter.length == 7
    torch.testing.assert_close(logits[0, -1], full[6], atol=TOL, rtol=0)
    logits, hidden = adapter.score(ids[:, 7:])
    torch.testing.assert_close(logits[0], full[7:], atol=TOL, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(capped(model, model.get_output_embeddings()(hidden)), logits, atol=TOL, rtol=0)
    assert adapter.length == 12 and adapter.calls == 2
    assert_no_hooks(model)


@pytest.mark.parametrize("impl", ["dynamic", "static"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_then_keep_its_path_equals_a_sequential_run(arch: str, impl: str) -> None:
    """Score a tree in one pass (each node sees the cache and its ancestors, at its depth), keep
    the prompt and one root-to-leaf path: the logits along the path, the cache, and the next
    call's logits all equal a sequential run over the prompt and that path."""
    if impl == "static" and arch == "gemma3":
        pytest.skip("a static cache cannot roll back sliding-window layers (tests/test_decode.py)")
    model = tiny(arch)
    vocab = vocab_size(model)
    prompt = make_prompt(6, vocab, seed=4)
    nodes = make_prompt(len(PARENTS), vocab, seed=5)
    adapter = CausalAdapter(model, impl, 24)
    adapter.prefill(prompt)
    positions = torch.tensor(depths(PARENTS)) + prompt.shape[1]
    logits, hidden = adapter.score(nodes, positions, ancestors(PARENTS))
    assert logits.shape[:2] == hidden.shape[:2] == (1, len(PARENTS))

    path = torch.cat([prompt, nodes[:, list(PATH)]], dim=1)
    ref, ref_logits = sequential(model, path, impl)
    torch.testing.assert_close(logits[0, list(PATH)], ref_logits[prompt.shape[1] :], atol=TOL, rtol=0)

    adapter.keep([*range(prompt.shape[1]), *(prompt.shape[1] + i for i in PATH)])
    assert adapter.length == ref.length == path.shape[1]
    for ours, theirs in zip(cache_tensors(adapter), cache_tensors(ref)):
        torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)

    after = make_prompt(3, vocab, seed=6)
    torch.testing.assert_close(adapter.score(after)[0], ref.score(after)[0], atol=TOL, rtol=0)
    assert_no_hooks(model)


def test_keep_a_prefix_is_a_rollback() -> None:
    model = tiny("llama")
    ids = make_prompt(10, vocab_size(model), seed=7)
    adapter = CausalAdapter(model, "dynamic", 16)
    adapter.prefill(ids)
    adapter.keep(range(6))
    ref, _ = sequential(model, ids[:, :6])
    assert adapter.length == 6
    for ours, theirs in zip(cache_tensors(adapter), cache_tensors(ref)):
        torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    adapter.keep([0, 1, 2, 3, 4])  # a list that happens to be a prefix takes the same path
    assert adapter.length == 5


@pytest.mark.parametrize("bad", [[3, 2], [0, 0], [0, 10], [-1, 2]])
def test_keep_refuses_what_is_not_ascending_cache_positions(bad: list[int]) -> None:
    adapter = CausalAdapter(tiny("llama"), "dynamic", 16)
    adapter.prefill(make_prompt(10, 512))
    with pytest.raises(ValueError, match="ascending cache positions in \\[0, 10\\)"):
        adapter.keep(bad)
    with pytest.raises(ValueError, match="cannot keep 11 positions of a cache holding 10"):
        adapter.keep(range(11))


@pytest.mark.parametrize("arch", ["marian", "bart", "t5"])
def test_seq2seq_scores_rolls_back_and_keeps_the_source(arch: str) -> None:
    """The encoder runs once; the decoder's chain, a rollback and a rescoring give a full forward's
    logits, and the cross-attention cache is never cut."""
    model = tiny(arch)
    source = make_prompt(9, vocab_size(model), seed=5)
    target = make_prompt(12, vocab_size(model), seed=6)
    with torch.inference_mode():
        full = model(input_ids=source, decoder_input_ids=target, use_cache=False).logits[0]
    adapter = Seq2seqAdapter(model, source, "dynamic", 16)
    logits, _ = adapter.prefill(target[:, :5])
    torch.testing.assert_close(logits[0, -1], full[4], atol=TOL, rtol=0)
    wrong = (target[:, 5:] + 1) % vocab_size(model)  # a rejected block, scored then dropped
    adapter.score(wrong)
    adapter.keep(range(5))
    logits, hidden = adapter.score(target[:, 5:])
    torch.testing.assert_close(logits[0], full[5:], atol=TOL, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(model.get_output_embeddings()(hidden), logits, atol=TOL, rtol=0)
    cross = adapter.cache.cross_attention_cache
    assert cross.get_seq_length() == 9 and adapter.cache.self_attention_cache.get_seq_length() == 12
    assert adapter.calls == 3 and adapter.takes_positions == (arch != "t5")
    if arch == "t5":  # relative position biases: no position ids to give
        with pytest.raises(ValueError, match="takes no decoder position ids"):
            adapter.score(target[:, :2], positions=torch.tensor([12, 12]), mask=torch.ones(2, 2, dtype=torch.bool))
    assert_no_hooks(model)


@pytest.mark.parametrize("arch", ["marian", "bart"])
def test_seq2seq_tree_then_keep_its_path_equals_a_sequential_run(arch: str) -> None:
    """Decoders that take no position ids get a tree's through their positional embedding, for
    that call only: the path's logits, the kept cache and the next call match a sequential run."""
    model = tiny(arch)
    vocab = vocab_size(model)
    source, prompt = make_prompt(7, vocab, seed=3), make_prompt(5, vocab, seed=4)
    nodes = make_prompt(len(PARENTS), vocab, seed=5)
    adapter = Seq2seqAdapter(model, source, "dynamic", 24)
    adapter.prefill(prompt)
    logits, _ = adapter.score(nodes, torch.tensor(depths(PARENTS)) + prompt.shape[1], ancestors(PARENTS))
    path = torch.cat([prompt, nodes[:, list(PATH)]], dim=1)
    ref = Seq2seqAdapter(model, source, "dynamic", 24)
    ref.prefill(path[:, :1])
    ref_logits = torch.cat([ref.score(path[:, t : t + 1])[0][0] for t in range(1, path.shape[1])])
    torch.testing.assert_close(logits[0, list(PATH)], ref_logits[prompt.shape[1] - 1 :], atol=TOL, rtol=0)
    adapter.keep([*range(prompt.shape[1]), *(prompt.shape[1] + i for i in PATH)])
    after = make_prompt(3, vocab, seed=6)
    torch.testing.assert_close(adapter.score(after)[0], ref.score(after)[0], atol=TOL, rtol=0)
    assert not adapter.embed_positions._forward_pre_hooks  # the positions were given for that call only
    assert_no_hooks(model)


@pytest.mark.parametrize(
    "arch, ids, mask, match",
    [
        (
            "llama",
            [[5, 6, 7], [1, 1, 1]],
            None,
            r"the prompt in row 1 is empty: it holds only special tokens \[1, 1, 1\]",
        ),
        (
            "llama",
            [[1, 0, 1], [5, 6, 7]],
            None,
            r"the prompt in row 0 is empty: it holds only special tokens \[1, 0, 1\]",
        ),
        (
            "llama",
            [[5, 6, 7], [9, 9, 1]],
            [[1, 1, 1], [0, 0, 1]],
            r"prompt in row 1 is empty: .* tokens \[1\], no text",
        ),
        ("marian", [[5, 6, 7], [2, 1, 9]], [[1, 1, 1], [1, 1, 0]], r"source in row 1 is empty: .* tokens \[2, 1\]"),
    ],
)
def test_every_row_of_a_prompt_must_hold_text_its_padding_aside(arch: str, ids: list, mask: list | None, match: str):
    """A row of special tokens alone is an empty prompt wherever it sits in the batch; padding (here a
    plain token, left out by the attention mask) is not the row's text, and neither makes it empty."""
    model = tiny(arch)
    mask = None if mask is None else torch.tensor(mask)
    with pytest.raises(ValueError, match=match):
        check_prompt(model, torch.tensor(ids), 4, mask)
    padded = torch.tensor([[5, 6, 7], [1, 1, 8]])  # special tokens as padding, a token of text after them
    assert torch.equal(check_prompt(model, padded, 4, torch.tensor([[1, 1, 1], [0, 0, 1]])), padded)
