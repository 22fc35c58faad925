"""``acco_ds.ops.quantized_sum_step``: the CPU pass that reads the W quantized chunks of a shard straight into the
norm and the AdamW step gives, bit for bit, the composition ``dequantize_sum`` -> ``+= tilde`` -> ``adamw_step`` /
``adamw_step_difference`` (master, both moments, the new parameters, the difference's q and scales, the g~ it
writes), and the norm within the fp64 order of its additions: W = 1, 2, 3 in an order that is not 0..W-1, fp32,
bf16 and fp16 sums and parameters, lengths the blocks do not divide, commit, peek and noop, with and without the kept g~, a
non-finite block (NaN scale), 1 and 2 threads. Bad arguments are refused naming them."""

from __future__ import annotations

import itertools

import pytest
import torch

from acco_ds.ops import _build
from acco_ds.ops.quantize import dequantize_sum, num_blocks
from acco_ds.ops.quantized_sum_step import adamw_step_quantized_sum, quantized_sum_of_squares

pytestmark = pytest.mark.skipif(
    not (_build.available("adamw_cpu") and _build.available("quantize_cpu")),
    reason="the CPU extensions are not built",
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)


_RAW = {F32: torch.int32, BF16: torch.int16, F16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_RAW[t.dtype]) if t.dtype in _RAW else t


def _rows(world: int, n: int, bs: int, seed: int, nan_block: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (world, n), dtype=torch.int8, generator=g)
    scales = torch.rand(world, num_blocks(n, bs), generator=g) * 1e-2
    if nan_block:  # what the quantizer sends for a block holding an inf or a NaN
        scales[world - 1, 0] = float("nan")
        q[world - 1, :bs] = 0
    return q, scales


def _state(n: int, pdt, sdt, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    master = torch.randn(n, generator=g)
    m, v = torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 0.01
    tilde = (torch.randn(n, generator=g) * 0.1).to(sdt)
    base = (master + torch.randn(n, generator=g) * 1e-2).to(pdt)
    return master, m, v, tilde, base


def _run(backend, rows, state, bs, order, sdt, pdt, *, commit, noop, tilde, diff, bits=8):
    q, scales = rows
    master, m, v, kept, base = (t.clone() for t in state)
    out = torch.empty(master.numel(), dtype=pdt)
    written = torch.empty(master.numel(), dtype=sdt)
    kw = dict(
        HYPER,
        commit=commit,
        scale_tensor=torch.tensor([0.7]),
        noop_flag=torch.tensor([noop], dtype=torch.int32),
    )
    sumsq = quantized_sum_of_squares(
        q, scales, bs, order, sdt, tilde=kept if tilde else None, tilde_out=written, backend=backend
    )
    got = adamw_step_quantized_sum(
        master, m, v, q, scales, bs, order, sdt, out, tilde=kept if tilde else None,
        base=base if diff else None, bits=bits, backend=backend, **kw,
    )  # fmt: skip
    return sumsq, [written, master, m, v, out, *(got or ())]


# (sum dtype, parameter dtype): bf16 and fp32 in every pair, fp16 with itself and with fp32
PAIRS = [(F32, F32), (BF16, BF16), (F32, BF16), (BF16, F32), (F16, F16), (F32, F16), (F16, F32)]
CASES = [
    (w, size, s, p) for w in (1, 2, 3) for size in ((37, 16), (1000, 64), (70001, 1024)) for s, p in PAIRS
]


@pytest.mark.parametrize(
    "world,size,sdt,pdt", CASES, ids=[f"W{w}-{n}x{b}-s{s}-p{p}" for w, (n, b), s, p in CASES]
)
def test_fused_equals_composition(world, size, sdt, pdt):
    n, bs = size
    order = list(range(world))[::-1]
    rows = _rows(world, n, bs, seed=world * 7 + n)
    state = _state(n, pdt, sdt, seed=n)
    for commit, noop, tilde, diff in itertools.product([True, False], [0, 1], [False, True], [False, True]):
        what = f"commit={commit} noop={noop} tilde={tilde} diff={diff}"
        ref_sq, ref = _run(
            "composed", rows, state, bs, order, sdt, pdt, commit=commit, noop=noop, tilde=tilde, diff=diff
        )
        sq, got = _run(
            "fused", rows, state, bs, order, sdt, pdt, commit=commit, noop=noop, tilde=tilde, diff=diff
        )
        torch.testing.assert_close(sq, ref_sq, rtol=1e-12, atol=0, msg=f"norm, {what}")
        for name, a, b in zip(
            ["g~ written", "master", "exp_avg", "exp_avg_sq", "out", "dq", "dscales"], got, ref
        ):
            assert torch.equal(_bits(a), _bits(b)), f"{name} differs, {what}"


def test_the_sum_is_dequantize_sum_plus_tilde():
    """What the passes read as the gradient: the g~ they write equals dequantize_sum's store, plus the kept g~."""
    n, bs, world = 3000, 128, 3
    q, scales = _rows(world, n, bs, seed=5)
    for sdt in (F32, BF16, F16):
        tilde = (torch.randn(n) * 0.1).to(sdt)
        expected = torch.empty(n, dtype=sdt)
        dequantize_sum(expected, q, scales, bs, [2, 0, 1])
        expected.add_(tilde)
        written = torch.empty(n, dtype=sdt)
        sq = quantized_sum_of_squares(
            q, scales, bs, [2, 0, 1], sdt, tilde=tilde, tilde_out=written, backend="fused"
        )
        assert torch.equal(_bits(written), _bits(expected))
        exact = expected.double().pow(2).sum()
        torch.testing.assert_close(sq, exact.reshape(1), rtol=1e-13, atol=0)


def test_threads_do_not_change_the_bits():
    n, bs, world = 300_001, 256, 2
    rows = _rows(world, n, bs, seed=11)
    state = _state(n, BF16, BF16, seed=3)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(
                _run("fused", rows, state, bs, [1, 0], BF16, BF16, commit=True, noop=0, tilde=True, diff=True)
            )
    finally:
        torch.set_num_threads(before)
    (sq1, one), (sq2, two) = results
    assert torch.equal(sq1, sq2), "the norm depends on the number of threads"
    for a, b in zip(one, two):
        assert torch.equal(_bits(a), _bits(b))


def test_a_non_finite_block_gives_a_non_finite_norm():
    n, bs = 500, 64
    rows = _rows(2, n, bs, seed=2, nan_block=True)
    state = _state(n, F32, F32, seed=2)
    for backend in ("composed", "fused"):
        sq, (written, master, *_rest) = _run(
            backend, rows, state, bs, [0, 1], F32, F32, commit=True, noop=0, tilde=False, diff=False
        )
        assert not torch.isfinite(sq).item(), backend
        assert torch.isnan(written[:bs]).all() and torch.isfinite(written[bs:]).all(), backend


def test_bad_arguments_are_refused():
    n, bs = 100, 16
    q, scales = _rows(2, n, bs, seed=0)
    master, m, v, tilde, base = _state(n, F32, F32, seed=0)
    out = torch.empty(n)
    with pytest.raises(TypeError, match="torch.float32, torch.bfloat16 or torch.float16, got torch.float64"):
        quantized_sum_of_squares(q, scales, bs, [0, 1], torch.float64)
    with pytest.raises(ValueError, match="scales must be fp32 of shape"):
        quantized_sum_of_squares(q, scales[:, :-1], bs, [0, 1], F32)
    with pytest.raises(ValueError, match="order"):
        quantized_sum_of_squares(q, scales, bs, [0, 0], F32)
    with pytest.raises(ValueError, match="tilde must be a contiguous flat"):
        quantized_sum_of_squares(q, scales, bs, [0, 1], F32, tilde=tilde.to(BF16))
    with pytest.raises(ValueError, match="tilde and out overlap"):
        adamw_step_quantized_sum(master, m, v, q, scales, bs, [0, 1], F32, out, tilde=out, **HYPER)
    with pytest.raises(ValueError, match="q has rows of 100 elements but master has 99"):
        adamw_step_quantized_sum(master[:99], m[:99], v[:99], q, scales, bs, [0, 1], F32, out[:99], **HYPER)
    with pytest.raises(ValueError, match="out .* is required"):
        adamw_step_quantized_sum(master, m, v, q, scales, bs, [0, 1], F32, None, **HYPER)
    with pytest.raises(ValueError, match="backend='fused' cannot run: its parameter difference is 8 bits"):
        adamw_step_quantized_sum(
            master, m, v, q, scales, bs, [0, 1], F32, out, base=base, bits=4, backend="fused", **HYPER
        )
    with pytest.raises(ValueError, match="backend must be one of"):
        quantized_sum_of_squares(q, scales, bs, [0, 1], F32, backend="cpp")
    with pytest.raises(TypeError, match="unexpected keyword argument 'momentum'"):
        adamw_step_quantized_sum(master, m, v, q, scales, bs, [0, 1], F32, out, momentum=0.9, **HYPER)
