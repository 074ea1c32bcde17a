"""What the benchmark scripts share (benchmarks/common.py): `--dtype` defaults to what `auto` picks on this CPU, and
every report's heading names the CPU, torch's kernels on it and the dtype used."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import script

from blockdecode.core import hardware
from blockdecode.core.hf import dtype_for


@pytest.fixture(scope="module")
def common():
    return script("common")


@pytest.mark.parametrize("native, expected", [(False, torch.float32), (True, torch.bfloat16)])
def test_dtype_defaults_to_what_auto_picks_on_this_cpu(common, monkeypatch, native, expected):
    monkeypatch.setattr(hardware, "native_bf16", lambda device="cpu": native)
    p = argparse.ArgumentParser()
    common.dtype_flag(p)
    assert dtype_for(p.parse_args([]).dtype) == expected
    assert dtype_for(p.parse_args(["--dtype", "bf16"]).dtype) == torch.bfloat16


def test_a_heading_and_its_title_name_the_cpu_its_kernels_and_the_dtype(common, monkeypatch):
    monkeypatch.setattr(common, "cpu_name", lambda: "Some CPU 9000")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    report = common.heading("toy", torch.float32, threads=2, rounds=3)
    assert report == {"model": "toy", "machine": "Some CPU 9000 (AVX2)", "dtype": "fp32", "threads": 2, "rounds": 3}
    assert common.title(report) == "toy, fp32, 2 threads; Some CPU 9000 (AVX2)"
    both = common.heading("toy", [torch.bfloat16, torch.float32], threads={})  # several dtypes; threads by count
    assert both["dtype"] == "bf16/fp32" and common.title(both, "1") == "toy, bf16/fp32, 1 thread; Some CPU 9000 (AVX2)"
