"""`--dtype auto` and `mixed_precision="auto"`: bf16 only where the machine computes it natively."""

from __future__ import annotations

import pytest
import torch

from blockdecode.core import hardware
from blockdecode.core.hf import dtype_for
from blockdecode.training.loop import Precision


@pytest.mark.parametrize(
    ("flags", "fast", "native"),
    [
        (frozenset({"avx2", "fma"}), True, False),  # no bf16 instructions: fp32, without probing
        (frozenset({"avx512f", "avx512_bf16"}), True, True),
        (frozenset({"avx512f", "avx512_bf16"}), False, False),  # the flag, but bf16 measured slow
        (frozenset({"amx_bf16"}), True, True),
    ],
)
def test_auto_is_bf16_only_where_flags_and_a_measurement_agree(
    monkeypatch: pytest.MonkeyPatch, flags: frozenset, fast: bool, native: bool
) -> None:
    probed = []
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hardware, "bf16_measured_fast", lambda: probed.append(1) or fast)
    assert hardware.native_bf16("cpu") is native
    assert dtype_for("auto") == (torch.bfloat16 if native else torch.float32)
    assert Precision("auto", torch.device("cpu")).mode == ("bf16" if native else "no")
    assert bool(probed) == bool(flags & {"avx512_bf16", "amx_bf16"})
    assert dtype_for("fp32") == torch.float32 and dtype_for("bf16") == torch.bfloat16  # named: as named


def test_the_probe_is_quick_and_answers_once() -> None:
    hardware.bf16_measured_fast.cache_clear()
    assert isinstance(hardware.bf16_measured_fast(), bool)
    assert hardware.bf16_measured_fast.cache_info().currsize == 1
    with pytest.raises(ValueError, match="unknown dtype 'float16'"):
        dtype_for("float16")
