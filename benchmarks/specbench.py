#!/usr/bin/env python
"""Spec-Bench (Xia et al. 2024, github.com/hemingkx/Spec-Bench) on an instruct model, its protocol sized for 2 cores:
every method side by side on the same chat turns, subtask by subtask, against `transformers`' greedy.

The questions are Spec-Bench's own `question.jsonl` (Apache-2.0; by default the copy beside the checkout,
`../shared/data/spec_bench/`, whose README names its sources). Six subtasks, `--per-subtask` questions each, the
first of each in the file: multi-turn conversation (MT-bench, ids 81-160; its picks spread over its eight
categories, the first of writing, math, reasoning, stem, roleplay, coding, extraction, humanities, then the second
of each; the second turn is asked after the model's own first answer, greedy's), translation, summarization, QA,
math reasoning and RAG (one turn each).

As Spec-Bench's `evaluation/eval.py` runs them: each turn through the tokenizer's chat template (the generation
prompt added, never healed: it ends where the reply begins), greedy, batch 1, `--max-new-tokens` at most, ending at
the model's end of turn (its generation config's EOS ids, the EOS token counted as a new token), timed from the
prompt's ids to the last token (the prefill included). A question's speed is its turns' new tokens over their
seconds; a subtask's, the mean over its questions; a method's speedup, that mean over greedy's (Spec-Bench's
`evaluation/speed.py`; "overall" takes the mean over every question). Mean accepted tokens: the new tokens each call
after the prefill gained, the model's own bonus token counted (1.00 for greedy). Every method decodes every turn
in turn, the order rotated from question to question so that machine drift hits all alike, after one short warm-up
each. Each output is compared with greedy's: in fp32 it must be identical; where one parts from it, the reference's
top-2 logit gap there says whether it is a near tie in the dtype (`decoding.reference.first_divergence`). What a
call of 1, 4 and 16 new tokens costs over the first prompt is timed in each engine (`call_ms`): what a verifying
call pays, and why one engine's greedy may outrun another's blocks.

Methods: `transformers`' greedy (the reference) and prompt lookup (`prompt_lookup_num_tokens=10`); llama.cpp's
greedy on the same GGUF where llama-cpp-python is installed (`pip install .[llama]`; its own kernels, so its text
may part from greedy's); blockdecode's default (`model.generate(ids, n)`); each of `--drafters` alone, in one
chain (heads, EAGLE-3 and DFlash only where the model has them trained); and each of `--ranked` as the default
decodes (ranked trees), to weigh drafters the default could take.

Drafters are chosen on prompts they never trained on, never on Spec-Bench: `--heldout runs/.../heldout.jsonl` runs
the same protocol on the held-out conversations of a chat-data run (`blockdecode.training.chat_data`), a column a
kind of prompt (code, prose, math, translation, open, self-instruct).

The default model is Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Alibaba Cloud's Qwen team, Apache-2.0), joined from the
registry's chunks (`benchmarks/instruct_models.py`, never committed). The defaults, 2 questions a subtask (14 turns)
and 128 new tokens, are sized for about 30 minutes on 2 cores with every method (`transformers`' greedy at 5-6
tokens/s in fp32), after Qwen's one-time dequantization (about 100 s) and llama.cpp's build (about 20 minutes, once).

    make bench-specbench                                   # installs what it needs; about 30 min on 2 cores
    python benchmarks/specbench.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --per-subtask 1 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import RESULTS, dtype_flag, heading, llama_cpp_call_cost, llama_cpp_run, plot_bars, title
from instruct_models import qwen_gguf

from blockdecode import load
from blockdecode.bench.methods import Run, transformers_run
from blockdecode.core.hf import dtype_for, resolve_eos
from blockdecode.core.io import write_json
from blockdecode.decoding.reference import first_divergence
from blockdecode.decoding.timing import forward_cost

SUBTASKS = {"MT": None, "trans": "translation", "sum": "summarization", "QA": "qa", "math": "math_reasoning",
            "RAG": "rag"}  # fmt: skip
"""The leaderboard's columns, each with its rows' category in question.jsonl (MT: MT-bench's categories)."""
MT_CATEGORIES = ("writing", "math", "reasoning", "stem", "roleplay", "coding", "extraction", "humanities")
"""MT-bench's categories in the order its questions are picked, so that a few spread over all eight."""
QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench" / "question.jsonl"
GREEDY = "transformers greedy"
OWN_KERNELS = ("llama.cpp greedy",)  # another engine's arithmetic: its text parting from greedy's is no fault
METHODS = ("prompt-lookup", "llama.cpp", "default")
CALL_QS = (1, 4, 16)  # a call's cost in each engine at these many new tokens: what a verifying call pays

Method = Callable[[torch.LongTensor, int], Run]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = p.add_mutually_exclusive_group()
    model.add_argument("--gguf", type=Path, help="a GGUF file (default: Qwen2.5-Coder-0.5B-Instruct's, joined once)")
    model.add_argument("--model", type=Path, help="a model folder with its tokenizer, in place of a GGUF")
    questions = p.add_mutually_exclusive_group()
    questions.add_argument("--questions", type=Path, default=QUESTIONS, help="Spec-Bench's question.jsonl")
    questions.add_argument("--heldout", type=Path, help="a chat-data run's heldout.jsonl, in place of Spec-Bench")
    p.add_argument("--per-subtask", type=int, default=2, help="questions a subtask, the first of each")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens a turn at most")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, of {', '.join(METHODS)}; transformers' greedy always runs")  # fmt: skip
    p.add_argument("--drafters", default="ngram,suffix", help="comma-separated: blockdecode drafters, each alone")
    p.add_argument("--ranked", default="", help="comma-separated drafter specs (eagle3+suffix), ranked as the default")
    p.add_argument("--threads", type=int, default=2)
    dtype_flag(p)
    p.add_argument("--out", type=Path, help="the JSON (and the PNG beside it); default results/specbench-MODEL.json")
    args = p.parse_args(argv)
    unknown = sorted(set(filter(None, args.methods.split(","))) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if args.per_subtask < 1 or args.max_new_tokens < 1:
        p.error("--per-subtask and --max-new-tokens must be at least 1")
    return args


def read_questions(path: Path) -> list[dict]:
    """The rows of a question.jsonl: {"question_id", "category", "turns": [...]}."""
    if not path.is_file():
        raise SystemExit(f"error: no Spec-Bench questions at {path}: pass --questions PATH (question.jsonl)")
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append({"question_id": row["question_id"], "category": row["category"], "turns": list(row["turns"])})
        except (ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"error: {path}:{i} is not a Spec-Bench question ({type(err).__name__}: {err})") from err
    return rows


def read_heldout(path: Path) -> list[dict]:
    """A chat-data run's held-out conversations as questions: {"question_id": its index, "category": its kind,
    "turns": its user turns}; a self-instruct one's first turn is the question the model wrote."""
    if not path.is_file():
        raise SystemExit(f"error: no held-out conversations at {path}: pass a chat-data run's heldout.jsonl")
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
            turns = [m["content"] for m in row["messages"] if m["role"] == "user"]
            rows.append({"question_id": row["i"], "category": row["kind"], "turns": turns})
        except (ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"error: {path}:{i} is not a held-out conversation ({type(err).__name__}: {err})") from err
    return rows


def pick_heldout(rows: list[dict], n: int) -> list[tuple[str, dict]]:
    """The first `n` held-out conversations of each kind, kind by kind in the order they first appear."""
    kinds = list(dict.fromkeys(r["category"] for r in rows))
    return [(kind, row) for kind in kinds for row in [r for r in rows if r["category"] == kind][:n]]


def pick(rows: list[dict], n: int, where: Path | str = "the questions") -> list[tuple[str, dict]]:
    """The first `n` questions of each subtask, as (subtask, row), subtask by subtask; MT-bench's spread over its
    categories in `MT_CATEGORIES`' order, the first of each, then the second of each, and so on."""
    chosen = []
    for subtask, category in SUBTASKS.items():
        if category is None:
            seen: dict[str, int] = {}
            keyed = []
            for row in (r for r in rows if r["category"] in MT_CATEGORIES):
                seen[row["category"]] = rank = seen.get(row["category"], -1) + 1
                keyed.append(((rank, MT_CATEGORIES.index(row["category"])), row))
            found = [row for _, row in sorted(keyed, key=lambda item: item[0])]
        else:
            found = [r for r in rows if r["category"] == category]
        if not found:
            raise SystemExit(f"error: {where} holds no {subtask} question ({category or 'MT-bench'})")
        chosen += [(subtask, row) for row in found[:n]]
    return chosen


def chat_ids(tokenizer, messages: list[dict]) -> torch.LongTensor:
    """The conversation through the tokenizer's chat template, ending in the generation prompt: [1, T]."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return torch.tensor([ids["input_ids"]])


def blockdecode_method(lm, **settings) -> Method:
    """blockdecode's `generate` as a user calls it, with `settings`; nothing remembered across turns, so that no
    method drafts from another's answer to the same question."""

    def run(ids: torch.LongTensor, n: int) -> Run:
        start = time.perf_counter()
        out = lm.generate(ids, n, remember=False, **settings)
        seconds = time.perf_counter() - start
        return Run(out.sequences[0, ids.shape[1] :].tolist(), seconds, out.stats.calls)

    return run


def build_methods(lm, gguf: Path | None, args, context: int) -> tuple[dict[str, Method], list[str]]:
    """The methods asked for, greedy first, and a note for each one skipped and why."""
    asked = set(filter(None, args.methods.split(",")))
    methods: dict[str, Method] = {GREEDY: lambda ids, n: transformers_run(lm.base, ids, n, stop_at_eos=True)}
    notes = []
    if "prompt-lookup" in asked:
        methods["transformers prompt lookup"] = lambda ids, n: transformers_run(
            lm.base, ids, n, stop_at_eos=True, prompt_lookup_num_tokens=10
        )
    if "llama.cpp" in asked:
        if gguf is None:
            notes.append("llama.cpp greedy: skipped, the model is a folder, not a GGUF file")
        elif importlib.util.find_spec("llama_cpp") is None:
            notes.append("llama.cpp greedy: skipped, llama-cpp-python is not installed (pip install .[llama])")
        else:
            engine, eos = llama_cpp_run(gguf, args.threads, context), resolve_eos(lm.base, None)
            methods["llama.cpp greedy"] = lambda ids, n: engine(ids, n, stop=eos)
    if "default" in asked:
        methods["blockdecode default"] = blockdecode_method(lm)
    trained = {"heads": lm.heads_trained, "eagle3": lm.eagle3 is not None, "dflash": lm.dflash is not None}
    asked_drafters = [(d, "chain", {"tree": None}) for d in filter(None, args.drafters.split(","))]
    asked_drafters += [(d, "ranked", {}) for d in filter(None, args.ranked.split(","))]  # as the default decodes
    for drafter, how, settings in asked_drafters:
        lacking = [part for part in drafter.split("+") if not trained.get(part, True)]
        if lacking:
            notes.append(f"blockdecode {drafter} {how}: skipped, the model has no trained {lacking[0]}")
        else:
            methods[f"blockdecode {drafter} {how}"] = blockdecode_method(lm, drafter=drafter, **settings)
    return methods, notes


def compare(base, ids: torch.LongTensor, runs: dict[str, Run]) -> tuple[dict[str, bool], dict[str, dict]]:
    """Each run against greedy's: identical or not, and where one parts from it, the new token's index, the
    reference's top-2 logit gap there and whether that is a near tie in the model's dtype."""
    greedy = runs[GREEDY].sequence
    identical, departures = {}, {}
    for name, run in runs.items():
        identical[name] = run.sequence == greedy
        if not identical[name]:
            prompt = ids[0].tolist()
            gap = first_divergence(base, torch.tensor([prompt + greedy]), torch.tensor([prompt + run.sequence]))
            departures[name] = {"position": gap.position - len(prompt), "top2_gap": gap.top2_gap,
                                "near_tie": gap.near_tie(base.dtype)}  # fmt: skip
    return identical, departures


def measure(lm, tokenizer, chosen: list[tuple[str, dict]], methods: dict[str, Method], n: int,
            done: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:  # fmt: skip
    """Every method on every turn of every question, greedy's answer carried into the next turn; `done` is given
    the rows so far after each question."""
    names, rows = list(methods), []
    for i, (subtask, question) in enumerate(chosen):
        messages, turns = [], []
        order = names[i % len(names) :] + names[: i % len(names)]
        for t, text in enumerate(question["turns"]):
            messages.append({"role": "user", "content": text})
            ids = chat_ids(tokenizer, messages)
            runs = {name: methods[name](ids, n) for name in order}
            runs = {name: runs[name] for name in names}
            identical, departures = compare(lm.base, ids, runs)
            reply = tokenizer.decode(runs[GREEDY].sequence, skip_special_tokens=True).strip()
            messages.append({"role": "assistant", "content": reply})
            turns.append({"prompt_tokens": ids.shape[1], "reply": reply,
                          "new_tokens": {m: len(r.sequence) for m, r in runs.items()},
                          "seconds": {m: r.seconds for m, r in runs.items()},
                          "calls": {m: r.calls for m, r in runs.items()},
                          "identical": identical, "departures": departures})  # fmt: skip
            speeds = ", ".join(f"{m} {len(r.sequence) / r.seconds:.1f}" for m, r in runs.items())
            parted = f"; differs from greedy: {', '.join(departures)}" if departures else ""
            print(f"  [{i + 1}/{len(chosen)}] {subtask} #{question['question_id']} turn {t + 1} "
                  f"({ids.shape[1]} prompt tokens): {speeds} tokens/s{parted}", flush=True)  # fmt: skip
        rows.append({"subtask": subtask, "question_id": question["question_id"], "category": question["category"],
                     "turns": turns})  # fmt: skip
        done(rows)
    return rows


def question_speed(row: dict, method: str) -> float:
    """Spec-Bench's speed of one question: its turns' new tokens over their seconds."""
    return sum(t["new_tokens"][method] for t in row["turns"]) / sum(t["seconds"][method] for t in row["turns"])


def accepted(rows: list[dict], method: str) -> float:
    """New tokens a call after the prefill, over every turn of `rows` (the prefill's own token left out)."""
    turns = [t for row in rows for t in row["turns"]]
    gained = sum(t["new_tokens"][method] - 1 for t in turns)
    return gained / max(1, sum(t["calls"][method] - 1 for t in turns))


def subtasks_of(rows: list[dict]) -> list[str]:
    """The columns: Spec-Bench's subtasks, or a held-out set's kinds, in the order the rows hold them."""
    return list(dict.fromkeys(r["subtask"] for r in rows))


def summarize(rows: list[dict], dtype: torch.dtype) -> dict:
    """Per subtask and overall: each method's tokens/s (mean over questions), speedup over greedy, mean accepted
    tokens; and the equality check: identical turns, and every departure with its gap."""
    methods = list(rows[0]["turns"][0]["seconds"])
    groups = {subtask: [r for r in rows if r["subtask"] == subtask] for subtask in subtasks_of(rows)}
    groups["overall"] = rows
    tps = {m: {g: statistics.mean(question_speed(r, m) for r in found) for g, found in groups.items()} for m in methods}
    out = {
        "tokens_per_second": tps,
        "speedup": {m: {g: tps[m][g] / tps[GREEDY][g] for g in groups} for m in methods},
        "mean_accepted": {m: {g: accepted(found, m) for g, found in groups.items()} for m in methods},
        "identical_turns": {m: sum(t["identical"][m] for r in rows for t in r["turns"]) for m in methods},
        "turns": sum(len(r["turns"]) for r in rows),
        "departures": [],
    }
    for r in rows:
        for t, turn in enumerate(r["turns"]):
            for m, d in turn["departures"].items():
                fault = m not in OWN_KERNELS and (dtype == torch.float32 or not d["near_tie"])
                out["departures"].append({"method": m, "question_id": r["question_id"], "turn": t + 1, **d,
                                          "fault": fault})  # fmt: skip
    return out


def call_costs(lm, gguf: Path | None, ids: torch.LongTensor, threads: int, context: int) -> dict[str, dict]:
    """Milliseconds of one call of q new tokens over the first prompt, for q in CALL_QS: `transformers`' bare
    forward, and llama.cpp's (all q logits) on `gguf` where it runs; the median of 5 each."""
    costs = {"transformers forward": forward_cost(lm.base, ids, CALL_QS, reps=5)}
    if gguf is not None:
        costs["llama.cpp"] = llama_cpp_call_cost(gguf, threads, context, ids[0].tolist(), CALL_QS)
    return {engine: {str(q): 1000 * t for q, t in cost.items()} for engine, cost in costs.items()}


def table(report: dict) -> str:
    """The leaderboard, laid out as Spec-Bench's: a row a method, speedup per subtask, overall, mean accepted
    tokens; and how many turns each gave exactly greedy's text."""
    s = report["summary"]
    groups = list(s["tokens_per_second"][GREEDY])  # the subtasks, then "overall"
    head = ["× transformers' greedy", *groups, "mean accepted", "identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, speedup in s["speedup"].items():
        cells = [f"{speedup[g]:.2f}" for g in groups]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {s['mean_accepted'][m]['overall']:.2f} | "
                     f"{s['identical_turns'][m]}/{s['turns']} |")  # fmt: skip
    greedy = s["tokens_per_second"][GREEDY]
    lines.append(f"\n{GREEDY}: " + ", ".join(f"{g} {greedy[g]:.1f}" for g in groups) + " tokens/s")
    for engine, ms in report.get("call_ms", {}).items():
        lines.append(f"a call of {engine}: " + ", ".join(f"{ms[str(q)]:.1f} ms at {q}" for q in CALL_QS))
    return "\n".join(lines)


def equality_lines(report: dict) -> list[str]:
    """The equality check in words: every departure from greedy's text, a fault unless a near tie in bf16 (or
    another engine's arithmetic)."""
    dtype = report["dtype"]
    found = report["summary"]["departures"]
    if not found:
        return [f"equality: every turn of every method is greedy's own text ({dtype})"]
    lines = []
    for d in found:
        why = "near tie" if d["near_tie"] else "not a near tie"
        why = "another engine's kernels" if d["method"] in OWN_KERNELS else why + ", a FAULT" * d["fault"]
        lines.append(f"equality: {d['method']} parts from greedy on question {d['question_id']} turn {d['turn']} "
                     f"at new token {d['position']}, top-2 gap {d['top2_gap']:.3g} ({why})")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.heldout:
        chosen, source = pick_heldout(read_heldout(args.heldout), args.per_subtask), args.heldout
    else:
        chosen, source = pick(read_questions(args.questions), args.per_subtask, args.questions), args.questions
    gguf = None if args.model else args.gguf or qwen_gguf()
    path = args.model or gguf
    dtype = dtype_for(args.dtype)
    start = time.perf_counter()
    lm, tokenizer = load(path, dtype=dtype)
    lm.eval()
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"error: {path}'s tokenizer has no chat template, and Spec-Bench's questions are chat turns")
    name = ("heldout-" if args.heldout else "") + Path(path).name.removesuffix(".gguf")
    out = args.out or RESULTS / f"specbench-{name}.json"
    turns = sum(len(q["turns"]) for _, q in chosen)
    context = max(len(tokenizer(" ".join(q["turns"])).input_ids) for _, q in chosen) + 2 * (args.max_new_tokens + 64)
    methods, notes = build_methods(lm, gguf, args, context)
    report = heading(Path(path).name, dtype, threads=args.threads, questions=str(source),
                     per_subtask=args.per_subtask, max_new_tokens=args.max_new_tokens, turns=turns,
                     methods=list(methods), notes=notes,
                     speed="Spec-Bench's speed.py: a question's new tokens over its seconds, "
                           "the mean over a subtask's questions, over greedy's")  # fmt: skip
    print(f"loaded in {time.perf_counter() - start:.1f} s: {title(report)}; {len(chosen)} questions, {turns} turns, "
          f"{args.max_new_tokens} new tokens at most", flush=True)  # fmt: skip
    for note in notes:
        print(f"  {note}", flush=True)
    warm = chat_ids(tokenizer, [{"role": "user", "content": chosen[0][1]["turns"][0]}])
    for method in methods.values():  # first calls, the default's calibration and cost curve: not timed
        method(warm, min(16, args.max_new_tokens))
    report["call_ms"] = call_costs(lm, gguf if "llama.cpp greedy" in methods else None, warm, args.threads, context)
    rows = measure(lm, tokenizer, chosen, methods, args.max_new_tokens,
                   done=lambda rows: write_json(out, {**report, "per_question": rows}))  # fmt: skip
    report["summary"] = summarize(rows, dtype)
    report["per_question"] = rows
    write_json(out, report)
    groups = [*subtasks_of(rows), "overall"]
    bars = {m: [report["summary"]["speedup"][m][g] for g in groups] for m in methods if m != GREEDY}
    what = "held-out chat prompts" if args.heldout else "Spec-Bench"
    what += f", {args.per_subtask} question(s) a subtask, {args.max_new_tokens} new tokens at most"
    plot_bars(report, groups, bars, "speed × transformers' greedy", what, out.with_suffix(".png"))
    print(f"\n{title(report)}; {what}\n" + table(report))
    print("\n".join(equality_lines(report)))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
