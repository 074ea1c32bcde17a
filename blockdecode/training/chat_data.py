"""Chat data for self-distillation, as Medusa-2 and EAGLE train: an instruct model's own greedy replies to prompts
made from what this machine holds, as token ids that `blockdecode train --data train.npy` reads.

No prompt comes from a benchmark. They are built from the standard library's functions (explain, document, write
from a docstring, review), installed packages' descriptions and stdlib modules' docstrings (summarize, answer a
question about a passage, simplify), math word problems from templates, German example sentences of Debian's
trans-de-en dictionary (where installed) to translate, open questions about modules and packages, and questions the
model writes itself (self-instruct: asked for a question of some kind on a topic, it writes one, then answers it in a
conversation of its own). A tenth ask a second turn after the model's own first answer, as MT-bench does. `--avoid`
leaves out the prompts of earlier runs, so that a second, larger set never repeats the first (nor its held-out part).
Each conversation is appended as one line, fsynced, so that a killed run loses at most the one it was answering, and
a rerun continues after the last.

    python -m blockdecode.training.chat_data --gguf qwen.gguf --out runs/qwen-chat/data --prompts 200
    python -m blockdecode.training.chat_data --gguf qwen.gguf --out runs/qwen-chat/data2 --prompts 600 --seed 1 \
        --avoid runs/qwen-chat/data/conversations.jsonl
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import itertools
import json
import os
import random
import re
import sys
import sysconfig
import textwrap
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from blockdecode.chat import chat_ids, reply_text
from blockdecode.core.hf import DTYPE_CHOICES, dtype_for, resolve_eos, stay_offline
from blockdecode.core.io import append_jsonl, atomic_write, read_json, save_npy, write_json, write_text

TRANS_DE_EN = Path("/usr/share/trans/de-en")  # Debian's trans-de-en: Ding dictionary lines "German :: English"
PASSAGE_CHARS = 1200  # about 300 tokens: a passage or a function is cut to this
SHARES = {"math": 0.15, "translation": 0.15, "open": 0.1, "prose": 0.25, "self": 0.2}  # code: the rest, any shortfall
SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
FOLLOW_UPS = ("Now make it shorter.", "Explain it to a beginner.", "Can you give an example?",
              "Sum up your answer in one sentence.")  # fmt: skip
STEP_BY_STEP = ("Solve it step by step.", "Think step by step, then give the final answer.",
                "Show your reasoning step by step.")  # fmt: skip
MATH = (  # {lo-hi}: a number drawn from lo..hi
    "A train travels {60-300} km in {2-5} hours. At the same speed, how far does it travel in {3-9} hours?",
    "Pencils cost {20-95} cents each. Maria buys {2-9} and pays with a {10-20}-dollar bill. What change does she get?",
    "A rectangle is {5-60} m long and {2-40} m wide. What are its area and its perimeter?",
    "Tom has {20-60} apples. He gives {1-19} to his sister and buys {2-30} more. How many apples does he have now?",
    "A recipe needs {200-900} grams of flour for {2-6} people. How much flour is needed for {3-12} people?",
    "A worker earns {12-45} dollars an hour, {4-10} hours a day, {3-6} days a week. What does she earn in a week?",
    "A tank holds {200-2000} l. A pipe adds {15-40} l a minute, a leak loses {1-10} l a minute. When is it full?",
    "A jacket costs {40-250} dollars. It is discounted by {10-50}%, then a tax of {3-12}% is added. What is its price?",
    "Two cars drive off in opposite directions at {40-90} and {50-120} km/h. How far apart are they after {2-6} h?",
    "A bag holds {2-15} red, {2-15} blue and {2-15} green marbles. What is the chance of drawing a blue one?",
    "Anna is {5-15} years old, and her father is {3-5} times as old. How old will her father be in {2-20} years?",
    "A cyclist rides {10-80} km on Monday, {10-80} km on Tuesday and {10-80} km on Wednesday. What is her average?",
    "A plan costs {15-40} dollars a month, {5-25} cents an extra minute. What is the bill with {10-200} extra minutes?",
    "A farmer has {5-50} chickens and {2-20} cows. How many legs do the animals have in all?",
    "A book has {120-600} pages. Lena reads {10-40} pages a day. How many days does she need to finish it?",
)
SELF_ASK = "Write one {style} question about {topic} that someone might ask an AI assistant. Reply with the question."
STYLES = ("factual", "how-to", "why", "comparison", "advice", "short creative writing", "reasoning")
TOPICS = " ".join(
    """history, geography, physics, chemistry, biology, astronomy, medicine, nutrition, cooking,
    travel, sports, music, film, literature, poetry, art, economics, personal finance, law, politics, philosophy,
    psychology, education, careers, language learning, mathematics, statistics, computer networks, databases,
    web development, gardening, pets, operating systems, fitness, climate, energy, transport, architecture, fashion,
    games, parenting, email writing, job interviews, marketing, famous people, world capitals, inventions,
    holidays""".split()
).split(", ")
QUESTION_TOKENS = 48  # a self-instruct question is one sentence


class Prompt(NamedTuple):
    kind: str  # code, prose, math, translation or open
    messages: list[dict]  # user turns: each after the first is asked after the model's answer to the one before


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def stdlib_files(rng: random.Random) -> list[Path]:
    """The standard library's Python files, test packages left out, in an order `rng` shuffles."""
    files = []
    for folder, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(d for d in dirs if d not in SKIP)
        files += [Path(folder, n) for n in sorted(names) if n.endswith(".py") and not n.startswith("test_")]
    rng.shuffle(files)
    return files


def parsed(files: Sequence[Path]) -> Iterator[tuple[Path, list[str], ast.Module]]:
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            yield path, source.splitlines(), ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue


def code(rng: random.Random, count: int) -> list[Prompt]:
    """Two functions at most from each file, each with one of four asks; a function seen before (the codecs' own
    boilerplate, say) but for its strings is left out."""
    made, seen = [], set()
    for _, lines, tree in parsed(stdlib_files(rng)):
        funcs = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
        text = {f: textwrap.dedent("\n".join(lines[f.lineno - 1 : f.end_lineno])) for f in funcs}
        fit = [f for f in funcs if 150 <= len(text[f]) <= PASSAGE_CHARS]
        for f in rng.sample(fit, min(2, len(fit))):
            if (bare := re.sub(r"'[^']*'|\"[^\"]*\"", "", text[f])) in seen:
                continue
            seen.add(bare)
            doc, first, src = ast.get_docstring(f), f.body[0], text[f]
            if doc is not None and len(f.body) > 1 and first.lineno > f.lineno:  # the same function, undocumented
                drop = range(first.lineno - 1, first.end_lineno)
                src = textwrap.dedent("\n".join(lines[i] for i in range(f.lineno - 1, f.end_lineno) if i not in drop))
            block, summary = f"\n\n```python\n{text[f]}\n```", (doc or "").split("\n")[0]
            asks = [f"Explain what this Python function does:{block}",
                    f"Find a bug or suggest an improvement in this Python function:{block}"]  # fmt: skip
            if src != text[f] or not doc:
                asks.append(f"Write a docstring for this function:\n\n```python\n{src}\n```")
            if len(summary) >= 20 and not (f.args.args and f.args.args[0].arg in ("self", "cls")):  # no methods
                asks.append(f"Write a Python function `{f.name}({ast.unparse(f.args)})` that does this: {summary}")
            made.append(Prompt("code", [user(rng.choice(asks))]))
            if len(made) == count:
                return made
    return made


def prose_of(text: str) -> str:
    """The paragraphs of `text` that read as prose (no code, markup, tables or badges), joined, capped."""
    keep = []
    for para in re.split(r"\n\s*\n", text):
        flat = " ".join(para.split())
        prose = sum(c.isalpha() or c in " ,.'" for c in flat) >= 0.85 * len(flat) and flat[:1].isalpha()
        heading = re.search(r"[-=~^*#]{3}", flat)  # a title's underline, a rule
        if len(flat) >= 120 and prose and not heading and not para[:1].isspace():
            keep.append(flat)
    text = "\n\n".join(keep)  # cut at the end of a sentence in the second half of PASSAGE_CHARS, where one ends
    cut = text.rfind(". ", PASSAGE_CHARS // 2, PASSAGE_CHARS) + 1 or PASSAGE_CHARS
    return text if len(text) <= PASSAGE_CHARS else text[:cut]


def passages(rng: random.Random) -> Iterator[tuple[str, str]]:
    """(name, passage): installed packages' descriptions and stdlib modules' docstrings, taken in turn."""
    described = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        described.append((dist.metadata["Name"], prose_of(body if isinstance(body, str) else "")))
    rng.shuffle(described)
    root = Path(sysconfig.get_paths()["stdlib"])
    dotted = lambda p: ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")  # noqa: E731
    modules = ((dotted(p), prose_of(ast.get_docstring(t) or "")) for p, _, t in parsed(stdlib_files(rng)))
    for pair in itertools.chain.from_iterable(itertools.zip_longest(described, modules)):
        if pair and pair[0] and pair[1]:
            yield pair


def prose(rng: random.Random, count: int) -> list[Prompt]:
    made = []
    for name, passage in itertools.islice(passages(rng), count):
        words = Counter(w for w in re.findall(r"[a-z]{7,}", passage.lower()) if w != name.lower())
        about = [f"What does the passage say about {w}?" for w, n in words.most_common(1) if n > 1]
        questions = [f"What is {name} used for?", *about]
        made.append(Prompt("prose", [user(rng.choice((
            f"Summarize the following text in three sentences:\n\n{passage}",
            f"Read the passage and answer: {rng.choice(questions)}\n\n{passage}",
            f"Rewrite this paragraph more simply:\n\n{passage}",
        )))]))  # fmt: skip
    return made


def math(rng: random.Random, count: int) -> list[Prompt]:
    made = []
    for template in (rng.choice(MATH) for _ in range(count)):
        text = re.sub(r"\{(\d+)-(\d+)\}", lambda m: str(rng.randint(int(m[1]), int(m[2]))), template)
        made.append(Prompt("math", [user(f"{text} {rng.choice(STEP_BY_STEP)}")]))
    return made


def translation(rng: random.Random, count: int) -> list[Prompt]:
    """German example sentences of six words or more, annotation-free, from the Ding dictionary's German side."""
    if not TRANS_DE_EN.is_file():
        print(f"note: no {TRANS_DE_EN} (Debian's trans-de-en): no translation prompts", file=sys.stderr)
        return []
    sentences = []
    for line in TRANS_DE_EN.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("#") or " :: " not in line:
            continue
        for s in (s.strip() for s in line.split(" :: ")[0].split("|")):
            if len(s.split()) >= 6 and s[0].isupper() and s[-1] in ".?!" and not set(s) & set("{}[]()/;…<>"):
                sentences.append(s)
    picked = rng.sample(sentences, min(count, len(sentences)))
    return [Prompt("translation", [user(f"Translate into English: {s}")]) for s in picked]


def self_instruct(rng: random.Random, count: int) -> list[Prompt]:
    """Asks for a question of a kind on a topic; `answer` has the model write it, then answer it."""
    asks = [SELF_ASK.format(style=s, topic=t) for s in STYLES for t in TOPICS]
    return [Prompt("self", [user(a)]) for a in rng.sample(asks, min(count, len(asks)))]


def open_questions(rng: random.Random, count: int) -> list[Prompt]:
    names = [f"module `{m}`" for m in sorted(sys.stdlib_module_names) if not m.startswith("_")]
    packages = {d.metadata["Name"] for d in importlib.metadata.distributions()} - {None}
    names += [f"package `{d}`" for d in sorted(packages)]
    asks = ("What is the Python {} for? Give an example.", "When would you use the Python {}? Show a short example.")
    return [Prompt("open", [user(rng.choice(asks).format(n))]) for n in rng.sample(names, min(count, len(names)))]


def make_prompts(n: int, seed: int = 0, avoid: frozenset[str] = frozenset()) -> list[Prompt]:
    """`n` chat prompts from this machine's own text, each source's share as SHARES says, shuffled by `seed`; a
    tenth of them get a second user turn. None opens with a message in `avoid` (an earlier run's first turns)."""
    if n < 1:
        raise ValueError(f"make_prompts needs n >= 1, got {n}")
    sources = {"math": math, "translation": translation, "open": open_questions, "prose": prose,
               "self": self_instruct, "code": code}  # fmt: skip
    prompts: list[Prompt] = []
    for kind, source in sources.items():
        want = round(n * SHARES[kind]) if kind in SHARES else n - len(prompts)
        made = source(random.Random(f"{seed}:{kind}"), want + len(avoid))
        prompts += [p for p in made if p.messages[0]["content"] not in avoid][:want]
    if len(prompts) < n:
        raise ValueError(f"this machine's text makes only {len(prompts)} prompts, not {n}")
    rng = random.Random(seed)
    rng.shuffle(prompts)
    for i in rng.sample(range(n), round(n / 10)):
        prompts[i] = Prompt(prompts[i].kind, [*prompts[i].messages, user(rng.choice(FOLLOW_UPS))])
    return prompts


def asked(record: dict) -> list[dict]:
    """The user turns a conversation was made from: a self-instruct one's ask, not the question the model wrote."""
    return record.get("prompt") or [m for m in record["messages"] if m["role"] == "user"]


def own_question(model, tokenizer, ask: dict, eos: list[int]) -> dict:
    """Self-instruct: the model's reply to `ask`, its first line unquoted, as a user's turn."""
    ids = chat_ids(tokenizer, [ask]).to(model.base.device)
    reply = model.generate(ids, QUESTION_TOKENS, tokenizer=tokenizer)
    text = reply_text(tokenizer, reply, ids.shape[1], eos).strip().split("\n")[0].strip().strip('"*').strip()
    return user(text or ask["content"])


def read_conversations(path: Path, repair: bool = False) -> list[dict]:
    """The conversations saved in `path`. A torn last line (a run killed while writing it) is dropped with a note,
    and with `repair` cut from the file, so that the next conversation starts a line of its own."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    whole = data.rfind(b"\n") + 1
    if whole < len(data):
        print(f"note: {path}: dropped a torn last line (a run killed while writing it)", file=sys.stderr)
        if repair:
            os.truncate(path, whole)
    records = []
    for n, line in enumerate(data[:whole].decode("utf-8").splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except ValueError as err:
            raise ValueError(f"{path}:{n} is not a JSON record ({err}): the file is damaged") from err
    return records


def answer(model, tokenizer, prompts: Sequence[Prompt], out_dir: str | Path, max_new_tokens: int = 160) -> Path:
    """Each prompt's conversation, answered by `model.generate`'s exact greedy (the default drafter), appended to
    `out_dir/conversations.jsonl`: {"i", "kind", "messages" (the user's turns and the model's replies), "ids" (the
    templated conversation and the last reply, with its end of turn where it stopped), "reply_tokens" (the tokens
    the model wrote, over all turns), "prompt" (the prompt's user turns)}. A self-instruct prompt's first turn is
    the model's own question. A rerun continues after the last conversation saved."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to separate conversations with")
    meta = {"eos_token_id": tokenizer.eos_token_id, "vocab_size": len(tokenizer), "max_new_tokens": max_new_tokens}
    if (out / "meta.json").is_file() and (old := read_json(out / "meta.json")) != meta:
        name = next(k for k in meta if old.get(k) != meta[k])
        raise ValueError(
            f"{out} holds conversations made with {name}={old.get(name)}, not {meta[name]}: use a fresh --out"
        )
    write_json(out / "meta.json", meta)
    path = out / "conversations.jsonl"
    done = read_conversations(path, repair=True)
    for j, record in enumerate(done):
        if j >= len(prompts) or record["i"] != j or [record["kind"], asked(record)] != [*prompts[j]]:
            raise ValueError(f"{path}: conversation {j} answers another prompt than this run's: use a fresh --out "
                             "(or the same --prompts and --seed)")  # fmt: skip
    eos, start, tokens = resolve_eos(model.base, None), time.perf_counter(), 0
    for i in range(len(done), len(prompts)):
        messages, written, turns = [], 0, prompts[i].messages
        if prompts[i].kind == "self":
            turns = [own_question(model, tokenizer, turns[0], eos), *turns[1:]]
        for turn in turns:
            messages.append(turn)
            ids = chat_ids(tokenizer, messages).to(model.base.device)
            reply = model.generate(ids, max_new_tokens, tokenizer=tokenizer)
            conversation = reply.sequences[0, : ids.shape[1] + reply.stats.new_tokens].tolist()
            messages.append({"role": "assistant", "content": reply_text(tokenizer, reply, ids.shape[1], eos)})
            written += reply.stats.new_tokens
        record = {"i": i, "kind": prompts[i].kind, "messages": messages, "ids": conversation, "reply_tokens": written,
                  "prompt": prompts[i].messages}  # fmt: skip
        append_jsonl(path, record)  # flushed and fsynced: a kill loses at most the conversation it was answering
        tokens += written
        if (i + 1) % 10 == 0 or i + 1 == len(prompts):
            seconds, answered = time.perf_counter() - start, i + 1 - len(done)
            eta = (len(prompts) - i - 1) * seconds / answered
            print(f"chat data: {i + 1}/{len(prompts)} conversations, {tokens / seconds:.1f} tokens/s, "
                  f"ETA {eta / 60:.1f} min", flush=True)  # fmt: skip
    return path


def to_npy(out_dir: str | Path, holdout: float = 0.1) -> tuple[Path, Path]:
    """`train.npy` and `heldout.npy` (int32 ids, conversations joined by the tokenizer's EOS id), the held-out slice
    every round(1/holdout)-th conversation (the first, the 11th, ...), and `heldout.jsonl` with its messages, to
    choose drafters by measurement on prompts they never trained on."""
    if not 0 < holdout <= 0.5:
        raise ValueError(f"holdout must be in (0, 0.5], got {holdout}")
    out = Path(out_dir)
    records = read_conversations(out / "conversations.jsonl")
    if not records:
        raise ValueError(f"{out} holds no conversations yet: answer prompts first")
    eos, every = read_json(out / "meta.json")["eos_token_id"], round(1 / holdout)
    held = [r for r in records if r["i"] % every == 0]
    parts = {"train": [r for r in records if r["i"] % every], "heldout": held}
    for name, chosen in parts.items():
        ids = [t for j, r in enumerate(chosen) for t in ([eos] if j else []) + r["ids"]]
        array = np.asarray(ids, dtype=np.int32)
        atomic_write(out / f"{name}.npy", lambda p, a=array: save_npy(p, a))
        print(f"chat data: {name}.npy holds {len(chosen)} conversations, {len(ids):,} tokens")
    write_text(out / "heldout.jsonl", "".join(json.dumps({k: r[k] for k in ("i", "kind", "messages")}) + "\n"
                                              for r in held))  # fmt: skip
    return out / "train.npy", out / "heldout.npy"


def main(argv: list[str] | None = None) -> None:
    from blockdecode.model import load

    stay_offline()
    parser = argparse.ArgumentParser(
        prog="python -m blockdecode.training.chat_data", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--gguf", required=True, help="the instruct model: a GGUF file (or any model folder)")
    parser.add_argument("--out", required=True, help="folder for conversations.jsonl, train.npy and heldout.npy")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--avoid", nargs="*", default=[], type=Path,
                        help="conversations.jsonl of earlier runs: their prompts are left out")  # fmt: skip
    parser.add_argument("--holdout", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if missing := [str(p) for p in args.avoid if not p.is_file()]:
            raise ValueError(f"--avoid: no conversations at {', '.join(missing)}")
        avoid = frozenset(asked(r)[0]["content"] for path in args.avoid for r in read_conversations(path))
        prompts = make_prompts(args.prompts, args.seed, avoid)
        print(f"chat data: {len(prompts)} prompts, {dict(Counter(p.kind for p in prompts))}", flush=True)
        model, tokenizer = load(args.gguf, dtype=dtype_for(args.dtype))
        answer(model, tokenizer, prompts, args.out, args.max_new_tokens)
        to_npy(args.out, args.holdout)
    except (ValueError, OSError) as err:
        raise SystemExit(f"error: {err}") from err


if __name__ == "__main__":
    main()
