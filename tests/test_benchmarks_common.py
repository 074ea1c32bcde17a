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


def test_llama_cpp_runs_each_prompt_from_an_empty_cache_and_ends_at_a_stop_token(common, monkeypatch):
    """llama-cpp-python, faked: every run prefills its whole prompt (the engine would keep the last prefix) and ends
    after an EOS id of `stop`, or at the budget."""
    import sys
    import types

    seen = []

    class Llama:
        def __init__(self, path: str, **settings) -> None:
            seen.append(("load", path, settings["n_ctx"], settings["n_threads"]))

        def reset(self) -> None:
            seen.append("reset")

        def generate(self, tokens: list[int], **sampling):
            seen.append(("generate", tokens, sampling["temp"]))
            yield from [7, 8, 9, 10, 11]

    engine = types.ModuleType("llama_cpp")
    engine.Llama = Llama
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = None
    monkeypatch.setitem(sys.modules, "llama_cpp", engine)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    run = common.llama_cpp_run("m.gguf", 2, 64)
    stopped = run(torch.tensor([[1, 2]]), 4, stop={9})
    assert stopped.sequence == [7, 8, 9] and stopped.calls == 3 and stopped.seconds >= 0
    assert run(torch.tensor([[1, 2]]), 4).sequence == [7, 8, 9, 10]
    assert seen == [("load", "m.gguf", 64, 2), "reset", ("generate", [1, 2], 0.0), "reset", ("generate", [1, 2], 0.0)]
