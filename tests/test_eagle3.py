"""The EAGLE-3 drafter: exact decoding with it on every toy causal architecture (chain, tree, batch, sampling),
its training (resumed exactly, saved and loaded), its exports against a reader written from the formats alone,
and the refusals."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_cfg, make_prompt, vocab_size
from safetensors.torch import load_file, save_file
from test_batch import RANKED, causal_batch, check_rows
from test_sampling import BUDGET, PROMPT, SETTINGS, SHOWN, homogeneity, reference, small
from test_train import TWO_PROCESS_SCRIPT, Killed, kill_at, launch_two
from transformers import AutoConfig

from blockdecode import BlockwiseLM, NgramDrafter, decode, make_plan
from blockdecode.cli import main
from blockdecode.core.hf import layer_inputs
from blockdecode.core.io import CheckpointError
from blockdecode.core.toy import TOY_ARCHITECTURES, toy_model
from blockdecode.decoding.sampling import sampling_settings
from blockdecode.drafters.eagle3.config import config_for, default_aux_layers
from blockdecode.drafters.eagle3.drafting import Eagle3Drafter
from blockdecode.drafters.eagle3.model import Eagle3, ttt_loss
from blockdecode.serving.export import export_heads
from blockdecode.training.eagle3 import Eagle3Objective
from blockdecode.training.train import train

K = 5


PROMPTS = 6  # the decodes below start from make_prompt(10, 512, seed) for these seeds


@torch.no_grad()
def greedy_rows(base, new: int = 48) -> torch.LongTensor:
    """The base's own greedy continuations of the prompts the tests decode (what a drafter learns to guess: here,
    the very text it will be asked for, so that long blocks stand as well as short ones)."""
    vocab = vocab_size(base)
    prompts = torch.cat([make_prompt(10, vocab, seed=seed) for seed in range(PROMPTS)])
    return hf_greedy(base, prompts, new, min_new_tokens=new)


def fitted(base, steps: int = 80, draft_vocab: int = 0, aux_layers=None, seed: int = 0) -> Eagle3:
    """A drafter trained briefly on the base's greedy text (the training-time test over k-1 steps), so that its
    guesses often stand and the decodes below accept long blocks as well as reject."""
    torch.manual_seed(seed)
    vocab = vocab_size(base)
    drafter = Eagle3(config_for(base, draft_vocab or vocab, aux_layers, k=K))
    rows = greedy_rows(base)
    if draft_vocab:
        drafter.set_vocabulary(rows.flatten().bincount(minlength=vocab).topk(draft_vocab).indices)
    objective = Eagle3Objective(drafter, base)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        sums, tallies = objective(rows, steps=K - 1)
        ttt_loss(sums, tallies[:, 1]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return drafter.eval()


def with_drafter(arch: str, **kw) -> BlockwiseLM:
    base = toy_model(arch, layers=4)
    lm = BlockwiseLM.from_base(base, k=K)
    lm.attach_eagle3(fitted(base, **kw))
    return lm


def test_the_layers_read_are_vllms_where_distinct() -> None:
    assert default_aux_layers(32) == (2, 16, 29)  # Llama-3.1-8B's, as vLLM picks them
    assert default_aux_layers(4) == (1, 2, 3)  # vLLM's rule gives (2, 2, 1) here
    assert default_aux_layers(3) == (0, 1, 2)
    assert default_aux_layers(1) == (0, 0, 0)
    base = toy_model("llama", layers=4)
    with pytest.raises(ValueError, match="three distinct layers where the base has 4, got \\[2, 2, 2\\]"):
        config_for(base, 64, (2, 2, 2))
    assert config_for(toy_model("llama", layers=2), 64, (0, 1, 1)).aux_layers == (0, 1, 1)  # a shallow base repeats


@pytest.mark.parametrize("arch", TOY_ARCHITECTURES)
def test_chain_and_tree_are_transformers_greedy(arch: str) -> None:
    lm = with_drafter(arch)
    blocks = []
    for seed in (0, 1, 99):  # two prompts it learnt, one it did not
        ids = make_prompt(10, 512, seed=seed)
        ref = hf_greedy(lm.base, ids, 64, eos_token_id=NO_EOS)  # past the 48 tokens it learnt: there it errs
        for tree in (None, 12):
            out = lm.generate(ids, 64, drafter="eagle3", k=K, tree=tree, eos_token_id=NO_EOS)
            assert_greedy_equal(lm.base, ids, out.sequences, ref, what=f"{arch} tree={tree} seed {seed}")
            blocks += zip(out.stats.block_sizes, out.stats.verified) if tree is None else []
        ranked = make_plan(lm.base, [NgramDrafter(), lm.eagle3_drafter()], K, 16, eos_token_id=NO_EOS, ranking=RANKED)
        out = decode(lm.base, ids, 64, ranked)  # a tree ranked by the drafters' chances, n-gram lookup's beside
        assert_greedy_equal(lm.base, ids, out.sequences, ref, what=f"{arch} ranked seed {seed}")
    assert max(b for b, _ in blocks) >= 3, "the drafter should be right for several tokens at times"
    assert any(b < v for b, v in blocks), "and wrong at others"


def test_a_batch_is_transformers_batched_greedy() -> None:
    model, prompts, ids, mask, ref = causal_batch("llama", new=24)
    lm = BlockwiseLM.from_base(model, k=K)
    lm.attach_eagle3(fitted(model))
    plan = make_plan(model, lm.eagle3_drafter(), K, eos_token_id=NO_EOS)
    out = decode(model, ids, 24, plan, attention_mask=mask)
    check_rows(model, prompts, mask, out.sequences, ref, what="eagle3 batch")
    assert max(b for s in out.row_stats for b in s.block_sizes) > 1


def test_a_draft_vocabulary_maps_back_to_the_bases_ids() -> None:
    lm = with_drafter("llama", draft_vocab=64)
    ids = make_prompt(10, 512, seed=PROMPTS - 1)
    out = lm.generate(ids, 32, drafter="eagle3", k=K, tree=None, eos_token_id=NO_EOS)
    assert_greedy_equal(lm.base, ids, out.sequences, hf_greedy(lm.base, ids, 32, eos_token_id=NO_EOS))
    assert out.stats.mean_block_size > 1.2


def test_sampling_matches_transformers_in_distribution() -> None:
    model = small()
    drafter = Eagle3Drafter(fitted(model, steps=40), model.get_input_embeddings())
    setting = "t1.3-k5-p0.8"
    plan = make_plan(model, drafter, 3, sampling=sampling_settings(model, True, **SETTINGS[setting]))
    generator, samples = torch.Generator().manual_seed(0), Counter()
    for _ in range(600):
        new = decode(model, PROMPT, BUDGET[setting], plan, generator=generator).sequences[0, PROMPT.shape[1] :]
        samples[tuple((new.tolist() + [1] * SHOWN)[:SHOWN])] += 1  # as transformers pads a finished row
    assert homogeneity(samples, reference(setting)) > 1e-3


# ------------------------------------------------------------------ an independent reader of the exports


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, d] at positions [T], the halves convention Llama and vLLM use."""
    d = x.shape[-1]
    freqs = torch.outer(positions.float(), 1.0 / theta ** (torch.arange(0, d, 2).float() / d))
    cos, sin = freqs.cos().repeat(1, 2)[:, None], freqs.sin().repeat(1, 2)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def reader_chain(folder: Path, base, tokens: list[int], n: int) -> list[int]:
    """vLLM's EAGLE-3 drafting, from an export's files alone and the base's hidden states as vLLM gathers them
    (hidden_states[L] is the input of layer L): every entry recomputed from scratch each step, no cache."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {
        k.replace("midlayer.", "layers.0."): v.float() for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    if cfg.get("speculators_model_type") == "eagle3":
        layer, ids = cfg["transformer_layer_config"], cfg["eagle_aux_hidden_state_layer_ids"]
    else:
        layer, ids = cfg, cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    eps, heads, kv = layer["rms_norm_eps"], layer["num_attention_heads"], layer["num_key_value_heads"]
    d, theta = layer["head_dim"], layer["rope_parameters"]["rope_theta"]

    def norm(x, name):
        return w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    with torch.no_grad():
        states = base(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        hidden = torch.cat([states[i][0] for i in ids], dim=-1) @ w["fc.weight"].T
        embed = base.get_input_embeddings().weight.float()
        inputs, positions, out = list(tokens[1:]), list(range(len(tokens) - 1)), []
        for _ in range(n):
            p = "layers.0."
            x = torch.cat(
                [norm(embed[inputs], p + "input_layernorm.weight"), norm(hidden, p + "hidden_norm.weight")], -1
            )
            pos = torch.tensor(positions)
            q = rotary((x @ w[p + "self_attn.q_proj.weight"].T).view(len(pos), heads, d), pos, theta)
            k = rotary((x @ w[p + "self_attn.k_proj.weight"].T).view(len(pos), kv, d), pos, theta)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(len(pos), kv, d)
            k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
            scores = scores.masked_fill(torch.ones(len(pos), len(pos)).triu(1).bool(), float("-inf"))
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(pos), -1)
            h = attended @ w[p + "self_attn.o_proj.weight"].T + (
                norm(hidden, p + "hidden_norm.weight") if cfg.get("norm_before_residual") else hidden
            )
            m = norm(h, p + "post_attention_layernorm.weight")
            h = (
                torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
            ) @ w[p + "mlp.down_proj.weight"].T + h
            draft = int((norm(h[-1], "norm.weight") @ w["lm_head.weight"].T).argmax())
            token = draft + int(w["d2t"][draft])
            out.append(token)
            inputs, positions = inputs + [token], positions + [positions[-1] + 1]
            hidden = torch.cat([hidden, h[-1:]])
    return out


class Recording(Eagle3Drafter):
    """The drafter, keeping each chain it proposed with the sequence it was proposed after."""

    def __init__(self, *args):
        super().__init__(*args, min_prob=0.0)
        self.seen: list[tuple[list[int], list[int]]] = []

    def _chain(self, row, tokens, n):
        scored = super()._chain(row, tokens, n)
        self.seen.append((tokens[0].tolist(), scored.tokens))
        return scored


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[BlockwiseLM, dict[str, Path]]:
    """A model with a trained drafter, saved (folders["model"]) and exported in both formats."""
    lm = BlockwiseLM.from_base(toy_model("llama", layers=4), k=K)
    lm.attach_eagle3(fitted(lm.base, draft_vocab=128))
    root = tmp_path_factory.mktemp("eagle3")
    lm.save_pretrained(root / "model")
    lm.base_location = str(root / "model")
    for fmt in ("speculators", "eagle3"):
        export_heads(lm, root / fmt, fmt)
    return lm, {name: root / name for name in ("model", "speculators", "eagle3")}


@pytest.mark.parametrize("fmt", ["speculators", "eagle3"])
def test_an_independent_reader_of_the_export_proposes_what_blockdecode_does(exported, fmt: str) -> None:
    lm, folders = exported
    drafter = Recording(Eagle3.load(folders[fmt]), lm.base.get_input_embeddings())
    for seed in range(20):
        ids = make_prompt(8 + seed % 5, 512, seed=100 + seed)
        decode(lm.base, ids, 24, make_plan(lm.base, drafter, K, eos_token_id=NO_EOS))
    assert len(drafter.seen) > 40
    disagree = [(t, c) for t, c in drafter.seen if reader_chain(folders[fmt], lm.base, t, len(c)) != c]
    assert not disagree, f"{len(disagree)} of {len(drafter.seen)} chains differ, first after {disagree[0][0]}"


def test_the_speculators_export_holds_every_field_vllm_reads(exported) -> None:
    lm, folders = exported
    cfg = json.loads((folders["speculators"] / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    for field in ("transformer_layer_config", "draft_vocab_size", "target_hidden_size", "norm_before_residual"):
        assert field in cfg
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    spec = cfg["speculators_config"]
    assert spec["default_proposal_method"] == "greedy" and spec["proposal_methods"][0]["speculative_tokens"] == K - 1
    assert (folders["speculators"] / spec["verifier"]["name_or_path"]).is_dir() and "speculators_version" in cfg
    tensors = load_file(str(folders["speculators"] / "model.safetensors"))
    width, vocab = lm.base.config.hidden_size, vocab_size(lm.base)
    assert tensors["fc.weight"].shape == (width, 3 * width)
    assert tensors["lm_head.weight"].shape == (128, width) and tensors["d2t"].dtype == torch.int64
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (vocab,) and int(tensors["t2d"].sum()) == 128
    targets = torch.arange(128) + tensors["d2t"]
    assert targets.min() >= 0 and targets.max() < vocab and tensors["t2d"][targets].all()
    assert any(name.startswith("layers.0.self_attn.q_proj") for name in tensors)
    original = load_file(str(folders["eagle3"] / "model.safetensors"))
    assert set(original) == {name.replace("layers.0.", "midlayer.") for name in tensors}


def test_a_saved_model_keeps_its_drafter(exported) -> None:
    lm, _ = exported
    again = BlockwiseLM.from_pretrained(exported[1]["model"])
    ids = make_prompt(9, 512, seed=1)
    a = lm.generate(ids, 20, drafter="eagle3", k=K, tree=None, eos_token_id=NO_EOS)
    b = again.generate(ids, 20, drafter="eagle3", k=K, tree=None, eos_token_id=NO_EOS)
    assert torch.equal(a.sequences, b.sequences) and a.stats.block_sizes == b.stats.block_sizes


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda t: t.pop("layers.0.mlp.up_proj.weight"), "lacks the tensor layers.0.mlp.up_proj.weight"),
        (lambda t: t.update({"fc.weight": t["fc.weight"][:, :-1].contiguous()}), "fc.weight has shape"),
        (lambda t: t.update({"d2t": t["d2t"] + 10_000}), "d2t maps draft ids outside"),
        (lambda t: t["norm.weight"].fill_(float("nan")), "not finite"),  # refused on loading, not mid-decode
    ],
)
def test_a_damaged_export_is_refused_in_one_line(exported, tmp_path, damage, match) -> None:
    _, folders = exported
    folder = tmp_path / "damaged"
    folder.mkdir()
    (folder / "config.json").write_text((folders["speculators"] / "config.json").read_text())
    tensors = load_file(str(folders["speculators"] / "model.safetensors"))
    damage(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=match) as err:
        Eagle3.load(folder)
    assert str(folder / "model.safetensors") in str(err.value) and "\n" not in str(err.value)


def test_a_drafter_for_another_base_is_refused(exported) -> None:
    _, folders = exported
    other = BlockwiseLM.from_base(toy_model("llama", layers=4, vocab=300), k=K)
    with pytest.raises(CheckpointError, match="built for a vocabulary of 512, the base's is 300"):
        other.attach_eagle3(folders["speculators"])


def test_an_encoder_decoder_is_refused_in_one_line() -> None:
    marian = toy_model("marian")
    lm = BlockwiseLM.from_base(marian, k=K)
    drafter = Eagle3Drafter(Eagle3(config_for(marian, 64)), marian.get_input_embeddings())
    with pytest.raises(ValueError, match="reads a decoder-only base's layers.*encoder-decoder"):
        make_plan(lm.base, drafter, K)


def test_without_features_the_drafter_says_where_it_proposes() -> None:
    base = toy_model("llama", layers=4)
    drafter = Eagle3Drafter(Eagle3(config_for(base, 64)), base.get_input_embeddings())
    with pytest.raises(ValueError, match="propose inside a decode"):
        drafter.propose(make_prompt(6, 512), None, 3)


# ------------------------------------------------------------------------------------------- training


def test_training_resumes_exactly_and_saves_a_model_that_decodes(tiny_base, tmp_path, monkeypatch) -> None:
    """Resumed with the same settings spelt otherwise: the base as a relative path, the default layers named."""
    kw = dict(head_type="eagle3", mode="distill", draft_vocab=64, steps=8, checkpoint_every=4, log_every=1)
    kw |= dict(eval_every=100, feature_cache=str(tmp_path / "features"))
    a, b = tmp_path / "a", tmp_path / "b"
    train(make_cfg(tiny_base, a, **kw))
    with pytest.raises(Killed):
        train(make_cfg(tiny_base, b, **kw), callback=kill_at(6))
    monkeypatch.chdir(Path(tiny_base.dir).parent)
    layers = list(default_aux_layers(AutoConfig.from_pretrained(tiny_base.dir).num_hidden_layers))
    spelt = dict(base=Path(tiny_base.dir).name, aux_layers=layers)
    with pytest.raises(ValueError, match="has aux_layers=None, this run asks for \\[0, 0, 0\\]"):
        train(make_cfg(tiny_base, b, resume=True, **kw | spelt | dict(aux_layers=[0, 0, 0])))
    train(make_cfg(tiny_base, b, resume=True, **kw | spelt))
    first, resumed = (load_file(str(out / "eagle3" / "model.safetensors")) for out in (a, b))
    for name, t in first.items():
        torch.testing.assert_close(resumed[name], t, atol=1e-6, rtol=0, msg=name)
    loaded = BlockwiseLM.from_pretrained(a)
    assert loaded.eagle3.config.aux_layers == (0, 1, 1) and loaded.eagle3.config.draft_vocab_size == 64
    ids = tiny_base.sequences[:1, :16]
    out = loaded.generate(ids, 24, drafter="eagle3", tree=None, eos_token_id=NO_EOS)
    assert_greedy_equal(loaded.base, ids, out.sequences, hf_greedy(loaded.base, ids, 24, eos_token_id=NO_EOS))
    assert (a / "training.png").is_file() and json.loads((a / "blockdecode.json").read_text())["training"]


def test_an_encoder_decoder_base_is_refused_before_training(tiny_marian, tmp_path) -> None:
    from conftest import pairs_cfg

    with pytest.raises(ValueError, match="eagle3 reads a decoder-only base's layers"):
        train(pairs_cfg(tiny_marian, tmp_path / "out", head_type="eagle3", mode="distill"))


def test_an_encoder_decoder_refuses_a_drafter_it_cannot_read_in_one_line(tiny_marian) -> None:
    lm = BlockwiseLM.from_pretrained(tiny_marian.dir, k=4)
    ids = tiny_marian.tokenizer("In the beginning", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="read a decoder-only base's layers; MarianMTModel is an encoder-decoder"):
        lm.attach_eagle3("any-folder")  # before anything is read
    with pytest.raises(ValueError, match="MarianMTModel is an encoder-decoder: draft with heads, dflash, ngram or suf"):
        lm.generate(ids, 4, drafter="eagle3")


def test_a_drafter_given_on_the_command_line_is_refused_unless_it_drafts(tmp_path) -> None:
    with pytest.raises(SystemExit, match="--eagle3 drafts only where --drafter names it .*, not auto"):
        main(["generate", "--prompt", "x", "--eagle3", str(tmp_path)])


@pytest.mark.slow
def test_two_processes_train_the_same_drafter_as_one(tiny_base, tmp_path) -> None:
    """DDP through accelerate (two gloo ranks on the CPU, the base's features computed each step): the same
    drafter as one process trains on the same global batches."""
    script = tmp_path / "run_train.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    kw = dict(head_type="eagle3", draft_vocab=64, steps=4, log_every=1, eval_every=4, checkpoint_every=4)
    kw |= dict(eval_prompts=1)
    proc = launch_two(script, make_cfg(tiny_base, tmp_path / "two", **kw))
    assert proc.returncode == 0, proc.stderr[-4000:]
    torch.manual_seed(0)
    train(make_cfg(tiny_base, tmp_path / "one", **kw))
    one, two = (load_file(str(tmp_path / run / "eagle3" / "model.safetensors")) for run in ("one", "two"))
    for name, t in one.items():
        torch.testing.assert_close(two[name], t, atol=1e-5, rtol=0, msg=name)


def test_the_command_line_trains_on_chosen_layers_and_exports_with_the_serving_commands(
    tiny_base, tmp_path, capsys
) -> None:
    from blockdecode.cli import main

    run, out = tmp_path / "run", tmp_path / "e3"
    common = ["train", "--base", str(tiny_base.dir), "--data", str(tiny_base.corpus), "--out", str(run)]
    main([*common, "--head-type", "eagle3", "--aux-layers", "0", "1", "1", "--k", "4", "--steps", "2",
          "--head-hidden-size", "48"])  # fmt: skip
    main(["export", "--model", str(run), "--format", "speculators", "--out", str(out)])
    assert Eagle3.load(run / "eagle3").config.intermediate_size == 48  # the drafter's MLP, narrower than the base's
    printed = capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    assert '"method": "eagle3"' in printed and "--speculative-algorithm EAGLE3" in printed
    assert "--spec-type draft-eagle3" in printed
    assert Eagle3.load(out).config.speculative_tokens == 3
    for folder in (run / "eagle3", out):  # the drafter a model holds, and its export: neither is a model
        with pytest.raises(SystemExit, match=f"{folder} is an EAGLE-3 drafter's folder, not a model's: --model takes"):
            main(["export", "--model", str(folder), "--format", "speculators", "--out", str(tmp_path / "again")])
    with pytest.raises(SystemExit, match="three layer ids in \\[0, 1\\]"):
        main([*common[:-1], str(tmp_path / "other"), "--head-type", "eagle3", "--aux-layers", "0", "1", "2"])


def test_the_training_time_test_unrolled_on_its_own_guesses_is_what_drafting_proposes(exported) -> None:
    """`guesses` runs every position's chain at once through the training-time test's attention: the same
    chains the drafter proposes one position at a time with its cache, so training sees what drafting does."""
    lm, _ = exported
    drafter = Eagle3Drafter(lm.eagle3, lm.base.get_input_embeddings(), min_prob=0.0)
    seq = hf_greedy(lm.base, make_prompt(10, 512, seed=3), 30, eos_token_id=NO_EOS)
    with torch.no_grad(), layer_inputs(lm.base, drafter.layers) as aux:
        lm.base(seq)
    at_once = lm.eagle3.guesses(lm.base.get_input_embeddings(), aux[0], seq, K - 1)[0]
    for t in range(5, seq.shape[1] - 2, 3):
        drafter.start([seq[0, : t + 2].tolist()])
        drafter.see(0, aux[0][0, : t + 1])
        assert drafter.propose(seq[:, : t + 2], None, K - 1)[0].tolist() == at_once[t].tolist(), f"position {t}"


def test_a_variant_the_layer_does_not_compute_is_refused_and_an_own_embedding_is_used(exported, tmp_path) -> None:
    _, folders = exported
    config = json.loads((folders["speculators"] / "config.json").read_text())
    tensors = load_file(str(folders["speculators"] / "model.safetensors"))
    folder = tmp_path / "variant"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    scaled = {**config["transformer_layer_config"], "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}
    (folder / "config.json").write_text(json.dumps({**config, "transformer_layer_config": scaled}))
    with pytest.raises(CheckpointError, match="rotary embedding is 'llama3'"):
        Eagle3.load(folder)
    (folder / "config.json").write_text(json.dumps({**config, "fc_norm": True}))
    with pytest.raises(CheckpointError, match="fc_norm is set"):
        Eagle3.load(folder)
    (folder / "config.json").write_text(json.dumps(config))
    own = torch.randn(512, tensors["fc.weight"].shape[0])
    save_file({**tensors, "embed_tokens.weight": own}, str(folder / "model.safetensors"))
    drafter = Eagle3Drafter(Eagle3.load(folder), torch.nn.Embedding(512, own.shape[1]))
    assert torch.equal(drafter.embed.weight, own)


def test_a_drafter_trains_beside_heads_saved_apart_from_their_base(tiny_base, tmp_path) -> None:
    """`--base` a heads folder whose base lives elsewhere (a GGUF's, or any saved with save_base=False): the base
    is the one it names, and the drafter lands beside those heads."""
    heads = tmp_path / "heads"
    BlockwiseLM.from_pretrained(tiny_base.dir, k=4).save_pretrained(heads, save_base=False)
    cfg = make_cfg(tiny_base, tmp_path / "e3", base=str(heads), head_type="eagle3", steps=2, eval_every=100)
    model = train(cfg)
    assert model.eagle3 is not None and Path(model.base_location) == Path(tiny_base.dir).resolve()
    again = BlockwiseLM.from_pretrained(tmp_path / "e3")
    assert again.eagle3 is not None and again.k == 4


def test_a_file_given_as_a_drafter_is_refused_in_one_line(exported, tmp_path) -> None:
    lm, _ = exported
    given = tmp_path / "drafter.safetensors"
    given.write_bytes(b"not a folder")
    with pytest.raises(CheckpointError, match="is a file: an EAGLE-3 drafter is saved as a folder of config.json"):
        lm.attach_eagle3(given)


def test_export_takes_the_built_in_model_by_default(tmp_path, capsys) -> None:
    from blockdecode.cli import main as cli

    with pytest.raises(SystemExit, match="holds both an EAGLE-3 and a DFlash drafter: say which speculators writes"):
        cli(["export", "--format", "speculators", "--out", str(tmp_path / "e3")])  # as usage.md says: no --model
    cli(["export", "--format", "speculators", "--drafter", "eagle3", "--out", str(tmp_path / "e3")])
    assert "exported an EAGLE-3 drafter (speculators)" in capsys.readouterr().out
    assert json.loads((tmp_path / "e3" / "config.json").read_text())["speculators_model_type"] == "eagle3"
