"""``acco_ds.ops.quantized_sum_step`` on a CUDA GPU: the Triton kernels (the default for CUDA tensors) against the
composition (the Triton dequantize_sum, the kept g~ added, the norm, the CUDA AdamW or the Triton AdamW + difference),
bit for bit for the state, the new parameters, the difference and the g~ written, the norm within the fp64 order of
its additions; W = 1 to 3, fp32, bf16 and fp16, commit / peek / noop, with and without the g~ and the difference, a
non-finite block; the host never waits. Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_quantized_sum_step import BF16, F16, F32, _bits, _rows, _run, _state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [(1, 37, 16), (2, 1000, 64), (3, 100_003, 256), (2, 1_000_003, 1024)]
# (commit, noop, tilde, diff): what the round job runs (a commit with or without the kept g~ and the compressed
# all-gather; a peek without the g~: dpu's), and a skipped commit; each a Triton compilation per dtype pair
COMBINATIONS = [
    (True, 0, False, False),
    (True, 0, True, False),
    (True, 0, False, True),
    (True, 0, True, True),
    (False, 0, False, False),
    (False, 0, False, True),
    (True, 1, True, True),
]


def _cuda(ts):
    return tuple(t.cuda() for t in ts)


@pytest.mark.parametrize(("sdt", "pdt"), [(F32, F32), (BF16, BF16), (F32, BF16), (F16, F16), (F32, F16)])
def test_triton_is_the_composition_on_the_gpu(sdt, pdt):
    for world, n, bs in CASES:
        rows = _cuda(_rows(world, n, bs, seed=n, nan_block=n % 2 == 1))
        state = _cuda(_state(n, pdt, sdt, seed=n))
        order = list(range(world))[::-1]
        for commit, noop, tilde, diff in COMBINATIONS:
            what = f"W={world} n={n} commit={commit} noop={noop} tilde={tilde} diff={diff}"
            args = dict(commit=commit, noop=noop, tilde=tilde, diff=diff)
            ref_sq, ref = _run("composed", rows, state, bs, order, sdt, pdt, **args)
            sq, got = _run("triton", rows, state, bs, order, sdt, pdt, **args)
            torch.testing.assert_close(sq.cpu(), ref_sq.cpu(), rtol=1e-12, atol=0, equal_nan=True, msg=what)
            for a, b in zip(got, ref):
                a, b = a.cpu(), b.cpu()
                if a.is_floating_point():  # a NaN's payload is the processor's: NaN where NaN, else the bits
                    assert torch.equal(a.isnan(), b.isnan()), what
                    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
                assert torch.equal(_bits(a), _bits(b)), what


def test_no_host_sync():
    world, n, bs = 2, 1_000_003, 256
    rows = _cuda(_rows(world, n, bs, seed=1))
    state = _cuda(_state(n, BF16, BF16, seed=1))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run("triton", rows, state, bs, [1, 0], BF16, BF16, commit=True, noop=0, tilde=True, diff=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
