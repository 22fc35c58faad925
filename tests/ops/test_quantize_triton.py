"""The Triton quantize kernels (``backend="triton"``, acco_ds/ops/triton_kernels/quantize.py) against the torch
reference, bit for bit, under the Triton interpreter (``TRITON_INTERPRET=1``, in a subprocess: it must be set before
triton is imported).

The same cases as the CPU kernel's (tests/ops/test_quantize_kernel.py: its inputs and bit comparison): fp32, bf16 and
fp16 inputs and residuals, 8 and 4 bits, odd lengths (short last blocks), block sizes from 1 to 4096 (a block longer
than a program's 1024-element tile is walked tile by tile), all-zero and negative-zero blocks, huge and subnormal
magnitudes, +-inf and NaN, exact ties, rounds of error feedback summed as a chunk's owner sums them. The
interpreter runs one program at a time in Python, so the lengths stay small where the blocks are.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from acco_ds.ops.quantize import (
    add_dequantized,
    add_dequantized_ref,
    dequantize,
    dequantize_add,
    dequantize_add_ref,
    dequantize_ref,
    dequantize_sum,
    dequantize_sum_ref,
    num_blocks,
    quantize,
    quantize_difference,
    quantize_difference_ref,
    quantize_ref,
    quantize_with_residual,
    quantize_with_residual_ref,
)
from tests.ops.test_quantize_kernel import (
    DTYPES,
    assert_same,
    check_edge_cases,
    deq_case,
    diff_case,
    gen,
    small,
    special,
    sum_case,
)
from tests.ops.triton_interpreter import run_this_file_interpreted

ROOT = Path(__file__).resolve().parents[2]
# (length, block size): short inputs with every block size (one element per block on the shortest), longer ones
# with blocks the interpreter can afford (it runs each program, one per block, in Python)
CASES = [(n, b) for n in (0, 1, 7, 255, 257) for b in (7, 16, 256, 4096)] + [(1, 1), (7, 1)]
CASES += [(4099, 256), (4099, 4096), (20_011, 4096), (20_011, 1000)]


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        quantize(torch.ones(10), 4, backend="triton")


def test_importing_the_quantizer_does_not_import_triton():
    code = "import sys, acco_ds.ops.quantize, acco_ds.core.compressed_comm; print('triton' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr


def test_triton_kernels_under_interpreter():
    """Runs this file's checks in a subprocess with TRITON_INTERPRET=1 (set before triton is imported)."""
    out = run_this_file_interpreted(__file__, timeout=1800)
    assert f"triton quantize checks: {_expected_checks()} passed" in out, out[-2000:]


def _bit_widths(n: int, block: int) -> tuple:
    """8 bits everywhere; 4 bits (the same code, another bound) on the short inputs with small blocks."""
    return (8, 4) if n <= 257 and block <= 16 else (8,)


def _expected_checks() -> int:
    # per bit width: quantize of each dtype, with a residual of each dtype; per case one dequantize check
    # + per parameter dtype: dequantize_sum, the difference quantized per bit width, the difference applied
    d = len(DTYPES)
    per_case = [d * len(_bit_widths(n, b)) * (1 + d) + 1 + d * (2 + len(_bit_widths(n, b))) for n, b in CASES]
    return (
        sum(per_case) + d * d + 1
    )  # + the error-feedback runs (dtype x residual dtype) + the exact edge cases


def _interpret_checks() -> int:

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    count = 0
    for n, block in CASES:
        for dtype in DTYPES.values():
            x = special(n, block, dtype, "triton")
            for nbits in _bit_widths(n, block):
                q, s = quantize(x, block, bits=nbits, backend="triton")
                q_ref, s_ref = quantize_ref(x, block, nbits)
                assert_same(q, q_ref, f"q ({n}, {block}, {dtype}, {nbits} bits)")
                assert_same(s, s_ref, f"scales ({n}, {block}, {dtype}, {nbits} bits)")
                count += 1
                for rdtype in DTYPES.values():
                    residual = small(n, rdtype, "triton")
                    residual_ref = residual.clone()
                    q, s = quantize_with_residual(x, residual, block, bits=nbits, backend="triton")
                    q_ref, s_ref = quantize_with_residual_ref(x, residual_ref, block, nbits)
                    what = f"({n}, {block}, {dtype}, residual {rdtype}, {nbits} bits)"
                    assert_same(q, q_ref, f"q {what}")
                    assert_same(s, s_ref, f"scales {what}")
                    assert_same(residual, residual_ref, f"residual {what}")
                    count += 1
        q, s = deq_case(n, block, "triton-deq")
        out = special(n, 64, torch.float32, "triton-acc")
        out_ref = out.clone()
        dequantize_add(out, q, s, block, backend="triton")
        dequantize_add_ref(out_ref, q, s, block)
        assert_same(out, out_ref, f"dequantize_add ({n}, {block})")
        assert_same(
            dequantize(q, s, block, backend="triton"), dequantize_ref(q, s, block), f"deq ({n}, {block})"
        )
        count += 1
        for out_dtype in DTYPES.values():
            qs, ss = sum_case(3, n, block, "triton-sum")
            total, total_ref = torch.full((n,), 7.0, dtype=out_dtype), torch.full((n,), 7.0, dtype=out_dtype)
            dequantize_sum(total, qs, ss, block, [2, 0, 1], backend="triton")
            dequantize_sum_ref(total_ref, qs, ss, block, [2, 0, 1])
            assert_same(total, total_ref, f"dequantize_sum ({n}, {block}, {out_dtype})")
            count += 1
            new, base = diff_case(n, block, out_dtype, "triton")
            for nbits in _bit_widths(n, block):
                qd, sd = quantize_difference(new, base, block, bits=nbits, backend="triton")
                qd_ref, sd_ref = quantize_difference_ref(new, base, block, nbits)
                assert_same(qd, qd_ref, f"difference q ({n}, {block}, {out_dtype}, {nbits} bits)")
                assert_same(sd, sd_ref, f"difference scales ({n}, {block}, {out_dtype}, {nbits} bits)")
                count += 1
            applied, applied_ref = torch.empty_like(base), torch.empty_like(base)
            add_dequantized(applied, base, q, s, block, backend="triton")
            add_dequantized_ref(applied_ref, base, q, s, block)
            assert_same(applied, applied_ref, f"add_dequantized ({n}, {block}, {out_dtype})")
            add_dequantized(base, base, q, s, block, backend="triton")
            assert_same(base, applied_ref, f"add_dequantized in place ({n}, {block}, {out_dtype})")
            count += 1
    for dtype in DTYPES.values():
        for rdtype in DTYPES.values():
            count += _rounds(dtype, rdtype)
    count += _edge_cases()
    return count


def _rounds(dtype: torch.dtype, rdtype: torch.dtype) -> int:
    """12 rounds of error feedback summed into an fp32 accumulator, now and then a non-finite or huge block."""

    n, block = 1001, 256
    residual = torch.zeros(n, dtype=rdtype)
    residual_ref = residual.clone()
    total, total_ref = torch.zeros(n), torch.zeros(n)
    for step in range(12):
        g = gen("triton-round", step, dtype, rdtype)
        x = (torch.randn(n, generator=g) * float(torch.rand(1, generator=g)) * 10).to(dtype)
        if step % 5 == 3:
            x = special(n, block, dtype, "triton-round", step)
        if step % 2:  # straight into a row of a wider buffer, as the compressed reduce-scatter does
            rows = torch.full((2, n), 99, dtype=torch.int8), torch.full((2, num_blocks(n, block)), 5.0)
            q, s = quantize_with_residual(x, residual, block, backend="triton", out=(rows[0][1], rows[1][1]))
            assert (
                q.data_ptr() == rows[0][1].data_ptr() and (rows[0][0] == 99).all() and (rows[1][0] == 5).all()
            )
        else:
            q, s = quantize_with_residual(x, residual, block, backend="triton")
        q_ref, s_ref = quantize_with_residual_ref(x, residual_ref, block)
        assert_same(q, q_ref, f"q, round {step}")
        assert_same(s, s_ref, f"scales, round {step}")
        assert_same(residual, residual_ref, f"residual, round {step}")
        dequantize_add(total, q, s, block, backend="triton")
        dequantize_add_ref(total_ref, q_ref, s_ref, block)
        assert_same(total, total_ref, f"sum of the dequantized rounds, round {step}")
        total.nan_to_num_(0.0)
        total_ref.nan_to_num_(0.0)
    assert residual.abs().max() > 0
    return 1


def _edge_cases() -> int:
    """Ties to even, the smallest subnormal scale, negative zeros kept in the residual, a residual that overflows
    v, and the NaN bits of a non-finite block's scale (``check_edge_cases``)."""
    check_edge_cases("triton")
    return 1


if __name__ == "__main__" and "--triton-interpret" in sys.argv:
    print(f"triton quantize checks: {_interpret_checks()} passed")
