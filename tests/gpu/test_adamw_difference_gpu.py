"""``acco_ds.ops.adamw_difference.adamw_step_difference`` on a CUDA GPU: the Triton kernel (the default for CUDA
tensors) against the composition (the CUDA AdamW, then the Triton quantize_difference and add_dequantized), bit for
bit; against the CPU's fused kernel on the same inputs (8 bits, below 1M elements: the CPU pass is slow) to the AdamW
kernels' tolerance, NaN where NaN and q at most one step away: a non-finite step's NaN carries the processor's
payload (bitwise, the CPU comparison failed on the H200 only at the length with a planted inf); it never makes the
host wait. Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from acco_ds.ops.adamw import hyper_tensor
from acco_ds.ops.adamw_difference import adamw_step_difference
from tests.ops.adamw_oracle import ulp_atol
from tests.ops.test_adamw_difference import DTYPES_AND_LAYOUTS, HYPER, _assert_bits, _run, _state

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
            if bits == 8 and n < 1_000_000:  # the CPU's fused kernel (8 bits only), from the same inputs
                _assert_close_to_cpu(got, _run(None, state, *args), (n, bs))


def _assert_close_to_cpu(gpu: dict, cpu: dict, what) -> None:
    for k in ("master", "exp_avg", "exp_avg_sq"):
        x, y = gpu[k], cpu[k]
        torch.testing.assert_close(
            x, y, rtol=2e-6, atol=ulp_atol(y.nan_to_num()), equal_nan=True, msg=f"{k} {what}"
        )
    torch.testing.assert_close(
        gpu["scales"], cpu["scales"], rtol=4e-6, atol=0.0, equal_nan=True, msg=f"scales {what}"
    )
    off = (gpu["q"].int() - cpu["q"].int()).abs()
    assert off.numel() == 0 or int(off.max()) <= 1, f"q more than one step away: {what}"


def test_no_host_sync():
    """The step's own launches never wait for the device (its hyperparameter and flag tensors are made before, on
    the device, as the round job holds them)."""
    master, m, v, grad, base = _cuda(_state(100_003, torch.bfloat16, torch.bfloat16, seed=1))
    out = torch.empty_like(base)
    kw = dict(
        hyper_tensor=hyper_tensor(**HYPER, device="cuda"),
        scale_tensor=torch.tensor([0.5], device="cuda"),
        noop_flag=torch.zeros(1, dtype=torch.int32, device="cuda"),
        commit=True,
    )
    adamw_step_difference(
        master, m, v, grad, out, base, 256, backend="triton", **kw
    )  # compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adamw_step_difference(master, m, v, grad, out, base, 256, backend="triton", **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
