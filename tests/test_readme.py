"""The README's examples, run as a reader would run them: every Python block in order in one namespace,
and every `blockdecode ...` command line parsed by the command's own parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from blockdecode import cli

README = Path(__file__).parents[1] / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def command_lines() -> list[str]:
    """Each `blockdecode` command of the README's bash blocks, continuation lines joined, comments dropped,
    `[--flag a|b]` options taken with their first choice."""
    lines = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("blockdecode "):
                line = re.sub(r"\[([^\]]*)\]", r"\1", line)
                lines.append(re.sub(r"(\S+?)\|\S+", r"\1", line))
    return lines


@pytest.mark.parametrize("line", command_lines())
def test_readme_commands_parse(line, monkeypatch):
    """Every command the README shows is one the parser takes, flags and values alike (the command itself
    is not run: tests/test_cli.py runs each command)."""
    ran = []
    for command in cli.COMMANDS:
        monkeypatch.setattr(command, "run", lambda args, name=command.__name__: ran.append(name))
    cli.main(shlex.split(line)[1:])
    assert ran == ["blockdecode.commands." + shlex.split(line)[1].replace("-", "_")]


def test_readme_has_examples():
    assert len(blocks("python")) >= 4 and len(command_lines()) >= 8


@pytest.mark.slow
def test_readme_python_examples_run(tmp_path, monkeypatch):
    """The Python blocks, in order, on the built-in model; "path/to/model" is its base saved as a plain
    `transformers` folder, so the last block's claim (== transformers' greedy) is checked too."""
    from blockdecode import DEFAULT_MODEL, load

    base, _ = load(DEFAULT_MODEL)
    base.base.save_pretrained(tmp_path / "path" / "to" / "model")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks("python"):
        exec(compile(block, str(README), "exec"), namespace)
    text = namespace["tokenizer"].decode(namespace["out"].sequences[0])
    assert text.startswith("class MLP(nn.Module):\n")
    reference = namespace["base"].generate(namespace["ids"], max_new_tokens=128, do_sample=False)
    assert torch.equal(namespace["out"].sequences, reference)
    assert (tmp_path / "my-model" / "blockdecode.json").is_file()
