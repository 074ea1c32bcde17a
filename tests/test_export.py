"""Exported heads propose, in vLLM's Medusa format's own terms, exactly what blockdecode proposes; the DFlash and
EAGLE-3 exports read as the engines read them.

The readers below are written from the formats (config keys, weight names, per-head computation as vLLM's
loader defines them; vLLM's DFlash config translation and weight loader, SGLang's mask lookup), not from
blockdecode's export code."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny
from safetensors.torch import load_file
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockdecode import BlockwiseLM, CheckpointError
from blockdecode.cli import main
from blockdecode.core.toy import toy_model
from blockdecode.drafters.dflash.config import config_for as dflash_config
from blockdecode.drafters.dflash.model import DFlash
from blockdecode.drafters.eagle3.config import config_for as eagle3_config
from blockdecode.drafters.eagle3.model import Eagle3
from blockdecode.pretraining.corpus import train_tokenizer
from blockdecode.serving import export as export_module
from blockdecode.serving.export import export_heads, serve_command, verifier_name


class MedusaReader:
    """An independent reader of a vLLM Medusa speculator folder: config.json and *.safetensors."""

    def __init__(self, folder: Path):
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
        self.heads = next(v for k, v in config.items() if "num" in k and "heads" in k)
        self.layers = next(v for k, v in config.items() if "num" in k and "layers" in k)
        weights = {}
        for path in folder.glob("*.safetensors"):
            weights |= {name.removeprefix("medusa_heads."): t for name, t in load_file(str(path)).items()}
        self.weights, self.config = weights, config
        self.vocab = config["vocab_size"]
        truncated = config.get("truncated_vocab_size") or self.vocab
        self.token_map = weights["token_map"] if truncated < self.vocab else None
        assert self.token_map is None or len(self.token_map) == truncated

    def lm_head(self, i: int) -> torch.Tensor:
        w = self.weights["lm_heads.0.weight" if self.config.get("original_lm_head") else f"lm_heads.{i}.weight"]
        return w[self.token_map] if self.token_map is not None and w.shape[0] > len(self.token_map) else w

    def propose(self, hidden: torch.Tensor) -> torch.LongTensor:
        """Final hidden states [N, d] -> each head's argmax token id [N, heads]."""
        out = []
        for i in range(self.heads):
            x = hidden.float()
            for j in range(self.layers):
                w = self.weights[f"blocks.{i}.layers.{j}.weight"].float()
                b = self.weights[f"blocks.{i}.layers.{j}.bias"].float() if self.config.get("medusa_fc_bias") else None
                x = x + F.silu(F.linear(x, w, b))
            logits = x @ self.lm_head(i).float().T * self.config.get("logit_scale", 1.0)
            if self.token_map is not None:
                full = torch.full((*logits.shape[:-1], self.vocab), -torch.inf)
                full[..., self.token_map] = logits
                logits = full
            out.append(logits.argmax(-1))
        return torch.stack(out, dim=-1)


def trained_medusa(
    arch: str = "llama", k: int = 5, draft_vocab: int = 0, seed: int = 0, fresh: bool = False, **size
) -> BlockwiseLM:
    """Medusa heads with random (non-zero) weights and, with a draft vocabulary, a scattered map
    (`fresh`: on a base of their own, which the test may change)."""
    base = toy_model(arch, **size) if fresh else tiny(arch, **size)
    model = BlockwiseLM.from_base(base, k=k, head_type="medusa", draft_vocab=draft_vocab)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if draft_vocab:
            vocab = model.base.get_output_embeddings().weight.shape[0]
            model.heads.token_map.copy_(torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values)
    return model.eval()


def blockdecode_proposals(model: BlockwiseLM, hidden: torch.Tensor) -> torch.LongTensor:
    drafter = model.drafter()
    return torch.cat([drafter.propose(torch.tensor([[1]]), h[None], model.k - 1) for h in hidden])


@pytest.mark.parametrize("arch,width", [("llama", 64), ("gpt2", 48), ("qwen2", 96)])
@pytest.mark.parametrize("draft_vocab", [0, 96])
def test_exported_heads_propose_what_blockdecode_proposes(tmp_path, arch, width, draft_vocab):
    model = trained_medusa(arch, k=6, draft_vocab=draft_vocab, width=width)
    export_heads(model, tmp_path / "medusa")
    reader = MedusaReader(tmp_path / "medusa")
    assert reader.heads == 5 and reader.layers == 1 and reader.vocab == 512
    hidden = torch.randn(64, width, generator=torch.Generator().manual_seed(1)) * 2
    theirs, ours = reader.propose(hidden), blockdecode_proposals(model, hidden)
    assert theirs.shape == ours.shape == (64, 5)
    assert torch.equal(theirs, ours)
    if draft_vocab:  # every proposal lies in the map, as the format's -inf elsewhere makes it
        assert torch.isin(theirs, model.token_map).all()
        assert len(set(theirs.flatten().tolist())) > 5  # the map is used, not one token everywhere


def test_hidden_states_of_a_real_prompt_give_the_same_chain(tmp_path):
    """The heads read the base's final hidden state after its last norm, as vLLM hands it over."""
    model = trained_medusa("llama", k=5, draft_vocab=64)
    export_heads(model, tmp_path / "m")
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = model.base(ids, output_hidden_states=True).hidden_states[-1][0]
    assert torch.equal(MedusaReader(tmp_path / "m").propose(hidden), blockdecode_proposals(model, hidden))


def test_export_records_provenance_and_writes_the_base_apart(tmp_path):
    model = trained_medusa("llama", k=4, draft_vocab=32)
    target = export_heads(model, tmp_path / "m", provenance={"training": {"steps": 7}})
    record = json.loads((tmp_path / "m" / "blockdecode.json").read_text())
    assert record["export"]["format"] == "vllm-medusa" and record["training"] == {"steps": 7}
    assert record["heads"]["head_type"] == "medusa" and record["heads"]["draft_vocab"] == 32
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["truncated_vocab_size"] == 32
    # A base built in Python has no folder of its own: it goes, unchanged, beside the heads.
    assert target == tmp_path / "m" / "base"
    base = AutoModelForCausalLM.from_pretrained(target)
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), model.base.state_dict().values()))
    # The base's output layer is written once, not once per head.
    names = load_file(str(tmp_path / "m" / "model.safetensors")).keys()
    assert [n for n in names if n.startswith("lm_heads")] == ["lm_heads.0.weight"]


def test_a_base_in_its_own_folder_is_named_not_copied(tmp_path):
    tiny("llama").save_pretrained(tmp_path / "base")
    model = BlockwiseLM.from_base(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), k=3, head_type="medusa")
    model.save_pretrained(tmp_path / "heads", save_base=False)
    model = BlockwiseLM.from_pretrained(tmp_path / "heads")
    assert export_heads(model, tmp_path / "m") == (tmp_path / "base").resolve()
    assert not (tmp_path / "m" / "base").exists()


@pytest.mark.parametrize("head_type", ["paper", "hydra"])
def test_other_head_types_are_refused_by_name(tmp_path, head_type):
    model = BlockwiseLM.from_base(tiny("llama"), k=4, head_type=head_type)
    with pytest.raises(ValueError, match=rf"{head_type} heads have no serving-engine format.*--head-type medusa"):
        export_heads(model, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_what_the_format_cannot_hold_is_refused(tmp_path):
    with pytest.raises(ValueError, match="encoder-decoder"):
        export_heads(BlockwiseLM.from_base(tiny("t5"), k=4, head_type="medusa"), tmp_path / "a")
    with pytest.raises(ValueError, match="output layer has a bias"):  # phi's lm_head has one
        export_heads(BlockwiseLM.from_base(tiny("phi"), k=4, head_type="medusa"), tmp_path / "b")
    with pytest.raises(ValueError, match="k=1"):
        export_heads(BlockwiseLM.from_base(tiny("llama"), k=1, head_type="medusa"), tmp_path / "c")
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        export_heads(trained_medusa(), tmp_path / "d", format="onnx")


def test_a_folder_holding_other_files_is_never_written_into(tmp_path):
    model = trained_medusa()
    model.save_pretrained(tmp_path / "saved")  # exporting over the source would destroy it
    before = {p.name: p.read_bytes() for p in (tmp_path / "saved").iterdir() if p.is_file()}
    with pytest.raises(ValueError, match="holds other files"):
        export_heads(model, tmp_path / "saved")
    assert before == {p.name: p.read_bytes() for p in (tmp_path / "saved").iterdir() if p.is_file()}


def test_an_export_replaces_an_earlier_one_whole_or_not_at_all(tmp_path, monkeypatch):
    export_heads(trained_medusa(seed=0), tmp_path / "m")
    first = (tmp_path / "m" / "model.safetensors").read_bytes()
    export_heads(trained_medusa(seed=1), tmp_path / "m")  # an earlier export may be replaced
    second = (tmp_path / "m" / "model.safetensors").read_bytes()
    assert second != first

    def dies(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "write_text", dies)  # killed after the weights, before the configs
    with pytest.raises(KeyboardInterrupt):
        export_heads(trained_medusa(seed=2), tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == second
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "base",
        "blockdecode.json",
        "config.json",
        "model.safetensors",
    ]


def test_an_export_over_one_with_its_own_base_leaves_no_base_of_the_earlier(tmp_path):
    """The export's folder is replaced as a whole: out/base of an earlier export beside a
    blockdecode.json naming another base would serve the old weights with the new heads."""
    export_heads(trained_medusa(), tmp_path / "m")
    assert (tmp_path / "m" / "base").is_dir()
    tiny("llama").save_pretrained(tmp_path / "base")
    model = BlockwiseLM.from_base(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), k=3, head_type="medusa")
    model.save_pretrained(tmp_path / "heads", save_base=False)
    served = export_heads(BlockwiseLM.from_pretrained(tmp_path / "heads"), tmp_path / "m")
    assert served == (tmp_path / "base").resolve()
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "blockdecode.json",
        "config.json",
        "model.safetensors",
    ]
    assert json.loads((tmp_path / "m" / "blockdecode.json").read_text())["export"]["base_model"] == str(served)


def test_an_export_is_not_mistaken_for_a_blockwise_model(tmp_path):
    export_heads(trained_medusa(), tmp_path / "m")
    with pytest.raises(CheckpointError, match="is an export for serving engines"):
        BlockwiseLM.from_pretrained(tmp_path / "m")


def test_serve_command_speculates_k_minus_one_tokens():
    command = serve_command("/models/base", "/models/medusa", k=8)
    spec = json.loads(command.split("--speculative-config ")[1].strip("'"))
    assert command.startswith("vllm serve /models/base ")
    assert spec == {"method": "medusa", "model": "/models/medusa", "num_speculative_tokens": 7}


def test_cli_exports_a_saved_model_and_prints_how_to_serve_it(tmp_path, capsys):
    model = trained_medusa("llama", k=5, draft_vocab=64, fresh=True)
    model.base.to(torch.bfloat16)
    model.heads.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "saved", training={"mode": "distill"})
    main(["export", "--model", str(tmp_path / "saved"), "--out", str(tmp_path / "m")])
    out = capsys.readouterr().out
    assert "exported 4 medusa heads" in out and f"vllm serve {tmp_path / 'm' / 'base'} " in out
    assert '"num_speculative_tokens": 4' in out
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert weights["blocks.0.layers.0.weight"].dtype == torch.bfloat16  # as saved: no weight changed
    record = json.loads((tmp_path / "m" / "blockdecode.json").read_text())
    assert record["training"] == {"mode": "distill"} and record["exported_from"] == str((tmp_path / "saved").resolve())
    hidden = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    reloaded = BlockwiseLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)  # bf16 weights, exactly
    reloaded.heads.float()
    assert torch.equal(MedusaReader(tmp_path / "m").propose(hidden), blockdecode_proposals(reloaded, hidden))


def loads_nothing(monkeypatch):
    """From now on, loading a saved model's weights fails the test."""

    def load(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(BlockwiseLM, "from_pretrained", load)


@pytest.mark.parametrize("head_type", ["paper", "hydra"])
def test_cli_refuses_heads_the_format_cannot_hold_in_one_line_before_loading(tmp_path, monkeypatch, head_type):
    BlockwiseLM.from_base(toy_model("llama"), k=3, head_type=head_type).save_pretrained(tmp_path / "saved")
    loads_nothing(monkeypatch)
    with pytest.raises(SystemExit, match=f"^error: {head_type} heads have no serving-engine format[^\n]*$"):
        main(["export", "--model", str(tmp_path / "saved"), "--out", str(tmp_path / "m")])
    assert not (tmp_path / "m").exists()


def test_cli_refuses_a_missing_model_or_an_unwritable_out_before_loading(tmp_path, monkeypatch):
    trained_medusa().save_pretrained(tmp_path / "saved")
    (tmp_path / "file").write_text("not a folder")
    loads_nothing(monkeypatch)
    with pytest.raises(SystemExit, match=f"^error: no such folder: {tmp_path / 'nosuch'}$"):
        main(["export", "--model", str(tmp_path / "nosuch"), "--out", str(tmp_path / "m")])
    with pytest.raises(SystemExit, match=f"^error: {tmp_path} holds no trained heads"):
        main(["export", "--model", str(tmp_path), "--out", str(tmp_path / "m")])
    for out in (tmp_path / "file", tmp_path / "file" / "m"):
        with pytest.raises(SystemExit, match=f"^error: --out {out} cannot be written: {tmp_path / 'file'} is not a"):
            main(["export", "--model", str(tmp_path / "saved"), "--out", str(out)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "saved"]


# ------------------------------------------------------------------ DFlash and EAGLE-3 exports, as engines read them


def verifier_problems(folder: Path, verifier: dict, base: Path) -> list[str]:
    """The speculators format's verifier as a reader on another machine takes it: a hub name, or a folder named
    relative to the export, holding the base with the architectures it names."""
    name, architectures = verifier.get("name_or_path"), verifier.get("architectures")
    found = [] if architectures else ["verifier.architectures is empty"]
    if not isinstance(name, str) or Path(name).is_absolute():
        return [*found, f"verifier.name_or_path {name!r} is not a hub name or a path relative to the export"]
    if (folder / name).resolve() != base.resolve():
        return [*found, f"verifier.name_or_path {name!r} is not the base {base}"]
    if json.loads((base / "config.json").read_text()).get("architectures") != architectures:
        found.append(f"verifier.architectures {architectures} are not the base's")
    return found


class DFlashReader:
    """An independent reader of a DFlash export, either layout, served with the base in `base`: vLLM's config
    translation (`update_dflash`, the speculators format) and what `qwen3_dflash` builds and loads from it, and
    SGLang's lookup of the mask token through the base's tokenizer. `problems` says, one line each, where an engine
    would refuse the export or read it otherwise than blockdecode drafts with it."""

    def __init__(self, folder: Path, base: Path):
        self.folder, self.base = folder, base
        self.config = json.loads((folder / "config.json").read_text())
        self.weights = load_file(str(folder / "model.safetensors"))

    def problems(self) -> list[str]:
        cfg, found = self.config, []
        if cfg.get("speculators_model_type") == "dflash":  # the layers' config, updated as update_dflash does
            layer = dict(cfg["transformer_layer_config"])
            dflash = {"mask_token_id": cfg["mask_token_id"], "causal": not cfg.get("sliding_window_non_causal", True)}
            mask_token = cfg.get("mask_token")
            found += verifier_problems(self.folder, cfg["speculators_config"]["verifier"], self.base)
        else:  # z-lab's DFlashDraftModel, read as it is
            layer, dflash = cfg, cfg["dflash_config"]
            mask_token = dflash.get("mask_token")
        for i in range(layer["num_hidden_layers"]):  # is_causal, else dflash_config.causal, else sliding layers only
            causal = layer.get("is_causal", dflash.get("causal"))
            if causal is None:
                causal = (layer.get("layer_types") or ["full_attention"] * (i + 1))[i] == "sliding_attention"
            if causal:
                found.append(f"drafter layer {i} attends causally: its masks would not see the masks after them")
        vocab = json.loads((self.base / "config.json").read_text())["vocab_size"]
        mapped = (cfg.get("draft_vocab_size") or layer["vocab_size"]) != vocab  # a draft_id_to_target_id parameter
        if "d2t" in self.weights and not mapped:
            found.append("d2t is shipped for the base's own vocabulary, and the loader has no parameter to load it")
        if mapped and "d2t" not in self.weights:
            found.append("a draft vocabulary without d2t")
        tokenizer = AutoTokenizer.from_pretrained(self.base)
        token = mask_token or "<|MASK|>"  # SGLang's default
        resolved = tokenizer.mask_token_id if tokenizer.mask_token == token else tokenizer.get_vocab().get(token)
        if resolved is None:  # added, as SGLang adds a mask token the tokenizer lacks
            tokenizer.add_special_tokens({"mask_token": token})
            resolved = tokenizer.mask_token_id
        if resolved != dflash["mask_token_id"]:
            found.append(f"mask token {token!r} resolves to {resolved}, not mask_token_id {dflash['mask_token_id']}")
        return found


@functools.cache
def small_tokenizer():
    """A byte-level BPE of about 400 tokens: a toy base's 512 ids are a vocabulary padded past its tokenizer's."""
    words = ("def", "return", "class", "import", "for", "while", "self", "print", "lambda", "yield", "if", "else")
    picks = torch.randint(100 * len(words), (400, 8), generator=torch.Generator().manual_seed(0)).tolist()
    text = "\n".join(" ".join(f"{words[p % len(words)]}{p // len(words)}" for p in line) for line in picks)
    tokenizer = train_tokenizer([text], vocab_size=400)
    assert MASK < len(tokenizer) < 450
    return tokenizer


MASK = 300  # an id the tokenizer has a token for


def with_dflash(base, draft_vocab: int = 0, shared: bool = False, mask: int = MASK) -> BlockwiseLM:
    """A model with a DFlash drafter of random weights (the exports' files are what is read here)."""
    lm = BlockwiseLM.from_base(base, k=6)
    vocab = lm.base.get_output_embeddings().weight.shape[0]
    drafter = DFlash(dflash_config(lm.base, draft_vocab or vocab, mask, block_size=6, layers=2, shared_head=shared))
    if draft_vocab:
        drafter.set_vocabulary(torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:draft_vocab])
    lm.attach_dflash(drafter)
    return lm


RUNS = {"own": {}, "draft": {"draft_vocab": 128}, "shared": {"shared": True}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Saved models, each with its tokenizer: a DFlash drafter over the base's vocabulary with its own output layer
    ("own"), over a draft vocabulary ("draft"), sharing the base's output layer ("shared"); an EAGLE-3 drafter."""
    root = tmp_path_factory.mktemp("drafter-runs")
    for name, kw in RUNS.items():
        with_dflash(toy_model("qwen2", layers=4), **kw).save_pretrained(root / name, tokenizer=small_tokenizer())
    lm = BlockwiseLM.from_base(toy_model("qwen2", layers=4), k=6)
    lm.attach_eagle3(Eagle3(eagle3_config(lm.base, 512, k=6)))
    lm.save_pretrained(root / "eagle3", tokenizer=small_tokenizer())
    return {name: root / name for name in (*RUNS, "eagle3")}


@pytest.mark.parametrize(
    "run,fmt", [("own", "speculators"), ("draft", "speculators"), ("shared", "speculators"), ("shared", "dflash")]
)
def test_the_dflash_exports_read_as_vllm_and_sglang_read_them(runs, tmp_path, run: str, fmt: str) -> None:
    """Non-causal layers, d2t only for a draft vocabulary, the verifier named by its architectures and a path
    relative to the export, the mask token a string the exported tokenizer resolves to mask_token_id."""
    main(["export", "--model", str(runs[run]), "--format", fmt, "--out", str(tmp_path / "out")])
    reader = DFlashReader(tmp_path / "out", tmp_path / "out" / "base")
    assert reader.problems() == []
    assert ("d2t" in reader.weights) == (run == "draft") and ("t2d" in reader.weights) == (run == "draft")
    named = reader.config["dflash_config"] if fmt == "dflash" else reader.config
    assert named["mask_token"] == small_tokenizer().convert_ids_to_tokens(MASK) and named["mask_token_id"] == MASK
    if fmt == "speculators":
        assert reader.config["speculators_config"]["verifier"] == {"name_or_path": "base", "architectures":
                                                                   ["Qwen2ForCausalLM"]}  # fmt: skip


def test_the_reader_refuses_what_the_engines_would_misread(runs, tmp_path) -> None:
    """Each fault the reader checks for, written into a sound export, is found."""
    main(["export", "--model", str(runs["own"]), "--format", "speculators", "--out", str(tmp_path / "out")])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    faults = {
        "attends causally": {"sliding_window_non_causal": False},
        "architectures is empty": {"speculators_config": {**config["speculators_config"], "verifier": {
            "name_or_path": "base", "architectures": []}}},  # fmt: skip
        "not a hub name or a path relative": {"speculators_config": {**config["speculators_config"], "verifier": {
            "name_or_path": str((tmp_path / "out" / "base").resolve()), "architectures": ["Qwen2ForCausalLM"]}}},
        f"resolves to {len(small_tokenizer())}, not mask_token_id {MASK}": {"mask_token": None},
    }  # fmt: skip
    for fault, change in faults.items():
        (tmp_path / "out" / "config.json").write_text(json.dumps(config | change))
        assert any(fault in problem for problem in DFlashReader(tmp_path / "out", tmp_path / "out" / "base").problems())
    reader = DFlashReader(tmp_path / "out", tmp_path / "out" / "base")
    reader.config, reader.weights["d2t"] = config, torch.zeros(512, dtype=torch.long)
    assert any("loader has no parameter" in problem for problem in reader.problems())


def test_a_base_in_its_own_folder_is_the_verifier_by_a_relative_path_and_lends_its_tokenizer(tmp_path) -> None:
    tiny("qwen2", layers=4).save_pretrained(tmp_path / "models" / "base")
    small_tokenizer().save_pretrained(tmp_path / "models" / "base")
    lm = with_dflash(AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "base"))
    lm.save_pretrained(tmp_path / "models" / "run", save_base=False)
    served = export_heads(BlockwiseLM.from_pretrained(tmp_path / "models" / "run"), tmp_path / "exports" / "df",
                          "speculators")  # fmt: skip
    assert served == (tmp_path / "models" / "base").resolve()
    reader = DFlashReader(tmp_path / "exports" / "df", served)
    assert reader.problems() == []
    assert reader.config["speculators_config"]["verifier"]["name_or_path"] == "../../models/base"


def test_a_base_from_the_hub_is_the_verifier_by_its_hub_name(tmp_path) -> None:
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "93efa2f"
    snapshot.mkdir(parents=True)
    hub = "HuggingFaceTB/SmolLM2-135M"
    assert verifier_name(str(snapshot), tmp_path / "out", base_apart=True) == hub
    assert verifier_name(hub, tmp_path / "out", base_apart=False) == hub
    assert verifier_name(None, tmp_path / "out", base_apart=False) == "base"
    assert verifier_name(str(tmp_path / "model.gguf"), tmp_path / "out", base_apart=False) == "base"


def test_a_mask_id_the_tokenizer_has_no_token_for_is_named_by_id_with_a_warning(tmp_path) -> None:
    lm = with_dflash(toy_model("qwen2", layers=4), shared=True, mask=450)  # past the tokenizer's tokens
    with pytest.warns(UserWarning, match="the base's tokenizer has no token for the DFlash mask id 450"):
        export_heads(lm, tmp_path / "out", "dflash", tokenizer=small_tokenizer())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == 450 and "mask_token" not in config["dflash_config"]


def test_the_eagle3_speculators_export_names_its_verifier_as_well(runs, tmp_path) -> None:
    main(["export", "--model", str(runs["eagle3"]), "--format", "speculators", "--out", str(tmp_path / "out")])
    verifier = json.loads((tmp_path / "out" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier_problems(tmp_path / "out", verifier, tmp_path / "out" / "base") == []


def test_a_gguf_file_is_refused_as_holding_no_drafter_with_how_to_train_one(tmp_path, monkeypatch) -> None:
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    loads_nothing(monkeypatch)
    said = rf"{gguf} is a GGUF file: it holds a base, and no drafter to export\. Train one on it \(`blockdecode train"
    with pytest.raises(SystemExit, match=rf"^error: {said} --base {gguf} --data DATA --out RUN`\), then export RUN$"):
        main(["export", "--model", str(gguf), "--out", str(tmp_path / "m")])
    assert not (tmp_path / "m").exists()


def test_a_drafter_run_is_pointed_at_the_formats_that_export_its_drafter(runs, tmp_path, monkeypatch) -> None:
    loads_nothing(monkeypatch)
    cases = [
        ([], "own", r"this model holds a DFlash drafter, and \w+ heads, which vllm-medusa \(medusa heads\) cannot "
                    r"hold: export the drafter with --format dflash or speculators$"),
        ([], "eagle3", r"this model holds an EAGLE-3 drafter, .* --format eagle3 or speculators$"),
        (["--format", "dflash"], "eagle3", r"dflash holds a DFlash drafter, and this model has none: it holds an "
                                           r"EAGLE-3 drafter, which --format eagle3 or speculators exports$"),
        (["--format", "eagle3"], "own", r"eagle3 holds an EAGLE-3 drafter, and this model has none: it holds a "
                                        r"DFlash drafter, which --format dflash or speculators exports$"),
    ]  # fmt: skip
    for flags, run, said in cases:
        with pytest.raises(SystemExit, match="^error: " + said):
            main(["export", "--model", str(runs[run]), *flags, "--out", str(tmp_path / "m")])
    assert not (tmp_path / "m").exists()
