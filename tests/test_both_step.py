"""The Both step benchmark (benchmarks/both_step.py): every arm timed on the same rows, the report written."""

from __future__ import annotations

import json

import pytest
from conftest import script


@pytest.fixture(scope="module")
def both_step():
    return script("both_step")


def test_a_tiny_run_times_every_arm_and_writes_its_report(both_step, tmp_path):
    out = tmp_path / "both_step.json"
    report = both_step.main(
        ["--out", str(out), "--batch-size", "2", "--seq-len", "24", "--rounds", "2", "--no-compile"]
    )
    assert set(report["tokens_per_s"]) == {
        "pretraining, eager",
        "Both, base loss on real data (two passes)",
        "Both, base loss on the distilled rows (one pass)",
        "heads alone, frozen base",
    }
    assert all(rate > 0 for rate in report["tokens_per_s"].values()) and report["tokens_per_step"] == 48
    assert json.loads(out.read_text())["seconds_per_step"] == report["seconds_per_step"]


def test_bad_arguments_are_one_line(both_step, capsys):
    with pytest.raises(SystemExit):
        both_step.parse_args(["--rounds", "1"])
    assert "--rounds must be at least 2" in capsys.readouterr().err
