"""Chat data for self-distillation: prompts from each of this machine's sources, conversations that are the model's
own greedy (checked against `transformers`' on the same templated prompt), resuming after a kill or a torn line, and
the train / held-out arrays, on a tiny random Qwen2 chat model with ChatML's template."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from test_chat import BUDGET, chat_model, chat_tokenizer, greedy

from blockdecode import load
from blockdecode.chat import chat_ids
from blockdecode.training import chat_data
from blockdecode.training.chat_data import QUESTION_TOKENS, Prompt, answer, make_prompts, to_npy, user
from blockdecode.training.data import load_tokens

GERMAN = "Der neue Gewerbepark wird hunderte Arbeitsplätze schaffen."
DING = f"""# Version :: test
Aal {{m}} | Aal blau :: eel | eel au bleu
Arbeitsstelle {{f}} | Er hat mir eine Stelle besorgt. | {GERMAN} :: job | He found me a job. | hundreds of jobs
Andeutung {{f}} | Er hat den Wink (nicht) wirklich verstanden. :: hint | He did not take the hint.
"""
PROMPTS = [
    Prompt("open", [user("Hello, how are you?")]),
    Prompt("math", [user("What is the cat?"), user("Now make it shorter.")]),
    Prompt("prose", [user("The dog is blue. Hello?")]),
    Prompt("code", [user("def f1(x):\n    return x + 1\n")]),
]


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> SimpleNamespace:
    tok, folder = chat_tokenizer(), tmp_path_factory.mktemp("chat-qwen2")
    chat_model("qwen2", tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    lm, tok = load(folder)
    return SimpleNamespace(dir=folder, lm=lm, tok=tok)


def test_prompts_come_from_each_source_deterministically(monkeypatch, tmp_path, capsys) -> None:
    (tmp_path / "de-en").write_text(DING, encoding="utf-8")
    monkeypatch.setattr(chat_data, "TRANS_DE_EN", tmp_path / "de-en")
    prompts = make_prompts(30, seed=1)
    kinds = [p.kind for p in prompts]
    assert len(prompts) == 30 and {k: kinds.count(k) for k in set(kinds)} == {
        "math": 4, "translation": 2, "open": 3, "prose": 8, "self": 6, "code": 7}  # fmt: skip
    assert sum(len(p.messages) == 2 for p in prompts) == 3 and prompts == make_prompts(30, seed=1) != make_prompts(30)
    text = {k: [p.messages[0]["content"] for p in prompts if p.kind == k] for k in set(kinds)}
    # only example sentences of six words or more, without annotations ("(nicht)"), each taken once
    assert sorted(text["translation"]) == sorted(
        f"Translate into English: {s}" for s in ("Er hat mir eine Stelle besorgt.", GERMAN)
    )
    assert all("```python\n" in t or t.startswith("Write a Python function `") for t in text["code"])
    assert all(t.startswith(("Summarize", "Read the passage", "Rewrite")) for t in text["prose"])
    assert all("step" in t for t in text["math"]) and all(t.startswith(("What is", "When")) for t in text["open"])
    assert len(set(text["self"])) == 6 and all(t.startswith("Write one ") for t in text["self"])
    assert max(len(m["content"]) for p in prompts for m in p.messages) <= 1300  # passages capped near 1,200 chars
    monkeypatch.setattr(chat_data, "TRANS_DE_EN", tmp_path / "absent")
    kinds = [p.kind for p in make_prompts(30, seed=1)]
    assert (
        "translation" not in kinds and kinds.count("code") == 9 and "no translation prompts" in capsys.readouterr().err
    )


def test_a_second_run_avoids_the_prompts_of_the_first(monkeypatch, tmp_path) -> None:
    (tmp_path / "de-en").write_text(DING, encoding="utf-8")
    monkeypatch.setattr(chat_data, "TRANS_DE_EN", tmp_path / "de-en")
    first = make_prompts(30)
    avoid = frozenset(p.messages[0]["content"] for p in first)
    second = make_prompts(40, seed=1, avoid=avoid)
    kinds = [p.kind for p in second]
    assert len(second) == 40 and not avoid & {p.messages[0]["content"] for p in second}
    assert kinds.count("translation") == 0 and kinds.count("self") == 8  # the two German sentences were taken
    assert make_prompts(40, seed=1, avoid=avoid) == second and make_prompts(40, seed=1) != second


def test_conversations_are_the_models_own_greedy_turns(chat, tmp_path, capsys) -> None:
    path = answer(chat.lm, chat.tok, PROMPTS, tmp_path, BUDGET)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["i"], r["kind"]) for r in records] == [(i, p.kind) for i, p in enumerate(PROMPTS)]
    for record, prompt in zip(records, PROMPTS, strict=True):
        messages, written = record["messages"], 0
        assert [m for m in messages if m["role"] == "user"] == prompt.messages
        for turn in range(len(prompt.messages)):  # each turn: transformers' greedy on the conversation so far
            ids = chat_ids(chat.tok, messages[: 2 * turn + 1])
            ref = greedy(chat.lm.base, ids)[0]
            written += len(ref) - ids.shape[1]
            reply = ref[ids.shape[1] :].tolist()
            assert messages[2 * turn + 1]["content"] == chat.tok.decode(reply, skip_special_tokens=True)
        assert record["ids"] == ref.tolist() and record["reply_tokens"] == written
    assert records[0]["ids"][-1] == chat.tok.convert_tokens_to_ids("<|im_end|>")  # the turn's end kept where it ended
    assert "chat data: 4/4 conversations" in capsys.readouterr().out


def test_a_killed_run_resumes_to_the_same_file(chat, tmp_path, monkeypatch) -> None:
    whole = answer(chat.lm, chat.tok, PROMPTS, tmp_path / "whole", BUDGET).read_bytes()
    calls, generate = [], chat.lm.generate

    def killed(*args, **kwargs):  # the third call: the two-turn conversation's second turn
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    monkeypatch.setattr(chat.lm, "generate", killed)
    with pytest.raises(KeyboardInterrupt):
        answer(chat.lm, chat.tok, PROMPTS, tmp_path / "killed", BUDGET)
    path = tmp_path / "killed" / "conversations.jsonl"
    assert len(path.read_text().splitlines()) == 1  # the interrupted conversation is lost, and only it
    monkeypatch.undo()
    assert answer(chat.lm, chat.tok, PROMPTS, tmp_path / "killed", BUDGET).read_bytes() == whole
    with pytest.raises(ValueError, match="conversation 0 answers another prompt than this run's"):
        answer(chat.lm, chat.tok, PROMPTS[::-1], tmp_path / "killed", BUDGET)
    with pytest.raises(ValueError, match="made with max_new_tokens=40, not 8: use a fresh --out"):
        answer(chat.lm, chat.tok, PROMPTS, tmp_path / "killed", 8)


def test_a_self_instruct_prompt_is_answered_as_the_models_own_question(chat, tmp_path) -> None:
    ask = Prompt(
        "self", [user("Write one factual question about pets that someone might ask. Reply with the question.")]
    )
    path = answer(chat.lm, chat.tok, [ask, PROMPTS[1]], tmp_path, BUDGET)
    record = json.loads(path.read_text().splitlines()[0])
    ids = chat_ids(chat.tok, ask.messages)  # the question: the model's greedy reply to the ask, its first line
    written = chat.tok.decode(greedy(chat.lm.base, ids, QUESTION_TOKENS)[0, ids.shape[1] :], skip_special_tokens=True)
    question = written.strip().split("\n")[0].strip().strip('"*').strip() or ask.messages[0]["content"]
    assert record["kind"] == "self" and record["prompt"] == ask.messages
    assert record["messages"][0] == user(question) and len(record["messages"]) == 2
    assert record["ids"] == greedy(chat.lm.base, chat_ids(chat.tok, [user(question)]))[0].tolist()
    assert answer(chat.lm, chat.tok, [ask, PROMPTS[1]], tmp_path, BUDGET).read_bytes() == path.read_bytes()  # resumes
    with pytest.raises(ValueError, match="conversation 0 answers another prompt"):
        answer(chat.lm, chat.tok, [PROMPTS[0], PROMPTS[1]], tmp_path, BUDGET)


def test_a_torn_last_line_is_dropped_with_a_note(chat, tmp_path, capsys) -> None:
    whole = answer(chat.lm, chat.tok, PROMPTS[:3], tmp_path / "whole", BUDGET).read_bytes()
    path = answer(chat.lm, chat.tok, PROMPTS[:2], tmp_path / "torn", BUDGET)
    with open(path, "a") as f:
        f.write('{"i": 2, "kind": "pro')  # a run killed while writing its third line
    capsys.readouterr()
    assert answer(chat.lm, chat.tok, PROMPTS[:3], tmp_path / "torn", BUDGET).read_bytes() == whole
    assert "dropped a torn last line" in capsys.readouterr().err


def test_to_npy_joins_conversations_with_eos_and_holds_every_nth_out(chat, tmp_path) -> None:
    path = answer(chat.lm, chat.tok, PROMPTS, tmp_path, BUDGET)
    ids = [json.loads(line)["ids"] for line in path.read_text().splitlines()]
    eos = chat.tok.eos_token_id
    train, heldout = to_npy(tmp_path, holdout=0.5)  # every 2nd conversation: 0 and 2 held out
    assert np.load(train).dtype == np.int32 and np.load(train).tolist() == ids[1] + [eos] + ids[3]
    assert np.load(heldout).tolist() == ids[0] + [eos] + ids[2]
    held = [json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert [(r["i"], [m["content"] for m in r["messages"] if m["role"] == "user"]) for r in held] == [
        (0, ["Hello, how are you?"]), (2, ["The dog is blue. Hello?"])]  # fmt: skip
    assert load_tokens([train]).tolist() == ids[1] + [eos] + ids[3]  # what `blockdecode train --data` reads
    with pytest.raises(ValueError, match="holdout must be in"):
        to_npy(tmp_path, holdout=0.9)


def test_the_command_makes_prompts_answers_them_and_writes_the_arrays(chat, tmp_path, monkeypatch) -> None:
    avoided = []
    monkeypatch.setattr(chat_data, "make_prompts", lambda n, seed, avoid: avoided.append(avoid) or PROMPTS[:n])
    out, flags = tmp_path / "data", ["--max-new-tokens", "8", "--threads", "1", "--dtype", "fp32"]
    chat_data.main(["--gguf", str(chat.dir), "--out", str(out), "--prompts", "3", *flags])
    assert len((out / "conversations.jsonl").read_text().splitlines()) == 3 and avoided == [frozenset()]
    assert {p.name for p in out.iterdir()} >= {"train.npy", "heldout.npy", "heldout.jsonl", "meta.json"}
    first = out / "conversations.jsonl"
    chat_data.main(["--gguf", str(chat.dir), "--out", str(tmp_path / "two"), "--prompts", "1", "--avoid", str(first),
                    *flags])  # fmt: skip
    assert avoided[1] == {p.messages[0]["content"] for p in PROMPTS[:3]}
    with pytest.raises(SystemExit, match="--avoid: no conversations at .*absent.jsonl"):
        chat_data.main(
            ["--gguf", str(chat.dir), "--out", str(tmp_path / "x"), "--avoid", str(tmp_path / "absent.jsonl")]
        )
