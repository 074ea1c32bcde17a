"""`blockdecode bench` on a tiny model: every method and metric is there, exact methods match greedy,
the plots are written, and the tables come from the JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from blockdecode import BlockwiseLM
from blockdecode.bench import PRESETS, BenchConfig, Run, block_stats, run_bench
from blockdecode.bench.suite import default_prompts, methods_for, sourced
from blockdecode.cli import main
from blockdecode.core.toy import toy_model
from blockdecode.decoding.plan import make_plan
from blockdecode.drafters.sources import SuffixArray
from blockdecode.model import load
from blockdecode.pretraining.corpus import train_tokenizer
from tests.conftest import interrupt_after, perturb_heads

METRICS = (
    "tokens_per_s",
    "speedup",
    "calls_per_token",
    "identical_to_greedy",
    "token_agreement",
    "chrf",
    "loss",
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A saved BlockwiseLM (k=4) with its tokenizer, a smaller draft model on the same vocabulary, prompts."""
    root = tmp_path_factory.mktemp("bench")
    text = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))
    tokenizer = train_tokenizer([text], vocab_size=300)
    vocab = len(tokenizer)
    base = toy_model("llama", vocab=vocab, context=256)
    perturb_heads(BlockwiseLM.from_base(base, k=4), std=0.05).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    toy_model("llama", seed=1, vocab=vocab, width=32, layers=1, context=256).save_pretrained(root / "draft")
    (root / "prompts.json").write_text(json.dumps(["def f(x):\n", "def g(y):\n    return"]))
    return {"root": root, "vocab": vocab}


def quick_config(setup: dict, **overrides) -> BenchConfig:
    root = setup["root"]
    return BenchConfig.quick(
        **{
            "model": str(root / "model"),
            "draft": str(root / "draft"),
            "prompts": str(root / "prompts.json"),
            "ks": [2, 4],
            "dtype": "fp32",
            "new_tokens": 12,
            "max_q": 6,
            "out": str(root / "out"),
            **overrides,
        }
    )


def test_quick_bench_reports_every_method_and_metric(setup: dict) -> None:
    cfg = quick_config(
        setup,
        acceptance=["topk:2", "min-block:2"],
        system=True,
        system_model=dict(vocab=setup["vocab"], width=32, layers=1, heads=2),
        system_accuracies=[0.5, 1.0],
        trees=[16, "auto"],
        static_cache=True,
    )
    report = run_bench(cfg, show=False)
    saved = json.loads((Path(cfg.out) / "bench.json").read_text())
    assert saved["methods"].keys() == report["methods"].keys()
    expected = {"greedy", "prompt lookup", "assisted", "heads k=2", "heads k=4", "n-gram k=2", "n-gram k=4"}
    expected |= {"greedy static", "heads k=4 static", "n-gram k=4 static", "heads-rescored k=4"}
    expected |= {"heads k=2 topk:2", "heads k=4 topk:2", "heads k=2 min-block:2", "heads k=4 min-block:2"}
    expected |= {"heads tree 16 k=4", "ngram tree 16 k=4", "heads+ngram tree 16 k=4"}  # trees at the largest k
    auto = {
        name
        for name in saved["methods"]
        if re.fullmatch(r"(heads|ngram|heads\+ngram) tree auto \((\d+|chain)\) k=4", name)
    }
    assert len(auto) == 3 and "heads+ngram tree auto (chain) k=4" not in auto  # shared drafters need a tree
    assert set(saved["methods"]) == expected | auto
    for name, r in saved["methods"].items():
        for metric in METRICS:
            assert metric in r, (name, metric)
        if r["exact_method"]:
            assert r["identical_to_greedy"], name
            assert r["chrf"] == pytest.approx(100.0) and r["token_agreement"] == 1.0
        if r["family"] in ("heads", "ngram", "heads tree", "ngram tree", "heads+ngram tree"):
            assert len(r["block_histogram"]) == r["k"] and len(r["head_acceptance"]) == r["k"] - 1
            assert r["efficiency"] > 0 and r["ceiling"] > 0
            assert 1 / r["calls_per_token"] <= r["k"]
    assert saved["methods"]["greedy"]["calls_per_token"] == pytest.approx(1.0)
    assert saved["methods"]["assisted"]["draft_calls_per_token"] > 0
    assert set(saved["cost"]["seconds"]) == {str(q) for q in range(1, 7)}
    env = saved["environment"]
    assert env["dtype"] == "fp32" and env["threads"] >= 1 and env["torch"] and env["transformers"]
    system = saved["system_ceiling"]["methods"]
    assert system["scripted p=1"]["mean_block_size"] > system["scripted p=0.5"]["mean_block_size"]
    for png in ("speedup.png", "blocks.png", "cost.png", "batches.png"):
        assert (Path(cfg.out) / png).stat().st_size > 1000
    sampled = saved["sampling"]["0.7"]  # --quick samples at 0.7, against transformers' own sampling
    assert sampled["settings"] == "temperature=0.7, top_k=50, top_p=1"
    (auto,) = [name for name in sampled["methods"] if name.startswith("auto")]  # the calibration's chain
    assert re.fullmatch(r"auto \((heads|ngram)\) k=4 sampling", auto)
    assert set(sampled["methods"]) == {"sampling t=0.7", "heads k=4 sampling", "n-gram k=4 sampling", auto}
    assert sampled["methods"]["sampling t=0.7"]["calls_per_token"] == pytest.approx(1.0)
    for name in ("heads k=4 sampling", "n-gram k=4 sampling", auto):
        r = sampled["methods"][name]
        assert 1 <= r["tokens_per_call"] <= 4 and r["mean_block_size"] >= 1 and not r["exact_method"]
    batches = saved["batches"]  # --quick: a batch of 4 prompts, each drafter's chain at k=4
    assert [(r["batch"], r["drafter"], r["k"]) for r in batches] == [(4, d, 4) for d in ("auto", "heads", "ngram")]
    for r in batches:
        assert r["identical"] and r["divergences"] == [] and r["slowest_row_calls"] <= r["calls"] <= r["greedy_calls"]
        assert r["speedup"] > 0 and r["call_cost"] > 0 and 1 <= r["row_mean_block"] <= 4
    assert batches[2]["plan"] == "ngram, chain" and batches[0]["plan"].endswith(", chain")
    table = (Path(cfg.out) / "table.md").read_text()
    assert "| heads k=4 |" in table and "no (approximate)" in table
    assert "| temperature=0.7, top_k=50, top_p=1 | heads k=4 sampling |" in table
    assert "| 4 | ngram (ngram, chain) | 4 |" in table
    assert "| topk:2 | 4 |" in table and "| min-block:2 | 2 |" in table and "| exact | 4 |" in table


def test_block_stats_per_head_rates() -> None:
    runs = [Run([], 1.0, 4, block_sizes=[1, 2, 3, 3])]
    stats = block_stats(runs, 3)
    assert stats["block_histogram"] == [1, 1, 2]
    assert stats["head_reached"] == [0.75, 0.5]  # head 2 accepted in 3 of 4 calls, head 3 in 2
    assert stats["head_acceptance"] == [0.75, pytest.approx(2 / 3)]
    assert stats["mean_block_size"] == 2.25


def test_cli_bench_quick_and_bad_input(setup: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = setup["root"]
    args = ["bench", "--quick", "--model", str(root / "model"), "--prompts", str(root / "prompts.json")]
    args += ["--dtype", "fp32", "--new-tokens", "8", "--out", str(tmp_path)]
    main(args)
    assert "| heads k=2 |" in capsys.readouterr().out
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["config"]["ks"] == [2, 4, 8]  # --quick's own k list
    assert "assisted" not in saved["methods"]  # no draft model given
    assert [r["batch"] for r in saved["batches"]] == [4, 4, 4]
    main([*args, "--batches", "off", "--temperatures", "off", "--acceptance", "exact", "--out", str(tmp_path / "off")])
    saved = json.loads((tmp_path / "off" / "bench.json").read_text())
    assert saved["batches"] == [] and saved["sampling"] == {}
    assert saved["config"]["acceptance"] == [] and {r["acceptance"] for r in saved["methods"].values()} == {"exact"}
    assert not (tmp_path / "off" / "batches.png").exists()
    with pytest.raises(SystemExit, match="topk:N needs an integer N >= 1"):
        main([*args, "--acceptance", "topk:0"])
    capsys.readouterr()
    for flag, value, error in (
        ("--k", "0", "must be an integer >= 1, got 0"),
        ("--temperatures", "0.7,0", "must be a number > 0, got 0"),  # not the API's "do_sample=False"
        ("--batches", "4,0", "must be an integer >= 1, got 0"),
    ):
        with pytest.raises(SystemExit):
            main([*args, flag, value])
        assert f"error: argument {flag}: {error} (see blockdecode bench --help)" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('"def f():"')
    with pytest.raises(SystemExit, match="prompts must be a JSON list of non-empty strings"):
        main([*args, "--prompts", str(tmp_path / "bad.json")])


def test_an_out_that_cannot_be_written_is_refused_before_any_work(setup: dict, tmp_path: Path, monkeypatch) -> None:
    from blockdecode.bench import suite

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(suite, "load", load)
    (tmp_path / "file").write_text("an earlier result")
    for out in (tmp_path / "file", tmp_path / "file" / "bench"):
        with pytest.raises(SystemExit, match=f"^error: --out {out} cannot be written: {tmp_path / 'file'} is not a"):
            main(["bench", "--quick", "--model", str(setup["root"] / "model"), "--out", str(out)])
    assert (tmp_path / "file").read_text() == "an earlier result"


def test_the_tables_are_printed_before_they_are_written(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder that fails when the results are written (a full disk) loses the files, not the run."""
    from blockdecode.bench import report

    def full(*args, **kwargs):
        raise OSError("No space left on device")

    small = dict(system_model=dict(vocab=300, width=32, layers=1, heads=2), system_accuracies=[1.0], fwd_reps=1)
    monkeypatch.setitem(PRESETS, "core", lambda **kw: BenchConfig.core(**{**small, "repeats": 1, **kw}))
    monkeypatch.setattr(report, "saving_folder", full)
    with pytest.raises(SystemExit, match="^error: No space left on device$"):
        main(["bench", "--preset", "core", "--out", str(tmp_path / "out"), "--new-tokens", "6"])
    assert "| scripted p=1 |" in capsys.readouterr().out


def test_core_preset_measures_the_loop_with_both_caches(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--preset core: the scripted-drafter study alone, dynamic and static cache, its table written
    into the run's folder and nowhere else."""
    cfg = BenchConfig.core(
        out=str(tmp_path / "out"),
        new_tokens=12,
        repeats=1,
        fwd_reps=1,
        system_model=dict(vocab=300, width=32, layers=1, heads=2),
        system_accuracies=[0.5, 1.0],
    )
    report = run_bench(cfg, show=False)
    assert report["methods"] == {} and set(report["system_ceiling"]["cost"]) == {"dynamic", "static"}
    study = report["system_ceiling"]["methods"]
    assert {"greedy", "scripted p=1", "scripted p=0.5 static", "scripted p=1 static"} <= set(study)
    for name, r in study.items():
        assert r["identical_to_greedy"], name
        assert r["overhead_ms_per_call"] >= 0 and 0 < r["forward_share"] <= 1
        if name != "greedy":
            assert r["ceiling"] > 0 and r["efficiency"] > 0
    assert study["scripted p=1 static"]["mean_block_size"] > study["scripted p=0.5 static"]["mean_block_size"]
    assert "| scripted p=1 static |" in (tmp_path / "out" / "table.md").read_text()
    args = ["bench", "--preset", "core", "--out", str(tmp_path / "cli"), "--new-tokens", "6"]
    small = dict(system_model=cfg.system_model, system_accuracies=[1.0], fwd_reps=1, repeats=1)
    monkeypatch.setitem(PRESETS, "core", lambda **kw: BenchConfig.core(**{**small, **kw}))
    main(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli", "out"]
    assert "| scripted p=1 static |" in (tmp_path / "cli" / "table.md").read_text()
    assert "Scripted drafters" in capsys.readouterr().out


def test_bench_on_an_encoder_decoder_translates_to_eos_and_stays_exact(tmp_path: Path) -> None:
    """Table 4's harness: greedy, prompt lookup, assisted generation with a smaller Marian, heads,
    n-gram and trees on a translation model, every method stopping at the translation's EOS."""
    from blockdecode.pretraining.bible import read_tsv
    from blockdecode.pretraining.translation import marian_generation_config, translation_tokenizer

    verses = read_tsv(Path(__file__).parent / "data" / "bible" / "train.tsv")
    tokenizer = translation_tokenizer([t for p in verses for t in (p.source, p.target)], 400)
    for name, size in (("model", {}), ("draft", dict(width=32, layers=1))):
        model = toy_model("marian", seed=len(name), vocab=len(tokenizer), context=128, **size)
        model.config.decoder_start_token_id = tokenizer.pad_token_id
        model.generation_config = marian_generation_config(tokenizer, 128)
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    cfg = BenchConfig.quick(model=str(tmp_path / "model"), draft=str(tmp_path / "draft"), ks=[2, 4], dtype="fp32",
                            new_tokens=40, n_prompts=2, max_q=4, trees=[8], out=str(tmp_path / "out"))  # fmt: skip
    report = run_bench(cfg, show=False)
    assert report["task"] == "translation"  # docs/results.md gives it a table of its own, not the code one
    methods = report["methods"]
    assert {"greedy", "prompt lookup", "assisted", "heads k=4", "n-gram k=2", "heads+ngram tree 8 k=4"} <= set(methods)
    for name, r in methods.items():
        assert r["identical_to_greedy"], name
    eos = tokenizer.eos_token_id
    assert all(out[-1] == eos for out in methods["greedy"]["outputs"])  # each translation ended at its EOS
    assert all(r["identical"] for r in report["batches"])  # right-padded sources, each row to its own EOS


def test_an_interrupted_bench_leaves_the_old_folder_or_the_new_one(tmp_path: Path, monkeypatch) -> None:
    """Stopped (Ctrl-C) after any file of a new run is written, `bench --out` leaves the earlier run's
    files as they were; finished, the new run's set alone, with no plot of the earlier run beside it."""
    from blockdecode.bench.report import write_report

    small = dict(new_tokens=6, repeats=1, fwd_reps=1, system_accuracies=[1.0])
    cfg = BenchConfig.core(
        out=str(tmp_path / "new"), system_model=dict(vocab=300, width=32, layers=1, heads=2), **small
    )
    report = run_bench(cfg, show=False)
    new = {p.name: p.read_bytes() for p in (tmp_path / "new").iterdir()}
    out = tmp_path / "out"
    out.mkdir()
    for name in ("bench.json", "table.md", "speedup.png", "blocks.png", "cost.png"):
        (out / name).write_text(f"the earlier run's {name}")
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    for stop in range(1, len(new) + 1):
        interrupt_after(monkeypatch, stop)
        with pytest.raises(KeyboardInterrupt):
            write_report(report, out)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == old, f"stopped after {stop} files"
    monkeypatch.undo()
    write_report(report, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(new)
    assert json.loads((out / "bench.json").read_text()) == json.loads(new["bench.json"])


def test_more_prompts_than_shipped_are_capped_with_one_note(setup: dict) -> None:
    """--n-prompts beyond the model's prompts.json measures each prompt once, and says so."""
    with pytest.warns(UserWarning, match=r"100000 prompts asked for; .*prompts\.json holds 2: each is measured once"):
        texts = default_prompts(setup["root"], 100000)
    assert texts == json.loads((setup["root"] / "prompts.json").read_text())


def test_a_k_beyond_the_heads_names_the_rows_it_drops(setup: dict) -> None:
    """--k 16 on heads of k=4: the heads' rows at 16 are dropped, and the note says which and why."""
    lm = BlockwiseLM.from_pretrained(setup["root"] / "model")
    cfg = quick_config(setup, ks=[2, 16], trees=[8], static_cache=True)
    with pytest.warns(UserWarning, match=r"--k 16: the heads propose at most k=4, so k=16 gets n-gram rows alone"):
        names = [m.name for m in methods_for(cfg, lm, None, [])]
    assert "heads k=2" in names and "n-gram k=16" in names and "heads k=16" not in names
    assert "heads tree 8 k=2" in names  # the trees at the largest k that fits


def suffix_config(setup: dict, **overrides) -> BenchConfig:
    """The suffix chain at k=4 alone beside greedy: no draft, trees, sampling or batches."""
    settings = dict(draft=None, ks=[4], max_q=4, fwd_reps=1, trees=[], temperatures=[], batches=[], drafters=["suffix"])
    return quick_config(setup, **{**settings, **overrides})


def test_a_corpus_reaches_suffix_lookup_and_is_recorded(setup: dict, tmp_path: Path) -> None:
    """A corpus holding greedy's own continuations: the suffix chain makes fewer calls with it than
    without, stays exact, and bench.json records the corpus beside the other settings."""
    alone = run_bench(suffix_config(setup, out=str(tmp_path / "alone")), show=False)
    tokenizer = load(setup["root"] / "model")[1]
    texts = [tokenizer.decode(out) for out in alone["methods"]["greedy"]["outputs"]]
    (tmp_path / "seen.txt").write_text("\n".join(texts))
    cfg = suffix_config(setup, corpus=[tmp_path / "seen.txt"], out=str(tmp_path / "with"))
    report = run_bench(cfg, show=False)
    with_corpus, without = report["methods"]["suffix k=4"], alone["methods"]["suffix k=4"]
    assert with_corpus["identical_to_greedy"] and with_corpus["family"] == "suffix"
    assert with_corpus["calls_per_token"] < without["calls_per_token"]
    saved = json.loads((tmp_path / "with" / "bench.json").read_text())
    assert saved["config"]["corpus"] == [str(tmp_path / "seen.txt")] and saved["corpus_tokens"] > 0
    assert alone["config"]["corpus"] == () and alone["corpus_tokens"] == 0


def test_the_bench_reads_a_corpus_never_earlier_outputs(setup: dict) -> None:
    """Each prompt is timed alone: a plan's suffix lookup holds the corpus and no model memory."""
    lm, tokenizer = load(setup["root"] / "model")
    lm.memory.add([[1, 2, 3, 4, 5]])
    corpus = SuffixArray.of([[7, 8, 9]])
    (drafter,) = sourced(lm, make_plan(lm.base, "suffix", 4, lm=lm), corpus).drafters
    assert drafter.memory is None and drafter.corpus == (corpus,)
    heads = make_plan(lm.base, "heads", 4, lm=lm)
    assert sourced(lm, heads, corpus) is heads  # no suffix lookup: the plan as it was


def test_cli_bench_drafts_from_a_corpus_with_suffix_drafters(
    setup: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--drafters takes suffix lookup alone (a chain) and sharing a tree; --corpus is repeatable."""
    root = setup["root"]
    (tmp_path / "a.py").write_text("def f(x):\n    return x + 1\n" * 5)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "c.py").write_text("def g(y):\n    return y * 2\n")
    args = ["bench", "--quick", "--model", str(root / "model"), "--prompts", str(root / "prompts.json"), "--k", "4"]
    args += ["--dtype", "fp32", "--new-tokens", "8", "--out", str(tmp_path / "out"), "--trees", "8"]
    args += ["--temperatures", "off", "--batches", "off", "--drafters", "heads,suffix,heads+suffix"]
    main([*args, "--corpus", str(tmp_path / "a.py"), "--corpus", str(tmp_path / "b")])
    assert "| suffix k=4 |" in capsys.readouterr().out
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert saved["config"]["corpus"] == [str(tmp_path / "a.py"), str(tmp_path / "b")]
    assert saved["config"]["drafters"] == ["heads", "suffix", "heads+suffix"]
    rows = {"heads k=4", "suffix k=4", "heads tree 8 k=4", "suffix tree 8 k=4", "heads+suffix tree 8 k=4"}
    assert rows <= set(saved["methods"]) and "n-gram k=4" not in saved["methods"]
    assert all(saved["methods"][name]["identical_to_greedy"] for name in rows)


def test_a_corpus_no_method_reads_or_that_is_not_there_is_refused_in_one_line(
    setup: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--corpus without suffix lookup among the methods, or naming no file, fails before the model loads."""
    from blockdecode.bench import suite

    def loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(suite, "load", loading)
    (tmp_path / "a.py").write_text("x = 1\n")
    args = ["bench", "--model", str(setup["root"] / "model"), "--out", str(tmp_path / "out")]
    corpus = ["--corpus", str(tmp_path / "a.py")]
    unread = "error: corpus is read by suffix lookup, and no method measured here uses it"
    for extra, error in (
        ([], f"{unread} (drafters heads, ngram, heads+ngram; trees auto): add suffix to the drafters"),
        (["--drafters", "heads+suffix", "--trees", "expected"], f"{unread} (drafters heads+suffix; trees expected)"),
        (["--preset", "core"], "error: corpus is read by suffix lookup, and this run measures none of a model's"),
        (["--drafters", "suffix", "--corpus", str(tmp_path / "nope")], f"error: corpus: {tmp_path / 'nope'} does not"),
        (["--drafters", "suffix,heads-rescored"], "error: drafters takes heads, ngram, suffix or several joined by +"),
    ):
        with pytest.raises(SystemExit) as refused:
            main([*args, *corpus, *extra])
        assert str(refused.value).startswith(error) and "\n" not in str(refused.value), extra
    assert not (tmp_path / "out").exists()
