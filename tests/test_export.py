"""Exported heads propose, in vLLM's Medusa format's own terms, exactly what blockdecode proposes.

The reader below is written from the format (config keys, weight names, per-head computation as
vLLM's loader defines them), not from blockdecode's export code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny
from safetensors.torch import load_file
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from blockdecode import BlockwiseLM, CheckpointError
from blockdecode.cli import main
from blockdecode.core.toy import toy_model
from blockdecode.serving import export as export_module
from blockdecode.serving.export import export_heads, serve_command


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
