"""What this machine computes natively, so that "auto" precision is bf16 only where bf16 is fast.

On a CPU without AVX512-BF16 or AMX, bf16 matmuls are emulated: a verifying pass of 8 tokens cost
2.7 single-token passes there against 1.8 in fp32, and bf16 training was 40x slower."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")
"""Training precisions: "auto" is bf16 autocast where the device computes bf16 natively, none elsewhere."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux); empty where /proc/cpuinfo cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def cpu_name() -> str:
    """The CPU's model name (Linux), or "" where /proc/cpuinfo gives none: two machines of one instruction set
    still differ in speed, and a cost measured on one is not the other's."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether `device` multiplies bf16 matrices in hardware: a GPU that supports it, or a CPU whose
    flags say AVX512-BF16 or AMX and on which a bf16 product, measured, is no slower than fp32's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu" or not set(BF16_CPU_FLAGS) & cpu_flags():
        return False
    return bf16_measured_fast()


@functools.cache
def bf16_measured_fast(rows: int = 8, width: int = 1024, reps: int = 20) -> bool:
    """A probe of a few milliseconds, once per process: the rows of a verify pass through a layer,
    in bf16 and fp32, the best of `reps` each. Emulated bf16 takes about twice fp32's time."""
    x, w = torch.randn(rows, width), torch.randn(width, 4 * width)

    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    return best(x.bfloat16(), w.bfloat16()) <= 1.1 * best(x, w)


def auto_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 where `device` computes it natively, fp32 elsewhere."""
    return torch.bfloat16 if native_bf16(device) else torch.float32
