"""fp16 <-> fp32 in every kernel (csrc/common/bf16.h and its Triton mirror acco_ds/ops/triton_kernels/bf16.py)
against torch's cast, bit for bit.

The values: every finite fp16 value and inf, every midpoint between two neighbours (the ties of round to nearest
even) and the fp32 values one ulp either side of both, both signs; the fp16 edges (65504, the tie 65520 that rounds
to inf, the smallest subnormals and the ties around them, the normal/subnormal boundary, fp32 subnormals, -0); NaNs
with several payloads; 200k random fp32 bit patterns. fp32 -> fp16 must give ``x.to(torch.float16)``'s bits, NaNs
included (a quiet NaN keeping its sign and the payload's top 10 bits: torch's CPU cast); fp16 -> fp32 must be exact
(every one of the 65536 fp16 bit patterns), a NaN made quiet with its sign and payload.

The C++ rule runs through copy_flat / accumulate_flat ("cpp", every CPU instruction-set variant) and the CUDA AdamW
body's CPU harness (its noop step stores the fp32 master cast to the output dtype); the Triton rule under the Triton
interpreter (this file run as ``__main__`` with ``--triton-interpret``, in a subprocess).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from acco_ds.ops import _build
from acco_ds.ops.accumulate import accumulate_flat, copy_flat
from tests.ops.cpu_isa import run_under_isa
from tests.ops.triton_interpreter import run_this_file_interpreted


def edge_values() -> torch.Tensor:
    """fp32 values probing every rounding boundary of fp32 -> fp16 (module docstring)."""
    k = torch.arange(0, 0x7C01, dtype=torch.int32)
    vals = k.to(torch.int16).view(torch.float16).to(torch.float64)  # 0 .. 65504, then inf
    mid = (vals[:-1] + vals[1:]) / 2  # exact in fp32; the last one is inf (65504 and inf)
    base = torch.cat([vals, mid[:-1], torch.tensor([65520.0], dtype=torch.float64)]).to(torch.float32)
    b = base.view(torch.int32).to(torch.int64)
    near = torch.cat([b, b + 1, b - 1])
    near = near[near >= 0]
    edges = [
        0x477FE000,
        0x477FEFFF,
        0x477FF000,
        0x477FF001,
        0x47800000,
        0x7F7FFFFF,
        0x7F800000,  # 65504 .. inf
        0,
        1,
        0x7FFFFF,
        0x800000,  # zero, fp32 subnormals
        0x33000000,
        0x33000001,
        0x32FFFFFF,
        0x33400000,
        0x33800000,
        0x33C00000,  # 2**-25 (tie to 0), 2**-24
        0x387FC000,
        0x387FE000,
        0x387FF000,
        0x387FFFFF,
        0x38800000,
    ]  # around 2**-14, the smallest normal
    nans = [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000, 0x7FC12345, 0x7F802000, 0x7F801FFF]
    rnd = torch.randint(0, 2**31, (200_000,), generator=torch.Generator().manual_seed(16), dtype=torch.int64)
    mag = torch.cat([near, torch.tensor(edges + nans, dtype=torch.int64), rnd])
    both = torch.cat([mag, mag | 0x80000000])
    return torch.where(both >= 2**31, both - 2**32, both).to(torch.int32).view(torch.float32)


def all_fp16() -> torch.Tensor:
    """Every fp16 bit pattern."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)


def fp16_to_f32_expected(h: torch.Tensor) -> torch.Tensor:
    """The exact fp32 value of each fp16 (torch's cast), a NaN as sign | quiet | payload << 13 (int32 bits)."""
    raw = h.view(torch.int16).to(torch.int32) & 0xFFFF
    sign = (raw & 0x8000) << 16
    nan_bits = sign | 0x7FC00000 | ((raw & 0x3FF) << 13)
    return torch.where(h.isnan(), nan_bits, h.float().view(torch.int32))


def assert_bits(got: torch.Tensor, want: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """``got`` has ``want``'s bits (fp16 / fp32, NaN payloads and signed zeros included); names the first input
    (``src``, elementwise beside them) that differs."""
    raw = {torch.float16: torch.int16, torch.float32: torch.int32}
    g, w, x = (t.view(raw[t.dtype]).to(torch.int64) & 0xFFFFFFFF for t in (got, want, src))
    bad = (g != w).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {g.numel()} differ; first: input 0x{int(x[i]):x} -> 0x{int(g[i]):x}, "
            f"expected 0x{int(w[i]):x}"
        )


def check_cpp_conversions() -> None:
    """The C++ rule through the accumulate extension: copy (x * 1) and accumulate (0 + x) into fp16, back to fp32."""
    x = edge_values()
    want = x.to(torch.float16)
    out = torch.full_like(want, float("nan"))
    copy_flat(out, x, 1.0, backend="cpp")
    assert_bits(out, want, x, "cpp fp32 -> fp16 (copy)")
    acc = torch.zeros_like(want)
    accumulate_flat(acc, x, 1.0, backend="cpp")
    # 0 + x: x itself, but -0 + 0 is +0 and a signalling NaN comes out quiet (both as torch computes it)
    assert_bits(acc, (torch.zeros_like(x) + x).to(torch.float16), x, "cpp fp32 -> fp16 (accumulate)")
    h = all_fp16()
    back = torch.full((h.numel(),), float("nan"))
    copy_flat(back, h, 1.0, backend="cpp")
    assert_bits(back, fp16_to_f32_expected(h).view(torch.float32), h, "cpp fp16 -> fp32")


def require_ext(kind: str) -> None:
    if _build.load(kind) is None:
        pytest.skip(f"the {kind} extension is not built: {_build.why_missing(kind)}")


def test_cpp_fp16_matches_torch_cast():
    require_ext("accumulate_cpu")
    check_cpp_conversions()


_ISA_SCRIPT = (
    "from tests.ops.test_fp16_conversion import check_cpp_conversions\n"
    "from acco_ds.ops import _build\n"
    "check_cpp_conversions()\n"
    "print(_build.load('accumulate_cpu').ISA)\n"
)


@pytest.mark.parametrize("isa", ["avx2", "base"])
def test_cpp_fp16_every_isa_variant(isa):
    """The same bits from the lower instruction-set variants (the loops vectorise differently in each)."""
    require_ext("accumulate_cpu")
    run_under_isa(_ISA_SCRIPT, isa)


def test_cuda_body_harness_stores_torch_fp16_bits():
    """The CUDA AdamW body's conversion (its noop step writes ``out = cast(master)``): vector groups, scalar tail."""
    require_ext("adamw_cpu")
    from acco_ds.ops.adamw import adamw_step_cuda_body_on_cpu

    x = edge_values()
    n = x.numel() - (x.numel() % 4) + 3  # a partial last group
    x = torch.cat([x, x[:4]])[:n]
    zeros = torch.zeros(n)
    out = torch.full((n,), float("nan"), dtype=torch.float16)
    grad = torch.zeros(n, dtype=torch.float16)
    adamw_step_cuda_body_on_cpu(x.clone(), zeros.clone(), zeros.clone(), grad, out, lr=1e-3, beta1=0.9,
                                beta2=0.99, eps=1e-8, weight_decay=0.0, step=1,
                                noop_flag=torch.ones(1, dtype=torch.int32))  # fmt: skip
    assert_bits(out, x.to(torch.float16), x, "CUDA body harness fp32 -> fp16")


def test_edge_values_cover_the_boundaries():
    """The probe holds what the module docstring promises (so a narrower one cannot pass unnoticed)."""
    x = edge_values()
    for v in (65504.0, 65520.0, -65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, -0.0, float("inf")):
        assert bool((x.view(torch.int32) == torch.tensor([v]).view(torch.int32)).any()), v
    h = x.to(torch.float16)
    assert (
        bool(h.isnan().any()) and bool(torch.isinf(h).any()) and bool(((h != 0) & (h.abs() < 2**-14)).any())
    )


def test_triton_fp16_under_interpreter():
    out = run_this_file_interpreted(__file__, timeout=900)
    assert "triton fp16 conversions: ok" in out, out[-2000:]


def _triton_interpret_checks() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import triton

    x = edge_values()
    n, block = x.numel(), 4096
    half = torch.full((n,), float("nan"), dtype=torch.float16)
    _to_half[(triton.cdiv(n, block),)](x, half, n, BLOCK=block)
    assert_bits(half, x.to(torch.float16), x, "triton fp32 -> fp16")
    h = all_fp16()
    single = torch.full((h.numel(),), float("nan"))
    _to_single[(triton.cdiv(h.numel(), block),)](h, single, h.numel(), BLOCK=block)
    assert_bits(single, fp16_to_f32_expected(h).view(torch.float32), h, "triton fp16 -> fp32")
    round_trip = torch.full((n,), float("nan"))
    _by_code[(triton.cdiv(n, block),)](x, round_trip, n, DT=2, BLOCK=block)
    want = fp16_to_f32_expected(x.to(torch.float16)).view(torch.float32)
    assert_bits(round_trip, want, x, "triton to_f32(from_f32(x, 2), 2)")
    print("triton fp16 conversions: ok")
    return 0


if __name__ == "__main__" and "--triton-interpret" in sys.argv:
    import triton
    import triton.language as tl

    from acco_ds.ops.triton_kernels.bf16 import f16_to_f32, f32_to_f16, from_f32, to_f32

    @triton.jit
    def _to_half(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, f32_to_f16(tl.load(x_ptr + i, mask=i < n)), mask=i < n)

    @triton.jit
    def _to_single(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, f16_to_f32(tl.load(x_ptr + i, mask=i < n)), mask=i < n)

    @triton.jit
    def _by_code(x_ptr, y_ptr, n, DT: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, to_f32(from_f32(tl.load(x_ptr + i, mask=i < n), DT), DT), mask=i < n)

    raise SystemExit(_triton_interpret_checks())
