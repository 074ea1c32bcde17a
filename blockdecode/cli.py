"""The `blockdecode` command: a table of commands, each with its parser and handler in `commands/`."""

from __future__ import annotations

import os
import sys
import warnings

import torch

from blockdecode.commands import (
    bench,
    bible,
    calibrate,
    chat,
    demo,
    export,
    generate,
    pretrain,
    pretrain_translation,
    train,
)
from blockdecode.commands.flags import Parser, is_text, positive_int
from blockdecode.core.hf import stay_offline

COMMANDS = (generate, chat, train, pretrain, pretrain_translation, bench, calibrate, export, bible, demo)
"""Each module's `add_parser` adds its command's subparser, with `func` set to the module's `run`."""

TRAINING = ("train", "pretrain", "pretrain-translation")


def main(argv: list[str] | None = None) -> None:
    stay_offline()
    parser = Parser(prog="blockdecode", description=__doc__)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)

    args = parser.parse_args(argv)
    if args.threads:
        if args.threads > 4 * (os.cpu_count() or 1):
            parser.error(f"--threads {args.threads}: this machine has {os.cpu_count()} CPUs")
        torch.set_num_threads(args.threads)
    for name in ("prompt", "chat", "system"):  # generate's text: "-" reads a prompt or a message from stdin
        if name != "system" and getattr(args, name, None) == "-":
            setattr(args, name, sys.stdin.read())
        if getattr(args, name, None) is not None and not is_text(getattr(args, name)):
            parser.error(f"--{name} is not valid UTF-8 text")
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning
            args.func(args)
    except KeyboardInterrupt:
        resume = " (the last checkpoint is kept: run it again with --resume)" if args.command in TRAINING else ""
        print(f"interrupted{resume}", file=sys.stderr)
        raise SystemExit(130) from None
    except (ValueError, OSError) as err:
        raise SystemExit(f"error: {err}") from err


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A library's warning as a line of the command's own, without Python's file, line and source."""
    print(f"warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    main()
