"""The benchmark: every decoder on the same model, prompts, dtype and threads, in one process.

`methods` holds the decoders and the rounds that run them side by side, `report` what a run
writes, and `suite` the presets that `blockdecode bench` runs; the clocks are `blockdecode.decoding.timing`."""

from blockdecode.bench.methods import Method, Run, block_stats, measure
from blockdecode.bench.report import (
    acceptance_markdown,
    batch_markdown,
    core_markdown,
    markdown,
    sampling_markdown,
    write_report,
)
from blockdecode.bench.suite import PRESETS, BenchConfig, measure_bench, run_bench

__all__ = [
    "PRESETS",
    "BenchConfig",
    "Method",
    "Run",
    "acceptance_markdown",
    "batch_markdown",
    "block_stats",
    "core_markdown",
    "markdown",
    "measure",
    "measure_bench",
    "run_bench",
    "sampling_markdown",
    "write_report",
]
