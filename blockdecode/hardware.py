"""What this machine computes natively, so that "auto" precision is bf16 only where bf16 is fast.

On a CPU without AVX512-BF16 or AMX, bf16 matmuls are emulated: a verifying pass of 8 tokens cost
2.7 single-token passes there against 1.8 in fp32, and bf16 training was 40x slower."""

from __future__ import annotations

import functools
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


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether `device` multiplies bf16 matrices in hardware: a GPU that supports it, or a CPU with
    AVX512-BF16 or AMX (and a torch build that uses AVX-512)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    return bool(set(BF16_CPU_FLAGS) & cpu_flags()) and "AVX512" in torch.backends.cpu.get_cpu_capability()


def auto_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 where `device` computes it natively, fp32 elsewhere."""
    return torch.bfloat16 if native_bf16(device) else torch.float32
