"""The Triton kernels of ``acco_ds.ops.quantized_sum_step`` (``backend="triton"``,
acco_ds/ops/triton_kernels/quantized_sum_step.py) against its "composed" backend (``dequantize_sum`` into a shard,
``add_`` of ``tilde``, then ``sum_of_squares`` and the AdamW step), under the Triton interpreter
(``TRITON_INTERPRET=1``, in a subprocess: it must be set before triton is imported).

Bit for bit: the parameters, both moments, ``out``, the quantized difference (q and scales) and ``tilde_out``;
the sum of squares to a relative 1e-12 (the order of its fp64 additions is the backend's). Cases: 1, 2 and 3 rows
summed in an order that is not the rows' (nor its reverse), lengths that blocks do not divide, blocks of 7 to
1024 elements, sums in fp32 and bf16, parameters in fp32 and bf16 (mixed too), commit and peek, with and without
``tilde``, a scale tensor, a noop flag (0 and 1), the hyper tensor and the settings form; the difference in 8 and
4 bits, to a base of its own and to ``out`` itself; a block whose scale is NaN (a non-finite block) in some
rows. The dummies the launcher passes for absent tensors (q and the scales) are never written.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import zlib

import pytest
import torch

from acco_ds.ops.adamw import hyper_tensor
from acco_ds.ops.quantize import num_blocks
from acco_ds.ops.quantized_sum_step import adamw_step_quantized_sum, quantized_sum_of_squares
from tests.ops.triton_interpreter import assert_same_bits, run_this_file_interpreted

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)
ROWS = 4  # rows of q; the orders below sum some of them, not in the rows' order
ORDERS = ([2], [3, 1], [2, 0, 1])
# (length, block size): short last blocks, blocks of 7 (a tile's row not full) to 1024 elements
SHAPES = [(37, 16), (300, 7), (1000, 64), (1500, 1024)]


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _rows(n: int, bs: int, qmax: int, seed: int, bad_row: int | None = None):
    """q int8 [ROWS, n] in [-qmax, qmax] and positive fp32 scales of several magnitudes [ROWS, blocks]; a
    non-finite block (q 0, scale NaN) in row ``bad_row`` when given."""
    g = _gen("rows", n, bs, qmax, seed)
    nb = num_blocks(n, bs)
    q = torch.randint(-qmax, qmax + 1, (ROWS, n), generator=g, dtype=torch.int8)
    scales = torch.rand(ROWS, nb, generator=g) * 2.0 ** torch.randint(-14, -4, (ROWS, nb), generator=g)
    if bad_row is not None:
        b = nb // 2
        q[bad_row, b * bs : (b + 1) * bs] = 0
        scales[bad_row, b] = float("nan")
    return q, scales


def _shard(n: int, dtype, seed: int) -> torch.Tensor:
    return (torch.randn(n, generator=_gen("shard", n, seed)) * 1e-2).to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor, what) -> None:
    assert a.dtype == b.dtype == torch.float64 and a.shape == b.shape == (1,), (what, a, b)
    x, y = float(a), float(b)
    assert (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-12, abs_tol=0.0), (what, x, y)


def _squares_checks() -> int:
    """quantized_sum_of_squares: the triton kernel against the composition."""
    count = 0
    for (n, bs), order, sdt, (has_tilde, has_out) in itertools.product(
        SHAPES, ORDERS, (F32, BF16, F16), ((False, False), (True, False), (False, True), (True, True))
    ):
        bad = count % 3 == 1
        q, scales = _rows(n, bs, 127, count, order[-1] if bad else None)
        q0, s0 = q.clone(), scales.clone()
        tilde = _shard(n, sdt, count) if has_tilde else None
        t0 = None if tilde is None else tilde.clone()
        results = {}
        for backend in ("triton", "composed"):
            tilde_out = torch.full((n,), 7.0, dtype=sdt) if has_out else None
            total = quantized_sum_of_squares(
                q, scales, bs, order, sdt, tilde=tilde, tilde_out=tilde_out, backend=backend
            )
            results[backend] = total, tilde_out
        what = (n, bs, order, sdt, has_tilde, has_out, bad)
        (got, got_out), (want, want_out) = results["triton"], results["composed"]
        _close(got, want, what)
        assert math.isnan(float(got)) == bad, what
        if has_out:
            assert_same_bits(got_out, want_out, ("tilde_out", what))
        assert_same_bits(q, q0, ("q untouched", what))
        assert_same_bits(scales, s0, ("scales untouched", what))
        if tilde is not None:
            assert_same_bits(tilde, t0, ("tilde untouched", what))
        count += 1
    return count


# the step's cases: on the shortest shape every combination of (sum dtype, out dtype), the difference (none; 8
# bits to a base of its own; 8 bits to out itself; 4 bits to a base of its own), commit, tilde, the noop flag
# (absent, 0, 1) and the scale tensor; on the others the first four, the rest turning with the case's index
DTYPES = [(F32, F32), (BF16, BF16), (F32, BF16), (BF16, F32), (F16, F16), (F32, F16), (F16, F32)]
DIFFS = [None, ("base", 8), ("out", 8), ("base", 4)]
NOOPS = (None, 0, 1)


def _step_cases():
    full = itertools.product(DTYPES, DIFFS, (True, False), (True, False), NOOPS, (True, False))
    yield from ((SHAPES[0], *case) for case in full)
    for k, case in enumerate(itertools.product(SHAPES[1:], DTYPES, DIFFS, (True, False))):
        yield (*case, k % 2 == 0, NOOPS[(k // 2) % 3], (k // 6) % 2 == 0)


def _step(backend, state, q, scales, bs, order, sdt, tilde, diff, commit, extra):
    master, m, v, out, base = (t.clone() for t in state)
    kw = dict(extra)
    if diff is not None:
        kw["base"] = out if diff[0] == "out" else base
        kw["bits"] = diff[1]
    got = adamw_step_quantized_sum(
        master, m, v, q, scales, bs, order, sdt, out, tilde=tilde, commit=commit, backend=backend, **kw
    )
    res = {"master": master, "exp_avg": m, "exp_avg_sq": v, "out": out}
    assert (got is None) == (diff is None)
    if got is not None:
        res["dq"], res["dscales"] = got
    return res


def _step_checks() -> int:
    """adamw_step_quantized_sum: the triton kernel against the composition."""
    count = 0
    for k, ((n, bs), (sdt, pdt), diff, commit, has_tilde, noop, has_scale) in enumerate(_step_cases()):
        order = ORDERS[k % 3]
        settings_form = k % 5 == 1
        bad = k % 4 == 2
        bits = 8 if diff is None else diff[1]
        q, scales = _rows(n, bs, 127 if bits == 8 else 7, k, order[k % len(order)] if bad else None)
        q0, s0 = q.clone(), scales.clone()
        g = _gen("state", n, k)
        master = torch.randn(n, generator=g)
        m, v = torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 0.01
        # what the replicas hold: the master a few steps ago, so the difference has zeros and small values
        base = (master + torch.randn(n, generator=g) * 1e-2 * (torch.rand(n, generator=g) < 0.5)).to(pdt)
        out = base.clone() if diff is not None and diff[0] == "out" else torch.full((n,), 7.0, dtype=pdt)
        tilde = _shard(n, sdt, k) if has_tilde else None
        t0 = None if tilde is None else tilde.clone()
        extra = dict(HYPER) if settings_form else dict(hyper_tensor=hyper_tensor(**HYPER))
        if has_scale:
            extra["scale_tensor"] = torch.tensor([0.75])
            extra["grad_scale"] = 0.5
        if noop is not None:
            extra["noop_flag"] = torch.tensor([noop], dtype=torch.int32)
        state = (master, m, v, out, base)
        args = (q, scales, bs, order, sdt, tilde, diff, commit, extra)
        got, want = _step("triton", state, *args), _step("composed", state, *args)
        what = (n, bs, sdt, pdt, diff, commit, order, has_tilde, noop, has_scale, settings_form, bad)
        assert got.keys() == want.keys(), what
        for name in got:
            assert_same_bits(got[name], want[name], (name, what))
        assert_same_bits(q, q0, ("q untouched", what))
        assert_same_bits(scales, s0, ("scales untouched", what))
        if tilde is not None:
            assert_same_bits(tilde, t0, ("tilde untouched", what))
        stepped = commit and noop != 1
        assert torch.equal(got["master"], master) != stepped, what  # the state moved exactly when committed
        if bad and noop != 1:
            assert got["out"].isnan().any(), what  # the non-finite block's gradient reached the step
        elif diff is not None and noop != 1:
            assert (got["dq"] != 0).any(), what  # a difference was sent, not only zeros
        count += 1
    return count


def _interpret_checks() -> str:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    return f"quantized sum step checks: {_squares_checks()} + {_step_checks()} passed"


def _expected() -> str:
    squares = len(SHAPES) * len(ORDERS) * 3 * 4
    steps = sum(1 for _ in _step_cases())
    return f"quantized sum step checks: {squares} + {steps} passed"


def test_triton_kernels_under_interpreter():
    """Runs this file's checks in a subprocess with TRITON_INTERPRET=1 (set before triton is imported)."""
    out = run_this_file_interpreted(__file__, timeout=1800)
    assert _expected() in out, out[-2000:]


def test_triton_backend_states_why_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, scales = _rows(64, 16, 127, 0)
    with pytest.raises(ValueError, match="backend='triton' cannot run: CPU tensors need TRITON_INTERPRET=1"):
        quantized_sum_of_squares(q, scales, 16, [1, 0], F32, backend="triton")
    master = torch.zeros(64)
    with pytest.raises(ValueError, match="blocks of at most 1024 elements, got block_size=2048"):
        adamw_step_quantized_sum(
            master, torch.zeros(64), torch.zeros(64), q, torch.ones(4, 1), 2048, [0], F32, torch.empty(64),
            backend="triton", **HYPER,
        )  # fmt: skip


if __name__ == "__main__" and "--triton-interpret" in sys.argv:
    print(_interpret_checks())
