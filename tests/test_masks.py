"""Mask drafting: real tokens stay the base's, the packed training forward equals plain forwards,
training lowers the loss, and masks save and load whole."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import NO_EOS, hf_greedy, make_prompt, tiny

from blockdecode.core.hf import decoder_output
from blockdecode.core.io import CheckpointError
from blockdecode.core.loss import IGNORE, draft_projection
from blockdecode.core.toy import TOY_ARCHITECTURES, toy_model
from blockdecode.drafters.heads import most_frequent
from blockdecode.drafters.masks import (
    MASKS_CONFIG,
    MASKS_WEIGHTS,
    MasksConfig,
    attached,
    build_masks,
    load_masks,
    mask_batch,
    mask_loss,
    mask_states,
    save_masks,
)


def trained_looking(model, k: int = 4, seed: int = 0, **kwargs):
    """Masks with random embeddings and a non-zero LoRA (B = 0 would add nothing): the gate matters. Seeded, so
    that what ran before (another test's draws) does not choose the weights a tolerance is checked on."""
    torch.manual_seed(seed)
    masks = build_masks(model, k=k, rank=4, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        masks.embeddings.normal_(0.0, 1.0, generator=gen)
        for lora in masks.lora:
            lora.b.normal_(0.0, 0.5, generator=gen)
    return masks


def mask_ids(masks, count: int | None = None) -> torch.LongTensor:
    """The ids of masks 1..count (default all k-1), one row."""
    vocab, n = masks.config.vocab_size, masks.config.k - 1
    return torch.arange(vocab, vocab + (n if count is None else count))[None]


def logits(model, ids: torch.LongTensor, source: torch.LongTensor | None = None) -> torch.Tensor:
    if source is None:
        return model(input_ids=ids, use_cache=False).logits
    return model(input_ids=source, decoder_input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "marian"])
@torch.no_grad()
def test_real_tokens_keep_the_base_logits_with_masks_attached(arch):
    """Gate off (no mask in the input): the base's logits bit for bit. Gate on (masks after the real
    tokens, LoRA non-zero): the real rows' logits as the base's, to float tolerance (other matmul
    shapes), while the masks' rows do change. GPT-2's layers are Conv1D; Marian's encoder is untouched."""
    model = tiny(arch)
    masks = trained_looking(model)
    source = make_prompt(7, 512, seed=1) if arch == "marian" else None
    ids = make_prompt(9, 512)
    base = logits(model, ids, source)
    with attached(model, masks):
        assert torch.equal(logits(model, ids, source), base)
        both = logits(model, torch.cat([ids, mask_ids(masks)], dim=1), source)
    torch.testing.assert_close(both[:, :9], base, rtol=1e-5, atol=1e-5)
    plain = logits(model, torch.cat([ids, ids[:, :3]], dim=1), source)  # what ids < V at those rows would give
    assert not torch.allclose(both[:, 9:], plain[:, 9:], atol=1e-2)


def test_hooks_serve_only_their_thread_and_leave_on_exit():
    """Another thread's forward of the same model never sees the masks (a mask id is out of its
    embedding's range), and after the context the model carries no hook of theirs (the shared toy may
    carry other tests' hooks: what counts is that the set is as it was)."""
    model = tiny("llama")
    hooks = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()}
    masks = trained_looking(model)
    ids = torch.cat([make_prompt(5, 512), mask_ids(masks)], dim=1)
    seen: list[BaseException] = []

    def other() -> None:
        try:
            logits(model, ids)
        except IndexError as err:
            seen.append(err)

    with torch.no_grad(), attached(model, masks):
        logits(model, ids)
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert len(seen) == 1
    assert hooks == {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])  # rotary, absolute positions, eager attention
@torch.no_grad()
def test_a_packed_mask_group_equals_a_plain_forward_of_its_prefix_and_group(arch):
    """The 4-D training mask: each mask's decoder output in the packed forward (rows, then every
    group) equals that of a plain causal forward over the row up to the group's anchor and the group;
    and the real tokens' outputs are the base's."""
    model = tiny(arch)
    masks = trained_looking(model)
    vocab = masks.config.vocab_size
    rows = torch.cat([make_prompt(18, vocab, seed=2), make_prompt(18, vocab, seed=3)])
    rows[1, 14:] = -1  # a row that ended at an EOS
    batch = mask_batch(rows, masks.config.k, vocab, prompt_len=5, every=3)
    states = mask_states(model, masks, batch)
    for g, anchor in enumerate(batch.anchors.tolist()):
        for b in range(2):
            ids = torch.cat([rows[b : b + 1, : anchor + 1].clamp(min=0), mask_ids(masks)], dim=1)
            with attached(model, masks):
                plain = model.base_model(input_ids=ids).last_hidden_state[0, anchor + 1 :]
            # fp32, summed in another order over a packed row than over a short one: up to ~1.5e-5 apart
            torch.testing.assert_close(states[b, g], plain, rtol=1e-5, atol=5e-5)
    with attached(model, masks):
        packed = model.base_model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids.expand(2, -1),
            attention_mask=batch.attention_mask(model.dtype),
        ).last_hidden_state
    torch.testing.assert_close(packed[:, :18], model.base_model(input_ids=rows.clamp(min=0)).last_hidden_state)


def test_mask_batch_layout_and_targets():
    """Groups after every `every`-th position from the prompt's last; mask j of the group after t sits
    at position t + j and learns token t+1+j; past the row's end or on padding, IGNORE."""
    rows = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, -1, -1]])
    batch = mask_batch(rows, k=3, vocab_size=100, prompt_len=3, every=2)
    assert batch.anchors.tolist() == [2, 4]
    assert batch.input_ids[1].tolist() == [20, 21, 22, 23, 24, 25, 0, 0, 100, 101, 100, 101]
    assert batch.position_ids[0, 8:].tolist() == [3, 4, 5, 6]
    assert batch.targets.tolist() == [[[14, 15], [16, 17]], [[24, 25], [IGNORE, IGNORE]]]
    sees = batch.allowed.long()
    assert sees[4, :5].tolist() == [1] * 5 and sees[4, 5:].sum() == 0  # a real token: its prefix only
    assert sees[9].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0]  # mask 2 after position 2
    assert sees[10].tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0]  # mask 1 after position 4
    with pytest.raises(ValueError, match="no continuation"):
        mask_batch(rows, k=3, vocab_size=100, prompt_len=7)


def test_training_lowers_the_loss_on_the_base_models_own_text():
    """A few steps on a toy's greedy continuations, through a draft vocabulary and the chunked loss,
    lower every offset's loss; only the masks' weights move (the base is frozen, as in training)."""
    model = toy_model("llama").requires_grad_(False)
    prompt_len, k = 6, 4
    rows = torch.cat(
        [hf_greedy(model, make_prompt(prompt_len, 512, seed=s), 26, eos_token_id=NO_EOS) for s in range(6)]
    )
    token_map, _ = most_frequent(rows[:, prompt_len:], 512, 64)
    masks = build_masks(model, k=k, rank=8, draft_vocab=64)
    masks.token_map.copy_(token_map)
    projection, short = draft_projection(model.get_output_embeddings(), masks.token_map)
    batch = mask_batch(rows, k, masks.config.vocab_size, prompt_len)
    targets = short(batch.targets)
    counts = (batch.targets != IGNORE).sum(dim=(0, 1)).clamp(min=1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(masks.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        sums, _ = mask_loss(mask_states(model, masks, batch), targets, projection, chunk=64)
        per_offset = sums / counts
        per_offset.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(per_offset.detach())
    assert (losses[-1] < 0.7 * losses[0]).all(), (losses[0], losses[-1])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("arch", TOY_ARCHITECTURES)
@torch.no_grad()
def test_the_base_models_last_hidden_state_is_what_the_output_projection_reads(arch):
    """mask_states reads the base model's last hidden state, not the output projection's input: the
    same tensor on every toy architecture (final norms, OPT's project_out, NeoX's embed_out)."""
    model = tiny(arch)
    ids = make_prompt(6, 512)
    with decoder_output(model) as hidden:
        model(input_ids=ids)
    assert torch.equal(model.base_model(input_ids=ids).last_hidden_state, hidden[0])


def test_save_and_load_round_trip(tmp_path):
    """Weights, draft vocabulary and config come back; the loaded masks compute what the saved did."""
    model = tiny("gpt2")
    masks = trained_looking(model, draft_vocab=32)
    masks.token_map.copy_(torch.arange(100, 132))
    save_masks(masks, tmp_path / "masks")
    loaded = load_masks(tmp_path / "masks", model)
    assert loaded.config == masks.config
    assert all(torch.equal(a, b) for a, b in zip(masks.state_dict().values(), loaded.state_dict().values()))
    ids = torch.cat([make_prompt(6, 512), mask_ids(masks)], dim=1)
    with torch.no_grad():
        with attached(model, masks):
            want = logits(model, ids)
        with attached(model, loaded):
            assert torch.equal(logits(model, ids), want)


def test_a_damaged_or_foreign_save_is_one_clear_error(tmp_path):
    model = tiny("llama")
    save_masks(build_masks(model, k=3), tmp_path)
    with pytest.raises(CheckpointError, match="not describe masks for this model: masks made for an input embedding"):
        load_masks(tmp_path, tiny("llama", vocab=256))
    weights = tmp_path / MASKS_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{weights} is missing, corrupt or truncated"):
        load_masks(tmp_path, model)
    (tmp_path / MASKS_CONFIG).write_text("{")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        load_masks(tmp_path, model)
    with pytest.raises(CheckpointError, match="holds no masks.json"):
        load_masks(tmp_path / "none", model)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"k": 1}, "k must be an integer >= 2"),
        ({"rank": 0}, "rank must be an integer >= 1"),
        ({"alpha": float("nan")}, "alpha must be a positive number"),
        ({"draft_vocab": 600, "vocab_size": 512}, "draft_vocab must lie in"),
        ({"layers": "layers.0.mlp"}, "layers must be a list"),
    ],
)
def test_bad_settings_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        MasksConfig(**fields)


def test_bad_requests_are_refused_by_name():
    model = tiny("llama")
    with pytest.raises(ValueError, match="no linear layer 'lm_head' reads the decoder's tokens"):
        build_masks(model, layers=["lm_head"])
    masks = build_masks(model, k=3)
    with pytest.raises(ValueError, match="token id 514 is past the 2 mask ids 512..513"), attached(model, masks):
        logits(model, torch.tensor([[5, 514]]))
    with pytest.raises(ValueError, match="encoder-decoder: mask batches are built for causal LMs"):
        marian = tiny("marian")
        mask_states(marian, build_masks(marian, k=3), mask_batch(make_prompt(8, 512), 3, 512, 2))
