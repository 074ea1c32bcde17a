"""The command line's value types and its parser: each flag's value is read and checked here, so a
bad one is refused in one line before any model loads."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from blockdecode.core.hardware import MIXED_PRECISIONS
from blockdecode.decoding.plan import MAX_TREE
from blockdecode.drafters.registry import CHOICES, DRAFTERS

DRAFTER_CHOICES = tuple(dict.fromkeys(("auto", *DRAFTERS, *CHOICES, "heads+suffix")))


class Parser(argparse.ArgumentParser):
    """argparse, refusing in one line (the error and where the help is, not the whole usage), with
    every `type=int` flag read by `int64`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register("type", int, int64)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def integer_flag(text: str, low: int, high: int, allowed: str) -> int:
    """A flag's integer from `low` to `high`; else an error saying what it may be (`allowed`)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
    return value


def int64(text: str) -> int:
    """Every integer flag's value (`Parser`): torch takes it as a 64-bit integer, and beyond that
    range fails with "Overflow when unpacking long long", after the model has loaded."""
    return integer_flag(text, -(2**63), 2**63 - 1, "an integer from -2**63 to 2**63 - 1")


def positive_int(text: str) -> int:
    return integer_flag(text, 1, 2**63 - 1, "an integer >= 1")


def random_seed(text: str) -> int:
    """--seed: what torch's random generators take."""
    return integer_flag(text, 0, 2**64 - 1, "an integer from 0 to 2**64 - 1")


def top_k(text: str) -> int:
    return integer_flag(text, 0, 2**63 - 1, "an integer >= 0 (0: off)")


def temperature(text: str) -> float:
    """--temperature(s): sampling's, a number > 0 (greedy decoding is the command without --sample)."""
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def top_p(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1] (1: off), got {text}")
    return value


def tree_budget(text: str) -> int | str | None:
    """--tree N (a node budget, at most what a plan verifies; a short context may allow less), auto
    (measured, see `blockdecode calibrate`), expected (ranked each call by each candidate's chance to
    stand, `blockdecode.decoding.ranking`), off, or default: what `generate` does by default (expected, or auto
    under sampling)."""
    if text in ("off", "auto", "expected", "default"):
        return None if text == "off" else text
    return integer_flag(text, 1, MAX_TREE, f"off, auto, expected or a budget from 1 to {MAX_TREE}")


def tree_budgets(text: str) -> list[int | str | None]:
    return [tree_budget(t) for t in text.split(",")]


def listed(kind: Callable[[str], object]) -> Callable[[str], list]:
    """A flag's comma-separated values, each read by `kind`; off: none."""

    def values(text: str) -> list:
        return [] if text == "off" else [kind(t) for t in text.split(",") if t]

    return values


def config_from(cls, args: argparse.Namespace, **overrides):
    """The dataclass `cls` from the parsed arguments that name its fields (those given, not None),
    with `overrides` for the fields whose value is not a flag's as it stands."""
    fields = set(cls.__dataclass_fields__)
    given = {name: value for name, value in vars(args).items() if name in fields and value is not None}
    return cls(**{**given, **overrides})


def comma_names(text: str) -> list[str]:
    """Comma-separated names, lower-cased, each once, in their order."""
    return list(dict.fromkeys(name.lower() for name in text.split(",") if name))


def check_drafter(drafter: str, tree: int | str | None) -> None:
    """Drafters named together share a tree: without one they are refused here, before loading."""
    if "+" in drafter and tree is None:
        raise ValueError(f"--drafter {drafter} shares a tree among its drafters: give --tree N or auto, or one drafter")


def check_corpus(drafter: str, corpus: list[str] | None) -> None:
    """--corpus is read by suffix lookup alone, which the default adds: with other drafters it is refused here, before
    loading; so is an empty path (Path("") is the current folder, read whole: never meant), as the API's corpus=."""
    if corpus and not all(path.strip() for path in corpus):
        raise ValueError("--corpus: an empty path names nothing: give files or folders")
    if corpus and drafter != "auto" and "suffix" not in drafter.split("+"):
        raise ValueError(f"--corpus is read by suffix lookup, and --drafter {drafter} has none: add --drafter suffix "
                         "or heads+suffix")  # fmt: skip


def read_value_map(path: str) -> list[float]:
    """--value-map: a JSON list giving each token id's ordinal value (null for tokens that have none)."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not text at all (a binary file)
        raise ValueError(f"--value-map {path}: not a readable JSON file ({err})") from err
    if not isinstance(values, list) or not all(
        v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in values
    ):
        raise ValueError(f"--value-map {path} must hold a JSON list of numbers (null for non-ordinal tokens)")
    return [float("nan") if v is None else float(v) for v in values]


def is_text(value: str) -> bool:
    """False for what cannot be encoded as UTF-8: bytes the shell passed that are not UTF-8
    (decoded by Python as lone surrogates), or a lone surrogate from a JSON file."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


NO_HEAL = (
    "continue a prompt that ends mid-token (in a bare newline or space) from its last token as it is, "
    "not from its text (token healing, on by default; a translation or a --chat message is never healed)"
)


def add_drafting_flags(p: argparse.ArgumentParser) -> None:
    """--k, --drafter and --tree: how a decode drafts, the same in every command that decodes."""
    p.add_argument(
        "--k", type=positive_int, default=None, help="block size (default: the heads' k; 16 where a lookup ranks)"
    )
    p.add_argument(
        "--drafter", choices=DRAFTER_CHOICES, default="auto", help="where proposals come from (auto: measured)"
    )
    p.add_argument(
        "--tree",
        type=tree_budget,
        default="default",
        help="N candidates a call, expected (ranked; default, greedy), auto (measured; default, sampling), off",
    )


def add_corpus_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--corpus",
        action="append",
        metavar="PATH",
        help="with --drafter suffix or heads+suffix: a file or folder of text it also drafts from (repeatable; "
        "indexed once, cached in ~/.cache/blockdecode/corpus)",
    )


RESUME = "continue from the checkpoint in --out, refused if a setting that decides what is trained differs"


def add_run_arguments(p, defaults, ints: tuple[str, ...], floats: tuple[str, ...]) -> None:
    """--flags for a from-scratch run's config fields, defaulting to the dataclass's values; then
    --seed, --mixed-precision and --resume."""
    for names, kind in ((ints, int), (floats, float)):
        for name in names:
            p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(defaults, name))
    p.add_argument("--seed", type=random_seed, default=defaults.seed)
    p.add_argument("--mixed-precision", choices=MIXED_PRECISIONS, default=defaults.mixed_precision)
    p.add_argument("--resume", action="store_true", help=RESUME)


def say_what_may_change(p: argparse.ArgumentParser, config: type, must_match: tuple[str, ...]) -> None:
    """Each flag of a run's setting that a resume does not check says in its help that it may change
    (`must_match`: those it checks; the data's or corpus' content is checked by its fingerprint)."""
    fixed = (*must_match, "data", "corpus", "out", "resume")
    for action in p._actions:
        if action.dest in config.__dataclass_fields__ and action.dest not in fixed:
            action.help = f"{action.help or ''} (may change on --resume)".lstrip()
