"""Spec-Bench on an instruct model (benchmarks/specbench.py), run short on a tiny random chat model with a ChatML
template and a question file in Spec-Bench's format made here: the questions each subtask takes, the second turn
asked after greedy's first answer, the end of a turn, the equality check, JSON and plot."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import script

from blockdecode import load
from blockdecode.bench.methods import Run
from blockdecode.core.toy import toy_model
from blockdecode.pretraining.corpus import train_tokenizer

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SUBTASKS = ["MT", "trans", "sum", "QA", "math", "RAG"]


@pytest.fixture(scope="module")
def specbench():
    return script("specbench")


def question_rows() -> list[dict]:
    """Spec-Bench's layout: MT-bench rows (two turns) in file order writing, math, writing, then one row of each
    one-turn subtask, and a second translation row."""
    mt = [(81, "writing"), (82, "math"), (83, "writing")]
    rows = [{"question_id": i, "category": c, "turns": [f"Write about the {c} of {i} cats.", "Now say it shorter."]}
            for i, c in mt]  # fmt: skip
    one = ["translation", "summarization", "qa", "math_reasoning", "rag", "translation"]
    rows += [{"question_id": 161 + i, "category": c, "turns": [f"A {c} task: the cat sat on the mat {i} times."],
              "reference": []} for i, c in enumerate(one)]  # fmt: skip
    return rows


def write_questions(path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, specbench):
    """A tiny random Qwen2 with a locally trained tokenizer and a ChatML template; its generation config ends a turn
    at <|im_end|> and at a token its greedy answer to the first question writes 4th, so that one turn ends early."""
    root = tmp_path_factory.mktemp("chat")
    texts = [t for r in question_rows() for t in r["turns"]] * 20
    tok = train_tokenizer(texts, vocab_size=320, special_tokens=("<|im_end|>", "<|im_start|>", "<|endoftext|>"))
    tok.chat_template = CHATML
    model = toy_model("qwen2", vocab=len(tok), width=64, layers=2)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = tok.eos_token_id, None, tok.pad_token_id
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    model, tok = load(root / "model")  # as saved: its output layer tied to the input's, the tokenizer read back
    model = model.base
    ids = specbench.chat_ids(tok, [{"role": "user", "content": question_rows()[0]["turns"][0]}])
    new = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)[0, ids.shape[1] :]
    stop = next(int(t) for i, t in enumerate(new.tolist()) if i >= 3 and t not in new[:i].tolist())
    config = model.generation_config
    config.eos_token_id = [tok.eos_token_id, stop]  # a list, as Qwen's: <|im_end|> and <|endoftext|>
    config._from_model_config = False  # else loading rebuilds it from the config's one id
    config.save_pretrained(root / "model")
    return root / "model"


def test_each_subtask_takes_its_first_questions_and_mt_bench_spreads_over_categories(specbench, tmp_path):
    rows = question_rows()
    chosen = specbench.pick(rows, 2)
    assert [s for s, _ in chosen] == [s for s in SUBTASKS for _ in range(2 if s in ("MT", "trans") else 1)]
    assert [q["question_id"] for s, q in chosen if s == "MT"] == [81, 82]  # writing, then math: not both writing
    assert [q["question_id"] for s, q in chosen if s == "trans"] == [161, 166]
    assert [q["question_id"] for s, q in specbench.pick(rows, 3) if s == "MT"] == [81, 82, 83]
    with pytest.raises(SystemExit, match="holds no RAG question"):
        specbench.pick([r for r in rows if r["category"] != "rag"], 1, "q.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa", "turns": ["x"]}\n{"question_id": 2}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2 is not a Spec-Bench question"):
        specbench.read_questions(bad)
    with pytest.raises(SystemExit, match="no Spec-Bench questions at"):
        specbench.read_questions(tmp_path / "missing.jsonl")


def test_a_short_run_writes_every_subtask_the_heading_and_the_plot(specbench, chat_model, tmp_path):
    questions, out = tmp_path / "question.jsonl", tmp_path / "specbench.json"
    write_questions(questions, question_rows())
    report = specbench.main(["--model", str(chat_model), "--questions", str(questions), "--per-subtask", "1",
                             "--max-new-tokens", "8", "--methods", "default,llama.cpp", "--drafters", "heads",
                             "--dtype", "fp32", "--threads", "1", "--out", str(out)])  # fmt: skip
    assert report["dtype"] == "fp32" and report["machine"] and report["threads"] == 1 and report["turns"] == 7
    assert report["methods"] == ["transformers greedy", "blockdecode default"]
    assert any("llama.cpp greedy: skipped" in n for n in report["notes"])  # a folder, not a GGUF
    assert any("heads chain: skipped" in n for n in report["notes"])  # untrained heads
    summary = report["summary"]
    for figure in ("speedup", "tokens_per_second", "mean_accepted"):
        assert set(summary[figure]["blockdecode default"]) == {*SUBTASKS, "overall"}
    assert summary["speedup"]["transformers greedy"]["overall"] == 1.0
    assert summary["mean_accepted"]["transformers greedy"]["overall"] == 1.0
    assert summary["identical_turns"] == {"transformers greedy": 7, "blockdecode default": 7}  # fp32: all greedy's
    assert summary["departures"] == []
    rows = report["per_question"]
    assert [r["subtask"] for r in rows] == SUBTASKS and [len(r["turns"]) for r in rows] == [2, 1, 1, 1, 1, 1]
    first, second = rows[0]["turns"]
    assert first["new_tokens"]["transformers greedy"] == 4  # the turn ends at an EOS id, counted as a new token
    assert max(t["new_tokens"]["blockdecode default"] for r in rows for t in r["turns"]) == 8
    assert second["prompt_tokens"] > first["prompt_tokens"] + 4  # greedy's answer, then the second question
    saved = json.loads(out.read_text())
    assert saved["summary"] == json.loads(json.dumps(summary)) and saved["model"] == chat_model.name
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| blockdecode default |" in specbench.table(report)
    assert list(report["call_ms"]) == ["transformers forward"]  # llama.cpp: a folder is no GGUF
    assert list(saved["call_ms"]["transformers forward"]) == ["1", "4", "16"]
    assert "a call of transformers forward: " in specbench.table(saved)


def test_the_equality_check_flags_a_method_whose_output_differs(specbench, chat_model):
    lm, tok = load(chat_model)
    greedy = specbench.build_methods(lm, None, specbench.parse_args(["--methods", "", "--drafters", ""]), 64)[0]
    reference = greedy[specbench.GREEDY]

    def wrong(ids: torch.LongTensor, n: int) -> Run:
        run = reference(ids, n)
        return Run(run.sequence[:-1] + [(run.sequence[-1] + 1) % len(tok)], run.seconds, run.calls)

    rows = specbench.measure(lm, tok, specbench.pick(question_rows(), 1), {**greedy, "wrong": wrong}, 6)
    summary = specbench.summarize(rows, torch.float32)
    assert summary["identical_turns"] == {"transformers greedy": 7, "wrong": 0}
    departures = [(d["method"], d["question_id"], d["turn"], d["fault"]) for d in summary["departures"]]
    assert departures[:3] == [("wrong", 81, 1, True), ("wrong", 81, 2, True), ("wrong", 161, 1, True)]
    turns = [t for r in rows for t in r["turns"]]
    assert [d["position"] for d in summary["departures"]] == [t["new_tokens"]["wrong"] - 1 for t in turns]  # the last
    report = {"dtype": "fp32", "summary": summary}
    assert all("FAULT" in line for line in specbench.equality_lines(report))
    bf16 = specbench.summarize(rows, torch.bfloat16)  # a clear gap is a fault in bf16 too; only a near tie is not
    assert [d["fault"] for d in bf16["departures"]] == [not d["near_tie"] for d in bf16["departures"]]


def test_drafters_are_weighed_on_a_chat_data_runs_held_out_conversations(specbench, chat_model, tmp_path):
    """`--heldout`: the held-out conversations of a chat-data run in place of Spec-Bench, a column a kind; `--ranked`:
    a drafter spec decoded as the default decodes, beside it."""
    held = [{"i": 0, "kind": "code", "messages": [{"role": "user", "content": "Explain the cat."},
                                                  {"role": "assistant", "content": "A cat."}]},
            {"i": 10, "kind": "self", "messages": [{"role": "user", "content": "Why do cats sit?"},
                                                   {"role": "assistant", "content": "They do."},
                                                   {"role": "user", "content": "Now say it shorter."}]},
            {"i": 20, "kind": "code", "messages": [{"role": "user", "content": "Explain the mat."}]}]  # fmt: skip
    path, out = tmp_path / "heldout.jsonl", tmp_path / "heldout.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in held))
    assert [(kind, q["question_id"], len(q["turns"])) for kind, q in specbench.pick_heldout(
        specbench.read_heldout(path), 1)] == [("code", 0, 1), ("self", 10, 2)]  # fmt: skip
    report = specbench.main(["--model", str(chat_model), "--heldout", str(path), "--per-subtask", "2",
                             "--max-new-tokens", "6", "--methods", "", "--drafters", "", "--ranked", "ngram,heads",
                             "--dtype", "fp32", "--threads", "1", "--out", str(out)])  # fmt: skip
    assert report["questions"] == str(path) and report["turns"] == 4
    assert report["methods"] == ["transformers greedy", "blockdecode ngram ranked"]
    assert any("heads ranked: skipped" in n for n in report["notes"])  # untrained heads
    assert set(report["summary"]["speedup"]["blockdecode ngram ranked"]) == {"code", "self", "overall"}
    assert report["summary"]["identical_turns"]["blockdecode ngram ranked"] == 4
    assert "| × transformers' greedy | code | self | overall |" in specbench.table(report)
    (tmp_path / "bad.jsonl").write_text('{"i": 1, "kind": "code"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:1 is not a held-out conversation"):
        specbench.read_heldout(tmp_path / "bad.jsonl")
