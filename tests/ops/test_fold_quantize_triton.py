"""The Triton kernels of ``acco_ds.ops.fold_quantize`` (``backend="triton"``,
acco_ds/ops/triton_kernels/fold_quantize.py) against the torch reference (``backend="ref"``), under the Triton
interpreter (``TRITON_INTERPRET=1``, in a subprocess: it must be set before triton is imported).

A round's end as the fused round end runs it: the buffer of W = 1, 2, 3 chunks cut into parameters (smaller than a
block, a block's size, several blocks, spanning one or two chunk ends; some get no gradient; padding at the end),
each parameter's gradient folded in a shuffled order (2-D gradients too), then the blocks no fold quantized
(quantize_listed_blocks). After every call q, the scales, the residual and the buffer have the reference's bits (a
NaN matching any NaN: its payload is the processor's; a bf16 NaN the kernels store is 0x7FC0). Block sizes 7, 64,
256, 1024 (the row kernel, several blocks a program) and 2000 (longer than a 1024-element tile: one block a program,
walked tile by tile), the short ones also through the one-block kernel; buffer / gradient / residual dtypes fp32,
bf16 and fp16, mixed, and no residual; 8 and 4 bits; an inf in a block a fold quantizes, a NaN in one it accumulates (the
listed pass quantizes it: NaN scale), all-zero blocks (with -0.0), exact ties. The interpreter runs one program at a
time in Python, so the buffers stay small.
"""

from __future__ import annotations

import itertools
import os
import sys
import zlib

import pytest
import torch

from acco_ds.ops.fold_quantize import covered_blocks, fold_quantize, quantize_listed_blocks
from acco_ds.ops.quantize import num_blocks
from tests.ops.triton_interpreter import assert_same_bits, run_this_file_interpreted

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (buffer, gradient, residual) dtypes: all fp32, all bf16, all fp16, mixed, no residual
DTYPES = [
    (F32, F32, F32),
    (BF16, BF16, BF16),
    (BF16, BF16, F32),
    (BF16, F32, BF16),
    (F32, BF16, F32),
    (BF16, BF16, None),
    (F32, F32, None),
    (F32, BF16, BF16),
    (F16, F16, F16),
    (F16, F16, F32),
    (F16, F32, F16),
    (F32, F16, F32),
    (F16, F16, None),
]
# (block size, chunk): short last blocks of every chunk (the chunk not a multiple of the block size)
GEOMETRIES = [(7, 101), (64, 500), (256, 1100), (1024, 3100), (2000, 6500)]
WORLDS = (1, 2, 3)
Q_UNSET, SCALE_UNSET = -128, -1.0  # what q / scales hold before the round: no call ever writes these


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def layout(world: int, chunk: int, bs: int, seed: int) -> list:
    """[(offset, numel)]: parameters one after the other from 0, then a padding (the buffer's last elements, no
    parameter): sizes of 1 element, less than a block, a block, several blocks and more than a chunk, in turn."""
    g = _gen("layout", world, chunk, bs, seed)
    total = world * chunk
    end = total - int(torch.randint(0, min(bs, chunk // 2) + 1, (1,), generator=g))
    kinds = (
        lambda: int(torch.randint(bs + 1, 3 * bs + 2, (1,), generator=g)),
        lambda: 1,
        lambda: max(1, bs // 2 - 1),
        lambda: bs,
        lambda: int(torch.randint(1, 2 * bs + 2, (1,), generator=g)),
        lambda: chunk + bs // 3 + 1,
    )
    params, offset, k = [], 0, 0
    while offset < end:
        n = min(kinds[k % len(kinds)](), end - offset)
        params.append((offset, n))
        offset += n
        k += 1
    return params


def state(world: int, chunk: int, bdt, rdt, seed: int, zero_span=None):
    """The buffer (the round's accumulation so far: values of several magnitudes) and the residual (or None);
    ``zero_span`` (lo, hi): zeros there (-0.0 at every third element), in both."""
    g = _gen("state", world, chunk, seed)
    total = world * chunk
    mag = 2.0 ** torch.randint(-12, 4, (total // 16 + 1,), generator=g).repeat_interleave(16)[:total]
    buf = torch.randn(total, generator=g) * mag
    res = torch.randn(total, generator=g) * mag * 1e-2
    if zero_span is not None:
        lo, hi = zero_span
        z = torch.zeros(hi - lo)
        z[::3] = -0.0
        buf[lo:hi], res[lo:hi] = z, z
    return buf.to(bdt), None if rdt is None else res.to(rdt)


def gradient(offset: int, n: int, gdt, seed: int, zero: bool = False, special=None):
    """One parameter's gradient (2-D when its size allows); zeros (-0.0 at every other element) when ``zero``;
    ``special`` (position, value) put in."""
    g = _gen("grad", offset, n, seed)
    x = torch.randn(n, generator=g) * 2.0 ** float(torch.randint(-10, 2, (1,), generator=g))
    if zero:
        x = torch.zeros(n)
        x[::2] = -0.0
    if special is not None:
        x[special[0]] = special[1]
    x = x.to(gdt)
    return x.view(3, n // 3) if n % 3 == 0 and n >= 6 else x


def ties_state(world: int, chunk: int, bs: int, bdt):
    """A buffer of multiples of 0.25 whose blocks hold 63.5 (scale 0.5 at 8 bits): quotients ending in .5 (ties;
    the gradients zeros, no residual)."""
    total = world * chunk
    g = _gen("ties", world, chunk, bs)
    buf = torch.randint(-254, 255, (total,), generator=g).float() * 0.25
    starts = [c * chunk + j * bs for c in range(world) for j in range(num_blocks(chunk, bs))]
    buf[torch.tensor(starts)] = 63.5
    return buf.to(bdt)


def fused_round(
    backend, world, chunk, bs, params, grads, order, buf, res, bits, leftover=None, after=None
) -> None:
    """Folds ``grads`` (a dict: parameter index -> gradient) in ``order`` into ``buf`` (in place), then quantizes the
    blocks no fold quantized (``leftover``, computed when None); ``after(name)`` after each call."""
    nb = num_blocks(chunk, bs)
    q = torch.full((world * chunk,), Q_UNSET, dtype=torch.int8, device=buf.device)
    scales = torch.full((world * nb,), SCALE_UNSET, device=buf.device)
    for i in order:
        offset = params[i][0]
        fold_quantize(buf, grads[i], offset, chunk, res, q, scales, bs, bits, backend=backend)
        if after is not None:
            after(("fold", i), q, scales)
    if leftover is None:
        leftover = leftover_blocks(world, chunk, bs, [params[i] for i in grads])
    blocks = torch.tensor(leftover, dtype=torch.int64, device=buf.device)
    quantize_listed_blocks(buf, chunk, res, q, scales, bs, blocks, bits, backend=backend)
    if after is not None:
        after("listed", q, scales)
    return q, scales


def leftover_blocks(world: int, chunk: int, bs: int, folded) -> list:
    """The global blocks no fold of ``folded`` ([(offset, numel)]) covers whole, sorted."""
    fused = set()
    for offset, n in folded:
        for _, _, a, b in covered_blocks(offset, n, chunk, bs):
            fused.update(range(a, b))
    return [b for b in range(world * num_blocks(chunk, bs)) if b not in fused]


def _with_inner_block(params, chunk, bs, skip) -> list:
    """The parameters (indices) not in ``skip`` that cover a block whole, with that block's first element (relative
    to the parameter)."""
    out = []
    for i, (offset, n) in enumerate(params):
        inner = [a for _, _, a, b in covered_blocks(offset, n, chunk, bs) if b > a]
        if i not in skip and inner:
            nb = num_blocks(chunk, bs)
            out.append((i, (inner[0] // nb) * chunk + (inner[0] % nb) * bs - offset))
    return out


def _partial_end(params, chunk, bs, skip):
    """The last parameter not in ``skip`` whose last element lies in a block it covers in part, or None."""
    for i in reversed(range(len(params))):
        first, stop, _, inner_stop = covered_blocks(*params[i], chunk, bs)[-1]
        if i not in skip and inner_stop < stop:
            return i
    return None


def run_case(world, chunk, bs, bdt, gdt, rdt, bits, seed, specials=True, ties=False) -> int:
    """One fused round with the triton and the ref backends, compared after every call; returns the calls."""
    params = layout(world, chunk, bs, seed)
    g = _gen("case", world, chunk, bs, seed)
    skipped = {i for i in range(len(params)) if i % 5 == 3}  # parameters that got no gradient
    zero_param = inf_param = nan_param = None
    inf_at = 0
    if specials:
        whole = _with_inner_block(params, chunk, bs, skipped)
        assert whole, (world, chunk, bs, seed)
        inf_param, inf_at = whole[-1]  # an inf in a block it covers whole: fused, NaN scale
        if len(whole) > 1:
            zero_param = whole[0][0]  # its blocks all zeros (with -0.0): fused, scale 0
        nan_param = _partial_end(params, chunk, bs, skipped | {zero_param, inf_param})  # a NaN in its end
        # block: accumulated, then listed, NaN scale
    grads = {}
    for i, (offset, n) in enumerate(params):
        if i in skipped:
            continue
        special = {inf_param: (inf_at, float("inf")), nan_param: (n - 1, float("nan"))}.get(i)
        grads[i] = gradient(offset, n, gdt, seed, zero=ties or i == zero_param, special=special)
    order = [list(grads)[j] for j in torch.randperm(len(grads), generator=g).tolist()]
    if ties:
        buf0, res0 = ties_state(world, chunk, bs, bdt), None
    else:
        span = None if zero_param is None else (params[zero_param][0], sum(params[zero_param]))
        buf0, res0 = state(world, chunk, bdt, rdt, seed, span)
    runs = {}
    for backend in ("ref", "triton"):
        buf = buf0.clone()
        res = None if res0 is None else res0.clone()
        log = []

        def after(name, q, scales, buf=buf, res=res, log=log):
            log.append((name, q.clone(), scales.clone(), buf.clone(), None if res is None else res.clone()))

        fused_round(backend, world, chunk, bs, params, grads, order, buf, res, bits, after=after)
        runs[backend] = log
    what = (world, chunk, bs, bdt, gdt, rdt, bits, seed, ties)
    for got, want in zip(runs["triton"], runs["ref"], strict=True):
        for k, name in enumerate(("q", "scales", "buffer", "residual"), start=1):
            if want[k] is not None:
                assert_same_bits(got[k], want[k], (name, got[0], what))
    q, scales = runs["ref"][-1][1:3]
    assert (q != Q_UNSET).all(), f"an element no call quantized: {what}"  # the round quantizes every block
    assert (scales != SCALE_UNSET).all(), what
    seen = {"inf": inf_param is not None, "zero": zero_param is not None, "nan": nan_param is not None}
    if seen["zero"]:
        assert (scales == 0).any(), what  # the all-zero blocks
    if seen["inf"]:
        assert scales.isnan().any(), what
    if seen["nan"]:
        nan_block = covered_blocks(*params[nan_param], chunk, bs)[-1][1] - 1
        assert scales[nan_block].isnan(), what
    return len(runs["ref"]), seen


def cases():
    """(world, chunk, bs, (bdt, gdt, rdt), bits, one-block kernel, ties): every dtype combination at every
    geometry, the worlds and 8 / 4 bits in turn (``k + j`` over geometry ``k`` and dtype combination ``j``: every
    pair of geometry, dtype combination, world and bits meets); the short blocks through the one-block kernel too;
    exact ties."""
    for k, (bs, chunk) in enumerate(GEOMETRIES):
        for j, d in enumerate(DTYPES):
            yield WORLDS[(k + j) % len(WORLDS)], chunk, bs, d, 8 if (k + j) % 2 == 0 else 4, False, False
    for (bs, chunk), world in itertools.product(GEOMETRIES[:3], WORLDS):
        for j in range(2):
            yield world, chunk, bs, DTYPES[(3 * world + j) % len(DTYPES)], 8 if j else 4, True, False
    for bs, chunk in GEOMETRIES[1], GEOMETRIES[4]:
        yield 2, chunk, bs, (F32, F32, None), 8, False, True
        yield 1, chunk, bs, (BF16, BF16, None), 8, bs < 1024, True
        yield 1, chunk, bs, (F16, F16, None), 8, bs < 1024, True


def _interpret_checks() -> str:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from acco_ds.ops.triton_kernels import fold_quantize as kernels

    rows = kernels._rows
    count = calls = 0
    seen = {"inf": 0, "zero": 0, "nan": 0}
    for world, chunk, bs, (bdt, gdt, rdt), bits, one_block, ties in cases():
        kernels._rows = (lambda _: 0) if one_block else rows  # the one-block kernel for short blocks too
        n, got = run_case(world, chunk, bs, bdt, gdt, rdt, bits, seed=count, specials=not ties, ties=ties)
        calls += n
        seen = {k: seen[k] + got[k] for k in seen}
        count += 1
    kernels._rows = rows
    assert min(seen.values()) >= count // 2, seen  # the special blocks are in most rounds
    return f"fold quantize checks: {count} rounds passed ({calls} calls)"


def test_triton_kernels_under_interpreter():
    """Runs this file's checks in a subprocess with TRITON_INTERPRET=1 (set before triton is imported)."""
    out = run_this_file_interpreted(__file__, timeout=1800)
    assert f"fold quantize checks: {sum(1 for _ in cases())} rounds passed" in out, out[-2000:]


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    buf, q, scales = torch.zeros(64), torch.zeros(64, dtype=torch.int8), torch.zeros(4)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fold_quantize(buf, torch.ones(8), 3, 32, None, q, scales, 16, backend="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        quantize_listed_blocks(buf, 32, None, q, scales, 16, torch.tensor([1]), backend="triton")


if __name__ == "__main__" and "--triton-interpret" in sys.argv:
    print(_interpret_checks())
