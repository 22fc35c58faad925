"""acco_ds.ops.quantize against an fp64 reference written here: per-block scales, the error bound
|x - deq| <= scale / 2, round half to even, odd sizes (short last block), all-zero blocks, huge and tiny
magnitudes, bf16 and fp32 inputs, non-finite values, and the error-feedback residual. Every test runs on
the torch reference and, when it is built, on the CPU extension (tests/ops/test_quantize_kernel.py
compares the two bit for bit)."""

from __future__ import annotations

import math

import pytest
import torch

from acco_ds.ops import _build
from acco_ds.ops import quantize as Q
from acco_ds.ops.quantize import QMAX, num_blocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = ["ref"] + (["cpp"] if _build.available("quantize_cpu") else [])
_BACKEND = {"name": "ref"}


@pytest.fixture(autouse=True, params=BACKENDS)
def backend(request):
    """Every test once per backend: the functions below call it."""
    _BACKEND["name"] = request.param
    return request.param


def quantize(x, block_size):
    return Q.quantize(x, block_size, backend=_BACKEND["name"])


def dequantize(q, scales, block_size):
    return Q.dequantize(q, scales, block_size, backend=_BACKEND["name"])


def quantize_with_residual(x, residual, block_size):
    return Q.quantize_with_residual(x, residual, block_size, backend=_BACKEND["name"])


def ref_blocks(x: torch.Tensor, block_size: int):
    """(values fp64, absmax fp64) per block, in Python floats: the reference."""
    xs = x.double().tolist()
    out = []
    for lo in range(0, len(xs), block_size):
        block = xs[lo : lo + block_size]
        out.append((block, max((abs(v) for v in block), default=0.0)))
    return out


def check_against_reference(x: torch.Tensor, block_size: int) -> None:
    q, scales = quantize(x, block_size)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.numel() == num_blocks(x.numel(), block_size)
    deq = dequantize(q, scales, block_size)
    assert deq.dtype == torch.float32
    qs, ss, ds = q.tolist(), scales.double().tolist(), deq.double().tolist()
    for b, (block, absmax) in enumerate(ref_blocks(x, block_size)):
        scale = ss[b]
        want = absmax / QMAX
        if absmax == 0.0:
            assert scale == 0.0
        else:
            # absmax / 127 rounded up to fp32: at least the exact value, at most one fp32 step above it
            assert want <= scale <= want * (1 + 2**-23) + 2**-149, (b, scale, want)
        for j, v in enumerate(block):
            i = b * block_size + j
            assert -QMAX <= qs[i] <= QMAX
            assert ds[i] == float(torch.tensor(qs[i] * scale, dtype=torch.float64).float())
            # the bound, in fp64 from the int8 value and the fp32 scale (q * scale is exact in fp64)
            err = abs(v - qs[i] * scale)
            assert err <= scale * (0.5 + 2**-16), (i, v, qs[i], scale, err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "block_size"), [(1, 256), (7, 4), (255, 256), (257, 256), (1000, 64), (33, 1)])
def test_matches_fp64_reference(dtype, n, block_size):
    g = torch.Generator().manual_seed(n * 31 + block_size)
    x = (torch.randn(n, generator=g) * torch.logspace(-3, 3, n)).to(DTYPES[dtype])
    check_against_reference(x, block_size)


def test_round_half_to_even_and_the_clamp():
    # block [127, t]: scale exactly 1, so q = round(t) with ties to even
    for t, want in [(2.5, 2), (3.5, 4), (-2.5, -2), (-3.5, -4), (0.5, 0), (1.5, 2), (126.5, 126)]:
        q, scales = quantize(torch.tensor([127.0, t]), 2)
        assert scales.tolist() == [1.0]
        assert q.tolist() == [127, want], t
    q, _ = quantize(torch.tensor([-5.0, 5.0, 1.0]), 3)
    assert q.tolist() == [-127, 127, 25]  # 1 / (5 / 127) = 25.4


def test_all_zero_blocks_and_odd_sizes():
    x = torch.zeros(10)
    x[8] = -3.0  # blocks of 4: [0 0 0 0] [0 0 0 0] [0 -3] (short)
    q, scales = quantize(x, 4)
    assert scales.tolist() == [0.0, 0.0, pytest.approx(3.0 / 127, rel=1e-6)]
    assert q.tolist() == [0] * 8 + [-127, 0]
    assert dequantize(q, scales, 4)[:8].eq(0).all()
    q, scales = quantize(torch.zeros(0), 8)
    assert q.numel() == 0 and scales.numel() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_and_tiny_magnitudes(dtype):
    big = torch.finfo(DTYPES[dtype]).max
    tiny = torch.finfo(DTYPES[dtype]).tiny  # smallest normal
    blocks = [
        [big, -big / 3, 1.0, 0.0],
        [tiny, -tiny * 5, tiny / 4, 0.0],  # tiny / 4: subnormal
        [1e-40, -3e-41, 1e-44, 0.0],  # subnormal fp32 (bf16 keeps its own nearest)
        [1e30, 1e-30, -1e10, 7.0] if big > 1e30 else [big / 2, 1e-7, -1e3, 7.0],  # fp16: within its range
    ]
    x = torch.tensor([v for b in blocks for v in b], dtype=torch.float64).to(DTYPES[dtype])
    check_against_reference(x, 4)


def test_smallest_subnormal_absmax_keeps_the_bound():
    # absmax / 127 underflows fp32: the scale rounds up to the smallest subnormal, not down to 0
    s = 2.0**-149
    x = torch.tensor([s, -s, 0.0, 3 * s])
    q, scales = quantize(x, 4)
    assert scales.tolist() == [s]
    assert q.tolist() == [1, -1, 0, 3]
    check_against_reference(x, 4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_input_gives_a_non_finite_scale(bad, dtype):
    x = torch.arange(12, dtype=torch.float32).to(DTYPES[dtype])
    x[5] = bad  # block 1 of 3 (blocks of 4)
    q, scales = quantize(x, 4)
    assert math.isfinite(scales[0]) and math.isfinite(scales[2])
    assert not math.isfinite(scales[1])
    deq = dequantize(q, scales, 4)
    assert deq[4:8].isnan().all()  # whatever dequantizes it sees a non-finite value
    assert deq[:4].isfinite().all() and deq[8:].isfinite().all()
    # and so does a sum of squares (the round's global norm)
    assert not torch.isfinite(deq.double().square().sum())


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_with_residual_writes_what_was_lost(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(301, generator=g).to(DTYPES[dtype])
    residual = (torch.randn(301, generator=g) * 0.01).to(DTYPES[dtype])
    v = x.float() + residual.float()  # fp32, as the function adds them
    q, scales = quantize_with_residual(x, residual, 32)
    q2, s2 = quantize(v, 32)
    assert torch.equal(q, q2) and torch.equal(scales, s2)  # the quantization of v
    deq = dequantize(q, scales, 32)
    want = (v - deq).to(DTYPES[dtype])
    assert torch.equal(residual, want)
    per_elem = scales.double().repeat_interleave(32)[:301]
    assert (residual.double().abs() <= per_elem * (0.5 + 2**-8)).all()


def test_residual_telescopes_over_rounds():
    """sum of what was sent (dequantized) + the final residual == the exact sum of the inputs."""
    g = torch.Generator().manual_seed(5)
    residual = torch.zeros(97)
    sent = torch.zeros(97, dtype=torch.float64)
    exact = torch.zeros(97, dtype=torch.float64)
    for _ in range(50):
        x = torch.randn(97, generator=g) * torch.rand(1, generator=g) * 10
        exact += x.double()
        q, s = quantize_with_residual(x, residual, 16)
        sent += dequantize(q, s, 16).double()
    assert (sent + residual.double() - exact).abs().max() < 1e-4


def test_residual_of_a_non_finite_block_is_zeroed():
    x = torch.ones(8)
    x[1] = float("nan")
    residual = torch.full((8,), 0.25)
    _, scales = quantize_with_residual(x, residual, 4)
    assert scales[0].isnan() and scales[1] == pytest.approx(1.25 / 127)
    assert residual[:4].eq(0).all()
    assert residual[4:].isfinite().all()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.ones(4), 0)
    with pytest.raises(TypeError, match="torch.float32, torch.bfloat16 or torch.float16, got torch.float64"):
        quantize(torch.ones(4, dtype=torch.float64), 4)
    with pytest.raises(ValueError, match="flat"):
        quantize(torch.ones(2, 2), 4)
    with pytest.raises(ValueError, match="residual must match"):
        quantize_with_residual(torch.ones(4), torch.zeros(5), 4)
    with pytest.raises(ValueError, match="scales must be fp32"):
        dequantize(torch.zeros(4, dtype=torch.int8), torch.zeros(2), 4)


# -- four bits (values in [-7, 7], two per byte on the wire; the torch reference serves them) -------------
@pytest.mark.parametrize(("n", "block_size"), [(1, 16), (7, 4), (255, 16), (1000, 64)])
def test_four_bits_bound_and_scale(n, block_size):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    q, scales = Q.quantize(x, block_size, bits=4)
    assert q.abs().max() <= 7 and q.dtype == torch.int8
    deq = Q.dequantize(q, scales, block_size)
    for b, (block, absmax) in enumerate(ref_blocks(x, block_size)):
        s = scales[b].item()
        assert absmax / 7 <= s <= absmax / 7 * (1 + 2**-23) + 2**-149
        for j, v in enumerate(block):
            assert abs(v - deq[b * block_size + j].item()) <= s * (0.5 + 2**-16)
    # four bits lose more than eight: the bound is 127/7 times wider
    q8, s8 = Q.quantize(x, block_size)
    assert (Q.dequantize(q8, s8, block_size) - x).abs().max() < (deq - x).abs().max()


def test_four_bits_residual_telescopes():
    g = torch.Generator().manual_seed(6)
    residual, sent, exact = (
        torch.zeros(97),
        torch.zeros(97, dtype=torch.float64),
        torch.zeros(97, dtype=torch.float64),
    )
    for _ in range(50):
        x = torch.randn(97, generator=g)
        exact += x.double()
        q, s = Q.quantize_with_residual(x, residual, 16, bits=4)
        assert q.abs().max() <= 7
        sent += Q.dequantize(q, s, 16).double()
    assert (sent + residual.double() - exact).abs().max() < 1e-4


@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 255])
def test_int4_packing_round_trips(n):
    q = torch.randint(-7, 8, (n,), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
    packed = Q.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 1) // 2
    assert torch.equal(Q.unpack_int4(packed, n), q)
    assert Q.wire_bytes(n, 16, 4) == (n + 1) // 2 + 4 * num_blocks(n, 16)
    assert Q.wire_bytes(n, 16, 8) == n + 4 * num_blocks(n, 16)
    if n >= 2:  # element 2i in the low nibble, 2i + 1 in the high one, each + 8
        assert packed[0].item() == (q[0].item() + 8) | ((q[1].item() + 8) << 4)


def test_bits_other_than_8_or_4_are_refused():
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        Q.quantize(torch.ones(4), 4, bits=2)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        Q.quantize_with_residual(torch.ones(4), torch.zeros(4), 4, bits=16)
    with pytest.raises(ValueError, match="packed must be flat uint8 of 2 bytes"):
        Q.unpack_int4(torch.zeros(3, dtype=torch.uint8), 4)


BACKENDS_HERE = ["ref"] + (["cpp"] if _build.available("quantize_cpu") else [])


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_out_rows_get_the_bits_of_new_tensors(dtype, bits, backend):
    """``out=``: each chunk quantized straight into its row of a wider q / scales buffer (the compressed
    reduce-scatter's layout) gives the bits of the call that allocates, residual included."""
    world, shard, block = 3, 1001, 256
    g = torch.Generator().manual_seed(7)
    full = torch.randn(world * shard, generator=g).to(dtype)
    rest_a = (torch.randn(world * shard, generator=g) * 1e-3).to(dtype)
    rest_b = rest_a.clone()
    q = torch.full((world, shard), 99, dtype=torch.int8)
    scales = torch.full((world, num_blocks(shard, block)), 5.0)
    for r, (chunk, ra, rb) in enumerate(
        zip(full.view(world, -1), rest_a.view(world, -1), rest_b.view(world, -1))
    ):
        got = Q.quantize_with_residual(chunk, ra, block, bits=bits, backend=backend, out=(q[r], scales[r]))
        want = Q.quantize_with_residual(chunk, rb, block, bits=bits, backend=backend)
        assert got[0].data_ptr() == q[r].data_ptr() and got[1].data_ptr() == scales[r].data_ptr()
        assert torch.equal(q[r], want[0]) and torch.equal(scales[r], want[1]), r
        assert torch.equal(ra, rb), r
        plain = Q.quantize(chunk, block, bits=bits, backend=backend, out=(q[r], scales[r]))
        assert all(
            torch.equal(a, b) for a, b in zip(plain, Q.quantize(chunk, block, bits=bits, backend=backend))
        )


def test_bad_out_is_refused():
    x = torch.randn(300)
    q, s = torch.empty(300, dtype=torch.int8), torch.empty(2)
    with pytest.raises(TypeError, match=r"out must be a \(q, scales\) pair"):
        Q.quantize(x, 256, out=q)
    with pytest.raises(ValueError, match="out's q must be a contiguous flat torch.int8 tensor of 300"):
        Q.quantize(x, 256, out=(torch.empty(299, dtype=torch.int8), s))
    with pytest.raises(ValueError, match="out's scales must be a contiguous flat torch.float32 tensor of 2"):
        Q.quantize(x, 256, out=(q, torch.empty(3)))
    with pytest.raises(ValueError, match="out's scales overlaps an input"):
        Q.quantize(x, 256, out=(q, x[:2]))
    residual = torch.zeros(300)
    with pytest.raises(ValueError, match="out's scales overlaps an input"):
        Q.quantize_with_residual(x, residual, 256, out=(q, residual[:2]))
