"""The base model's quality checks (benchmarks/base_quality.py): loops in its text, held-out loss per byte."""

from __future__ import annotations

import pytest

from tests.conftest import script


@pytest.fixture(scope="module")
def quality():
    return script("base_quality")


def test_a_loop_is_a_run_of_eight_tokens_three_times_back_to_back(quality) -> None:
    text = list(range(20))
    assert quality.loop_in(text) is None
    assert quality.loop_in([1, 2, 3, 4, 5, 6, 7, 8] * 3) == (0, 8)
    assert quality.loop_in([1, 2, 3, 4, 5, 6, 7, 8] * 2 + [9]) is None  # twice is not a loop
    assert quality.loop_in(text[:5] + [7, 7, 7, 7, 7, 7, 7, 7, 7, 7]) == (5, 1)  # one token ten times
    assert quality.loop_in(text[:3] + [4, 5] * 9 + text[3:]) == (3, 2)  # a short period repeats a long run
    assert quality.loop_in(text[:3] + [4, 5] * 4 + text[3:]) is None  # 8 tokens, but not 3 runs of 8


def test_a_repeated_line_is_one_line_three_times_in_a_row(quality) -> None:
    assert quality.repeated_line("a = 1\nb = 2\na = 1\n") is None
    assert quality.repeated_line("x\n    self.f(a)\n    self.f(a)\n    self.f(a)\ny") == "    self.f(a)"
    assert quality.repeated_line("\n\n\n\nz") is None  # blank lines are layout, not a loop


def test_the_shipped_base_is_checked_end_to_end(quality, tmp_path) -> None:
    from blockdecode import DEFAULT_MODEL, load

    lm, tokenizer = load(DEFAULT_MODEL)
    rows = quality.continuations(lm.base, tokenizer, [quality.FIB], 16)
    assert len(rows) == 1 and rows[0]["text"] and (rows[0]["loop"] is None or len(rows[0]["loop"]) == 2)
    assert rows[0]["repeated_line"] is None or rows[0]["repeated_line"] in rows[0]["text"]
