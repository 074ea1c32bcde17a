"""`blockdecode demo`: the built-in model completes real code (or, with `--task translate`, an
encoder-decoder translates held-out verses), blockwise beside plain greedy.

Each prompt is first decoded blockwise while the text streams, one colour per accepted block;
then greedy `generate` and blockwise decoding are timed side by side (interleaved repeats, the
median kept) and compared token for token. A difference is reported with where it happens and
how close the reference's call was there, never hidden."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from blockdecode.bench.methods import Method, blockwise_run, measure, transformers_run
from blockdecode.builtin import DEFAULT_MODEL, DEFAULT_TRANSLATION_MODEL
from blockdecode.commands.flags import (
    NO_HEAL,
    add_corpus_flag,
    add_drafting_flags,
    check_corpus,
    check_drafter,
    positive_int,
)
from blockdecode.core.hardware import auto_dtype
from blockdecode.core.hf import DTYPE_CHOICES, dtype_for, dtype_name, is_seq2seq, vocab_size
from blockdecode.decoding.adapter import decoder_prompt
from blockdecode.decoding.healing import Healing, heal_prompts
from blockdecode.decoding.loop import decode
from blockdecode.decoding.plan import DecodePlan
from blockdecode.decoding.reference import first_divergence
from blockdecode.drafters.suffix import SuffixDrafter
from blockdecode.loading import load_base, load_config
from blockdecode.model import BlockwiseLM, load
from blockdecode.pretraining.bible import HELD_OUT_VERSES

PROMPTS = (
    "class MLP(nn.Module):\n    def __init__(self, config):\n        super().__init__()",
    "import torch\nfrom torch import nn\n\n\nclass Attention(nn.Module):",
    "    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:",
    'def read_json(path):\n    """Read a JSON file and return its contents."""',
)
"""Code of the kind the built-in model learnt from (torch, transformers, the standard library). Each ends
mid-line: the tokenizer writes a newline and the next line's indent as one token, so a prompt ending in
"\n" needs token healing (`blockdecode.decoding.healing`), which the demo applies to any prompt that ends mid-token."""
DRAFTER_NAMES = {
    "heads": "{head_type} heads",
    "heads-rescored": "{head_type} heads rescored by an n-gram model of the context",
    "ngram": "n-gram drafter",
    "suffix": "suffix lookup",
}
COLOURS = ("\x1b[48;5;24m", "\x1b[48;5;58m")
RESET = "\x1b[0m"


class BlockPrinter:
    """Streams decoded text, each accepted block in alternating colour when the terminal has it
    (and between | marks when it has not)."""

    def __init__(self, tokenizer, colour: bool, skip_special_tokens: bool = False):
        self.tokenizer, self.colour, self.skip = tokenizer, colour, skip_special_tokens
        self.tokens: list[int] = []
        self.shown = ""
        self.blocks = 0

    def __call__(self, block: list[int]) -> None:
        self.tokens += block
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip)
        new, self.shown = text[len(self.shown) :], text
        new = f"{COLOURS[self.blocks % 2]}{new}{RESET}" if self.colour else f"{new}|"
        self.blocks += 1
        sys.stdout.write(new)
        sys.stdout.flush()


@dataclass
class DemoRow:
    prompt: str
    greedy_tok_s: float
    blockwise_tok_s: float
    speedup: float
    calls: int
    new_tokens: int
    mean_block: float
    identical: bool
    divergence: str
    near_tie: bool  # a difference whose reference gap is within the dtype's rounding
    dtype: str
    speedup_bf16: float | None = None  # against greedy in bf16, when the demo runs in another dtype


def compare(
    model: BlockwiseLM,
    prompt: str,
    ids: torch.LongTensor,
    max_new_tokens: int,
    plan: DecodePlan,
    repeats: int,
    reference: PreTrainedModel | None = None,
    healing: Healing | None = None,
) -> DemoRow:
    """Greedy and blockwise, both timed from outside, in turn `repeats` times (the benchmark's
    rounds, so drift hits both alike); the median speedup kept. `reference`, if given, is the base in
    bf16, timed too, so a slower dtype's speedup can also be read against bf16 greedy. A translation
    stops at its EOS. `healing` (made for `ids`): both decode with it, greedy through its
    `prefix_allowed_tokens_fn`."""
    base = model.base
    settings = {"stop_at_eos": is_seq2seq(base)}
    if healing is not None:
        settings["prefix_allowed_tokens_fn"] = healing.prefix_allowed_tokens_fn(vocab_size(base))
    methods = [
        Method("greedy", "greedy", lambda x: transformers_run(base, x, max_new_tokens, **settings)),
        Method("blockwise", "heads", lambda x: blockwise_run(base, x, max_new_tokens, plan, healing), k=plan.k),
    ]
    if reference is not None:
        methods.append(
            Method("greedy bf16", "greedy", lambda x: transformers_run(reference, x, max_new_tokens, **settings))
        )
    results = measure(methods, [ids] * repeats, 1, show=False, warmup=False)
    greedy, ours = results["greedy"], results["blockwise"]
    source, start = decoder_prompt(base, ids)
    prompt_ids = start[0].tolist()
    reference_ids, output = (torch.tensor([prompt_ids + r["outputs"][0]], device=ids.device) for r in (greedy, ours))
    diverged = first_divergence(base, reference_ids, output, source=source)
    new = len(ours["outputs"][0])
    bf16 = results.get("greedy bf16")
    return DemoRow(
        prompt=prompt,
        greedy_tok_s=greedy["tokens_per_s"],
        blockwise_tok_s=ours["tokens_per_s"],
        speedup=ours["speedup"],
        calls=round(ours["calls_per_token"] * new),
        new_tokens=new,
        mean_block=ours["mean_block_size"],
        identical=diverged is None,
        divergence=str(diverged) if diverged else "",
        near_tie=diverged is not None and diverged.near_tie(base.dtype),
        dtype=dtype_name(base.dtype),
        speedup_bf16=ours["tokens_per_s"] / bf16["tokens_per_s"] if bf16 else None,
    )


def run_demo(
    model_dir: str | None = None,
    max_new_tokens: int = 128,
    k: int | None = None,
    dtype: torch.dtype | None = None,
    prompts: tuple[str, ...] = PROMPTS,
    repeats: int = 3,
    drafter: str = "auto",
    tree: int | str | None = "default",
    task: str = "code",
    heal: bool = True,
    corpus: list[Path] | None = None,
) -> list[DemoRow]:
    """Stream, time and compare every prompt; print the table; return its rows. `task`: "code"
    (a causal LM continues code) or "translate" (an encoder-decoder translates verses). `dtype`
    defaults to bf16 where this machine computes it natively, else fp32; in any dtype but bf16 the
    speedup is also stated against greedy in bf16. `heal`: a code prompt that ends mid-token is
    healed (`blockdecode.decoding.healing`), with a line that says so. `corpus`: files suffix lookup also drafts
    from; it remembers no output here, as each prompt is decoded several times and would read its own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the demo's own output is the point

    if task not in ("code", "translate"):
        raise ValueError(f"unknown demo task {task!r}: choose code or translate")
    translate = task == "translate"
    prompts = HELD_OUT_VERSES if translate and prompts == PROMPTS else prompts
    model_dir = model_dir or (DEFAULT_TRANSLATION_MODEL if translate else DEFAULT_MODEL)
    dtype = dtype or auto_dtype()
    model, tokenizer = load(model_dir, dtype)
    if translate != is_seq2seq(model.base):
        need = "an encoder-decoder (translation) model" if translate else "a causal LM"
        raise ValueError(f"demo --task {task} needs {need}; {model_dir} holds a {type(model.base).__name__}")
    ids_of = {p: tokenizer(p, return_tensors="pt").input_ids for p in prompts}
    eos = None if translate else []  # a translation ends at its EOS; code runs the whole budget
    # by default each call's tree ranked by its candidates' chance to stand (blockdecode.decoding.ranking)
    plan = model.plan(drafter, k, tree, eos_token_id=eos, prompts=list(ids_of.values()))
    if any(isinstance(d, SuffixDrafter) for d in plan.drafters):
        plan = model.with_sources(plan, remember=False, corpus=corpus)
    reference = None
    if dtype != torch.bfloat16:
        reference = load_base(model.base_location, torch.bfloat16).eval() if model.base_location else None
    colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    params = sum(p.numel() for p in model.base.parameters()) / 1e6
    kind = type(model.base).__name__.removesuffix("ForCausalLM")
    origin = {
        DEFAULT_MODEL: " trained on Python source (the standard library, torch, transformers), ",
        DEFAULT_TRANSLATION_MODEL: " En-Es, ",
    }
    print(
        f"blockdecode demo: {params:.1f}M-parameter {kind}"
        + origin.get(model_dir, f" from {model_dir}, ")
        + " + ".join(DRAFTER_NAMES.get(d.name, d.name) for d in plan.drafters).format(head_type=model.config.head_type)
        + f", k={plan.k}, "
        + (f"{plan.setting} candidates, " if plan.tree else "")
        + f"{dtype_name(dtype)}, "
        f"{torch.get_num_threads()} threads, exact mode.\n"
        + ("Each colour is one accepted block: one call of the model.\n" if colour else "| ends each block.\n")
    )
    rows = []
    for prompt, ids in ids_of.items():
        healing = heal_prompts(tokenizer, ids) if heal and not translate else None
        shown = f"{prompt}\n  -> " if translate else prompt
        if healing is not None and healing.healed:
            print(f"{healing.note()} (--no-heal: off)")
            ids, shown = healing.input_ids, tokenizer.decode(healing.input_ids[0], skip_special_tokens=True)
        sys.stdout.write(shown)
        printer = BlockPrinter(tokenizer, colour, skip_special_tokens=translate)
        stats = decode(model.base, ids, max_new_tokens, plan, on_block=printer, healing=healing).stats
        print(f"\n[{stats.mean_verified - 1:.1f} candidates a call; accepted proposals: {stats.supplied_share()}]\n")
        rows.append(compare(model, prompt, ids, max_new_tokens, plan, repeats, reference, healing))
    print_table(rows)
    return rows


def print_table(rows: list[DemoRow]) -> None:
    """One line per prompt and the overall figures; every divergence stated plainly."""
    bf16 = all(r.speedup_bf16 is not None for r in rows)  # another dtype: also against bf16 greedy
    print(
        f"{'prompt':34} {'greedy tok/s':>12} {'blockwise':>10} {'speedup':>8}"
        + (f" {'vs bf16':>8}" if bf16 else "")
        + f" {'calls':>6} {'block':>6}  identical"
    )
    for r in rows:
        first_line = r.prompt.splitlines()[0][:32]
        print(
            f"{first_line:34} {r.greedy_tok_s:12.1f} {r.blockwise_tok_s:10.1f} {r.speedup:7.2f}x "
            + (f"{r.speedup_bf16:7.2f}x " if bf16 else "")
            + f"{r.calls:6d} {r.mean_block:6.2f}  {'yes' if r.identical else 'near tie' if r.near_tie else 'NO'}"
        )
    tokens = sum(r.new_tokens for r in rows)
    calls = sum(r.calls for r in rows)
    block = statistics.mean(r.mean_block for r in rows)
    speedup = statistics.median(r.speedup for r in rows)
    ties = sum(r.near_tie for r in rows)
    real = sum(not (r.identical or r.near_tie) for r in rows)
    verdict = "NO" if real else f"yes, but for {ties} near-tie flip{'s' * (ties > 1)}" if ties else "yes"
    against = f" in {rows[0].dtype}" if rows else ""
    if bf16:
        against += f" ({statistics.median(r.speedup_bf16 for r in rows):.2f}x over its greedy in bf16)"
    print(
        f"\n{tokens} tokens in {calls} calls (mean accepted block {block:.2f}); median speedup "
        f"{speedup:.2f}x over transformers' greedy generate{against}; outputs identical: {verdict}"
    )
    for r in rows:
        if r.near_tie:
            print(
                f"  {r.prompt.splitlines()[0]!r}: {r.divergence}: within {r.dtype} rounding, so the one-token and "
                f"the k-token forward pass can break the tie differently; not a decoding error."
                + (" With --dtype fp32 such ties are far rarer." if r.dtype != "fp32" else "")
            )
        elif not r.identical:
            print(f"  {r.prompt.splitlines()[0]!r}: {r.divergence}: larger than {r.dtype} rounding, a REAL divergence")


def causal_only(model_dir: str | None, command: str) -> None:
    """`demo` (code) continues code prompts; an encoder-decoder model is refused by name."""
    config = Path(model_dir or "") / "config.json"
    if model_dir and config.is_file() and getattr(load_config(model_dir), "is_encoder_decoder", False):
        raise ValueError(
            f"`blockdecode {command}` continues code prompts with a causal LM; {model_dir} is an encoder-decoder "
            f"model: translate with `blockdecode demo --task translate --model {model_dir}` or `blockdecode generate "
            f"--model {model_dir} --prompt SOURCE --compare`"
        )


def run(args: argparse.Namespace) -> None:
    if args.task == "code":
        causal_only(args.model, "demo")
    check_drafter(args.drafter, args.tree)
    check_corpus(args.drafter, args.corpus)
    run_demo(
        args.model,
        max_new_tokens=args.max_new_tokens,
        k=args.k,
        dtype=dtype_for(args.dtype),
        drafter=args.drafter,
        tree=args.tree,
        task=args.task,
        heal=args.heal,
        corpus=[Path(p) for p in args.corpus] if args.corpus else None,
    )


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="show blockwise decoding against greedy on the built-in model")
    p.add_argument("--model", default=None, help="a saved BlockwiseLM (default: the built-in model)")
    p.add_argument(
        "--task", choices=("code", "translate"), default="code", help="translate: an encoder-decoder, Bible verses"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="auto: bf16 where native, else fp32")
    add_drafting_flags(p)
    p.add_argument("--no-heal", dest="heal", action="store_false", help=NO_HEAL)
    add_corpus_flag(p)
    p.set_defaults(func=run)
