"""Suffix lookup's other sources: the suffix array against a scan, a model's remembered outputs (bounded,
forgotten, shared by threads, exact to decode with) and a corpus of files (cached, rebuilt when changed or
damaged, binary files skipped, bad paths named)."""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import NO_EOS, assert_greedy_equal, hf_greedy, make_prompt, perturb_heads, tiny
from test_batch import causal_batch, check_rows
from test_sampling import BUDGET, PROMPT, RUNS, SETTINGS, SHOWN, homogeneity, reference, small

from blockdecode import BlockwiseLM, decode, make_plan
from blockdecode.cli import main
from blockdecode.core.toy import toy_model
from blockdecode.decoding.sampling import sampling_settings
from blockdecode.drafters import sources as src
from blockdecode.drafters.sources import Memory, MemoryConfig, SuffixArray, corpus_index
from blockdecode.drafters.suffix import SuffixDrafter
from blockdecode.pretraining.corpus import train_tokenizer


def occurrences(docs: list[list[int]], s: list[int]) -> list[tuple[int, int]]:
    return [(d, i) for d, doc in enumerate(docs) for i in range(len(doc) - len(s) + 1) if doc[i : i + len(s)] == s]


def check_array(array: SuffixArray, docs: list[list[int]], context: list[int], wide: int) -> None:
    """The longest suffix of `context` held, and at each length every occurrence's next token counted as a
    scan counts it (past `wide` occurrences: every token that followed more than 1 in `wide` of them)."""
    longest, node = array.finder(context, 32)
    assert longest == max(n for n in range(len(context) + 1) if n == 0 or occurrences(docs, context[-n:]))
    assert node(longest + 1) is None
    for size in range(1, longest + 1):
        found = occurrences(docs, context[-size:])
        following = Counter(docs[d][i + size] for d, i in found if i + size < len(docs[d]))
        children = {t: n for t, n, _, _ in array.children(node(size))}
        assert array.went_on(node(size)) == sum(following.values())
        if len(found) <= wide:
            assert children == following
        else:
            assert all(following[t] == n for t, n in children.items())
            assert {t for t, n in following.items() if n * wide > len(found)} <= set(children)


@pytest.mark.parametrize("wide", [src.WIDE, 3])
@pytest.mark.parametrize("seed", range(6))
def test_the_suffix_array_counts_as_a_scan_does(seed: int, wide: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(src, "WIDE", wide)
    rng = random.Random(seed)
    vocab = 2 + seed % 4
    docs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 60))] for _ in range(1 + seed % 3)]
    array = SuffixArray.of(docs)
    assert array.size == sum(map(len, docs))
    for _ in range(20):
        check_array(array, docs, [rng.randrange(vocab + 1) for _ in range(rng.randint(1, 9))], wide)
    children = array.children(array.finder(docs[0][:1], 1)[1](1)) if docs[0] and wide > 3 else []
    for token, _, newest, (lo, hi, _) in children:  # where it last began: the newest occurrence's start
        assert newest == max(array.order[lo:hi]) and token == array.tokens[newest + 1]


def test_the_memory_keeps_the_newest_outputs_under_its_bound() -> None:
    memory = Memory(MemoryConfig(limit=300, young=40))
    added = []
    for i in range(60):
        doc = [i % 50] * (3 + i % 17)
        memory.add([doc])
        added.append(doc)
        assert memory.tokens <= 300
    held = sum(array.size for array in memory.snapshot())
    assert held == memory.tokens > 300 - 40 - 20  # the oldest dropped, no more than to fit
    newest = added[-1]
    assert memory.snapshot()[0].finder(newest, 32)[0] == len(newest)  # the newest output, in the young array
    memory.forget()
    assert memory.tokens == 0 and memory.snapshot() == ()


def test_a_snapshot_stays_as_it_was_while_outputs_are_added() -> None:
    memory = Memory(MemoryConfig(limit=1000, young=8))
    memory.add([[1, 2, 3]])
    view = memory.snapshot()
    drafter = SuffixDrafter(memory=memory)
    drafter.start([[1, 2]])
    memory.add([[1, 2, 9, 9], [4, 5, 6, 7, 8, 9, 10]])  # the young array fills, and joins the old
    assert drafter.sources([1, 2], 0)[1:] == list(view)
    assert drafter.chain([1, 2], 1, 0)[0] == [3]  # the decode reads the memory as it began
    assert SuffixDrafter(memory=memory).chain([1, 2], 1)[0] in ([3], [9])  # one each: either


def lm_and_prompt(seed: int = 3) -> tuple[BlockwiseLM, torch.LongTensor, torch.LongTensor]:
    model = tiny("llama")
    ids = make_prompt(12, 512, seed=seed)
    return BlockwiseLM.from_base(model, k=4), ids, hf_greedy(model, ids, 40, eos_token_id=NO_EOS)


def test_a_remembered_output_lengthens_the_next_decodes_drafts() -> None:
    """The same prompt again: the earlier output is proposed, and stands; remember=False neither reads nor
    adds to the memory; forget() empties it."""
    lm, ids, ref = lm_and_prompt()
    settings = dict(eos_token_id=NO_EOS, drafter="suffix", tree=None)
    first = lm.generate(ids, 40, **settings)
    assert lm.memory.tokens == ref.shape[1]  # the prompt and the output
    again = lm.generate(ids, 40, **settings)
    unread = lm.generate(ids, 40, remember=False, **settings)
    assert lm.memory.tokens == 2 * ref.shape[1]
    for out in (first, again, unread):
        assert_greedy_equal(lm.base, ids, out.sequences, ref)
    assert again.stats.calls < first.stats.calls == unread.stats.calls, (first.stats.calls, again.stats.calls)
    lm.forget()
    assert lm.memory.tokens == 0
    assert lm.generate(ids, 40, **settings).stats.calls == first.stats.calls


@pytest.mark.parametrize("drafter", ["suffix", "heads+suffix"])
def test_threads_share_the_remembered_outputs(drafter: str) -> None:
    """4 threads decode on one model at once, twice each, reading and adding to one memory: each output
    is transformers' greedy."""
    lm, _, _ = lm_and_prompt()
    prompts = [make_prompt(10, 512, seed=s) for s in range(4)]
    refs = [hf_greedy(lm.base, p, 24, eos_token_id=NO_EOS) for p in prompts]
    outs: dict[tuple[int, int], torch.Tensor] = {}

    def work(i: int) -> None:
        for turn in range(2):
            outs[i, turn] = lm.generate(prompts[i], 24, eos_token_id=NO_EOS, drafter=drafter, tree=8).sequences

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (i, turn), out in outs.items():
        assert_greedy_equal(lm.base, prompts[i], out, refs[i], what=f"thread {i}, turn {turn}")
    assert len(outs) == 8 and lm.memory.tokens == 2 * sum(r.shape[1] for r in refs)


def test_a_batch_and_an_encoder_decoder_remember_each_rows_tokens() -> None:
    model, prompts, ids, mask, ref = causal_batch("gpt2")
    lm = BlockwiseLM.from_base(model, k=4)
    for _ in range(2):
        out = lm.generate(ids, 24, attention_mask=mask, eos_token_id=NO_EOS, drafter="suffix")
        check_rows(model, prompts, mask, out.sequences, ref, what="suffix batch")
    assert lm.memory.tokens == 2 * sum(p.shape[1] + 24 for p in prompts)
    marian = tiny("marian")
    source = make_prompt(9, marian.config.vocab_size, seed=1)
    ref = hf_greedy(marian, source, 30)
    lm = BlockwiseLM.from_base(marian, k=4)
    for tree in (None, 8, None):
        out = lm.generate(source, 30, drafter="suffix", tree=tree)
        assert_greedy_equal(marian, source, out.sequences, ref, what=f"marian, tree {tree}")
    assert lm.memory.tokens == 3 * ref.shape[1]  # the decoder's tokens, start token first


def test_sampling_with_remembered_samples_keeps_transformers_distribution() -> None:
    """test_sampling's chi-square test, each run drafting from every earlier run's sample."""
    setting = "t0.7"
    model = small()
    memory = Memory()
    plan = make_plan(
        model, [SuffixDrafter(memory=memory)], k=3, sampling=sampling_settings(model, True, **SETTINGS[setting])
    )
    generator, samples = torch.Generator().manual_seed(0), Counter()
    for _ in range(RUNS):
        out = decode(model, PROMPT, BUDGET[setting], plan, generator=generator).sequences[0]
        memory.add([out.tolist()])
        samples[tuple((out[PROMPT.shape[1] :].tolist() + [1] * SHOWN)[:SHOWN])] += 1
    assert homogeneity(samples, reference(setting)) > 1e-3


def test_a_corpus_needs_a_suffix_drafter_and_a_tokenizer_and_not_remembering_needs_nothing() -> None:
    lm, ids, _ = lm_and_prompt()
    with pytest.raises(ValueError, match=r"corpus= would be ignored: .* \(ngram\) hold none"):
        lm.generate(ids, 8, drafter="ngram", corpus=["some text"])
    lm.generate(ids, 8, drafter="ngram", tree=None, remember=False)  # nothing to remember: allowed as it is
    assert lm.memory.tokens == 0
    with pytest.raises(ValueError, match="this BlockwiseLM has none: load it with blockdecode.load"):
        lm.generate(ids, 8, drafter="suffix", corpus=["some text"])


@pytest.fixture
def texts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of text (one file a level down), a binary file beside them, and the cache in tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(src, "_LOADED", {})
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha beta gamma delta " * 20)
    (folder / "sub" / "b.py").write_text("def f(x):\n    return x + 1\n" * 10)
    (folder / "image.bin").write_bytes(b"\x89PNG\0\x01\x02")
    return folder


def tokenizer():
    return train_tokenizer(["alpha beta gamma delta def f(x): return x + 1 epsilon zeta"], vocab_size=270)


def test_a_corpus_is_indexed_once_and_rebuilt_when_a_file_changes_or_the_cache_is_damaged(
    texts: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = tokenizer()
    built = []
    monkeypatch.setattr(SuffixArray, "of", classmethod(lambda cls, docs: built.append(1) or make(cls, docs)))
    first = corpus_index(tok, [texts, "epsilon zeta"])
    err = capfd.readouterr().err
    assert (
        err.count("note:") == 1
        and "note: corpus: skipped 1 file that is not UTF-8 text, e.g." in err
        and "image.bin" in err
    )
    ids = tok("alpha beta gamma delta", add_special_tokens=False).input_ids
    assert first.finder(ids, 32)[0] == len(ids)
    assert corpus_index(tok, [texts, "epsilon zeta"]) is first and len(built) == 1  # this process: as loaded
    monkeypatch.setattr(src, "_LOADED", {})
    again = corpus_index(tok, [texts, "epsilon zeta"])  # another process: from the cache
    assert len(built) == 1 and np.array_equal(again.order, first.order)
    assert "indexing again" not in capfd.readouterr().err
    (texts / "a.txt").write_text("zeta " * 30)
    changed = corpus_index(tok, [texts, "epsilon zeta"])
    assert len(built) == 2 and changed.size != first.size
    assert capfd.readouterr().err.count("its files changed since they were indexed; indexing again") == 1
    monkeypatch.setattr(src, "_LOADED", {})
    (order,) = Path(src.cache_dir()).glob("*/order.npy")
    order.write_bytes(order.read_bytes()[:-8] + b"\x07" * 8)
    assert np.array_equal(corpus_index(tok, [texts, "epsilon zeta"]).order, changed.order) and len(built) == 3
    err = capfd.readouterr().err
    assert err.count("the cached index in") == 1 and "is damaged" in err


def test_a_file_rewritten_at_its_size_and_time_is_indexed_again_and_a_generator_is_read(texts: Path) -> None:
    tok = tokenizer()
    file = texts / "a.txt"
    first = corpus_index(tok, (p for p in [file]))  # a generator: read once, not spent by the stamp
    assert first.size == len(tok(file.read_text(), add_special_tokens=False).input_ids)
    info = file.stat()
    file.write_text("zeta ".ljust(info.st_size, "z"))  # same size, then the modification time put back
    os.utime(file, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert file.stat().st_size == info.st_size and file.stat().st_mtime_ns == info.st_mtime_ns
    again = corpus_index(tok, [file])
    assert again is not first and again.size != first.size


@pytest.mark.parametrize("bad, match", [(5, "got int .token ids go to SuffixDrafter"), (b"x y", "got bytes"),
                                        ([1, 2, 3], "got list .token ids go to SuffixDrafter")])  # fmt: skip
def test_a_corpus_item_that_is_no_path_or_text_is_refused_in_one_line(bad, match) -> None:
    lm, ids, _ = lm_and_prompt()
    lm.tokenizer = tokenizer()
    with pytest.raises(TypeError, match=f"corpus takes paths and strings, {match}"):
        lm.generate(ids, 4, drafter="suffix", corpus=[bad])


def test_a_cache_that_cannot_be_written_loses_nothing(tmp_path, monkeypatch, capfd) -> None:
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(src, "_LOADED", {})
    tok = tokenizer()
    array = corpus_index(tok, ["alpha beta gamma delta"])
    assert (
        array.size == len(tok("alpha beta gamma delta", add_special_tokens=False).input_ids)
        and "its index cannot be cached in" in capfd.readouterr().err
    )


def make(cls, docs) -> SuffixArray:
    tokens = src.joined(docs)
    return cls(tokens, src.sort_suffixes(tokens))


def test_a_path_that_cannot_be_read_is_one_line_naming_it(texts: Path) -> None:
    with pytest.raises(ValueError, match=f"corpus: {texts / 'nope'} does not exist"):
        corpus_index(tokenizer(), [texts / "nope"])
    with pytest.raises(ValueError, match=f"corpus: {texts / 'nope'} is neither a file nor a folder"):
        src.corpus_texts(str(texts / "nope"))  # one word naming nothing: a path mistyped, not a text
    assert src.corpus_texts("def f(): pass").texts == ["def f(): pass"]  # words: a text
    with pytest.raises(TypeError, match="corpus takes paths and strings, got int"):
        src.corpus_texts([3])


def test_a_corpus_given_to_generate_is_drafted_from_exactly(texts: Path) -> None:
    """The greedy output's own text as the corpus: decoding is still transformers' greedy, in fewer calls."""
    tok = tokenizer()
    model = toy_model("llama", vocab=len(tok), context=256)
    lm = BlockwiseLM.from_base(model, k=4)
    lm.tokenizer = tok
    ids = tok("alpha beta", return_tensors="pt").input_ids
    ref = hf_greedy(model, ids, 30, eos_token_id=NO_EOS)
    (texts / "output.txt").write_text(tok.decode(ref[0]))
    settings = dict(eos_token_id=NO_EOS, drafter="suffix", tree=None, remember=False)
    alone = lm.generate(ids, 30, **settings)
    read = lm.generate(ids, 30, corpus=[texts], **settings)
    for out in (alone, read):
        assert_greedy_equal(model, ids, out.sequences, ref)
    assert read.stats.calls < alone.stats.calls


def test_a_corpus_given_to_the_default_adds_suffix_lookup_and_says_so(texts: Path, capsys) -> None:
    tok = tokenizer()
    model = toy_model("llama", vocab=len(tok), context=256)
    lm = perturb_heads(BlockwiseLM.from_base(model, k=4))  # trained heads: the default ranks heads+ngram
    lm.tokenizer = tok
    ids = tok("alpha beta", return_tensors="pt").input_ids
    ref = hf_greedy(model, ids, 30, eos_token_id=NO_EOS)
    (texts / "output.txt").write_text(tok.decode(ref[0]))
    out = lm.generate(ids, 30, eos_token_id=NO_EOS, corpus=[texts], remember=False)
    assert_greedy_equal(model, ids, out.sequences, ref)
    assert "corpus= is read by suffix lookup, which joins the default's drafters: heads+ngram+suffix" in out.stats.note
    assert out.stats.supplied.get("suffix", 0) > 0, out.stats.supplied  # the corpus's long matches stood
    lm.default_drafters = "heads+suffix"  # a default that holds suffix lookup already: read as it is
    assert "corpus=" not in lm.generate(ids, 30, eos_token_id=NO_EOS, corpus=[texts], remember=False).stats.note
    main(["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--corpus", str(texts)])  # built-in
    assert "which joins the default's drafters: heads+ngram+suffix" in capsys.readouterr().err


def test_an_empty_string_is_no_corpus_not_the_current_folder(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.txt").write_text("never drafted from")
    with pytest.raises(ValueError, match="corpus: an empty string names nothing"):
        src.corpus_texts("")
    with pytest.raises(ValueError, match="corpus: an empty string names nothing"):
        src.corpus_texts(["a text with spaces", " "])
