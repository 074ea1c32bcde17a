"""`blockdecode chat`: a conversation with an instruct model in the terminal, each reply streamed block by block.

The conversation is a list of messages kept between turns and sent whole through the chat template each turn, so
the lookup drafters draft from its earlier turns. One plan serves every turn (made, and any measuring done, before
the first "> "), so what stood in earlier replies ranks the candidates of later ones."""

from __future__ import annotations

import argparse
import sys

from blockdecode.commands.flags import add_drafting_flags, check_drafter, positive_int
from blockdecode.core.hf import DTYPE_CHOICES, dtype_for, dtype_name

HELP = "/reset starts a new conversation, Ctrl-D quits, Ctrl-C cuts a reply short"


def run(args: argparse.Namespace) -> None:
    import warnings

    from blockdecode.chat import BlockStreamer, chat_ids
    from blockdecode.model import load

    check_drafter(args.drafter, args.tree)
    dtype = dtype_for(args.dtype)
    model, tokenizer = load(args.model, dtype, args.k)
    start = [{"role": "system", "content": args.system}] if args.system else []
    hello = chat_ids(tokenizer, [*start, {"role": "user", "content": "Hello!"}])  # refuses a model without a template
    with warnings.catch_warnings():  # a tree the plan cannot use is said once, as its note below
        warnings.simplefilter("ignore")
        plan = model.plan(args.drafter, args.k, args.tree, prompts=model.prompts or [hello])
    note = f"; note: {plan.note}" if plan.note else ""
    print(f"blockdecode chat: {args.model} ({plan.drafter_name}, k={plan.k}, {dtype_name(dtype)}); {HELP}{note}",
          file=sys.stderr)  # fmt: skip
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    streamer = BlockStreamer(tokenizer)
    messages = list(start)
    while True:
        try:
            text = input("> ")
        except EOFError:  # Ctrl-D
            print()
            return
        if text.strip() == "/reset":
            messages = list(start)
            print("(a new conversation)", file=sys.stderr)
            continue
        if not text.strip():
            continue
        try:
            reply = model.chat([*messages, {"role": "user", "content": text}], tokenizer, args.max_new_tokens,
                               plan=plan, streamer=streamer)  # fmt: skip
        except KeyboardInterrupt:  # the reply is dropped, and the message it answered
            print("\n(cut short: not kept)", file=sys.stderr)
            continue
        print()
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply.reply}]
        s = reply.stats
        ended = int(reply.output.sequences[0, -1]) in plan.eos
        cut = "" if ended else ", cut at --max-new-tokens"
        status = f"{s.new_tokens} tokens, {s.tokens_per_second:.1f} tokens/s, {s.mean_block_size:.2f} tokens a call"
        print(f"[{status}{cut}]", file=sys.stderr)


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="talk with an instruct model in the terminal, each reply streamed as it is decoded")
    p.add_argument("--model", required=True, help="an instruct model with a chat template: a folder or a GGUF file")
    p.add_argument("--system", default=None, help="the system message every conversation starts with")
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="the longest reply, in tokens")
    add_drafting_flags(p)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="auto: bf16 where native, else fp32")
    p.set_defaults(func=run)
