"""The CPU quantize kernels (acco_ds._quantize_cpu, ``backend="cpp"``) against the torch reference, bit for bit.

Every check compares the bits (fp32 as int32, bf16 and fp16 as int16: NaN payloads and the sign of zero included)
of q, scales, the residual and dequantized values / sums, for fp32, bf16 and fp16 inputs and residuals (fp16 turns
the huge magnitudes into infs and the tiny ones into subnormals or zeros), odd lengths (short
last blocks), block sizes from 1 to 4096, all-zero blocks, huge (1e38) and subnormal (1e-40) magnitudes, +-inf
and NaN in some blocks, one and two OpenMP threads, every CPU instruction-set variant, and many rounds of error
feedback (the residual evolves). The module skips when the extension is not built.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from acco_ds.ops import _build
from acco_ds.ops.quantize import (
    add_dequantized,
    add_dequantized_ref,
    dequantize,
    dequantize_add,
    dequantize_add_ref,
    dequantize_ref,
    dequantize_sum,
    dequantize_sum_ref,
    quantize,
    quantize_difference,
    quantize_difference_ref,
    quantize_ref,
    quantize_with_residual,
    quantize_with_residual_ref,
)
from tests.ops.cpu_isa import run_under_isa

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIZES = [0, 1, 7, 255, 257, 4099, 100_003]
BLOCKS = [1, 7, 16, 256, 4096]
# per-block magnitudes: ordinary, huge, tiny normal, subnormal, the smallest subnormals
MAGNITUDES = [1.0, 1e-3, 1e38, 3e37, 1e-37, 1e-40, 1e-44, 1e-45]


@pytest.fixture(autouse=True)
def _needs_the_extension():
    if not _build.available("quantize_cpu"):
        pytest.skip(f"the CPU quantize extension is not available: {_build.why_missing('quantize_cpu')}")


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (comparing them compares NaN payloads and signed zeros too)."""
    return t.view(
        {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}.get(
            t.dtype, t.dtype
        )
    )


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str, any_nan: bool = False) -> None:
    """``a`` and ``b`` bit for bit (signed zeros and NaN bits included). ``any_nan``: any NaN matches any NaN, for
    results computed on a CUDA GPU, which makes other NaN bits than x86 (0x7fffffff for inf - inf where x86 makes
    0xffc00000): the NaN's bits are not part of the contract, its being NaN is."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    same = bits(a) == bits(b)
    if any_nan and a.is_floating_point():
        same |= a.isnan() & b.isnan()
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(
            f"{what}: {int((~same).sum())} differ, first at {i}: {a[i].item()} vs {b[i].item()}"
        )


def special(n: int, block_size: int, dtype: torch.dtype, *key) -> torch.Tensor:
    """Random values, one magnitude per block (huge, subnormal, ...); some blocks all zero, some holding an
    inf, a -inf or a NaN, some all negative zeros, some exact ties (x.5 steps)."""
    g = gen(n, block_size, dtype, *key)
    nb = -(-n // block_size)
    mag = torch.tensor(MAGNITUDES)[torch.randint(0, len(MAGNITUDES), (nb,), generator=g)]
    x = torch.randn(nb * block_size, generator=g).view(nb, block_size) * mag.unsqueeze(1)
    kind = torch.randint(0, 10, (nb,), generator=g)
    x[kind == 0] = 0.0
    x[kind == 1] = -0.0
    ties = kind == 2  # [127, k + 0.5, ...]: scale exactly 1, quotients on ties
    x[ties] = torch.arange(block_size, dtype=torch.float32).remainder(127) + 0.5
    x[ties, 0] = 127.0
    col = torch.randint(0, block_size, (nb,), generator=g)
    for k, bad in ((3, float("inf")), (4, float("-inf")), (5, float("nan"))):
        rows = (kind == k).nonzero().flatten()
        x[rows, col[rows]] = bad
    return x.reshape(-1)[:n].to(dtype).contiguous()


def deq_case(n: int, block_size: int, *key) -> tuple:
    """(q, scales): arbitrary int8 values (-128 included) and scales of every size per block (0, subnormal,
    huge: products overflow, NaN)."""
    g = gen(n, block_size, *key)
    q = torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8)
    nb = -(-n // block_size)
    s = (
        torch.rand(nb, generator=g)
        * torch.tensor(MAGNITUDES)[torch.randint(0, len(MAGNITUDES), (nb,), generator=g)]
    )
    s[::11] = 0.0
    s[3::13] = float("nan")
    s[5::17] = 3e37
    return q, s


def small(n: int, dtype: torch.dtype, *key) -> torch.Tensor:
    """A residual-like tensor: small values (and some subnormal ones)."""
    g = gen("small", n, dtype, *key)
    r = torch.randn(n, generator=g) * 1e-3
    r[::5] *= 1e-38
    return r.to(dtype)


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_the_reference(dtype, n, block_size):
    x = special(n, block_size, DTYPES[dtype])
    q, s = quantize(x, block_size, backend="cpp")
    q_ref, s_ref = quantize_ref(x, block_size)
    assert_same(q, q_ref, "q")
    assert_same(s, s_ref, "scales")
    assert_same(dequantize(q, s, block_size, backend="cpp"), dequantize_ref(q_ref, s_ref, block_size), "deq")


@pytest.mark.parametrize("rdtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_with_residual_matches_the_reference(dtype, n, block_size, rdtype):
    x = special(n, block_size, DTYPES[dtype])
    residual = small(n, DTYPES[rdtype])
    residual_ref = residual.clone()
    q, s = quantize_with_residual(x, residual, block_size, backend="cpp")
    q_ref, s_ref = quantize_with_residual_ref(x, residual_ref, block_size)
    assert_same(q, q_ref, "q")
    assert_same(s, s_ref, "scales")
    assert_same(residual, residual_ref, "residual")


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_dequantize_add_matches_the_reference(n, block_size):
    """Arbitrary int8 values (-128 included) and scales (0, subnormal, huge: products overflow, NaN) into an
    accumulator holding values of every size."""
    q, s = deq_case(n, block_size, "deq")
    out = special(n, 64, torch.float32, "acc")
    out_ref = out.clone()
    dequantize_add(out, q, s, block_size, backend="cpp")
    dequantize_add_ref(out_ref, q, s, block_size)
    assert_same(out, out_ref, "out")
    assert_same(dequantize(q, s, block_size, backend="cpp"), dequantize_ref(q, s, block_size), "deq")


def sum_case(rows: int, n: int, block_size: int, *key) -> tuple:
    """(q [rows, n], scales [rows, nb]): every row a :func:`deq_case` of its own."""
    cases = [deq_case(n, block_size, *key, r) for r in range(rows)]
    return torch.stack([q for q, _ in cases]), torch.stack([s for _, s in cases])


SUM_ORDERS = {1: [0], 2: [1, 0], 3: [2, 0, 1], 5: [3, 4, 0, 1, 2]}  # the owner first, then the ring order


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rows", sorted(SUM_ORDERS))
def test_dequantize_sum_matches_the_reference(rows, n, block_size, out_dtype):
    """The owner's fused sum of W quantized chunks, in fp32 or stored in bf16: the reference's bits (the
    reference is dequantize, then dequantize_add per further row, then torch's cast), NaN and overflowing
    products included."""
    q, s = sum_case(rows, n, block_size, "sum")
    order = SUM_ORDERS[rows]
    out = torch.full((n,), 7.0, dtype=DTYPES[out_dtype])
    out_ref = out.clone()
    dequantize_sum(out, q, s, block_size, order, backend="cpp")
    dequantize_sum_ref(out_ref, q, s, block_size, order)
    assert_same(out, out_ref, "out")
    by_rows = dequantize_ref(q[order[0]], s[order[0]], block_size)
    for r in order[1:]:
        dequantize_add_ref(by_rows, q[r], s[r], block_size)
    assert_same(out_ref, by_rows.to(DTYPES[out_dtype]), "reference vs row by row", any_nan=True)


def diff_case(n: int, block_size: int, dtype: torch.dtype, *key) -> tuple:
    """(new, base): new parameters with every special value of :func:`special`, a base near them (so that the
    differences are small, as a step's are) with some values far off."""
    new = special(n, block_size, dtype, "new", *key)
    base = (new.float().nan_to_num(0.0, 0.0, 0.0) + small(n, torch.float32, "base", *key)).to(dtype)
    base[::7] = special(n, 3, dtype, "far", *key)[::7]
    return new, base


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_difference_kernels_match_the_reference(dtype, n, block_size):
    """The parameter path's two passes: the difference quantized (the reference: quantize of the fp32 difference)
    and applied onto the base, into another buffer and in place, in the parameter dtype."""
    new, base = diff_case(n, block_size, DTYPES[dtype])
    q, s = quantize_difference(new, base, block_size, backend="cpp")
    q_ref, s_ref = quantize_difference_ref(new, base, block_size)
    assert_same(q, q_ref, "q")
    assert_same(s, s_ref, "scales")
    q_plain, s_plain = quantize_ref(new.float() - base.float(), block_size)
    assert_same(q_ref, q_plain, "reference q vs quantize of the difference")
    assert_same(s_ref, s_plain, "reference scales vs quantize of the difference")
    qd, sd = deq_case(n, block_size, "apply")
    out, out_ref = torch.empty_like(base), torch.empty_like(base)
    add_dequantized(out, base, qd, sd, block_size, backend="cpp")
    add_dequantized_ref(out_ref, base, qd, sd, block_size)
    assert_same(out, out_ref, "base + deq")
    inplace = base.clone()
    add_dequantized(inplace, inplace, qd, sd, block_size, backend="cpp")
    assert_same(inplace, out_ref, "base + deq in place")
    total = base.float()
    dequantize_add_ref(total, qd, sd, block_size)
    assert_same(out_ref, total.to(DTYPES[dtype]), "reference vs dequantize_add then cast", any_nan=True)


def test_dequantize_sum_follows_the_order_and_checks_its_arguments():
    q, s = sum_case(3, 1000, 16, "order")
    q[:, :] = 1
    s[:, :] = torch.tensor([[2.0**24], [1.0], [1.0]])  # sums whose fp32 result depends on their order
    a, c = torch.empty(1000), torch.empty(1000)
    dequantize_sum(a, q, s, 16, [0, 1, 2], backend="cpp")  # (2**24 + 1) + 1 = 2**24 in fp32
    dequantize_sum(c, q, s, 16, [1, 2, 0], backend="cpp")  # (1 + 1) + 2**24 = 2**24 + 2
    assert a[0].item() == 2.0**24 and c[0].item() == 2.0**24 + 2
    for bad, match in (
        (dict(order=[0, 0, 1]), "distinct rows"),
        (dict(order=[3]), "distinct rows"),
        (dict(order=[]), "at least one"),
        (dict(scales=s[:, :-1]), "scales must be fp32 of shape"),
        (dict(out=torch.empty(999)), "row length"),
        (dict(out=torch.empty(1000, dtype=torch.float64)), "torch.float32, torch.bfloat16 or torch.float16"),
    ):
        args = dict(out=torch.empty(1000), q=q, scales=s, block_size=16, order=None) | bad
        with pytest.raises((ValueError, TypeError), match=match):
            dequantize_sum(**args, backend="cpp")


@pytest.mark.parametrize("rdtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rounds_of_error_feedback(dtype, rdtype):
    """40 rounds: the residual evolves; each round's dequantized chunk is summed into an fp32 accumulator
    (as a chunk's owner does); now and then a round holds a non-finite block or a huge one."""
    n, block_size = 10_007, 256
    residual = torch.zeros(n, dtype=DTYPES[rdtype])
    residual_ref = residual.clone()
    total, total_ref = torch.zeros(n), torch.zeros(n)
    for step in range(40):
        g = gen("round", step, dtype, rdtype)
        x = (torch.randn(n, generator=g) * float(torch.rand(1, generator=g)) * 10).to(DTYPES[dtype])
        if step % 7 == 3:
            x = special(n, block_size, DTYPES[dtype], step)
        q, s = quantize_with_residual(x, residual, block_size, backend="cpp")
        q_ref, s_ref = quantize_with_residual_ref(x, residual_ref, block_size)
        assert_same(q, q_ref, f"q, round {step}")
        assert_same(s, s_ref, f"scales, round {step}")
        assert_same(residual, residual_ref, f"residual, round {step}")
        dequantize_add(total, q, s, block_size, backend="cpp")
        dequantize_add_ref(total_ref, q_ref, s_ref, block_size)
        assert_same(total, total_ref, f"sum of the dequantized rounds, round {step}")
        total.nan_to_num_(0.0)  # a skipped round leaves NaN: start the next sum clean, in both
        total_ref.nan_to_num_(0.0)
    assert residual.abs().max() > 0  # the residual did evolve


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_do_not_change_the_bits(threads):
    """Above 2 x 32k elements the work is split over OpenMP threads (whole blocks per work item)."""
    n, block_size = 200_003, 100  # blocks do not tile the 64k-element work items evenly
    x = special(n, block_size, torch.float32, "threads")
    residual = small(n, torch.bfloat16)
    residual_ref = residual.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, s = quantize_with_residual(x, residual, block_size, backend="cpp")
        out = torch.ones(n)
        dequantize_add(out, q, s, block_size, backend="cpp")
    finally:
        torch.set_num_threads(before)
    q_ref, s_ref = quantize_with_residual_ref(x, residual_ref, block_size)
    out_ref = torch.ones(n)
    dequantize_add_ref(out_ref, q_ref, s_ref, block_size)
    for a, b, what in ((q, q_ref, "q"), (s, s_ref, "scales"), (residual, residual_ref, "residual"),
                       (out, out_ref, "out")):  # fmt: skip
        assert_same(a, b, what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_slices(dtype):
    """x, the residual and the accumulator as slices at odd element offsets (no vector alignment)."""
    n, block_size = 5003, 16
    x = special(n + 3, block_size, DTYPES[dtype], "unaligned")[3:]
    residual = small(n + 1, DTYPES[dtype], "unaligned")[1:]
    residual_ref = residual.clone()
    q, s = quantize_with_residual(x, residual, block_size, backend="cpp")
    q_ref, s_ref = quantize_with_residual_ref(x, residual_ref, block_size)
    out = torch.ones(n + 5)[5:]
    q8 = torch.cat([torch.zeros(7, dtype=torch.int8), q])[7:]
    dequantize_add(out, q8, s, block_size, backend="cpp")
    out_ref = torch.ones(n)
    dequantize_add_ref(out_ref, q_ref, s_ref, block_size)
    for a, b, what in ((q, q_ref, "q"), (s, s_ref, "scales"), (residual, residual_ref, "residual"),
                       (out, out_ref, "out")):  # fmt: skip
        assert_same(a, b, what)


def check_edge_cases(backend: str) -> None:
    """Ties to even, the smallest subnormal scale, an all-zero block of negative zeros (its residual keeps
    them), a residual that overflows v, and the NaN bits of a non-finite block's scale: ``backend``'s kernel
    against the reference."""
    tiny = 2.0**-149
    fmax = torch.finfo(torch.float32).max
    x = torch.tensor(
        [127.0, 2.5, 3.5, -2.5, tiny, -tiny, 0.0, 3 * tiny, -0.0, -0.0, -0.0, -0.0, fmax, 1.0, 0, 0]
    )
    residual = torch.tensor([0.0] * 8 + [-0.0] * 4 + [fmax, 0.25, 0.0, 0.0])
    residual_ref = residual.clone()
    q, s = quantize_with_residual(x, residual, 4, backend=backend)
    q_ref, s_ref = quantize_with_residual_ref(x, residual_ref, 4)
    assert q.tolist() == [127, 2, 4, -2, 1, -1, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0], q.tolist()
    assert s[:3].tolist() == [1.0, tiny, 0.0] and s[3].isnan()
    assert residual[8:12].signbit().all() and residual[12:].tolist() == [0.0] * 4
    assert_same(q, q_ref, "q")
    assert_same(s, s_ref, "scales")
    assert_same(residual, residual_ref, "residual")


def test_the_exact_edge_cases():
    """The CPU kernel on ``check_edge_cases``."""
    check_edge_cases("cpp")


def test_auto_dispatch_takes_the_kernel_and_falls_back():
    """CPU contiguous tensors take the kernel by default; a strided view or an overlapping residual the
    reference; backend="cpp" refuses what the kernel cannot take."""
    x = special(1000, 16, torch.float32, "dispatch")
    q, s = quantize(x, 16)
    assert_same(q, quantize_ref(x, 16)[0], "q")
    strided = x.repeat_interleave(2)[::2]
    assert not strided.is_contiguous()
    assert_same(quantize(strided, 16)[1], quantize_ref(x, 16)[1], "scales of a strided view")
    with pytest.raises(ValueError, match="not contiguous"):
        quantize(strided, 16, backend="cpp")
    both = torch.cat([x, torch.zeros(8)])
    with pytest.raises(ValueError, match="overlap"):
        quantize_with_residual(both[:1000], both[8:], 16, backend="cpp")
    y, r = both.clone(), both.clone()
    want = quantize_with_residual_ref(y[:1000], y[8:], 16)
    got = quantize_with_residual(r[:1000], r[8:], 16)
    assert_same(got[0], want[0], "q of an overlapping residual")
    assert_same(r, y, "the overlapping residual")
    with pytest.raises(ValueError, match="backend must be one of"):
        quantize(x, 16, backend="gpu")


_ISA_SCRIPT = """
import sys, torch
from tests.ops import test_quantize_kernel as t
from acco_ds.ops import _build
from acco_ds.ops.quantize import dequantize_add, dequantize_add_ref, quantize_with_residual, quantize_with_residual_ref
from acco_ds.ops.quantize import dequantize_sum, dequantize_sum_ref
from acco_ds.ops.quantize import add_dequantized, add_dequantized_ref, quantize_difference, quantize_difference_ref
print(_build.load("quantize_cpu").ISA)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for rdtype in (torch.float32, torch.bfloat16, torch.float16):
        for block_size in (7, 256):
            x = t.special(20_011, block_size, dtype, "isa")
            r = t.small(20_011, rdtype, "isa")
            r_ref = r.clone()
            q, s = quantize_with_residual(x, r, block_size, backend="cpp")
            q_ref, s_ref = quantize_with_residual_ref(x, r_ref, block_size)
            out = t.special(20_011, 64, torch.float32, "isa-acc")
            out_ref = out.clone()
            dequantize_add(out, q, s, block_size, backend="cpp")
            dequantize_add_ref(out_ref, q_ref, s_ref, block_size)
            for a, b, what in ((q, q_ref, "q"), (s, s_ref, "s"), (r, r_ref, "r"), (out, out_ref, "out")):
                t.assert_same(a, b, f"{what} {dtype} {rdtype} {block_size}")
        qs, ss = t.sum_case(3, 20_011, 256, "isa-sum")
        total, total_ref = torch.empty(20_011, dtype=dtype), torch.empty(20_011, dtype=dtype)
        dequantize_sum(total, qs, ss, 256, [2, 0, 1], backend="cpp")
        dequantize_sum_ref(total_ref, qs, ss, 256, [2, 0, 1])
        t.assert_same(total, total_ref, f"dequantize_sum {dtype}")
        new, base = t.diff_case(20_011, 256, dtype, "isa")
        qd, sd = quantize_difference(new, base, 256, backend="cpp")
        qd_ref, sd_ref = quantize_difference_ref(new, base, 256)
        t.assert_same(qd, qd_ref, f"difference q {dtype}")
        t.assert_same(sd, sd_ref, f"difference scales {dtype}")
        applied, applied_ref = torch.empty_like(base), torch.empty_like(base)
        add_dequantized(applied, base, qd_ref, sd_ref, 256, backend="cpp")
        add_dequantized_ref(applied_ref, base, qd_ref, sd_ref, 256)
        t.assert_same(applied, applied_ref, f"add_dequantized {dtype}")
"""


@pytest.mark.parametrize("isa", ["avx2", "base"])
def test_every_cpu_isa_variant_matches_the_reference(isa):
    """The AVX2 and baseline loops (ACCO_DS_CPU_ISA picks a variant below the CPU's best; the default one is
    what the other tests run) give the reference's bits too."""
    run_under_isa(_ISA_SCRIPT, isa)
