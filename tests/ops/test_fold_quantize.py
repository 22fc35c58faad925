"""The fused round end (acco_ds.ops.fold_quantize) on CPU: the torch reference (``backend="ref"``) and the CPU
extension (``backend="cpp"``, acco_ds._quantize_cpu's fold_quantize_cpu / quantize_listed_blocks_cpu).

1. The composition it replaces: for layouts of W = 1, 2, 3 chunks cut into parameters (1 element, less than a
   block, several blocks, spanning chunk ends; one gets no gradient; padding at the end), block sizes 1, 5, 7, 64,
   256 and one longer than the chunk, buffer / gradient / residual dtypes fp32, bf16 and fp16 (each half with
   itself or fp32; no residual too), 8 and 4 bits: folding every gradient (fold_quantize) then quantizing the blocks no fold covered
   whole (quantize_listed_blocks) gives q, the scales and the residual of accumulate_grads_ref of every gradient
   followed by quantize_with_residual_ref (quantize_ref) of each chunk, bit for bit, for both backends; the buffer
   holds the accumulated values where no fold quantized and its old values where one did.
2. "cpp" against "ref", each call alone, bit for bit (q, scales, residual and the buffer after the call, whose NaN
   bits are the processor's and the cast's: any NaN matches a NaN there, see assert_same): values of
   every magnitude per block (1e38: sums overflow; 1e-40: subnormal), all-zero blocks (-0.0 too), inf and NaN in
   the buffer, the gradient or the residual (NaN scale, q 0, residual 0 in that block), one and two OpenMP threads
   (work split into items), every CPU instruction-set variant (a subprocess per variant).
3. Argument errors, each naming the argument, for both backends.

Bits: fp32 compared as int32, bf16 and fp16 as int16 (signed zeros and NaN payloads included).
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from acco_ds.ops import _build
from acco_ds.ops.accumulate import accumulate_grads_ref
from acco_ds.ops.fold_quantize import (
    block_span,
    covered_blocks,
    fold_quantize,
    fold_quantize_ref,
    quantize_listed_blocks,
    quantize_listed_blocks_ref,
)
from acco_ds.ops.quantize import num_blocks, quantize_ref, quantize_with_residual_ref
from tests.ops.cpu_isa import run_under_isa

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OTHER = {F32: BF16, BF16: F32, F16: F32}
HALVES = (BF16, F16)
Q_UNSET, SCALE_UNSET = -128, -1.0  # never produced: an entry left at these was not written
BACKENDS = ["ref", "cpp"]
# per-block magnitudes: ordinary, huge (sums overflow), tiny normal, subnormal, the smallest subnormals
MAGNITUDES = [1.0, 1e-3, 1e38, 3e37, 1e-37, 1e-40, 1e-44]


def needs(backend: str) -> None:
    if backend == "cpp" and not _build.available("quantize_cpu"):
        pytest.skip(f"the CPU quantize extension is not available: {_build.why_missing('quantize_cpu')}")


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view({F32: torch.int32, BF16: torch.int16, F16: torch.int16}.get(t.dtype, t.dtype))


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str, any_nan: bool = False) -> None:
    """``a`` and ``b`` bit for bit (signed zeros and NaN bits included). ``any_nan``: any NaN matches any NaN, for
    the accumulated buffer: the kernels store a bf16 NaN as 0x7FC0 (csrc/common/bf16.h), torch's vectorised cast
    as 0xFFFF, and an fp32 NaN + NaN keeps the payload of whichever operand the processor picks (accumulate_grads'
    contract: its being NaN, not its bits)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    same = raw(a) == raw(b)
    if any_nan:
        same |= a.isnan() & b.isnan()
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(
            f"{what}: {int((~same).sum())} differ, first at {i}: {a[i].item()} vs {b[i].item()}"
        )


def rows(world: int, chunk: int, bs: int):
    """q and scales of a round, every entry at a value no call produces."""
    q = torch.full((world * chunk,), Q_UNSET, dtype=torch.int8)
    return q, torch.full((world * num_blocks(chunk, bs),), SCALE_UNSET)


def clone(t):
    return None if t is None else t.clone()


# -- 1. the composition ----------------------------------------------------------------------------------------
def layout(world: int, chunk: int, bs: int, seed) -> list:
    """[(offset, numel)]: parameters one after the other from 0, then a padding (no parameter): 1 element, less
    than a block, several blocks and more than a chunk (across a chunk end), in turn, then random sizes."""
    g = gen("layout", world, chunk, bs, seed)
    total = world * chunk
    end = total - int(torch.randint(0, min(bs, chunk) + 1, (1,), generator=g))
    e = min(bs, chunk)  # a block's length (a block longer than the chunk is the chunk)
    kinds = [1, max(1, e - 2), 3 * e + 1, chunk + 3]
    out, off, k = [], 0, 0
    while off < end:
        size = kinds[k] if k < len(kinds) else int(torch.randint(1, 2 * bs + 2, (1,), generator=g))
        size = min(size, end - off)
        out.append((off, size))
        off += size
        k += 1
    return out


def geometries():
    """(world, chunk, block size): block sizes 1, 5, 7, 64, 256 and 8, W = 1, 2, 3 in turn, one block longer than
    its chunk (the chunk is then one short block); every chunk but the last a non-multiple of its block size (short
    last blocks)."""
    return [(1, 23, 1), (2, 37, 5), (3, 50, 7), (1, 300, 64), (2, 600, 256), (3, 40, 64), (2, 64, 8)]


def round_case(world, chunk, bs, bdtype, gdtype, rdtype, seed):
    g = gen("round", world, chunk, bs, bdtype, gdtype, rdtype, seed)
    params = layout(world, chunk, bs, seed)
    total = world * chunk
    buffer = torch.randn(total, generator=g).to(bdtype)  # earlier micro-batches' sum
    buffer[params[-1][0] + params[-1][1] :] = 0.0  # the padding
    residual = None if rdtype is None else (torch.randn(total, generator=g) * 0.01).to(rdtype)
    grads = []
    # a parameter less than a block long, or the last one (of several blocks), or the first (one element)
    no_grad = 1 if bs % 2 else len(params) - 1 if len(params) > 4 else 0
    for i, (_, n) in enumerate(params):
        if i == no_grad:  # no gradient in the last micro-batch
            grads.append(None)
            continue
        t = torch.randn(n, generator=g).to(gdtype)
        grads.append(t.view(2, n // 2) if n % 2 == 0 and n > 2 else t)  # 2-D gradients too
    order = torch.randperm(len(params), generator=g).tolist()  # the hooks' order is any
    return params, buffer, residual, grads, order


def composed(buffer, residual, grads, params, chunk, bs, bits):
    """What the fused round end replaces: accumulate every gradient, then quantize each chunk."""
    world = buffer.numel() // chunk
    buffer, residual = buffer.clone(), clone(residual)
    accumulate_grads_ref(buffer, grads, [off for off, _ in params])
    q, scales = rows(world, chunk, bs)
    nb = num_blocks(chunk, bs)
    for c in range(world):
        x = buffer[c * chunk : (c + 1) * chunk]
        if residual is None:
            got = quantize_ref(x, bs, bits)
        else:
            got = quantize_with_residual_ref(x, residual[c * chunk : (c + 1) * chunk], bs, bits)
        q[c * chunk : (c + 1) * chunk], scales[c * nb : (c + 1) * nb] = got
    return buffer, residual, q, scales


def fused(buffer, residual, grads, params, order, chunk, bs, bits, backend):
    """The fused round end: each gradient folded (in the hooks' order), then the blocks no fold quantized."""
    world = buffer.numel() // chunk
    buffer, residual = buffer.clone(), clone(residual)
    q, scales = rows(world, chunk, bs)
    done = torch.zeros(world * num_blocks(chunk, bs), dtype=torch.bool)
    for i in order:
        if grads[i] is None:
            continue
        off, n = params[i]
        fold_quantize(buffer, grads[i], off, chunk, residual, q, scales, bs, bits, backend=backend)
        for _, _, inner_first, inner_stop in covered_blocks(off, n, chunk, bs):
            done[inner_first:inner_stop] = True
    rest = (~done).nonzero().flatten()
    quantize_listed_blocks(buffer, chunk, residual, q, scales, bs, rest, bits, backend=backend)
    return buffer, residual, q, scales, done


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rdtype", ["none", "same", "other"])
@pytest.mark.parametrize("gdtype", ["same", "other"])
@pytest.mark.parametrize("bdtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fused_round_end_is_the_composition(backend, bdtype, gdtype, rdtype, bits):
    needs(backend)
    gd = bdtype if gdtype == "same" else OTHER[bdtype]
    rd = {"none": None, "same": bdtype, "other": OTHER[bdtype]}[rdtype]
    for (world, chunk, bs), seed in itertools.product(geometries(), (0, 1)):
        params, buffer, residual, grads, order = round_case(world, chunk, bs, bdtype, gd, rd, seed)
        want_buf, want_res, want_q, want_s = composed(buffer, residual, grads, params, chunk, bs, bits)
        buf, res, q, s, done = fused(buffer, residual, grads, params, order, chunk, bs, bits, backend)
        at = f"W={world} chunk={chunk} bs={bs} seed={seed}"
        assert_same(q, want_q, f"q ({at})")
        assert_same(s, want_s, f"scales ({at})")
        if res is not None:
            assert_same(res, want_res, f"residual ({at})")
        # the buffer: accumulated where no fold quantized, untouched where one did
        fused_at = torch.zeros(buffer.numel(), dtype=torch.bool)
        for b in done.nonzero().flatten().tolist():
            lo, hi = block_span(b, chunk, bs)
            fused_at[lo:hi] = True
        assert_same(torch.where(fused_at, buffer, want_buf), buf, f"buffer ({at})")
        assert done.any() and not done.all(), at  # both paths ran


# -- 2. cpp against ref, call by call ---------------------------------------------------------------------------
def special(world: int, chunk: int, bs: int, bdtype, gdtype, rdtype, offset: int, numel: int, key):
    """(buffer, grad, residual) with one magnitude per block (huge, subnormal, ...); some blocks all zero (+0.0
    or -0.0, the residual too), some with an inf or a NaN in the buffer, the gradient or the residual."""
    g = gen("special", world, chunk, bs, bdtype, gdtype, rdtype, offset, numel, key)
    nb = num_blocks(chunk, bs)
    pos = torch.arange(world * chunk)
    block = pos // chunk * nb + pos % chunk // bs  # each element's global block
    mag = torch.tensor(MAGNITUDES)[torch.randint(0, len(MAGNITUDES), (world * nb,), generator=g)][block]
    kind = torch.randint(0, 12, (world * nb,), generator=g)[block]
    buffer = torch.randn(world * chunk, generator=g) * mag
    grad = torch.randn(world * chunk, generator=g) * mag
    residual = torch.randn(world * chunk, generator=g) * mag * 1e-2
    residual[::5] *= 1e-38
    for k, zero in ((0, 0.0), (1, -0.0)):
        for t in (buffer, grad, residual):
            t[kind == k] = zero
    one = torch.rand(world * chunk, generator=g) < 0.05  # a few elements of the blocks of kinds 2 .. 7
    for k, t, bad in ((2, buffer, float("inf")), (3, grad, float("-inf")), (4, grad, float("nan")),
                      (5, residual, float("inf")), (6, buffer, float("nan")), (7, residual, float("nan"))):  # fmt: skip
        t[(kind == k) & one] = bad
    grad = grad[offset : offset + numel].to(gdtype)
    return buffer.to(bdtype), grad, None if rdtype is None else residual.to(rdtype)


def both(call, buffer, residual, q, scales, *args):
    """``call`` by both backends on copies; their (buffer, residual, q, scales) compared bit for bit."""
    got = {}
    for backend in BACKENDS:
        t = [clone(x) for x in (buffer, residual, q, scales)]
        call(t, *args, backend=backend)
        got[backend] = t
    for name, a, b in zip(("buffer", "residual", "q", "scales"), got["cpp"], got["ref"]):
        if a is not None:
            assert_same(a, b, name, any_nan=name == "buffer")
    return got["ref"]


def fold(t, grad, offset, chunk, bs, bits, backend):
    buffer, residual, q, scales = t
    fold_quantize(buffer, grad, offset, chunk, residual, q, scales, bs, bits, backend=backend)


def listed(t, blocks, chunk, bs, bits, backend):
    buffer, residual, q, scales = t
    quantize_listed_blocks(buffer, chunk, residual, q, scales, bs, blocks, bits, backend=backend)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rdtype", [None, F32, BF16, F16], ids=["none", "r-fp32", "r-bf16", "r-fp16"])
@pytest.mark.parametrize("gdtype", [F32, BF16, F16], ids=["g-fp32", "g-bf16", "g-fp16"])
@pytest.mark.parametrize("bdtype", [F32, BF16, F16], ids=["b-fp32", "b-bf16", "b-fp16"])
def test_cpp_matches_the_reference_call_by_call(bdtype, gdtype, rdtype, bits):
    needs("cpp")
    world, chunk = 2, 1000
    for bs, offset, numel in ((16, 13, 1500), (7, 0, 2000), (1, 999, 2), (100, 1000, 1000), (64, 1, 1)):
        buffer, grad, residual = special(world, chunk, bs, bdtype, gdtype, rdtype, offset, numel, "call")
        q, scales = rows(world, chunk, bs)
        buffer, residual, q, scales = both(fold, buffer, residual, q, scales, grad, offset, chunk, bs, bits)
        # then every block, the quantized ones again (a second round's values)
        g = gen("listed", bs, offset)
        every = torch.arange(world * num_blocks(chunk, bs))
        some = every[torch.rand(every.numel(), generator=g) < 0.5]
        for blocks in (some, every, every[:0]):
            both(listed, buffer, residual, q, scales, blocks, chunk, bs, bits)


def test_non_finite_zero_huge_and_tiny_blocks():
    """The exact results of the edge cases (both backends): a block holding an inf or a NaN in the buffer, the
    gradient or the residual gets scale NaN, q 0 and residual 0; an all-zero block scale 0, q 0 and its residual
    v (a -0.0 kept); sums that overflow fp32 (1e38 + 3e38) are inf; subnormal values get a subnormal scale."""
    chunk, bs = 24, 4  # six blocks
    buffer = torch.tensor([1.0, 2.0, 3.0, 4.0] * 6)
    grad = torch.zeros(chunk)
    residual = torch.zeros(chunk)
    buffer[1] = float("nan")  # block 0: NaN in the buffer
    grad[6] = float("inf")  # block 1: inf in the gradient
    residual[9] = float("-inf")  # block 2: inf in the residual
    buffer[12:16], grad[12:16], residual[12:16] = -0.0, -0.0, torch.tensor([-0.0, 0.0, -0.0, -0.0])  # block 3
    buffer[16:20], grad[16:20] = 3e38, torch.tensor([3e38, 0.0, 0.0, 0.0])  # block 4: overflows
    buffer[20:24], grad[20:24] = torch.tensor([1e-40, -2e-40, 3e-45, 0.0]), 0.0  # block 5: subnormal
    for backend in BACKENDS:
        needs(backend)
        b, r = buffer.clone(), residual.clone()
        q, s = rows(1, chunk, bs)
        fold_quantize(b, grad, 0, chunk, r, q, s, bs, backend=backend)
        assert s[:3].isnan().all() and s[4].isnan() and q[:12].eq(0).all() and q[16:20].eq(0).all()
        assert r[:12].eq(0).all() and not r[:12].signbit().any() and r[16:20].eq(0).all()
        assert s[3] == 0 and q[12:16].eq(0).all() and r[12:16].signbit().tolist() == [True, False, True, True]
        assert 0 < s[5] < torch.finfo(torch.float32).tiny and q[21] == -127 and q[22:24].eq(0).all()
        assert_same(b, buffer, f"the buffer, untouched ({backend})")


@pytest.mark.parametrize("bdtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
def test_non_finite_values_at_the_ends_and_in_the_cast(bdtype):
    """The accumulated ends store NaN (a NaN in the buffer or the gradient, inf - inf) and inf (an overflow) with
    the reference's bits; a sum finite in fp32 that the bf16 / fp16 cast rounds to inf (its largest value + 1e36) makes
    its fused block non-finite (NaN scale, q 0, residual 0)."""
    chunk, bs = 32, 8  # blocks 0 .. 3; the gradient at [4, 28): blocks 1 and 2 fused, 0 and 3 accumulated
    big = float(torch.finfo(bdtype if bdtype in HALVES else BF16).max)
    buffer = torch.zeros(chunk)
    grad = torch.ones(24, dtype=F32)
    buffer[4], grad[1] = float("nan"), float("nan")  # buffer[5] + NaN
    buffer[6], grad[2] = float("inf"), float("-inf")  # inf - inf
    buffer[7], grad[3] = big, big  # overflows
    buffer[24], grad[20] = float("-inf"), 1.0
    buffer[25], grad[21] = -big, -big
    buffer[8], grad[4] = big, 1e36  # block 1: finite in fp32; in bf16 / fp16 inf
    buffer = buffer.to(bdtype)
    for rdtype in (None, F32, BF16, F16):
        residual = None if rdtype is None else torch.full((chunk,), 0.5, dtype=rdtype)
        q, scales = rows(1, chunk, bs)
        b, r, q, scales = both(fold, buffer, residual, q, scales, grad, 4, chunk, bs, 8)
        assert (
            b[4:7].isnan().all()
            and b[7] == float("inf")
            and b[24] == float("-inf")
            and b[25] == float("-inf")
        )
        assert (scales[1].isnan() if bdtype in HALVES else scales[1] > 0) and scales[2] > 0
        assert q[16:24].ne(0).any() and (q[8:16].eq(0).all() if bdtype in HALVES else q[8] == 127)
        if r is not None and bdtype in HALVES:
            assert r[8:16].eq(0).all() and r[16:24].ne(0).any()


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_do_not_change_the_bits(threads):
    """Above 2 x 32k elements the work is split over OpenMP threads (work items of whole blocks and pieces of the
    accumulated ends)."""
    needs("cpp")
    world, chunk, bs = 2, 100_003, 100
    buffer, grad, residual = special(world, chunk, bs, BF16, F32, BF16, 57, 200_000, "threads")
    q, scales = rows(world, chunk, bs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer, residual, q, scales = both(fold, buffer, residual, q, scales, grad, 57, chunk, bs, 8)
        blocks = torch.arange(0, world * num_blocks(chunk, bs), 2)
        both(listed, buffer, residual, q, scales, blocks, chunk, bs, 8)
    finally:
        torch.set_num_threads(before)


def test_big_blocks_and_long_ends():
    """Ends longer than a work item (a block of 200k elements, the range starting and ending inside it)."""
    needs("cpp")
    world, chunk, bs = 1, 300_000, 200_000
    buffer, grad, residual = special(world, chunk, bs, F32, BF16, F32, 70_001, 200_000, "long")
    q, scales = rows(world, chunk, bs)
    buffer, residual, q, scales = both(fold, buffer, residual, q, scales, grad, 70_001, chunk, bs, 4)
    both(listed, buffer, residual, q, scales, torch.tensor([0, 1]), chunk, bs, 4)


_ISA_SCRIPT = """
import torch
from acco_ds.ops import _build
from tests.ops import test_fold_quantize as t
for bdtype, gdtype, rdtype in ((t.F32, t.F32, t.F32), (t.BF16, t.BF16, t.BF16), (t.BF16, t.F32, None),
                               (t.F16, t.F16, t.F16), (t.F16, t.F32, t.F32), (t.F32, t.F16, None)):
    for bits in (8, 4):
        for bs, offset, numel in ((16, 13, 1500), (7, 0, 2000)):
            buffer, grad, residual = t.special(2, 1000, bs, bdtype, gdtype, rdtype, offset, numel, "isa")
            q, scales = t.rows(2, 1000, bs)
            buffer, residual, q, scales = t.both(t.fold, buffer, residual, q, scales, grad, offset, 1000, bs, bits)
            blocks = torch.arange(0, 2 * t.num_blocks(1000, bs), 3)
            t.both(t.listed, buffer, residual, q, scales, blocks, 1000, bs, bits)
print(_build.load("quantize_cpu").ISA)
"""


@pytest.mark.parametrize("isa", ["avx2", "base"])
def test_every_cpu_isa_variant_matches_the_reference(isa):
    """The AVX2 and baseline loops (ACCO_DS_CPU_ISA picks a variant below the CPU's best; the default one is what
    the other tests run) give the reference's bits too."""
    needs("cpp")
    run_under_isa(_ISA_SCRIPT, isa)


def test_default_backend_on_cpu_is_the_extension(monkeypatch):
    """backend=None takes "cpp" on CPU tensors (when built), the reference otherwise; an empty gradient and an
    empty block list are no-ops."""
    needs("cpp")
    calls = []
    real = _build.load("quantize_cpu")

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(_build, "load", lambda kind: Spy())
    buffer = torch.randn(64)
    q, scales = rows(2, 32, 8)
    fold_quantize(buffer, torch.randn(20), 3, 32, None, q, scales, 8)
    quantize_listed_blocks(buffer, 32, None, q, scales, 8, torch.tensor([0, 7]))
    assert calls == ["fold_quantize_cpu", "quantize_listed_blocks_cpu"]
    before = (buffer.clone(), q.clone(), scales.clone())
    fold_quantize(buffer, torch.randn(0), 64, 32, None, q, scales, 8)
    quantize_listed_blocks(buffer, 32, None, q, scales, 8, torch.zeros(0, dtype=torch.int64))
    assert calls == ["fold_quantize_cpu", "quantize_listed_blocks_cpu"]
    for a, b in zip(before, (buffer, q, scales)):
        assert_same(a, b, "after no-ops")


# -- 3. argument errors -------------------------------------------------------------------------------------------
def _fold_args(**change):
    """fold_quantize's arguments for W = 2, chunk 32, blocks of 8, with ``change`` applied."""
    buffer = torch.zeros(64)
    args = dict(buffer=buffer, grad=torch.ones(10), offset=3, chunk=32, residual=torch.zeros(64),
                q=torch.zeros(64, dtype=torch.int8), scales=torch.zeros(8), block_size=8, bits=8)  # fmt: skip
    args.update(change)
    return args


@pytest.mark.parametrize("backend", BACKENDS)
def test_argument_errors_name_the_argument(backend):
    needs(backend)
    fn = fold_quantize if backend == "cpp" else fold_quantize_ref
    kw = {"backend": "cpp"} if backend == "cpp" else {}
    shared = torch.zeros(128)
    bad_fold = [
        (dict(chunk=0), ValueError, "chunk"),
        (dict(chunk=30), ValueError, "chunk"),
        (dict(chunk=True), ValueError, "chunk"),
        (dict(q=torch.zeros(63, dtype=torch.int8)), ValueError, "q must"),
        (dict(q=torch.zeros(64)), ValueError, "q must"),
        (dict(scales=torch.zeros(7)), ValueError, "scales must"),
        (dict(scales=torch.zeros(8, dtype=torch.float64)), ValueError, "scales must"),
        (dict(residual=torch.zeros(63)), ValueError, "residual must"),
        (dict(buffer=shared[:64], residual=shared[32:96]), ValueError, "buffer and residual overlap"),
        (dict(buffer=shared[:64], grad=shared[60:70]), ValueError, "grad and buffer overlap"),
        (dict(offset=-1), ValueError, "offset -1"),
        (dict(offset=55), ValueError, "offset 55"),
        (dict(offset=2.0), TypeError, "offset"),
        (dict(grad=torch.ones(10, dtype=torch.float64)), TypeError, "grad has dtype torch.float64"),
        (dict(grad=torch.ones(20)[::2]), ValueError, "grad must be contiguous"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(bits=2), ValueError, "bits"),
    ]
    for change, err, match in bad_fold:
        a = _fold_args(**change)
        with pytest.raises(err, match=match):
            fn(a["buffer"], a["grad"], a["offset"], a["chunk"], a["residual"], a["q"], a["scales"], a["block_size"],
               a["bits"], **kw)  # fmt: skip
    lq = quantize_listed_blocks if backend == "cpp" else quantize_listed_blocks_ref
    a = _fold_args()
    bad_blocks = [
        (torch.tensor([3, 1]), "sorted"),
        (torch.tensor([1, 1]), "sorted"),
        (torch.tensor([0, 8]), "8 is outside 0 .. 7"),
        (torch.tensor([-1]), "-1 is outside"),
    ]
    for blocks, match in bad_blocks:
        before = a["q"].clone()
        with pytest.raises(ValueError, match=match):
            lq(a["buffer"], 32, a["residual"], a["q"], a["scales"], 8, blocks, 8, **kw)
        if backend == "cpp":  # checked before anything is written
            assert_same(a["q"], before, "q after a refused call")
    with pytest.raises(TypeError, match="blocks must be a flat int64"):
        lq(
            a["buffer"],
            32,
            a["residual"],
            a["q"],
            a["scales"],
            8,
            torch.tensor([0, 1], dtype=torch.int32),
            **kw,
        )
    with pytest.raises(ValueError, match="chunk"):
        lq(a["buffer"], 33, a["residual"], a["q"], a["scales"], 8, torch.tensor([0]), **kw)


def test_the_extension_checks_its_own_arguments():
    """The raw entry points refuse what would take them out of bounds, with a message naming it."""
    needs("cpp")
    ext = _build.load("quantize_cpu")
    buffer, grad, q, scales = torch.zeros(64), torch.ones(10), *rows(2, 32, 8)
    ptrs = (buffer.data_ptr(), 0, grad.data_ptr(), 0)

    def fold_raw(offset=3, numel=10, chunk=32, world=2, residual=0, rdtype=-1, bs=8, qmax=127, gdtype=0):
        ext.fold_quantize_cpu(ptrs[0], 0, ptrs[2], gdtype, offset, numel, chunk, world, residual, rdtype,
                              q.data_ptr(), scales.data_ptr(), bs, qmax, 1)  # fmt: skip

    for change, match in ((dict(qmax=15), "qmax"), (dict(chunk=0), "chunk"), (dict(bs=0), "block_size"),
                          (dict(offset=60), "does not fit"), (dict(offset=-1), "does not fit"),
                          (dict(rdtype=1), "residual"), (dict(gdtype=3), "grad dtype")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            fold_raw(**change)
    with pytest.raises(ValueError, match="qmax"):
        ext.quantize_listed_blocks_cpu(
            ptrs[0], 0, 32, 2, 0, -1, q.data_ptr(), scales.data_ptr(), 8, 8, 0, 0, 1
        )
    assert ext.ABI_VERSION == _build.ABI_VERSION == 8
