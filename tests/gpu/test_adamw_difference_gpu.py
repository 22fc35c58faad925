"""``acco_ds.ops.adamw_difference.adamw_step_difference`` on a CUDA GPU: the Triton kernel (the default for CUDA
tensors) against the composition (the CUDA AdamW, then the Triton quantize_difference and add_dequantized), bit for
bit, and against the CPU's fused kernel on the same inputs; it never makes the host wait. Skipped without a CUDA
GPU."""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_adamw_difference import DTYPES_AND_LAYOUTS, _assert_bits, _run, _state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [(1, 16), (300, 7), (100_003, 256), (1_000_003, 1024)]


def _cuda(state):
    return tuple(t.cuda() for t in state)


def _cpu(d: dict) -> dict:
    return {k: v.cpu() for k, v in d.items()}


@pytest.mark.parametrize("mode", ["commit", "peek", "noop"])
@pytest.mark.parametrize(("gdt", "pdt", "layout"), DTYPES_AND_LAYOUTS)
def test_triton_is_the_composition_on_the_gpu(gdt, pdt, layout, mode):
    for n, bs in CASES:
        for bits in (8, 4):
            state = _state(n, pdt, gdt, seed=n + bs, bad=n % 2 == 0)
            args = (pdt, bs, mode != "peek", mode == "noop", layout)
            got = _cpu(_run("triton", _cuda(state), *args, bits=bits))
            want = _cpu(_run("composed", _cuda(state), *args, bits=bits))
            _assert_bits(got, want, (n, bs, bits))
            if bits == 8:  # the CPU's fused kernel: the same bits from the same inputs
                _assert_bits(got, _run(None, state, *args), ("cpu", n, bs))


def test_no_host_sync():
    state = _cuda(_state(100_003, torch.bfloat16, torch.bfloat16, seed=1))
    _run("triton", state, torch.bfloat16, 256, True, False, "separate")  # compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run("triton", state, torch.bfloat16, 256, True, False, "separate")
    finally:
        torch.cuda.set_sync_debug_mode("default")
