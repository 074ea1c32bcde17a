"""The repetition measure (benchmarks/repetition.py): which generated n-grams stood before them."""

from __future__ import annotations

from conftest import script


def test_only_output_ngrams_count_and_each_is_repeated_when_it_stood_anywhere_before():
    repetition = script("repetition").repetition
    # prompt 1 2 3; output 1 2 3 9 1 2 3: output 3-grams from position 3 on: (1,2,3) seen in the prompt,
    # (2,3,9) (3,9,1) (9,1,2) new, (1,2,3) seen, so 2 of 5
    assert repetition([1, 2, 3, 1, 2, 3, 9, 1, 2, 3], 3, n=3) == (2, 5)
    assert repetition([5, 6, 7, 8], 2, n=4) == (0, 0)  # no 4-gram starts in a 2-token output
    assert repetition([4, 4, 4, 4, 4, 4], 2, n=2) == (3, 3)  # the last token starts no 2-gram
    assert repetition([1, 2, 3, 1, 2, 3], 2, n=3) == (1, 2)  # (1, 2, 3) stood across the prompt's end
