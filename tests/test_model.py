"""BlockwiseLM checkpoints: round trips, and a clear CheckpointError for anything missing, corrupt or mismatched."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import NO_EOS, make_prompt, perturb_heads, tiny
from transformers import AutoModelForCausalLM

from blockdecode import BlockwiseLM, CheckpointError, HeadsConfig, ScriptedDrafter
from blockdecode.core.hf import weights_digest
from blockdecode.core.toy import toy_model
from blockdecode.loading import HEADS_CONFIG, HEADS_WEIGHTS

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")


def trained(head_type: str = "paper", k: int = 4, arch: str = "llama", **size: int) -> BlockwiseLM:
    """Heads with random weights: a round trip of zero-init heads would prove little."""
    return perturb_heads(BlockwiseLM.from_base(tiny(arch, **size), k=k, head_type=head_type), seed=1)


def assert_same_heads(a: BlockwiseLM, b: BlockwiseLM) -> None:
    assert a.config == b.config
    sa, sb = a.heads.state_dict(), b.heads.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


def assert_same_generation(a: BlockwiseLM, b: BlockwiseLM) -> None:
    """Same tokens and same block sizes: the heads propose exactly what they did before saving."""
    ids = make_prompt(6, 512)
    for k in (None, 1):
        x, y = (
            a.generate(ids, 30, eos_token_id=NO_EOS, k=k, tree=None),
            b.generate(ids, 30, eos_token_id=NO_EOS, k=k, tree=None),
        )
        assert torch.equal(x.sequences, y.sequences)
        assert (x.stats.calls, x.stats.block_sizes) == (y.stats.calls, y.stats.block_sizes)


def leftovers(directory: Path) -> list[str]:
    """Temporary files or folders a save may have left behind."""
    return [p.name for p in directory.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".")]


@pytest.mark.parametrize("head_type", ["paper", "medusa", "hydra"])
def test_round_trip_with_base(tmp_path: Path, head_type: str) -> None:
    lm = trained(head_type)
    lm.save_pretrained(tmp_path)
    assert {HEADS_CONFIG, HEADS_WEIGHTS, "config.json"} <= {p.name for p in tmp_path.iterdir()}
    assert leftovers(tmp_path) == []
    assert json.loads((tmp_path / HEADS_CONFIG).read_text())["base_model"] == "."
    loaded = BlockwiseLM.from_pretrained(tmp_path)
    assert_same_heads(lm, loaded)
    base, other = lm.base.state_dict(), loaded.base.state_dict()
    assert all(torch.equal(base[n], other[n]) for n in base)
    assert_same_generation(lm, loaded)


@pytest.mark.parametrize("arch", ["marian", "t5"])
def test_round_trip_of_an_encoder_decoder(tmp_path: Path, arch: str) -> None:
    """Heads on a seq2seq decoder save and load like any others, and decode the same source alike."""
    lm = trained(arch=arch)
    lm.save_pretrained(tmp_path)
    loaded = BlockwiseLM.from_pretrained(tmp_path)
    assert loaded.base.config.is_encoder_decoder
    assert_same_heads(lm, loaded)
    assert_same_generation(lm, loaded)


def test_heads_of_one_encoder_decoder_are_refused_on_another(tmp_path: Path) -> None:
    trained(arch="marian").save_pretrained(tmp_path, save_base=False)
    with pytest.raises(CheckpointError, match="hidden size 64, the base model's is 32"):
        BlockwiseLM.from_pretrained(tmp_path, base=toy_model("bart", width=32))


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("head_type", ["paper", "medusa"])
def test_round_trip_heads_only(tmp_path: Path, head_type: str, k: int) -> None:
    lm = trained(head_type, k=k)
    lm.save_pretrained(tmp_path, save_base=False)
    assert {p.name for p in tmp_path.iterdir()} == {HEADS_CONFIG, HEADS_WEIGHTS}
    loaded = BlockwiseLM.from_pretrained(tmp_path, base=lm.base)
    assert loaded.base is lm.base
    assert_same_heads(lm, loaded)
    assert_same_generation(lm, loaded)


def test_saving_twice_overwrites_cleanly(tmp_path: Path) -> None:
    trained(k=4).save_pretrained(tmp_path, save_base=False)
    lm = trained("medusa", k=6)
    lm.save_pretrained(tmp_path, save_base=False)
    assert leftovers(tmp_path) == []
    assert_same_heads(lm, BlockwiseLM.from_pretrained(tmp_path, base=lm.base))


def test_heads_only_checkpoint_finds_a_base_loaded_from_disk(tmp_path: Path) -> None:
    """A base loaded from a directory is recorded by its path, so the heads alone can be reloaded."""
    trained().save_pretrained(tmp_path / "full")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    lm = perturb_heads(BlockwiseLM.from_base(base, k=4))
    lm.save_pretrained(tmp_path / "heads", save_base=False)
    loaded = BlockwiseLM.from_pretrained(tmp_path / "heads")
    assert_same_heads(lm, loaded)
    assert_same_generation(lm, loaded)


def test_heads_only_checkpoint_of_an_in_memory_base_fails_clearly(tmp_path: Path) -> None:
    """A base that came from no directory (built from a config) cannot be reloaded from a heads-only
    checkpoint; that must be a CheckpointError naming the problem, not transformers' unrelated
    "Unrecognized model" error. Exposes a bug: the config records base_model ".", which from_pretrained
    reads as "the base is saved here" (see the report)."""
    trained().save_pretrained(tmp_path, save_base=False)
    with pytest.raises(CheckpointError):
        BlockwiseLM.from_pretrained(tmp_path)


def test_resaving_heads_of_a_loaded_checkpoint_keeps_the_base_location(tmp_path: Path) -> None:
    """Load a full checkpoint, save only its heads elsewhere, load those: the base must still be found.
    Exposes a bug: the loaded model keeps base_location "." (relative to the first directory) and
    writes it into the second checkpoint, which then points at itself (see the report)."""
    trained().save_pretrained(tmp_path / "full")
    lm = BlockwiseLM.from_pretrained(tmp_path / "full")
    lm.save_pretrained(tmp_path / "heads", save_base=False)
    assert_same_heads(lm, BlockwiseLM.from_pretrained(tmp_path / "heads"))


# Mismatches: heads built for another model.


def test_heads_config_must_match_the_base() -> None:
    base = tiny("llama")
    with pytest.raises(CheckpointError, match="heads were built for hidden size 32, the base model's is 64"):
        BlockwiseLM(base, HeadsConfig(k=4, hidden_size=32, vocab_size=512))
    with pytest.raises(CheckpointError, match="heads were built for a vocabulary of 1000, the base model's is 512"):
        BlockwiseLM(base, HeadsConfig(k=4, hidden_size=64, vocab_size=1000))


@pytest.mark.parametrize(
    "size, match",
    [(dict(width=32), "hidden size 64, the base model's is 32"), (dict(vocab=300), "vocabulary of 512")],
)
def test_loading_heads_onto_a_different_base(tmp_path: Path, size: dict, match: str) -> None:
    trained().save_pretrained(tmp_path, save_base=False)
    with pytest.raises(CheckpointError, match=match):
        BlockwiseLM.from_pretrained(tmp_path, base=tiny("llama", **size))


# Damaged checkpoints.


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A heads-only checkpoint of k=4 paper heads on tiny('llama')."""
    trained().save_pretrained(tmp_path, save_base=False)
    return tmp_path


def load(directory: Path) -> BlockwiseLM:
    return BlockwiseLM.from_pretrained(directory, base=tiny("llama"))


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # truncated mid-tensor
        lambda data: data[:20],  # truncated inside the header
        lambda data: b"",
        lambda data: b"not a safetensors file at all" * 8,
        lambda data: bytes(len(data)),
    ],
    ids=["half", "header", "empty", "garbage", "zeros"],
)
def test_damaged_weights(saved: Path, damage) -> None:
    weights = saved / HEADS_WEIGHTS
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(CheckpointError, match=f"{HEADS_WEIGHTS} is corrupt or truncated"):
        load(saved)


def test_missing_weights(saved: Path) -> None:
    (saved / HEADS_WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match=f"{HEADS_WEIGHTS} is missing"):
        load(saved)


def test_weights_that_do_not_match_the_config(saved: Path) -> None:
    """Config says k=3, weights are for k=4: refused rather than partly loaded."""
    meta = json.loads((saved / HEADS_CONFIG).read_text())
    meta["heads"]["k"] = 3
    (saved / HEADS_CONFIG).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not match its config \\(k=3, head_type=paper"):
        load(saved)


@pytest.mark.parametrize(
    "text",
    [
        "{ not json",
        "",
        "[1, 2]",
        '{"base_model": "."}',
        '{"heads": {"k": 0, "hidden_size": 64, "vocab_size": 512}}',
        '{"heads": {"k": 4, "head_type": "eagle", "hidden_size": 64, "vocab_size": 512}}',
        '{"heads": {"k": 4, "hidden_size": 64, "vocab_size": 512, "colour": "blue"}}',
    ],
    ids=["syntax", "empty", "list", "no-heads", "bad-k", "bad-type", "unknown-key"],
)
def test_corrupt_config(saved: Path, text: str) -> None:
    (saved / HEADS_CONFIG).write_text(text)
    with pytest.raises(CheckpointError, match=f"{HEADS_CONFIG} is corrupt"):
        load(saved)


def test_missing_directory_or_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nowhere does not exist$"):
        BlockwiseLM.from_pretrained(tmp_path / "nowhere")
    (tmp_path / HEADS_WEIGHTS).write_bytes(b"")
    with pytest.raises(CheckpointError, match="holds no blockdecode.json"):
        BlockwiseLM.from_pretrained(tmp_path, base=tiny("llama"))


@pytest.mark.parametrize("named", ["eagle3", "suffix+dflash", "auto"])
def test_default_drafters_it_cannot_draft_with_fail_at_load_naming_its_file(saved: Path, named: str) -> None:
    """default_drafters naming a drafter the folder does not hold (no eagle3/ or dflash/ beside it), or auto (the
    choice, not a drafter), is refused by the load in one line naming blockdecode.json, not at the first generate."""
    meta = json.loads((saved / HEADS_CONFIG).read_text())
    (saved / HEADS_CONFIG).write_text(json.dumps({**meta, "default_drafters": named}))
    with pytest.raises(CheckpointError) as err:
        load(saved)
    said = str(err.value)
    assert "\n" not in said and said.startswith(f"{saved / HEADS_CONFIG}: default_drafters")
    if named == "auto":
        assert "auto is the choice among drafters" in said and "auto" not in said.split(": name ")[1]
    else:
        drafter = named.split("+")[-1]
        assert f"names {drafter}, and the model holds no {saved / drafter}" in said
    if named == "eagle3":  # saved with the drafter it names, the same default loads
        from blockdecode.drafters.eagle3.config import config_for
        from blockdecode.drafters.eagle3.model import Eagle3

        lm = BlockwiseLM.from_base(toy_model("qwen2", layers=4), k=4)
        lm.attach_eagle3(Eagle3(config_for(lm.base, 512, k=4)))
        lm.default_drafters = named
        lm.save_pretrained(saved / "whole")
        assert BlockwiseLM.from_pretrained(saved / "whole").default_drafters == named


def test_generate_after_load_is_still_exact(saved: Path) -> None:
    """Loaded random heads still decode greedily (a sanity check on the whole path)."""
    lm = load(saved)
    ids = make_prompt(5, 512)
    ref = lm.base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20)
    assert torch.equal(lm.generate(ids, 20, tree=None).sequences, ref)
    drafter = ScriptedDrafter(ref, accuracy=1.0, vocab_size=512)
    assert torch.equal(lm.generate(ids, 20, drafter=drafter, tree=None).sequences, ref)


def test_a_missing_built_in_model_says_how_to_build_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from blockdecode import builtin

    monkeypatch.setattr(builtin, "DEFAULT_MODEL", str(tmp_path / "default_model"))
    with pytest.raises(CheckpointError, match="built-in model is not installed; `make default-model` builds it"):
        BlockwiseLM.from_pretrained(tmp_path / "default_model")


def test_truncated_base_weights_are_one_clear_error(tmp_path: Path) -> None:
    """The likeliest real fault, an interrupted copy: a CheckpointError naming the folder."""
    broken = tmp_path / "broken"
    trained().save_pretrained(broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model weights are corrupt or truncated"):
        BlockwiseLM.from_pretrained(broken)


def test_k_is_bounded_by_context_and_memory_before_anything_is_allocated() -> None:
    model = tiny("gpt2", width=96, layers=1, heads=4, vocab=300, context=64)
    with pytest.raises(ValueError, match="k=65 exceeds the model's context of 64 positions"):
        BlockwiseLM.from_base(model, k=65)
    wide = toy_model("gpt2", width=768, layers=1, heads=12, vocab=300, context=2048)
    with pytest.raises(ValueError, match="k=1500 needs paper heads of .* GiB, more than half this machine's"):
        BlockwiseLM.from_base(wide, k=1500)
    assert HeadsConfig(k=5, hidden_size=8, head_hidden_size=4).parameters() == sum(
        p.numel()
        for p in BlockwiseLM.from_base(toy_model("llama", width=8, heads=2), k=5, head_hidden_size=4).heads.parameters()
    )


def test_a_heads_only_save_refuses_a_base_that_is_not_its_own(tmp_path: Path) -> None:
    """A base built from a saved model's config inherits its path but not its weights: reloading the
    heads-only save must not silently pair the heads with the folder's different weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    real = tmp_path / "real"
    toy_model("llama", seed=1).save_pretrained(real)
    lookalike = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(real))  # fresh random weights
    BlockwiseLM.from_base(lookalike, k=3).save_pretrained(tmp_path / "heads", save_base=False)
    with pytest.raises(CheckpointError, match="does not hold the base these heads were saved with"):
        BlockwiseLM.from_pretrained(tmp_path / "heads")
    BlockwiseLM.from_pretrained(tmp_path / "heads", base=lookalike)  # given explicitly: the caller's choice

    honest = AutoModelForCausalLM.from_pretrained(real)
    BlockwiseLM.from_base(honest, k=3).save_pretrained(tmp_path / "honest", save_base=False)
    reloaded = BlockwiseLM.from_pretrained(tmp_path / "honest", dtype=torch.bfloat16)  # another dtype still matches
    assert reloaded.base_location == str(real.resolve())


def test_the_next_save_removes_what_a_killed_save_left(tmp_path: Path) -> None:
    lm = BlockwiseLM.from_base(tiny("llama"), k=3)
    (tmp_path / ".save-x1y2").mkdir()  # a save killed while writing its files: not yet whole
    (tmp_path / ".save-x1y2" / "model.safetensors").write_bytes(b"half a copy")
    (tmp_path / ".heads.safetensors.abc.tmp").write_bytes(b"half")
    lm.save_pretrained(tmp_path)
    assert leftovers(tmp_path) == []
    assert_same_heads(lm, BlockwiseLM.from_pretrained(tmp_path))


# ----------------------------------------------------------------------------- saves stay whole
WRITER = """
import os, sys, itertools
from blockdecode import BlockwiseLM
a, b, out, die_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
models = [BlockwiseLM.from_pretrained(a), BlockwiseLM.from_pretrained(b)]
if die_after:  # die like a SIGKILL once that many of a save's files have been moved into `out`
    replace, moved = os.replace, []
    def dying_replace(src, dst):
        replace(src, dst)
        if os.path.dirname(os.path.abspath(dst)) == os.path.abspath(out):
            moved.append(dst)
            if len(moved) == die_after:
                os._exit(9)
    os.replace = dying_replace
print("ready", flush=True)
for i in itertools.count():
    models[i % 2].save_pretrained(out)
"""


def identity(lm: BlockwiseLM) -> tuple[str, str]:
    return weights_digest(lm.base), weights_digest(lm.heads)


@pytest.fixture
def two_saves(tmp_path: Path) -> tuple[Path, Path, set]:
    """Two whole saves, A and B, that differ in every file, and their identities."""
    folders, identities = [], set()
    for seed in (0, 1):
        lm = perturb_heads(BlockwiseLM.from_base(toy_model("llama", seed=seed), k=4), seed=seed)
        lm.save_pretrained(tmp_path / f"model-{seed}")
        folders.append(tmp_path / f"model-{seed}")
        identities.add(identity(lm))
    return folders[0], folders[1], identities


def writer(a: Path, b: Path, out: Path, die_after: int = 0) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(a), str(b), str(out), str(die_after)],
        stdout=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.stdout.readline().strip() == b"ready"
    return proc


def test_loads_during_repeated_resaves_are_always_one_whole_save(two_saves, tmp_path: Path) -> None:
    """One process re-saves A and B in turn while this one loads: every load is all A or all B. The loads go on
    until they saw the folder change three times (whole saves made while loading), however slow the machine.
    Then the writer is SIGKILLed mid-save: the next load and the next save work, and leave nothing."""
    a, b, identities = two_saves
    out = tmp_path / "out"
    shutil.copytree(a, out)
    proc = writer(a, b, out)
    seen = []
    try:
        while len(seen) < 10 or sum(x != y for x, y in zip(seen, seen[1:])) < 3:
            seen.append(identity(BlockwiseLM.from_pretrained(out)))
            assert len(seen) < 10_000, "the writer's saves never reached a load"
    finally:
        time.sleep(random.Random(0).uniform(0, 0.05))
        proc.kill()
        proc.wait()
    assert set(seen) <= identities, f"{sum(s not in identities for s in seen)} of {len(seen)} loads mixed two saves"
    assert identity(BlockwiseLM.from_pretrained(out)) in identities
    BlockwiseLM.from_pretrained(a).save_pretrained(out)
    assert leftovers(out) == []
    assert identity(BlockwiseLM.from_pretrained(out)) == identity(BlockwiseLM.from_pretrained(a))


@pytest.mark.parametrize("die_after", [2])
def test_a_save_killed_while_moving_its_files_in_is_finished_by_the_next_load(two_saves, tmp_path, die_after):
    a, b, _ = two_saves
    out = tmp_path / "out"
    shutil.copytree(a, out)
    proc = writer(b, a, out, die_after)  # B's save is killed after moving some of its files in
    assert proc.wait() == 9
    assert [p.name for p in out.glob(".save-*")], "the writer died before its swap: nothing to finish"
    assert identity(BlockwiseLM.from_pretrained(out)) == identity(BlockwiseLM.from_pretrained(b))
    assert leftovers(out) == []


def broken(damage: str) -> BlockwiseLM:
    lm = BlockwiseLM.from_base(toy_model("llama"), k=4)
    if damage == "meta":
        lm.to("meta")
    elif damage == "meta heads":
        lm.heads.to("meta")
    elif damage == "no lm_head":
        del lm.base.lm_head
    elif damage == "lm_head None":
        lm.base.lm_head = None
    elif damage == "heads None":
        lm.heads = None
    elif damage == "no heads":
        del lm.heads
    return lm


@pytest.mark.parametrize(
    "damage, error, match",
    [
        ("meta", ValueError, r"of (LlamaForCausalLM|the heads) is on the meta device, which holds no values"),
        ("meta heads", ValueError, r"up.weight of the (heads|BlockwiseLM) is on the meta device"),
        ("no lm_head", ValueError, r"LlamaForCausalLM has no output projection \(lm_head\)"),
        ("lm_head None", ValueError, r"LlamaForCausalLM has no output projection \(lm_head\)"),
        ("heads None", TypeError, r"this BlockwiseLM's heads are NoneType, not a module"),
        ("no heads", TypeError, r"this BlockwiseLM's heads are NoneType, not a module"),
    ],
)
def test_a_broken_model_is_one_clear_error_before_it_is_called(damage: str, error: type, match: str) -> None:
    """A model moved to the meta device, its lm_head deleted or its heads removed: one line naming what is
    wrong, from generate, a plan and calibration alike, not a traceback from deep inside torch."""
    from blockdecode.decoding.calibrate import calibrate

    lm = broken(damage)
    ids = make_prompt(4, 512)
    if damage in ("heads None", "no heads"):  # untrained heads gone: the default drafts by lookup, needing none
        assert lm.generate(ids, 8, eos_token_id=[]).stats.new_tokens == 8
    else:
        with pytest.raises(error, match=match):
            lm.generate(ids, 8)
    for run in (
        lambda: lm.generate(ids, 8, drafter="heads", tree=None),
        lambda: lm.plan("heads", tree=None),
        lambda: calibrate(lm, [ids], "heads", 4),
    ):
        with pytest.raises(error, match=match):
            run()


@pytest.fixture
def shipped(tiny_base, tmp_path: Path) -> Path:
    """tiny_base's folder with trained k=4 paper heads, its tokenizer and a prompts.json, as a model ships."""
    from blockdecode.model import load as load_folder

    lm, tok = load_folder(tiny_base.dir, k=4)
    perturb_heads(lm, seed=1).save_pretrained(tmp_path / "shipped", tokenizer=tok)
    (tmp_path / "shipped" / "prompts.json").write_text(json.dumps(["the quick", "brown fox"]))
    return tmp_path / "shipped"


def test_plan_without_prompts_measures_on_the_models_own(shipped: Path) -> None:
    """`model.plan()` as docs/usage.md writes it: the ranked tree measured on the folder's prompts.json."""
    from blockdecode.model import load as load_folder

    lm, tok = load_folder(shipped)
    assert [p.tolist() for p in lm.prompts] == [tok("the quick", return_tensors="pt").input_ids.tolist(),
                                                tok("brown fox", return_tensors="pt").input_ids.tolist()]  # fmt: skip
    plan = lm.plan()
    assert plan.ranking is not None and plan.drafter_name == "ngram+heads"
    bare = BlockwiseLM.from_base(tiny("llama"), k=4)  # in memory: no prompts to measure on
    for tree in ("expected", "auto"):
        with pytest.raises(ValueError, match=rf"tree='{tree}' measures .* ships none .*pass prompts=\[input_ids\]"):
            bare.plan(tree=tree)


def test_load_refuses_a_head_type_it_would_ignore(shipped: Path, tiny_base) -> None:
    from blockdecode.model import load as load_folder

    for directory in (shipped, tiny_base.dir):
        with pytest.raises(ValueError, match="^unknown head_type 'bogus': choose one of paper, medusa, hydra$"):
            load_folder(directory, k=4, head_type="bogus")
    with pytest.raises(ValueError, match="holds trained paper heads, not head_type='hydra': leave head_type out"):
        load_folder(shipped, head_type="hydra")
    assert load_folder(shipped, head_type="paper")[0].config.head_type == "paper"
    assert load_folder(tiny_base.dir, head_type="hydra")[0].config.head_type == "hydra"


@pytest.mark.parametrize("dtype, error", [("bf16", TypeError), (torch.int64, ValueError), (torch.float64, ValueError)])
def test_load_refuses_a_dtype_by_itself(shipped: Path, dtype, error: type) -> None:
    """Not as a fault of the folder's config.json, which transformers would blame."""
    from blockdecode.model import load as load_folder

    accepted = "torch.float32, torch.bfloat16, torch.float16"
    with pytest.raises(error, match=rf"^dtype must be {accepted}, got .*dtype_for") as err:
        load_folder(shipped, dtype=dtype)
    assert "config.json" not in str(err.value)


def test_a_file_is_not_a_model_folder(tmp_path: Path) -> None:
    from blockdecode.model import load as load_folder

    (tmp_path / "hostname").write_text("box\n")
    for run in (load_folder, BlockwiseLM.from_pretrained):
        with pytest.raises(CheckpointError, match=r"hostname is a file, not a model folder"):
            run(tmp_path / "hostname")


def test_generate_refuses_a_plan_that_is_not_one() -> None:
    lm = BlockwiseLM.from_base(tiny("llama"), k=4)
    with pytest.raises(TypeError, match=r"plan takes a DecodePlan from model.plan\(...\), got str 'heads'"):
        lm.generate(make_prompt(4, 512), 8, plan="heads")


def test_a_hub_name_offline_says_how_to_fetch_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    from blockdecode.model import load as load_folder

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="^nobody/no-such-model is not a folder here.*HF_HUB_OFFLINE=0 to let it"):
        load_folder("nobody/no-such-model")


def test_a_hub_out_of_reach_is_asked_once_and_fails_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """load() and the train path (hf.load_base, hf.load_tokenizer) ask the hub once, with no retries (huggingface_hub
    alone retried for about 25 s), waiting HUB_TIMEOUT at most: the hub is a closed local port here, so nothing
    leaves the machine. Counted in connections, each socket's timeout read as it connects."""
    import socket

    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers

    from blockdecode.loading import HUB_TIMEOUT, load_base, load_tokenizer
    from blockdecode.model import load as load_folder

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    build_hf_headers()  # huggingface_hub's own lookup, once a process (of agents, for its user-agent): not counted
    attempts, connect = [], socket.socket.connect

    def counted(sock: socket.socket, address) -> None:
        attempts.append((address, sock.gettimeout()))
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", counted)
    for run in (load_folder, load_base, load_tokenizer, BlockwiseLM.from_pretrained):
        attempts.clear()
        with pytest.raises(CheckpointError) as err:
            run("nobody/no-such-model")
        assert attempts == [(("127.0.0.1", 9), HUB_TIMEOUT)], run
        said = str(err.value)
        assert "\n" not in said and said.startswith("nobody/no-such-model is not a folder here, and the hub")
        assert "http://127.0.0.1:9) cannot be reached (ConnectError" in said


def test_a_hub_name_is_fetched_once_the_hub_knows_it(shipped: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A name the hub holds is fetched at the commit it names, then loaded as a folder; one it lacks is one line.
    The hub's answers are stand-ins: nothing leaves the machine."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError

    from blockdecode import loading as hf
    from blockdecode.model import load as load_folder

    fetched = []

    class Hub:
        def __init__(self, endpoint: str) -> None:
            pass

        def model_info(self, name: str, timeout: float):
            assert timeout == hf.HUB_TIMEOUT
            if name != "someone/model":
                response = httpx2.Response(404, request=httpx2.Request("GET", f"http://hub/api/models/{name}"))
                raise RepositoryNotFoundError("404 Client Error.\n\nRepository Not Found", response=response)
            return SimpleNamespace(sha="a" * 40)

    def snapshot_download(name: str, revision: str, allow_patterns: list[str], etag_timeout: float) -> str:
        fetched.append((name, revision))
        return str(shipped)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf, "HfApi", Hub)
    monkeypatch.setattr(hf, "snapshot_download", snapshot_download)
    lm, _ = load_folder("someone/model")
    assert fetched == [("someone/model", "a" * 40)] and lm.k == 4 and len(lm.prompts) == 2
    with pytest.raises(CheckpointError, match="^nobody/no-such-model is not a folder here, nor a model the hub .*$"):
        load_folder("nobody/no-such-model")
