"""`blockdecode generate`: one prompt completed blockwise, or one --chat message answered through the chat
template (never healed); --compare checks it against transformers' greedy."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

from blockdecode.builtin import DEFAULT_MODEL
from blockdecode.commands.flags import (
    NO_HEAL,
    add_corpus_flag,
    add_drafting_flags,
    check_corpus,
    check_drafter,
    positive_int,
    random_seed,
    read_value_map,
    temperature,
    top_k,
    top_p,
)
from blockdecode.core.hf import DTYPE_CHOICES, dtype_for, dtype_name, is_seq2seq
from blockdecode.drafters.heads import HEAD_TYPES


def run(args: argparse.Namespace) -> None:
    from blockdecode.chat import chat_ids, reply_text
    from blockdecode.core.hf import vocab_size
    from blockdecode.decoding.acceptance import parse_acceptance
    from blockdecode.decoding.healing import heal_prompts
    from blockdecode.decoding.inputs import check_prompt
    from blockdecode.decoding.reference import first_divergence, greedy_generate
    from blockdecode.model import load

    # Settings first: a bad rule or value map is reported before the model takes seconds to load.
    if args.value_map and not args.acceptance.startswith("distance"):
        raise ValueError(f"--value-map is for --acceptance distance:EPS, not {args.acceptance}")
    acceptance = parse_acceptance(args.acceptance, read_value_map(args.value_map) if args.value_map else None)
    warpers = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    given = [f"--{name.replace('_', '-')}" for name, v in {**warpers, "seed": args.seed}.items() if v is not None]
    if given and not args.sample:
        raise ValueError(f"{', '.join(given)} applies only when sampling: add --sample")
    if args.sample and args.compare:
        raise ValueError("--compare checks the output against greedy decoding; a sampled output is not greedy's")
    if args.sample and acceptance.rule != "exact":
        raise ValueError(f"--acceptance {args.acceptance} is approximate, which has no exact meaning with --sample")
    check_drafter(args.drafter, args.tree)
    check_corpus(args.drafter, args.corpus)
    if args.system is not None and args.chat is None:
        raise ValueError("--system is the system message of a --chat message: add --chat")
    if args.eagle3 and "eagle3" not in args.drafter.split("+"):
        raise ValueError(f"--eagle3 drafts only where --drafter names it (eagle3, eagle3+suffix, ...), not "
                         f"{args.drafter}")  # fmt: skip

    dtype = dtype_for(args.dtype)
    model, tokenizer = load(args.model, dtype, args.k, args.head_type)
    if args.eagle3:
        model.attach_eagle3(args.eagle3)
    if not model.heads_trained and (args.drafter == "auto" or "heads" in args.drafter):
        auto = args.drafter == "auto"
        uses = "the default drafts by suffix lookup" if auto else f"these {model.config.head_type} heads are untrained"
        print(f"note: {args.model} has no trained heads: {uses}", file=sys.stderr)
    if args.chat is not None:  # the template's generation prompt ends where the reply begins: never healed
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        ids = chat_ids(tokenizer, [*messages, {"role": "user", "content": args.chat}])
    else:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    ids = check_prompt(model.base, ids, args.max_new_tokens)
    seq2seq = is_seq2seq(model.base)  # the output is the decoder's: a translation, not a continuation
    heal = tokenizer if args.heal and not seq2seq and args.chat is None else None
    healing = heal_prompts(heal, ids) if heal is not None else None
    if healing is not None and healing.healed:
        print(f"{healing.note()} (--no-heal: off)", file=sys.stderr)
    prompts = model.prompts or [ids]  # "auto" times on the model's own prompts
    with warnings.catch_warnings():  # a tree the plan cannot use is said once, as its note below
        warnings.simplefilter("ignore")
        plan = model.plan(args.drafter, args.k, args.tree, acceptance, prompts=prompts, do_sample=args.sample,
                          corpus=bool(args.corpus), **warpers)  # fmt: skip
    generator = torch.Generator(device=model.base.device)
    seed = generator.seed() if args.seed is None else args.seed  # a fresh one unless given, shown to repeat the run
    generator.manual_seed(seed)
    corpus = [Path(p) for p in args.corpus] if args.corpus else None
    out = model.generate(ids, args.max_new_tokens, plan=plan, generator=generator, heal=heal, corpus=corpus)
    if args.chat is not None:
        print(reply_text(tokenizer, out, ids.shape[1], plan.eos))
    else:
        print(tokenizer.decode(out.sequences[0], skip_special_tokens=seq2seq))
    s = out.stats
    print(
        f"\nblockwise ({plan.drafter_name}, k={plan.k}, {plan.setting}, {dtype_name(dtype)}): {s.new_tokens} tokens, "
        f"{s.calls} calls, mean accepted block {s.mean_block_size:.2f}, {s.tokens_per_second:.1f} tokens/s",
        file=sys.stderr,
    )
    if s.sampling:
        print(f"sampled ({s.sampling}, --seed {seed}): exact in distribution, not the greedy output", file=sys.stderr)
    elif not s.exact:
        print(f"acceptance {s.acceptance}: approximate, this is NOT the exact greedy output", file=sys.stderr)
    if s.note:
        print(f"note: {s.note}", file=sys.stderr)
    if args.compare:
        prompt = ids if healing is None else healing.input_ids  # healed: transformers with the same constraint
        constraint = None if healing is None else healing.prefix_allowed_tokens_fn(vocab_size(model.base))
        start = time.perf_counter()
        ref = greedy_generate(model.base, prompt, args.max_new_tokens, prefix_allowed_tokens_fn=constraint)
        seconds = time.perf_counter() - start
        new = ref.shape[1] - (1 if seq2seq else prompt.shape[1])
        print(f"greedy (transformers): {new} tokens, {new} calls, {new / seconds:.1f} tokens/s", file=sys.stderr)
        diverged = first_divergence(model.base, ref, out.sequences, source=ids if seq2seq else None)
        note = "" if s.exact else f"; expected under approximate acceptance {s.acceptance}"
        if diverged is None:
            verdict = "yes"
        elif diverged.near_tie(model.base.dtype):
            verdict = f"no, a near tie within {dtype_name(dtype)} rounding ({diverged}{note})"
        else:
            verdict = f"NO ({diverged}{note})"
        print(f"identical: {verdict}", file=sys.stderr)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete a prompt with exact blockwise decoding (greedy, or --sample)")
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="saved BlockwiseLM or transformers folder, or GGUF (default: built-in)"
    )
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the text to continue; - reads it from standard input")
    given.add_argument(
        "--chat",
        metavar="MESSAGE",
        help="a message to an instruct model, sent through its chat template (never healed), its reply printed; - "
        "reads it from standard input",
    )
    p.add_argument("--system", default=None, help="with --chat: the system message before it")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    add_drafting_flags(p)
    p.add_argument(
        "--head-type", choices=HEAD_TYPES, default=None, help="for a model without trained heads (default: paper)"
    )
    p.add_argument(
        "--eagle3",
        default=None,
        help="an EAGLE-3 drafter for this model (a folder in the speculators or the original layout), for "
        "--drafter eagle3 (default: the one saved with the model, if any)",
    )
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="auto: bf16 where native, else fp32")
    p.add_argument("--compare", action="store_true", help="also run transformers greedy and compare outputs")
    p.add_argument(
        "--acceptance",
        default="exact",
        help="exact (default), or approximate: topk:N, distance:EPS (needs --value-map), min-block:L",
    )
    p.add_argument("--value-map", default=None, help="JSON list: each token id's value, for distance:EPS")
    p.add_argument(
        "--sample", action="store_true", help="sample as transformers' do_sample=True does, exactly in distribution"
    )
    p.add_argument(
        "--temperature", type=temperature, default=None, help="with --sample (default: the generation config's)"
    )
    p.add_argument(
        "--top-k", type=top_k, default=None, help="with --sample: 0 is off (default: the generation config's)"
    )
    p.add_argument(
        "--top-p", type=top_p, default=None, help="with --sample: 1 is off (default: the generation config's)"
    )
    p.add_argument("--seed", type=random_seed, default=None, help="with --sample: the same seed gives the same text")
    p.add_argument("--no-heal", dest="heal", action="store_false", help=NO_HEAL)
    add_corpus_flag(p)
    p.set_defaults(func=run)
