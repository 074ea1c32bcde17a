"""Shared test helpers: tiny random-weight models, transformers' greedy reference, and the exactness rule.

Everything runs offline on CPU in fp32; a toy model generates 40 tokens in milliseconds."""

from __future__ import annotations

import functools
import os
import random
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: tests never touch the hub
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="blockdecode-test-cache-")  # calibrations stay out of ~
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import PreTrainedModel  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from blockdecode.core import io  # noqa: E402
from blockdecode.core.toy import toy_model  # noqa: E402
from blockdecode.pretraining.corpus import train_tokenizer  # noqa: E402
from blockdecode.training.config import TrainConfig  # noqa: E402
from blockdecode.training.data import load_tokens, pack  # noqa: E402

_atomic_write = io.atomic_write

# One thread: these models are too small to gain from more, and with two the 2-core CI box showed
# multi-second scheduling stalls on millisecond forwards.
torch.set_num_threads(1)
hf_logging.set_verbosity_error()  # "pass an attention_mask" advice is noise for unpadded single rows

NO_EOS: list[int] = []  # an empty EOS list: transformers and blockdecode both decode the whole budget


@functools.cache
def tiny(arch: str, seed: int = 0, **size: int) -> PreTrainedModel:
    """A cached toy model. Shared across tests, so tests must not modify it: build a fresh
    `toy_model` for anything that edits weights or configs."""
    model = toy_model(arch, seed=seed, **size)
    assert model.dtype == torch.float32 and not model.training
    return model


def script(name: str):
    """A benchmark script (benchmarks/<name>.py) as a module, for testing what it decides. Its folder
    goes first on sys.path, as when the script runs, so that it finds the scripts it imports."""
    import importlib.util
    import sys

    folder = Path(__file__).parents[1] / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import leaves it: a dataclass of the script looks its module up there
    spec.loader.exec_module(module)
    return module


def keep_checkpoint_at(monkeypatch, module, step: int, dest: Path) -> None:
    """Copy the checkpoint folder `module` writes at `step` to `dest`: what a kill after that step
    would leave, now that a finished run keeps its last step's checkpoint."""
    save = module.save_checkpoint

    def saving(path: Path, state: dict) -> None:
        save(path, state)
        if state["step"] == step:
            shutil.copytree(path.parent, dest)

    monkeypatch.setattr(module, "save_checkpoint", saving)


def interrupt_after(monkeypatch, files: int) -> None:
    """From now on, the `files`-th file written atomically raises KeyboardInterrupt once it is written:
    a Ctrl-C that lands just after it."""
    written: list[Path] = []

    def interrupted(path: Path, write) -> None:
        _atomic_write(path, write)
        written.append(path)
        if len(written) == files:
            raise KeyboardInterrupt

    monkeypatch.setattr(io, "atomic_write", interrupted)


def vocab_size(model: PreTrainedModel) -> int:
    return model.get_output_embeddings().weight.shape[0]


def make_prompt(length: int, vocab: int, seed: int = 0) -> torch.LongTensor:
    """Random ids [1, length], avoiding 0 and 1 (the toys' BOS and EOS) so a prompt never looks special."""
    return torch.randint(2, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def hf_greedy(model: PreTrainedModel, ids: torch.LongTensor, max_new_tokens: int, **kwargs) -> torch.LongTensor:
    """transformers' own greedy decoding, the ground truth. Omit eos_token_id to get the generation
    config's EOS (the toys say 1); note that passing eos_token_id=None explicitly to transformers
    disables EOS instead, while blockdecode reads None as "use the generation config"."""
    mask = torch.ones_like(ids)
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)


@torch.inference_mode()
def assert_greedy_equal(
    model: PreTrainedModel,
    ids: torch.LongTensor,
    ours: torch.LongTensor,
    ref: torch.LongTensor,
    tol: float = 1e-4,
    what: str = "",
) -> None:
    """Assert that `ours` is greedy decoding of `model` from prompt `ids`, given the reference `ref`.

    The rule: the two sequences must be identical, with one exception. Verifying a block in one pass
    sums in a different order than decoding token by token, and float non-associativity can flip a
    near tie. So at the first position where they differ, run the base model in fp32 over the
    reference prefix before it (one full forward, no cache); if the top-2 logit gap there is below
    `tol` and our token is one of the tied ones (it trails the top logit by less than `tol`), the
    difference is accepted and the rest, being a different context, is not compared. Anything else
    fails: a token with a clear margin, or a length difference on identical tokens (an EOS or budget
    bug), with a message giving the position and the gap. For an encoder-decoder, `ids` is the source
    and the sequences are the decoder's, from its start token."""
    ours, ref = ours.reshape(-1).cpu(), ref.reshape(-1).cpu()
    seq2seq = model.config.is_encoder_decoder
    start = 1 if seq2seq else ids.shape[-1]
    prefix = f"{what}: " if what else ""
    assert torch.equal(ours[:start], ref[:start]), f"{prefix}the output does not begin with the prompt"
    n = min(len(ours), len(ref))
    diff = (ours[:n] != ref[:n]).nonzero()
    if len(diff) == 0:
        assert len(ours) == len(ref), (
            f"{prefix}same tokens, but {len(ours) - start} new tokens where the reference has {len(ref) - start}"
        )
        return
    pos = int(diff[0])
    device = next(model.parameters()).device
    if seq2seq:
        out = model(input_ids=ids.to(device), decoder_input_ids=ref[None, :pos].to(device), use_cache=False)
    else:
        out = model(ref[None, :pos].to(device), use_cache=False)
    logits = out.logits[0, -1].float().cpu()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    trail = float(logits.max() - logits[ours[pos]])
    assert gap < tol and trail < tol, (
        f"{prefix}new token {pos - start} (position {pos}) differs: ours {int(ours[pos])}, reference "
        f"{int(ref[pos])}; reference top-2 logit gap {gap:.3g}, our token trails the top by {trail:.3g} "
        f"(tolerance {tol})"
    )


def assert_bf16_weights(folder: Path) -> None:
    """A shipped model's base and heads are stored in bf16, the form that fits the package's budget (token
    ids, a draft vocabulary's `token_map`, stay integers)."""
    from safetensors import safe_open

    for weights in ("model.safetensors", "heads.safetensors"):
        with safe_open(folder / weights, "pt") as f:
            dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
        assert {d for name, d in dtypes.items() if name != "token_map"} == {"BF16"}, weights
        assert dtypes.get("token_map", "I64") == "I64", weights


def perturb_heads(lm: torch.nn.Module, seed: int = 0, std: float = 0.5) -> torch.nn.Module:
    """Give the heads random weights, as if trained (badly): zero-init heads only ever propose the base
    model's next token repeated, random ones propose arbitrary tokens, which exactness must survive."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.heads.parameters():
            torch.nn.init.normal_(p, std=std, generator=gen)
    lm.heads_trained = True  # drafter="auto" asks them, as it asks trained ones
    return lm


# ----------------------------------------------------------------------------- head training's toy runs
# shared by the tests of training, its config and its distilled data


WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
CONTEXT = 256
SEQ_LEN = 64


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> SimpleNamespace:
    """A saved toy Llama + byte-level BPE tokenizer, and the corpus they were made for.

    The model's EOS is the tokenizer's <|endoftext|>, as for a real checkpoint, so EOS separators
    in the training data and EOS stops in distillation use the same id."""
    root = tmp_path_factory.mktemp("tiny-base")
    rng = random.Random(0)
    lines = []
    for _ in range(1500):
        start = rng.randrange(len(WORDS))
        lines.append(" ".join(WORDS[(start + j) % len(WORDS)] for j in range(12)))
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(lines))
    tok = train_tokenizer([corpus.read_text()], vocab_size=300)
    model = toy_model("llama", vocab=len(tok), width=64, layers=2, std=0.02, context=CONTEXT)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = tok.eos_token_id
        cfg.bos_token_id = tok.eos_token_id
        cfg.pad_token_id = tok.pad_token_id
    base = root / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    sequences = pack(load_tokens([corpus], tok, tok.eos_token_id), SEQ_LEN)
    return SimpleNamespace(dir=base, corpus=corpus, tokenizer=tok, vocab=len(tok), sequences=sequences)


def make_cfg(tiny_base: SimpleNamespace, out: Path, **overrides) -> TrainConfig:
    """The brief's fast configuration (1-4 s a run), with a lighter evaluation."""
    kw = dict(
        base=str(tiny_base.dir),
        data=[str(tiny_base.corpus)],
        out=str(out),
        k=4,
        mode="frozen",
        steps=60,
        batch_size=8,
        seq_len=SEQ_LEN,
        lr=3e-3,
        base_lr=1e-3,
        eval_every=30,
        log_every=10,
        checkpoint_every=30,
        eval_batches=2,
        eval_prompts=2,
        eval_prompt_len=16,
        eval_new_tokens=32,
        distill_prompts=32,
        distill_new_tokens=48,
        distill_prompt_len=16,
        mixed_precision="no",  # fp32 numerics, compared at 1e-5; "auto" would be bf16 on some CPUs
    )
    kw.update(overrides)
    return TrainConfig(**kw)


def varied_base(vocab: int):
    """A random base whose greedy text varies (std 0.2), so continuations are not one repeated token."""
    return toy_model("llama", vocab=vocab, width=64, layers=2, std=0.2, context=CONTEXT)


@pytest.fixture(scope="module")
def tiny_marian(tmp_path_factory) -> SimpleNamespace:
    """A toy Marian with a shared BPE trained on the committed verse sample, saved as a folder."""
    from blockdecode.pretraining.bible import read_tsv
    from blockdecode.pretraining.translation import marian_generation_config, translation_tokenizer

    root = tmp_path_factory.mktemp("tiny-marian")
    verses = Path(__file__).parent / "data" / "bible" / "train.tsv"
    tok = translation_tokenizer([t for p in read_tsv(verses) for t in (p.source, p.target)], 400)
    model = toy_model("marian", vocab=len(tok), width=64, layers=2, context=128)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    for c in (model.config,):
        c.eos_token_id, c.pad_token_id, c.decoder_start_token_id, c.forced_eos_token_id = eos, pad, pad, eos
    model.generation_config = marian_generation_config(tok, 128)
    model.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    return SimpleNamespace(dir=root / "base", data=verses, tokenizer=tok)


def pairs_cfg(tiny_marian: SimpleNamespace, out: Path, **overrides) -> TrainConfig:
    kw = dict(base=str(tiny_marian.dir), data=[str(tiny_marian.data)], out=str(out), k=4, steps=6, batch_size=8,
              seq_len=128, lr=3e-3, base_lr=1e-3, eval_every=3, checkpoint_every=3, log_every=1, eval_batches=1,
              eval_prompts=2, eval_new_tokens=24, distill_batch_size=16, distill_new_tokens=40)  # fmt: skip
    return TrainConfig(**{**kw, **overrides})


# ----------------------------------------------------------------------------- a GGUF file, written here


GGUF_WORDS = ["▁the", "▁def", "▁return", "▁self", "▁and", "▁of", "in", "er", "on", "at"]
GGUF_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


def write_gemma3_gguf(
    path: Path, architecture: str = "gemma3", layers: int = 6, width: int = 64, seed: int = 0
) -> None:
    """A random Gemma 3 as llama.cpp lays it out: GGUF's tensor names, norms stored as 1 + weight, 2-D
    weights in Q8_0, and a SentencePiece-style vocabulary (specials, 256 byte tokens, letters, words)."""
    heads, head_dim, ffn = 4, 16, 2 * width
    rng = np.random.default_rng(seed)
    tokens = [*GGUF_SPECIAL, *(f"<0x{i:02X}>" for i in range(256)), "▁", *"abcdefghijklmnopqrstuvwxyz", *GGUF_WORDS]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("toy")
    writer.add_context_length(512)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(8)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 260 + [-1.0] + [-2.0] * 26 + [-0.5] * len(GGUF_WORDS))
    writer.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * (1 + 26 + len(GGUF_WORDS)))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)

    def tensor(name: str, *shape: int) -> None:
        if len(shape) == 1:  # a norm: GGUF keeps Gemma's 1 + weight
            writer.add_tensor(name, (1.0 + rng.normal(0, 0.1, shape)).astype(np.float32))
            return
        values = rng.normal(0, 0.2, shape).astype(np.float32)
        q8 = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quantize(values, q8), raw_dtype=q8)  # byte rows: the shape follows

    tensor("token_embd.weight", len(tokens), width)
    for i in range(layers):
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, width)
        tensor(f"blk.{i}.attn_k.weight", head_dim, width)
        tensor(f"blk.{i}.attn_v.weight", head_dim, width)
        tensor(f"blk.{i}.attn_output.weight", width, heads * head_dim)
        tensor(f"blk.{i}.attn_q_norm.weight", head_dim)
        tensor(f"blk.{i}.attn_k_norm.weight", head_dim)
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            tensor(f"blk.{i}.{norm}.weight", width)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, width)
        tensor(f"blk.{i}.ffn_up.weight", ffn, width)
        tensor(f"blk.{i}.ffn_down.weight", width, ffn)
    tensor("output_norm.weight", width)
    tensor("output.weight", len(tokens), width)  # untied: tied, the embedding scale repeats the last token
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
