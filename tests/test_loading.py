"""A GGUF file taken wherever a model is: dequantized once into a folder cached by its content, checked on
reading, and decoded exactly as transformers decodes the same file. The file is a tiny random Gemma 3 written
here with the `gguf` package: sliding-window layers (window 8) and a full one, Q8_0 weights, a byte-fallback
vocabulary."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_cfg, perturb_heads, write_gemma3_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockdecode import BlockwiseLM, builtin, gguf_cache, load
from blockdecode.cli import main as cli_main
from blockdecode.core.io import CheckpointError, cache_root
from blockdecode.core.toy import toy_model
from blockdecode.decoding.calibrate import record_rates
from blockdecode.decoding.costs import model_ranking
from blockdecode.gguf_cache import gguf_folder
from blockdecode.loading import HEADS_CONFIG
from blockdecode.pretraining.corpus import train_tokenizer
from blockdecode.training.train import train


@pytest.fixture(scope="module")
def toy_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "toy.gguf"
    write_gemma3_gguf(path)
    return path


def transformers_reads(path: Path):
    """The model and tokenizer transformers makes of the file itself: the reference."""
    where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    return AutoModelForCausalLM.from_pretrained(**where).eval(), AutoTokenizer.from_pretrained(**where)


def test_a_gguf_decodes_exactly_as_transformers_reads_it(toy_gguf: Path) -> None:
    """Chains, trees and the ranked default on a window of 8 crossed many times, and a left-padded batch."""
    reference, ref_tokenizer = transformers_reads(toy_gguf)
    model, tokenizer = load(toy_gguf)
    assert model.base_location == str(toy_gguf.resolve()) and type(model.base).__name__ == "Gemma3ForCausalLM"
    assert set(model.base.config.layer_types) == {"sliding_attention", "full_attention"}
    text = "the def return self and of the def"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(ids, ref_tokenizer(text, return_tensors="pt").input_ids)
    ref = hf_greedy(reference, ids, 48, eos_token_id=NO_EOS)
    for drafter, tree in (("ngram", None), ("heads", None), ("heads+ngram", 12), ("auto", "expected")):
        out = model.generate(ids, 48, drafter=drafter, tree=tree, eos_token_id=NO_EOS)
        assert_greedy_equal(reference, ids, out.sequences, ref, what=f"{drafter}, tree {tree}")
    prompts = ["the def", "return self and of the def the"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    expected = reference.generate(**batch, max_new_tokens=24, do_sample=False, eos_token_id=None, min_new_tokens=24)
    out = model.generate(batch.input_ids, 24, attention_mask=batch.attention_mask, eos_token_id=NO_EOS, tree=None)
    assert torch.equal(out.sequences, expected)


def conversions(monkeypatch) -> list[Path]:
    """Where each GGUF conversion of the test goes: `_dequantize` counted, then called."""
    made = []

    def counted(file, folder, *args):
        made.append(folder)
        return dequantize(file, folder, *args)

    dequantize = gguf_cache._dequantize
    monkeypatch.setattr(gguf_cache, "_dequantize", counted)
    return made


def cached_folders() -> set[str]:
    return {p.name for p in (cache_root() / "gguf").iterdir() if p.is_dir()}


def test_the_second_load_reads_the_cache_and_a_damaged_one_is_made_again(toy_gguf: Path, monkeypatch, capsys) -> None:
    folder = gguf_folder(toy_gguf, torch.float32)
    assert folder.parent == cache_root() / "gguf" and (folder / "source.json").is_file()
    source = json.loads((folder / "source.json").read_text())
    assert source["gguf"] == str(toy_gguf.resolve()) and "model.safetensors" in source["files"]
    made = conversions(monkeypatch)
    assert gguf_folder(toy_gguf, torch.float32) == folder
    assert gguf_folder(toy_gguf) == folder  # no dtype asked: whichever is there
    assert made == []
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short, as a killed copy would leave it
    capsys.readouterr()
    model, _ = load(toy_gguf)
    assert "is damaged: model.safetensors holds 1000 bytes" in capsys.readouterr().err and made == [folder]
    assert weights.stat().st_size == source["files"]["model.safetensors"]["size"]
    bf16 = gguf_folder(toy_gguf, torch.bfloat16)
    assert bf16 != folder and load(toy_gguf, dtype=torch.bfloat16)[0].base.dtype == torch.bfloat16


def test_a_copy_at_another_path_reuses_the_conversion(toy_gguf: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    folder = gguf_folder(toy_gguf)
    copy = tmp_path / "elsewhere.gguf"
    shutil.copy(toy_gguf, copy)
    made = conversions(monkeypatch)
    capsys.readouterr()
    for path in (copy, toy_gguf, copy, toy_gguf):  # switching between the two
        assert gguf_folder(path) == folder
    assert made == [] and capsys.readouterr().err == ""
    model, _ = load(copy)
    assert made == [] and model.base_location == str(copy.resolve())


def flip_byte(path: Path, at: int) -> None:
    """One byte of `path` changed in place, its size and modification time as they were."""
    info, data = path.stat(), bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


def test_a_flipped_byte_in_the_cached_weights_is_caught_before_decoding(toy_gguf: Path, monkeypatch, capsys) -> None:
    folder = gguf_folder(toy_gguf)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    flip_byte(weights, len(good) // 2)
    made = conversions(monkeypatch)
    capsys.readouterr()
    assert gguf_folder(toy_gguf) == folder and made == [folder]
    assert capsys.readouterr().err.startswith(
        f"blockdecode: {folder} (blockdecode's own conversion cache, safe to delete) is damaged: model.safetensors "
        "does not match the sha256 written when it was made; making it again\n"
    )
    assert weights.read_bytes() == good


@pytest.mark.parametrize("damage", ["safetensors header", "config.json", "a missing file", "source.json"])
def test_a_damaged_conversion_is_made_again_in_one_line(toy_gguf: Path, damage: str, monkeypatch, capsys) -> None:
    folder = gguf_folder(toy_gguf)
    if damage == "safetensors header":
        (folder / "model.safetensors").write_bytes(b"\xff" * 16 + (folder / "model.safetensors").read_bytes()[16:])
    elif damage == "config.json":
        (folder / "config.json").write_text("{" + (folder / "config.json").read_text()[1:].replace("{", "["))
    elif damage == "a missing file":
        (folder / "tokenizer.json").unlink()
    else:
        (folder / "source.json").write_text("{ not json")
    made = conversions(monkeypatch)
    capsys.readouterr()
    model, tokenizer = load(toy_gguf)
    err = capsys.readouterr().err
    assert made == [folder] and err.count("is damaged") == 1
    line = next(line for line in err.splitlines() if "is damaged" in line)
    assert "safe to delete" in line and line.endswith("; making it again")
    assert type(model.base).__name__ == "Gemma3ForCausalLM" and tokenizer("the def").input_ids


@pytest.mark.parametrize("where", ["a file in place of the cache", "XDG_CACHE_HOME a file", "an unwritable cache"])
def test_an_unusable_cache_is_said_before_converting_and_the_model_loads_uncached(
    toy_gguf: Path, tmp_path: Path, where: str, monkeypatch, capsys
) -> None:
    xdg = tmp_path / "xdg"
    if where == "a file in place of the cache":
        (xdg / "blockdecode").mkdir(parents=True)
        (xdg / "blockdecode" / "gguf").write_text("")
    elif where == "XDG_CACHE_HOME a file":
        xdg.write_text("")
    else:
        (xdg / "blockdecode" / "gguf").mkdir(parents=True)
        (xdg / "blockdecode" / "gguf").chmod(0o500)
        if os.geteuid() == 0:  # root writes through a read-only mode: here the write fails as it would for anyone
            real = gguf_cache.tempfile.mkstemp

            def refused(*args, dir=None, **kwargs):
                if dir is not None and Path(dir).is_relative_to(xdg):
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
                return real(*args, dir=dir, **kwargs)

            monkeypatch.setattr(gguf_cache.tempfile, "mkstemp", refused)
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    path = tmp_path / "m.gguf"  # a path of its own: this process has not converted it uncached before
    shutil.copy(toy_gguf, path)
    made = conversions(monkeypatch)
    capsys.readouterr()
    model, _ = load(path)
    err = capsys.readouterr().err
    assert "Errno" not in err and len(made) == 1 and made[0] is None
    note = err.splitlines()[0]
    assert note.startswith("blockdecode: the GGUF conversion cache ") and " cannot be used (" in note
    assert note.endswith("into a temporary folder, going on uncached")
    assert model.base_location == str(path.resolve()) and type(model.base).__name__ == "Gemma3ForCausalLM"
    assert load(path)[0] is not None and len(made) == 1  # the same process reuses what it converted


def test_a_same_size_edit_with_its_time_put_back_is_converted_again_in_place_of_the_old(
    tmp_path: Path, monkeypatch
) -> None:
    path = tmp_path / "m.gguf"
    write_gemma3_gguf(path, seed=1)
    first = gguf_folder(path)
    flip_byte(path, path.stat().st_size - 100)  # inside the last tensor's data
    made = conversions(monkeypatch)
    second = gguf_folder(path)
    assert made == [second] and second != first and not first.exists()
    weights = AutoModelForCausalLM.from_pretrained(second).lm_head.weight
    assert torch.equal(BlockwiseLM.from_pretrained(path).base.lm_head.weight, weights)
    write_gemma3_gguf(path, seed=2)  # rewritten whole: again one conversion, in place of the last
    third = gguf_folder(path)
    assert made == [second, third] and not second.exists() and third.exists()


def test_a_touch_or_a_rename_reuses_the_conversion_and_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "m.gguf"
    write_gemma3_gguf(path, seed=3)
    folder = gguf_folder(path)
    before = cached_folders()
    made = conversions(monkeypatch)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # touch
    assert gguf_folder(path) == folder
    renamed = path.rename(tmp_path / "renamed.gguf")
    assert gguf_folder(renamed) == folder and made == [] and cached_folders() == before
    index = json.loads((cache_root() / "gguf" / "index.json").read_text())
    assert str(renamed.resolve()) in index and str(path.resolve()) not in index


@pytest.mark.parametrize("keep", [5000, -5000])
def test_a_gguf_cut_short_is_said_so_with_the_architecture_its_header_names(
    toy_gguf: Path, tmp_path: Path, keep: int
) -> None:
    cut = tmp_path / "cut.gguf"
    data = toy_gguf.read_bytes()
    cut.write_bytes(data[:keep])
    if keep > 0:  # within the header: its token list
        why = r"its header runs past the end of the file \(5000 bytes\)"
    else:
        why = rf"\({len(data) - 5000} of \d+ bytes: its tensors run past the end of the file\)"
    with pytest.raises(CheckpointError, match=rf"^{cut} is cut short:? {why}; its header names architecture gemma3$"):
        load(cut)


def test_what_is_not_a_readable_gguf_is_one_line_naming_it(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a model")
    with pytest.raises(CheckpointError, match=f"{fake} is not a GGUF file"):
        load(fake)
    other = tmp_path / "other.gguf"
    write_gemma3_gguf(other, architecture="nonesuch")
    with pytest.raises(
        CheckpointError, match=r"other.gguf: transformers cannot read this GGUF \(architecture nonesuch\)"
    ):
        load(other)
    plain = tmp_path / "notes.txt"
    plain.write_text("hello")
    with pytest.raises(CheckpointError, match="is a file, not a model folder .* nor a GGUF file"):
        load(plain)


def test_a_folder_without_config_json_is_not_a_model_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=rf"^{tmp_path} holds no config.json: not a model folder$"):
        load(tmp_path)
    with pytest.raises(SystemExit, match=rf"^error: {tmp_path} holds no config.json: not a model folder$"):
        cli_main(["generate", "--model", str(tmp_path), "--prompt", "the def"])


def test_the_command_line_takes_a_gguf(toy_gguf: Path, capsys) -> None:
    args = ["--model", str(toy_gguf), "--prompt", "the def", "--max-new-tokens", "24", "--dtype", "fp32"]
    cli_main(["generate", *args, "--compare"])
    assert "identical: yes" in capsys.readouterr().err


def test_heads_train_on_a_gguf_base_and_find_it_again(toy_gguf: Path, tiny_base, tmp_path: Path) -> None:
    """`train --base x.gguf`: the saved heads name the file, and loading them reads the base from it."""
    out = tmp_path / "heads"
    cfg = make_cfg(tiny_base, out, base=str(toy_gguf), steps=4, eval_every=4, checkpoint_every=4)
    train(cfg)
    assert json.loads((out / HEADS_CONFIG).read_text())["base_model"] == str(toy_gguf.resolve())
    model, tokenizer = load(out)
    reference, _ = transformers_reads(toy_gguf)
    ids = tokenizer("the def return", return_tensors="pt").input_ids
    out_ids = model.generate(ids, 24, eos_token_id=NO_EOS).sequences
    assert_greedy_equal(reference, ids, out_ids, hf_greedy(reference, ids, 24, eos_token_id=NO_EOS))


def test_drafters_shipped_for_a_base_are_attached_by_its_weights(tmp_path: Path, monkeypatch) -> None:
    """A base users install themselves (a GGUF) gets the heads trained for it from the package, matched by its
    weights' signature: no flag, and exact; another base of the same shape gets none."""
    tokenizer = train_tokenizer(["\n".join(f"x{i} = {i}" for i in range(300))], vocab_size=300)
    base, other = tmp_path / "base", tmp_path / "other"
    for seed, folder in ((3, base), (4, other)):
        toy_model("llama", vocab=len(tokenizer), seed=seed).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    trained = perturb_heads(BlockwiseLM.from_pretrained(base, k=4), seed=5)
    trained.base_location = None  # shipped without its base: the user's own copy is what it attaches to
    trained.save_pretrained(tmp_path / "shipped" / "toy", save_base=False)
    monkeypatch.setattr(builtin, "SHIPPED_DRAFTERS", tmp_path / "shipped")
    model, tokenizer = load(base)
    assert model.heads_trained and model.k == 4 and model.base_location == str(base.resolve())
    for name, tensor in trained.heads.state_dict().items():
        assert torch.equal(model.heads.state_dict()[name], tensor)
    ids = tokenizer("x1 = 1", return_tensors="pt").input_ids
    out = model.generate(ids, 24, eos_token_id=NO_EOS)
    assert_greedy_equal(model.base, ids, out.sequences, hf_greedy(model.base, ids, 24, eos_token_id=NO_EOS))
    assert not load(other)[0].heads_trained
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert model_ranking(model, ids).rates == ()  # no rates shipped yet: the drafters' own priors
    rates = record_rates(trained, [ids], tmp_path / "shipped" / "toy", new_tokens=8, drafter="heads+suffix")
    assert any(name.startswith("heads ") for name in rates)
    model = load(base)[0]  # the rates shipped beside its drafters, not its base's folder, are where it starts
    assert model.priors_folder == str(tmp_path / "shipped" / "toy") and dict(model_ranking(model, ids).rates) == rates


def test_the_drafters_a_model_names_for_its_default_are_what_auto_ranks(tmp_path: Path) -> None:
    base = toy_model("llama", layers=2)
    lm = BlockwiseLM.from_base(base, k=4)
    perturb_heads(lm)
    lm.default_drafters = "suffix+heads"  # as measured for a model, and saved with its drafters
    lm.save_pretrained(tmp_path / "m")
    again = BlockwiseLM.from_pretrained(tmp_path / "m")
    prompt = torch.randint(3, 500, (1, 12))
    assert again.plan("auto", prompts=[prompt]).drafter_name == "suffix+heads"
    assert BlockwiseLM.from_base(base, k=4).default_drafters is None
    meta = json.loads((tmp_path / "m" / HEADS_CONFIG).read_text())
    meta["default_drafters"] = "heads+oracle"
    (tmp_path / "m" / HEADS_CONFIG).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="default_drafters: unknown drafter 'heads\\+oracle'"):
        BlockwiseLM.from_pretrained(tmp_path / "m")


def test_the_drafters_shipped_for_installed_bases_keep_their_budget_and_terms() -> None:
    folders = [p for p in builtin.SHIPPED_DRAFTERS.glob("*") if p.is_dir()]
    for folder in folders:  # each base's drafters within 40 MiB
        assert sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) <= 40 * 2**20, folder
        meta = json.loads((folder / HEADS_CONFIG).read_text())
        assert meta["base_model"] is None and len(meta["base_signature"]) == 4  # the base is never shipped
        terms = "Gemma Terms of Use" if "gemma" in folder.name else "Apache License, Version 2.0"
        assert terms in (folder / "NOTICE").read_text()  # the upstream model's terms named beside them
        assert not list(folder.rglob("*.gguf")) and not (folder / "model.safetensors").exists()
        for config in folder.glob("*/config.json"):  # a drafter names its verifier as engines load it, not a local path
            verifier = json.loads(config.read_text())["speculators_config"]["verifier"]["name_or_path"]
            assert not Path(verifier).is_absolute() and verifier.count("/") == 1, config
