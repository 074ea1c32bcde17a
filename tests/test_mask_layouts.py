"""The mask layouts benchmark (benchmarks/mask_layouts.py): where groups sit in a verify call, and the blocks."""

from __future__ import annotations

import pytest
import torch
from conftest import script

from blockdecode.core.loss import IGNORE


@pytest.fixture(scope="module")
def layouts():
    return script("mask_layouts")


def test_a_group_after_a_node_sees_that_node_its_ancestors_and_its_own_earlier_masks(layouts):
    positions, allowed = layouts.layout(3, [0, 2])  # nodes 0..2, a group of 2 masks after node 0 and after node 2
    assert positions.tolist() == [0, 1, 2, 1, 2, 3, 4]
    sees = [row.nonzero().flatten().tolist() for row in allowed]
    assert sees == [[0], [0, 1], [0, 1, 2], [0, 3], [0, 3, 4], [0, 1, 2, 5], [0, 1, 2, 5, 6]]
    positions, allowed = layouts.layout(4, [])
    assert positions.tolist() == [0, 1, 2, 3] and torch.equal(allowed, torch.ones(4, 4, dtype=torch.bool).tril())


def test_chain_blocks_count_leading_right_guesses_per_k(layouts):
    targets = torch.tensor([[[5, 6, 7], [6, 7, 8], [7, 8, IGNORE]]])
    guesses = torch.tensor([[[5, 0, 7], [6, 7, 8], [7, 8, 9]]])
    found = layouts.chain_blocks(guesses, targets, [2, 4])
    assert found == {"2": pytest.approx(2.0), "4": pytest.approx(1 + (1 + 3) / 2)}  # the third anchor is left out


def test_bad_arguments_are_one_line(layouts, tmp_path, capsys):
    with pytest.raises(SystemExit):
        layouts.parse_args(["--pilot", str(tmp_path)])
    assert "holds no mask_pilot.json" in capsys.readouterr().err
    (tmp_path / "mask_pilot.json").write_text("{}")
    with pytest.raises(SystemExit):
        layouts.parse_args(["--pilot", str(tmp_path), "--ks", "4,x"])
    assert "--ks must be integers" in capsys.readouterr().err
