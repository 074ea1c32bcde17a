"""Proposal heads: shapes, the zero-init identity, config validation, and sharing the base's output projection."""

from __future__ import annotations

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_prompt, perturb_heads, tiny, vocab_size

from blockdecode import BlockwiseLM, HeadsConfig
from blockdecode.core.toy import toy_model
from blockdecode.drafters.heads import HydraHeads, MedusaHeads, PaperHeads, build_heads, most_frequent, path_tokens

HEAD_TYPES = ["paper", "medusa", "hydra"]
# k=1 paper heads are zero-width Linear layers; torch warns that initialising them is a no-op (see report).
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")


def heads(k: int, head_type: str, d: int = 16, **kwargs: int) -> torch.nn.Module:
    return build_heads(HeadsConfig(k=k, head_type=head_type, hidden_size=d, vocab_size=50, **kwargs))


def embeds(h: torch.Tensor, k: int, e: int = 16, seed: int = 1) -> torch.Tensor:
    """Embeddings of the tokens before each head's own, [..., k-1, e] (hydra reads them; the others ignore them)."""
    return torch.randn(*h.shape[:-1], k - 1, e, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("head_type", HEAD_TYPES)
@pytest.mark.parametrize("k", [1, 2, 5, 8])
@pytest.mark.parametrize("batch", [(), (1,), (2, 3)])
def test_output_shape(head_type: str, k: int, batch: tuple[int, ...]) -> None:
    """h [..., D] -> [..., k-1, D]; k=1 means no proposals, an empty but well-formed tensor."""
    h = torch.randn(*batch, 16)
    out = heads(k, head_type)(h, embeds(h, k))
    assert out.shape == (*batch, k - 1, 16)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_untrained_heads_return_h_exactly(head_type: str) -> None:
    """Zero-init output layers: each head's state is h itself, so it proposes the base's next token."""
    h = torch.randn(4, 16) * 10
    assert torch.equal(heads(6, head_type)(h, embeds(h, 6)), h.unsqueeze(-2).expand(4, 5, 16))


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_random_heads_are_finite_and_per_head(head_type: str) -> None:
    """Random weights and large inputs give finite states that differ from h and between heads."""
    module = heads(4, head_type)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            torch.nn.init.normal_(p, std=1.0, generator=gen)
        h = torch.randn(3, 16, generator=gen) * 100
        out = module(h, embeds(h, 4))
    assert torch.isfinite(out).all()
    assert not torch.allclose(out[:, 0], h) and not torch.allclose(out[:, 0], out[:, 1])


def test_paper_heads_form() -> None:
    """Stern et al.: one ReLU layer of width (k-1)*d_hidden, its (k-1)*d outputs added back to h per head."""
    module = heads(4, "paper", head_hidden_size=8)
    assert isinstance(module, PaperHeads)
    assert module.up.weight.shape == (3 * 8, 16) and module.down.weight.shape == (3 * 16, 3 * 8)
    torch.nn.init.normal_(module.down.weight)
    h = torch.randn(2, 16)
    delta = module.down(torch.relu(module.up(h))).reshape(2, 3, 16)
    torch.testing.assert_close(module(h), h[:, None] + delta)


@pytest.mark.parametrize("head_type", ["paper", "medusa"])
def test_the_first_n_heads_alone_are_the_first_n_of_all(head_type: str) -> None:
    """A drafter asked for fewer tokens computes fewer heads (the paper's from the first rows of `down`)."""
    module = heads(5, head_type, head_hidden_size=8)
    for p in module.parameters():
        torch.nn.init.normal_(p)
    h = torch.randn(2, 3, 16)
    for n in range(5):
        torch.testing.assert_close(module(h, None, n), module(h)[..., :n, :])


def test_medusa_heads_form() -> None:
    """Medusa: an independent residual block h + SiLU(W h) per head."""
    module = heads(4, "medusa")
    assert isinstance(module, MedusaHeads) and len(module.blocks) == 3
    for block in module.blocks:
        torch.nn.init.normal_(block.weight)
    h = torch.randn(2, 16)
    expected = torch.stack([h + torch.nn.functional.silu(b(h)) for b in module.blocks], dim=1)
    torch.testing.assert_close(module(h), expected)


def test_hydra_heads_form_and_see_only_the_tokens_before_their_own() -> None:
    """Hydra in recurrent form: s_1 = h, s_i = s_(i-1) + down(ReLU(up([s_(i-1); e_(i-1)]))); changing the
    token before head j changes heads j.. and leaves the heads before it alone."""
    module = heads(5, "hydra", head_hidden_size=8, embed_size=12)
    assert isinstance(module, HydraHeads) and module.up[0].weight.shape == (8, 16 + 12)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.5, generator=gen)
        h, e = torch.randn(2, 16, generator=gen), torch.randn(2, 4, 12, generator=gen)
        out = module(h, e)
        state = h
        for i in range(4):
            state = state + module.down[i](torch.relu(module.up[i](torch.cat([state, e[:, i]], -1))))
            torch.testing.assert_close(out[:, i], state)
        changed = e.clone()
        changed[:, 2] += 1
        other = module(h, changed)
    assert torch.equal(other[:, :2], out[:, :2]) and not torch.allclose(other[:, 2:], out[:, 2:])
    with pytest.raises(ValueError, match="hydra heads need the embeddings"):
        module(h)


def test_path_tokens_are_the_newest_token_then_the_data() -> None:
    """Teacher forcing for hydra: at t, the base's newest token (its argmax at t), then tokens t+2.. ."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    newest = torch.tensor([[20, 21, 22, 23, 24, 25]])
    out = path_tokens(newest, ids, 4)
    assert out.shape == (1, 6, 3)
    assert out[0, 0].tolist() == [20, 12, 13] and out[0, 2].tolist() == [22, 14, 15]
    assert out[0, 3].tolist() == [23, 15, 0]  # past the end: no head has a target there


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(k=0), "k must be an integer >= 1"),
        (dict(k=-1), "k must be an integer >= 1"),
        (dict(k=2.5), "k must be an integer >= 1"),
        (dict(k="3"), "k must be an integer >= 1"),
        (dict(head_type="eagle"), "unknown head_type 'eagle': choose one of paper, medusa, hydra"),
        (dict(hidden_size=0), "hidden_size must be positive"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HeadsConfig(**{"hidden_size": 16, "vocab_size": 50, **kwargs})


def test_config_defaults_and_round_trip() -> None:
    cfg = HeadsConfig(k=4, hidden_size=16, vocab_size=50)
    assert cfg.head_hidden_size == 16 and cfg.head_type == "paper"
    assert HeadsConfig(k=4, hidden_size=16, head_hidden_size=8).head_hidden_size == 8
    assert HeadsConfig(**cfg.to_dict()) == cfg


def test_from_base_rejects_unknown_head_type() -> None:
    with pytest.raises(ValueError, match="unknown head_type 'eagle'"):
        BlockwiseLM.from_base(tiny("llama"), k=4, head_type="eagle")


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_head_logits_share_the_base_projection(head_type: str) -> None:
    """The heads add one small layer and no vocabulary-sized weights: logits come from the base's own
    lm_head, the same tensor, not a copy (so editing it moves the heads' logits too)."""
    base = toy_model("llama", vocab=97)  # private copy, edited below; 97 matches no other dimension
    lm = perturb_heads(BlockwiseLM.from_base(base, k=5, head_type=head_type))
    projection = base.get_output_embeddings().weight
    head_params = list(lm.heads.parameters())
    assert all(97 not in p.shape for p in head_params)
    assert all(p.data_ptr() != projection.data_ptr() for p in head_params)
    expected = {
        "medusa": 4 * (64 * 64 + 64),
        "paper": (64 * 256 + 256) + (256 * 256 + 256),
        "hydra": 4 * ((64 + 64) * 64 + 64 + 64 * 64 + 64),
    }[head_type]
    assert sum(p.numel() for p in head_params) == expected == lm.config.parameters()
    assert sum(p.numel() for p in lm.parameters()) == sum(p.numel() for p in base.parameters()) + expected

    h, tokens = torch.randn(2, 64), torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.no_grad():
        logits = lm.head_logits(h, tokens)
        assert logits.shape == (2, 4, 97)
        states = lm.heads(h, base.get_input_embeddings()(tokens))
        torch.testing.assert_close(logits, torch.nn.functional.linear(states, projection))
        projection.mul_(2)
        torch.testing.assert_close(lm.head_logits(h, tokens), 2 * logits)


def test_untrained_head_logits_equal_the_base_logits() -> None:
    model = tiny("gpt2")
    lm = BlockwiseLM.from_base(model, k=3)
    h = torch.randn(5, 64)
    with torch.no_grad():
        base = model.get_output_embeddings()(h)
        torch.testing.assert_close(lm.head_logits(h), base[:, None].expand(5, 2, 512), rtol=0, atol=1e-5)


def test_heads_follow_the_base_dtype() -> None:
    """Heads are built on the projection's device and dtype, so bf16 bases get bf16 heads."""
    base = toy_model("llama").to(torch.bfloat16)
    lm = BlockwiseLM.from_base(base, k=3)
    assert all(p.dtype == torch.bfloat16 for p in lm.heads.parameters())


def test_a_draft_vocabulary_is_checked_and_found_from_the_targets() -> None:
    with pytest.raises(ValueError, match="draft_vocab must lie in"):
        HeadsConfig(k=4, hidden_size=8, vocab_size=10, draft_vocab=11)
    with pytest.raises(ValueError, match="draft_vocab must lie in"):
        HeadsConfig(k=4, hidden_size=8, vocab_size=10, draft_vocab=-1)
    targets = torch.tensor([[3, 3, 3, 7, 7, 1, -100], [3, 7, 9, 2, -1, -1, -1]])
    top, coverage = most_frequent(targets, 10, 2)
    assert top.tolist() == [3, 7] and coverage == pytest.approx(7 / 10)  # 7 of the 10 real targets


@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi"])
@pytest.mark.parametrize("tree", [None, 12])
def test_heads_with_a_draft_vocabulary_decode_exactly_and_propose_only_its_ids(arch: str, tree: int | None) -> None:
    """The heads score only the map's rows; verification keeps the whole vocabulary, so the output is
    greedy's, and a token outside the map is still gained as the model's own token after a block."""
    model = tiny(arch)
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4, draft_vocab=40))
    lm.heads.token_map.copy_(torch.arange(100, 140))
    ids = make_prompt(6, vocab_size(model), seed=3)
    out = lm.generate(ids, 30, eos_token_id=NO_EOS, drafter="heads", tree=tree)
    assert_greedy_equal(model, ids, out.sequences, hf_greedy(model, ids, 30, eos_token_id=NO_EOS))
    drafter = lm.drafter()
    hidden = torch.randn(1, lm.config.hidden_size)
    assert set(drafter.propose(ids, hidden, 3)[0].tolist()) <= set(range(100, 140))
    assert all(set(p) <= set(range(100, 140)) for p in drafter.propose_paths(ids, hidden, 3, 10))
    projection = lm.base.get_output_embeddings()
    with torch.no_grad():
        full = projection(lm.heads(hidden))[..., 100:140]
    assert torch.equal(drafter.propose(ids, hidden, 3), full.argmax(-1) + 100)  # the same as slicing the full logits
