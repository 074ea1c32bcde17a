"""The command line's value types: each bad value is refused in one line that names it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from blockdecode.commands.flags import comma_names, config_from, listed, positive_int, read_value_map, tree_budget


def test_a_binary_value_map_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "values.bin"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match=rf"^--value-map {path}: not a readable JSON file") as err:
        read_value_map(str(path))
    assert "\n" not in str(err.value)


def test_a_value_map_reads_nulls_as_values_missing(tmp_path: Path) -> None:
    path = tmp_path / "values.json"
    path.write_text("[1, null, 2.5]")
    values = read_value_map(str(path))
    assert values[0] == 1.0 and values[1] != values[1] and values[2] == 2.5


def test_flag_values() -> None:
    assert tree_budget("off") is None and tree_budget("expected") == "expected" and tree_budget("8") == 8
    assert listed(positive_int)("2,4") == [2, 4] and listed(positive_int)("off") == []
    assert comma_names("WEB,mhcc,web") == ["web", "mhcc"]
    for bad in ("0", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be"):
            tree_budget(bad)


def test_a_config_takes_the_flags_that_name_its_fields_and_the_overrides() -> None:
    """How a run's dataclass is built from its command's flags: one builder for the CLI and the benchmarks."""

    @dataclass
    class Run:
        out: str
        steps: int = 10
        lr: float = 1e-3

    args = argparse.Namespace(out="root", steps=None, lr=0.5, unrelated=1)
    assert config_from(Run, args) == Run("root", 10, 0.5)  # None: the field's default
    assert config_from(Run, args, out="root/masks", steps=3) == Run("root/masks", 3, 0.5)
