"""The DFlash block drafter: exact decoding with it on every toy causal architecture (chain, tree, ranked tree,
batch, sampling), and its training objective's blocks."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_cfg, make_prompt, pairs_cfg, vocab_size
from safetensors.torch import load_file, save_file
from test_batch import RANKED, causal_batch, check_rows, hf_batch, padded
from test_eagle3 import greedy_rows, rotary
from test_sampling import BUDGET, PROMPT, SETTINGS, SHOWN, homogeneity, reference, small
from test_train import Killed, kill_at

from blockdecode import BlockwiseLM, NgramDrafter, decode, make_plan
from blockdecode.cli import main
from blockdecode.core.hf import layer_inputs
from blockdecode.core.io import CheckpointError
from blockdecode.core.toy import TOY_ARCHITECTURES, TOY_SEQ2SEQ, toy_model
from blockdecode.decoding.sampling import sampling_settings
from blockdecode.drafters.dflash.config import config_for
from blockdecode.drafters.dflash.drafting import DFlashDrafter
from blockdecode.drafters.dflash.model import DFlash
from blockdecode.serving.export import export_heads
from blockdecode.training.dflash import mask_token
from blockdecode.training.train import train

K = 6
BLOCK = 6


@torch.no_grad()
def base_argmax(base, rows: torch.LongTensor, layers) -> tuple[torch.Tensor, torch.Tensor]:
    with layer_inputs(base, layers) as aux:
        logits = base(input_ids=rows).logits
    return aux[0].float(), logits.argmax(-1)


def fitted(base, steps=80, draft_vocab=0, seed=0, layers=1, shared=False, rows=None) -> DFlash:
    """A drafter trained briefly on the base's greedy text, so that its blocks often stand, and sometimes do not."""
    torch.manual_seed(seed)
    vocab = vocab_size(base)
    shape = config_for(base, draft_vocab or vocab, vocab - 1, block_size=BLOCK, layers=layers, shared_head=shared)
    drafter = DFlash(shape)
    rows = greedy_rows(base) if rows is None else rows
    if draft_vocab:
        drafter.set_vocabulary(rows.flatten().bincount(minlength=vocab).topk(draft_vocab).indices)
    features, argmax = base_argmax(base, rows, drafter.config.target_layer_ids)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss, _ = drafter.loss(base, features, rows, argmax, anchors=8, gamma=4.0, generator=generator)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return drafter.eval()


def drafter_for(base, **kw) -> DFlashDrafter:
    return DFlashDrafter(fitted(base, **kw), base)


@pytest.mark.parametrize("arch", TOY_ARCHITECTURES)
def test_chain_and_trees_are_transformers_greedy(arch: str) -> None:
    base = toy_model(arch, layers=4)
    model = fitted(base)
    blocks = []
    for seed in (0, 1, 99):  # two prompts it learnt, one it did not
        ids = make_prompt(10, 512, seed=seed)
        ref = hf_greedy(base, ids, 64, eos_token_id=NO_EOS)
        for tree in (None, 12):
            plan = make_plan(base, DFlashDrafter(model, base), K, tree, eos_token_id=NO_EOS)
            out = decode(base, ids, 64, plan)
            assert_greedy_equal(base, ids, out.sequences, ref, what=f"{arch} tree={tree} seed {seed}")
            blocks += zip(out.stats.block_sizes, out.stats.verified) if tree is None else []
        drafters = [NgramDrafter(), DFlashDrafter(model, base)]
        out = decode(base, ids, 64, make_plan(base, drafters, K, 16, eos_token_id=NO_EOS, ranking=RANKED))
        assert_greedy_equal(base, ids, out.sequences, ref, what=f"{arch} ranked seed {seed}")
    assert max(b for b, _ in blocks) >= 3, "the drafter should be right for several tokens at times"
    assert any(b < v for b, v in blocks), "and wrong at others"


def test_a_batch_is_transformers_batched_greedy() -> None:
    model, prompts, ids, mask, ref = causal_batch("llama", new=24)
    plan = make_plan(model, drafter_for(model, layers=2, rows=ref), K, eos_token_id=NO_EOS)  # learnt its text
    out = decode(model, ids, 24, plan, attention_mask=mask)
    check_rows(model, prompts, mask, out.sequences, ref, what="dflash batch")
    assert max(b for s in out.row_stats for b in s.block_sizes) > 1


def test_a_draft_vocabulary_maps_back_to_the_bases_ids() -> None:
    base = toy_model("llama", layers=4)
    ids = make_prompt(10, 512, seed=2)
    plan = make_plan(base, drafter_for(base, draft_vocab=64), K, eos_token_id=NO_EOS)
    out = decode(base, ids, 32, plan)
    assert_greedy_equal(base, ids, out.sequences, hf_greedy(base, ids, 32, eos_token_id=NO_EOS))
    assert out.stats.mean_block_size > 1.2


def test_sampling_matches_transformers_in_distribution() -> None:
    model = small()
    setting = "t1.3-k5-p0.8"
    sampling = sampling_settings(model, True, **SETTINGS[setting])
    plan = make_plan(model, drafter_for(model, steps=40), 3, sampling=sampling)
    generator, samples = torch.Generator().manual_seed(0), Counter()
    for _ in range(600):
        new = decode(model, PROMPT, BUDGET[setting], plan, generator=generator).sequences[0, PROMPT.shape[1] :]
        samples[tuple((new.tolist() + [1] * SHOWN)[:SHOWN])] += 1  # as transformers pads a finished row
    assert homogeneity(samples, reference(setting)) > 1e-3


def test_one_pass_guesses_what_each_block_of_the_training_pass_does() -> None:
    """Drafting's pass (context entries, then one block) and training's (every block at once, block-sparse)
    compute the same logits for the same anchor: the masks keep each block to its own context."""
    base = toy_model("llama", layers=4)
    model = fitted(base, steps=5)
    rows = greedy_rows(base)[:1]
    features, _ = base_argmax(base, rows, model.config.target_layer_ids)
    embed = base.get_input_embeddings()
    with torch.no_grad():
        for a in (5, 20, 40):
            context = model.context(features[:, :a], torch.arange(a)[None])
            embeds, positions = model.blocks(embed, rows, torch.tensor([[a]]))
            alone = model(embeds, positions, context)
            starts = torch.tensor([[3, a, 50]])
            embeds, positions = model.blocks(embed, rows, starts)
            length = rows.shape[1]
            full = model.context(features, torch.arange(length)[None])
            block = torch.arange(3).repeat_interleave(BLOCK)
            sees = torch.arange(length) < starts.repeat_interleave(BLOCK, dim=1)[..., None]
            mask = torch.cat([sees, (block[:, None] == block[None, :])[None]], dim=-1)[:, None]
            together = model(embeds, positions, full, mask)[:, BLOCK : 2 * BLOCK]
            torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)


def test_a_drafter_sharing_the_bases_output_layer_drafts_over_its_vocabulary() -> None:
    base = toy_model("qwen2", layers=4)
    model = fitted(base, shared=True)
    assert not hasattr(model, "lm_head")  # z-lab's design: the base's output layer, not a copy
    ids = make_prompt(10, 512, seed=1)
    out = decode(base, ids, 32, make_plan(base, DFlashDrafter(model, base), K, eos_token_id=NO_EOS))
    assert_greedy_equal(base, ids, out.sequences, hf_greedy(base, ids, 32, eos_token_id=NO_EOS))
    assert out.stats.mean_block_size > 1.2


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[BlockwiseLM, Path]:
    base = toy_model("llama", layers=4)
    lm = BlockwiseLM.from_base(base, k=K)
    lm.attach_dflash(fitted(base, steps=30))
    folder = tmp_path_factory.mktemp("dflash") / "model"
    lm.save_pretrained(folder)
    return lm, folder


def test_a_saved_model_keeps_its_drafter_and_decodes_with_it_by_name(saved) -> None:
    lm, folder = saved
    again = BlockwiseLM.from_pretrained(folder)
    assert again.dflash is not None and again.dflash.config == lm.dflash.config
    for name, t in lm.dflash.state_dict().items():
        assert torch.equal(t, again.dflash.state_dict()[name]), name
    ids = make_prompt(10, 512, seed=0)
    out = again.generate(ids, 32, drafter="dflash", k=K, tree=None, eos_token_id=NO_EOS)
    assert_greedy_equal(again.base, ids, out.sequences, hf_greedy(again.base, ids, 32, eos_token_id=NO_EOS))
    assert out.stats.mean_block_size > 1.2


@pytest.mark.parametrize("shared", [False, True])
def test_both_layouts_read_back_what_they_wrote(tmp_path, shared: bool) -> None:
    base = toy_model("llama", layers=4)
    model = fitted(base, steps=2, draft_vocab=0 if shared else 64, shared=shared)
    layout = "dflash" if shared else "speculators"
    model.save(tmp_path / layout, layout)
    config = json.loads((tmp_path / layout / "config.json").read_text())
    if shared:  # z-lab's ids are layers' outputs: vLLM's input id L is z-lab's L - 1
        assert config["dflash_config"]["target_layer_ids"] == [i - 1 for i in model.config.target_layer_ids]
        assert config["architectures"] == ["DFlashDraftModel"] and config["num_target_layers"] == 4
    else:
        assert config["speculators_model_type"] == "dflash" and config["draft_vocab_size"] == 64
    again = DFlash.load(tmp_path / layout)
    assert replace(again.config, verifier={}) == replace(model.config, verifier={})
    for name, t in model.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda f: (f / "config.json").unlink(), "config.json is missing"),
        (lambda f: (f / "config.json").write_text("{"), "config.json is corrupt"),
        (lambda f: (f / "model.safetensors").write_bytes(b"\0" * 10), "corrupt or truncated"),
        (lambda f: _edit(f, lambda t: t.pop("norm.weight")), "lacks the tensor norm.weight"),
        (lambda f: _edit(f, lambda t: t.update({"fc.weight": t["fc.weight"][:, :3].clone()})), "fc.weight has"),
        (lambda f: _edit(f, lambda t: t["norm.weight"].fill_(float("nan"))), "not finite"),
    ],
)
def test_a_damaged_drafter_is_refused_in_one_line(saved, tmp_path, damage, match) -> None:
    _, folder = saved
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    damage(copy / "dflash")
    with pytest.raises(CheckpointError, match=match):
        BlockwiseLM.from_pretrained(copy)


def _edit(folder: Path, change) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_a_drafter_for_another_base_is_refused(saved) -> None:
    lm, folder = saved
    other = BlockwiseLM.from_base(toy_model("llama", layers=4, width=96), k=K)
    with pytest.raises(CheckpointError, match="the DFlash drafter was built for an embedding width of 64"):
        other.attach_dflash(folder / "dflash")


def trained_and_resumed(cfg, tmp_path: Path) -> Path:
    """A run trained whole (`cfg(out, **settings)`) in tmp_path/a, and the same run killed at step 6 and resumed in
    tmp_path/b: the two drafters must be the same. Returns a."""
    a, b = tmp_path / "a", tmp_path / "b"
    train(cfg(a))
    with pytest.raises(Killed):
        train(cfg(b), callback=kill_at(6))
    train(cfg(b, resume=True))
    first, resumed = (load_file(str(out / "dflash" / "model.safetensors")) for out in (a, b))
    for name, t in first.items():
        torch.testing.assert_close(resumed[name], t, atol=1e-6, rtol=0, msg=name)
    return a


# ----------------------------------------------------------------------------------------- encoder-decoders


def fitted_pairs(base, sources: list[torch.LongTensor], steps: int = 120) -> DFlash:
    """A drafter trained briefly on the decoder's greedy translations of `sources`, reading the decoder's layers."""
    torch.manual_seed(0)
    vocab = vocab_size(base)
    drafter = DFlash(config_for(base, vocab, vocab - 1, block_size=BLOCK, layers=1))
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    cases = []
    for source in sources:
        rows = hf_greedy(base, source, 40, eos_token_id=NO_EOS)
        with torch.no_grad(), layer_inputs(base, drafter.config.target_layer_ids) as aux:
            logits = base(input_ids=source, decoder_input_ids=rows).logits
        cases.append((aux[0].float(), rows, logits.argmax(-1)))
    for step in range(steps):
        features, rows, argmax = cases[step % len(cases)]
        loss, _ = drafter.loss(base, features, rows, argmax, anchors=8, gamma=4.0, generator=generator)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return drafter.eval()


@pytest.mark.parametrize("arch", TOY_SEQ2SEQ)
def test_an_encoder_decoder_drafts_from_its_decoders_layers_exactly(arch: str) -> None:
    """The decoder's features, the source encoded once: chains, trees (where the model scores one) and a ranked tree
    give `generate`'s decoder tokens, and blocks it learnt stand for several tokens."""
    base = toy_model(arch, layers=4, seed=1)
    sources = [make_prompt(9, vocab_size(base), seed=seed) for seed in (0, 1)]
    model = fitted_pairs(base, sources)
    blocks = []
    for source in [*sources, make_prompt(9, vocab_size(base), seed=7)]:  # two it learnt, one it did not
        ref = hf_greedy(base, source, 40, eos_token_id=NO_EOS)
        for tree in (None, 12) if arch != "t5" else (None,):  # T5's relative positions score no tree
            plan = make_plan(base, DFlashDrafter(model, base), K, tree, eos_token_id=NO_EOS)
            out = decode(base, source, 40, plan)
            assert_greedy_equal(base, source, out.sequences, ref, what=f"{arch} tree={tree}")
            blocks += out.stats.block_sizes
        if arch != "t5":
            drafters = [NgramDrafter(), DFlashDrafter(model, base)]
            out = decode(base, source, 40, make_plan(base, drafters, K, 16, eos_token_id=NO_EOS, ranking=RANKED))
            assert_greedy_equal(base, source, out.sequences, ref, what=f"{arch} ranked")
    assert max(blocks) >= 3, "the drafter should be right for several tokens where it learnt the translation"


def test_an_encoder_decoder_batch_drafts_each_row_from_its_own_features() -> None:
    base = toy_model("marian", layers=4, seed=1)
    prompts = [make_prompt(n, vocab_size(base), seed=n) for n in (3, 9, 14)]
    model = fitted_pairs(base, prompts)
    ids, mask = padded(prompts, base.generation_config.pad_token_id, left=False)
    ref = hf_batch(base, ids, mask, 24, eos=NO_EOS)
    out = decode(base, ids, 24, make_plan(base, DFlashDrafter(model, base), K, eos_token_id=NO_EOS),
                 attention_mask=mask)  # fmt: skip
    check_rows(base, prompts, mask, out.sequences, ref, NO_EOS, what="marian dflash batch")
    assert max(b for s in out.row_stats for b in s.block_sizes) > 1


@pytest.mark.filterwarnings("ignore:left out")
def test_an_encoder_decoder_trains_a_drafter_that_decodes_its_translations(tiny_marian, tmp_path) -> None:
    """`train --head-type dflash` on pairs: distilled translations, cached decoder features, resumable; the saved
    model decodes with drafter="dflash" exactly."""
    kw = dict(head_type="dflash", mode="distill", k=5, steps=8, checkpoint_every=4, anchors=4, eval_every=4)
    kw |= dict(feature_cache=str(tmp_path / "features"))
    a = trained_and_resumed(lambda out, **more: pairs_cfg(tiny_marian, out, **kw, **more), tmp_path)
    record = json.loads((a / "blockdecode.json").read_text())["training"]
    assert record["head_type"] == "dflash" and record["mean_block_size"] >= 1.0
    loaded = BlockwiseLM.from_pretrained(a)
    assert loaded.base.config.is_encoder_decoder and loaded.dflash.config.block_size == 5
    source = tiny_marian.tokenizer("In the beginning was the Word.", return_tensors="pt").input_ids
    for tree in (None, "default"):
        out = loaded.generate(source, 30, drafter="dflash", tree=tree)
        assert_greedy_equal(loaded.base, source, out.sequences, hf_greedy(loaded.base, source, 30), what=f"{tree}")
    with pytest.raises(ValueError, match="dflash serves decoder-only models, and this base is an encoder-decoder"):
        export_heads(loaded, tmp_path / "export", "dflash")  # no engine serves an encoder-decoder's drafter


# ------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_training_resumes_exactly_and_saves_a_model_that_decodes(tiny_base, tmp_path, draft_vocab: int) -> None:
    kw = dict(head_type="dflash", mode="distill", draft_vocab=draft_vocab, k=5, steps=8, checkpoint_every=4)
    kw |= dict(log_every=1, eval_every=100, anchors=4, feature_cache=str(tmp_path / "features"))
    a = trained_and_resumed(lambda out, **more: make_cfg(tiny_base, out, **kw, **more), tmp_path)
    loaded = BlockwiseLM.from_pretrained(a)
    shape = loaded.dflash.config
    assert shape.block_size == 5 and shape.shared_head == (not draft_vocab)
    assert shape.draft_vocab_size == (draft_vocab or vocab_size(loaded.base))
    ids = tiny_base.sequences[:1, :16]
    out = loaded.generate(ids, 24, drafter="dflash", tree=None, eos_token_id=NO_EOS)
    assert_greedy_equal(loaded.base, ids, out.sequences, hf_greedy(loaded.base, ids, 24, eos_token_id=NO_EOS))
    record = json.loads((a / "blockdecode.json").read_text())["training"]
    assert record["head_type"] == "dflash" and record["steps"] == 8 and (a / "training.png").is_file()


def test_the_mask_is_an_id_the_rows_never_use() -> None:
    rows = torch.tensor([[0, 1, 2, 3, -1], [3, 2, 1, 0, 5]])
    assert mask_token(rows, 8) == 7  # 4, 6 and 7 are unused: the highest
    assert mask_token(torch.arange(8)[None].repeat(2, 1), 8) == 7  # all used as often


# ------------------------------------------------------------------ an independent reader of the exports


def reader_chain(folder: Path, base, tokens: list[int]) -> list[int]:
    """vLLM's DFlash drafting, from an export's files alone (either layout) and the base's hidden states as the
    layout names them: the context's keys and values precomputed (hidden_norm(fc(features)), each layer's k/v
    projections, k_norm, rotary), then the block [newest, mask, ...] through every layer, attending to the
    context and to the whole block, and the argmax of every mask through the head (its own, or the base's)."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    if cfg.get("speculators_model_type") == "dflash":
        layer, states_at = cfg["transformer_layer_config"], cfg["aux_hidden_state_layer_ids"]  # inputs of layers
        block, mask = cfg["block_size"], cfg["mask_token_id"]
    else:  # z-lab: layers' outputs, hidden_states[id + 1]
        layer, states_at = cfg, [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
        block, mask = cfg["block_size"], cfg["dflash_config"]["mask_token_id"]
    eps, heads, kv = layer["rms_norm_eps"], layer["num_attention_heads"], layer["num_key_value_heads"]
    d, theta = layer["head_dim"], layer["rope_theta"]
    head = w["lm_head.weight"] if "lm_head.weight" in w else base.get_output_embeddings().weight.float()

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    with torch.no_grad():
        states = base(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        context = norm(torch.cat([states[i][0] for i in states_at], -1) @ w["fc.weight"].T, w["hidden_norm.weight"])
        n = context.shape[0]
        x = base.get_input_embeddings()(torch.tensor([tokens[-1]] + [mask] * (block - 1))).float()
        where = torch.arange(n, n + block)
        for i in range(layer["num_hidden_layers"]):
            p = f"layers.{i}."
            ctx_k = rotary(
                norm((context @ w[p + "self_attn.k_proj.weight"].T).view(n, kv, d), w[p + "self_attn.k_norm.weight"]),
                torch.arange(n),
                theta,
            )
            ctx_v = (context @ w[p + "self_attn.v_proj.weight"].T).view(n, kv, d)
            h = norm(x, w[p + "input_layernorm.weight"])
            q = rotary(
                norm((h @ w[p + "self_attn.q_proj.weight"].T).view(block, heads, d), w[p + "self_attn.q_norm.weight"]),
                where,
                theta,
            )
            k = rotary(
                norm((h @ w[p + "self_attn.k_proj.weight"].T).view(block, kv, d), w[p + "self_attn.k_norm.weight"]),
                where,
                theta,
            )
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(block, kv, d)
            k, v = (
                torch.cat([ctx_k, k]).repeat_interleave(heads // kv, 1),
                torch.cat([ctx_v, v]).repeat_interleave(heads // kv, 1),
            )
            scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5  # no mask: the block sees the context and itself
            x = (
                torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(block, -1)
                @ w[p + "self_attn.o_proj.weight"].T
                + x
            )
            m = norm(x, w[p + "post_attention_layernorm.weight"])
            x = (
                torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
            ) @ w[p + "mlp.down_proj.weight"].T + x
        draft = (norm(x[1:], w["norm.weight"]) @ head.T).argmax(-1)
        return (draft + w["d2t"].long()[draft] if "d2t" in w else draft).tolist()


class Recording(DFlashDrafter):
    """The drafter, keeping each chain it proposed with the sequence it was proposed after."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen: list[tuple[list[int], list[int]]] = []

    def _chain(self, row, tokens, n):
        scored = super()._chain(row, tokens, n)
        self.seen.append((tokens[0].tolist(), scored.tokens))
        return scored


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    """Two models, one with a drafter over a draft vocabulary, one sharing the base's output layer, each saved and
    exported in every format it can be."""
    root = tmp_path_factory.mktemp("dflash-export")
    folders = {}
    for name, kw in (("own", {"draft_vocab": 128}), ("shared", {"shared": True, "layers": 2})):
        lm = BlockwiseLM.from_base(toy_model("qwen2", layers=4), k=K)
        lm.attach_dflash(fitted(lm.base, **kw))
        lm.save_pretrained(root / name)
        folders[name] = root / name
        for fmt in ("speculators", "dflash") if name == "shared" else ("speculators",):
            folders[f"{name}-{fmt}"] = root / f"{name}-{fmt}"
            export_heads(BlockwiseLM.from_pretrained(root / name), folders[f"{name}-{fmt}"], fmt)
    return folders


@pytest.mark.parametrize("export", ["own-speculators", "shared-speculators", "shared-dflash"])
def test_an_independent_reader_of_the_export_proposes_what_blockdecode_does(exported, export: str) -> None:
    lm = BlockwiseLM.from_pretrained(exported[export.split("-")[0]])
    drafter = Recording(DFlash.load(exported[export]), lm.base)
    for seed in range(12):
        ids = make_prompt(8 + seed % 5, 512, seed=100 + seed)
        decode(lm.base, ids, 24, make_plan(lm.base, drafter, K, eos_token_id=NO_EOS))
    assert len(drafter.seen) > 20
    disagree = [(t, c) for t, c in drafter.seen if reader_chain(exported[export], lm.base, t)[: len(c)] != c]
    assert not disagree, f"{len(disagree)} of {len(drafter.seen)} chains differ, first after {disagree[0][0]}"


def test_the_exports_hold_every_field_the_engines_read(exported) -> None:
    zlab = json.loads((exported["shared-dflash"] / "config.json").read_text())
    assert zlab["architectures"] == ["DFlashDraftModel"] and zlab["block_size"] == K
    assert zlab["num_target_layers"] == 4 and set(zlab["dflash_config"]) == {"target_layer_ids", "mask_token_id"}
    tensors = load_file(str(exported["shared-dflash"] / "model.safetensors"))
    assert "lm_head.weight" not in tensors and "d2t" not in tensors and "layers.1.self_attn.q_norm.weight" in tensors
    spec = json.loads((exported["own-speculators"] / "config.json").read_text())
    assert spec["speculators_model_type"] == "dflash" and spec["draft_vocab_size"] == 128
    assert spec["sample_from_anchor"] is False and spec["block_size"] == K and spec["aux_hidden_state_layer_ids"]
    proposal = spec["speculators_config"]["proposal_methods"][0]
    assert (
        proposal["speculative_tokens"] == K - 1
        and (exported["own-speculators"] / spec["speculators_config"]["verifier"]["name_or_path"]).is_dir()
    )
    own = load_file(str(exported["own-speculators"] / "model.safetensors"))
    assert own["lm_head.weight"].shape[0] == 128 and int(own["t2d"].sum()) == 128


def test_an_export_the_format_cannot_hold_is_refused_in_one_line(exported, tmp_path) -> None:
    lm = BlockwiseLM.from_pretrained(exported["own"])
    with pytest.raises(ValueError, match="z-lab's DFlash layout drafts through the base's output layer"):
        export_heads(lm, tmp_path / "a", "dflash")
    with pytest.raises(ValueError, match="eagle3 holds an EAGLE-3 drafter, and this model has none"):
        export_heads(lm, tmp_path / "b", "eagle3")
    with pytest.raises(
        ValueError, match="eagle3 does not hold a dflash drafter: choose --format speculators or dflash"
    ):
        export_heads(lm, tmp_path / "c", "eagle3", drafter="dflash")
    assert not any(tmp_path.iterdir())


def test_the_command_line_exports_and_prints_the_serving_commands(exported, tmp_path, capsys) -> None:
    main(["export", "--model", str(exported["shared"]), "--format", "dflash", "--out", str(tmp_path / "out")])
    said = capsys.readouterr().out
    assert "exported a DFlash drafter (dflash, blocks of 6)" in said
    assert '"method": "dflash"' in said and '"num_speculative_tokens": 5' in said
    assert "--speculative-algorithm DFLASH" in said and "--speculative-num-draft-tokens 6" in said
