"""Gradient accumulation / cast-copy into flat buffers (acco_ds.ops.accumulate) on CPU.

The CPU extension ("cpp") and the torch reference run in this process. The Triton kernel runs on CPU tensors
under TRITON_INTERPRET=1, which must be set before triton is imported: those checks run in a subprocess
(this file run as ``__main__`` with ``--triton-interpret``) so no other test sees the variable.

Every check compares bit for bit with the ``*_ref`` (same fp32 operations, same round-to-nearest-even);
gradients are large compared with the buffer's values, so an element that is not written fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from acco_ds.ops import _build, accumulate
from acco_ds.ops.accumulate import (
    accumulate_flat,
    accumulate_flat_ref,
    accumulate_grads,
    accumulate_grads_ref,
    copy_flat,
    copy_flat_ref,
)
from tests.ops.triton_interpreter import run_this_file_interpreted

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 7, 278011]
# Under the Triton interpreter (whose cost grows with the elements) the large size is two full chunks of the kernel
# (rows of its chunk table, acco_ds.ops.accumulate._CHUNK) and a ragged last one of four blocks and three elements:
# both passes of the kernel (full rows without masks, the masked last row of a tensor) as 278011 takes them
INTERPRETED_SIZES = [1, 7, 2 * accumulate._CHUNK + 4 * accumulate._BLOCK + 3]


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def big_grad(shape, dtype, g) -> torch.Tensor:
    """Values with |x| in [0.5, 1.5): adding one changes any buffer value of |x| < 0.1, even in bf16."""
    x = torch.rand(shape, generator=g) + 0.5
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return (x * sign).to(dtype)


def layout(sizes, g, gap=3):
    """Offsets with gaps (so untouched regions exist) and some offsets that are not multiples of 8."""
    offsets, off = [], 5
    for s in sizes:
        offsets.append(off)
        off += s + gap
    return offsets, off + 2


def case(bdtype, gdtype, sizes, seed):
    g = gen(seed, bdtype, gdtype, tuple(sizes))
    offsets, total = layout(sizes, g)
    buffer = (torch.rand(total, generator=g) * 0.2 - 0.1).to(bdtype)
    shapes = [(s,) if s % 3 else (3, s // 3) for s in sizes]
    grads = [big_grad(sh, gdtype, g) for sh in shapes]
    grads.insert(1, None)
    offsets.insert(1, 0)
    return buffer, grads, offsets


def check_accumulate(backend: str, bdtype, gdtype, n: int, scale: float) -> None:
    buffer, grads, offsets = case(bdtype, gdtype, [n, 5, 64, n + 1], f"acc{backend}")
    ref = buffer.clone()
    accumulate_grads_ref(ref, grads, offsets, scale)
    ours = buffer.clone()
    accumulate_grads(ours, grads, offsets, scale, backend=backend)
    assert torch.equal(ours, ref), f"{backend} {bdtype} {gdtype} n={n} scale={scale}"
    written = torch.zeros(buffer.numel(), dtype=torch.bool)
    for gr, off in zip(grads, offsets):
        if gr is not None:
            written[off : off + gr.numel()] = True
    assert torch.equal(ours[~written], buffer[~written]), "an element outside the gradients changed"
    assert bool((ours[written] != buffer[written]).all()), "an element of a gradient region was not updated"


def check_flat(backend: str, bdtype, gdtype, n: int, scale: float) -> None:
    g = gen("flat", backend, bdtype, gdtype, n)
    buffer = (torch.rand(n, generator=g) * 0.2 - 0.1).to(bdtype)
    grad = big_grad((n,), gdtype, g)
    ref, ours = buffer.clone(), buffer.clone()
    accumulate_flat_ref(ref, grad, scale)
    accumulate_flat(ours, grad, scale, backend=backend)
    assert torch.equal(ours, ref) and bool((ours != buffer).all())
    dst_ref = torch.full((n,), float("nan"), dtype=bdtype)
    dst = torch.full((n,), float("nan"), dtype=bdtype)
    copy_flat_ref(dst_ref, grad, scale)
    copy_flat(dst, grad, scale, backend=backend)
    assert torch.equal(dst, dst_ref) and not bool(dst.isnan().any())


def require_cpu_ext():
    if _build.load("accumulate_cpu") is None:
        import shutil

        why = _build.why_missing("accumulate_cpu")
        if shutil.which("g++") or shutil.which("c++"):
            pytest.fail(f"a C++ compiler is present but the CPU accumulate extension is missing: {why}")
        pytest.skip(f"no C++ compiler: {why}")


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("bdtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_cpp_matches_ref(n, bdtype, gdtype, scale):
    require_cpu_ext()
    check_accumulate("cpp", bdtype, gdtype, n, scale)
    check_flat("cpp", bdtype, gdtype, n, scale)


def test_cpp_threads_do_not_change_results():
    require_cpu_ext()
    buffer, grads, offsets = case(torch.bfloat16, torch.float32, [300_001, 70_000], "threads")
    outs = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            b = buffer.clone()
            accumulate_grads(b, grads, offsets, 0.5)
            outs.append(b)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1])


def test_ref_semantics_by_hand():
    """The reference is buffer + grad*scale in fp32, rounded once to the buffer dtype (RNE)."""
    buf = torch.tensor([1.0, 1.0, -2.0], dtype=torch.bfloat16)
    # 1 + 2**-8 is exactly between two bf16 values: ties go to even (1.0); 1 + 3*2**-9 rounds up.
    accumulate_grads_ref(buf, [torch.tensor([2.0**-7, 3 * 2.0**-8]), torch.tensor([0.5])], [0, 2], 0.5)
    assert buf.tolist() == [1.0, 1.0078125, -1.75]


def test_copy_flat_scale_one_is_a_cast():
    src = torch.randn(1001)
    dst = torch.full((1001,), float("nan"), dtype=torch.bfloat16)
    copy_flat(dst, src)
    assert torch.equal(dst, src.to(torch.bfloat16))


@pytest.mark.parametrize(
    "call,exc,msg",
    [
        (lambda b: accumulate_grads(b, [torch.ones(3)], [0, 1]), ValueError, "got 1 grads but 2 offsets"),
        (
            lambda b: accumulate_grads(b, [torch.ones(3)], [98]),
            ValueError,
            r"grads\[0\] \(3 elements at offset 98\)",
        ),
        (
            lambda b: accumulate_grads(b, [torch.ones(6)[::2]], [0]),
            ValueError,
            r"grads\[0\] is not contiguous",
        ),
        (
            lambda b: accumulate_grads(b, [torch.ones(3, dtype=torch.float64)], [0]),
            TypeError,
            "float64; allowed: torch.float32, torch.bfloat16 or torch.float16",
        ),
        (lambda b: accumulate_grads(b, [torch.ones(3, device="meta")], [0]), ValueError, "is on meta"),
        (lambda b: accumulate_grads(b, [torch.ones(3)], [0], backend="cuda"), ValueError, "backend must be"),
        (lambda b: accumulate_grads(b.view(10, 10), [torch.ones(3)], [0]), ValueError, "buffer must be 1-D"),
        (lambda b: accumulate_flat(b, torch.ones(99)), ValueError, "sizes differ"),
        (
            lambda b: accumulate_flat(b, torch.ones(100), backend="triton"),
            ValueError,
            "needs TRITON_INTERPRET=1",
        ),
        (lambda b: copy_flat(b, torch.ones(100, dtype=torch.int32)), TypeError, "src has dtype torch.int32"),
    ],
)
def test_bad_inputs(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call(torch.zeros(100))


def mixed_alignment_case(g):
    """A 16-byte aligned buffer and gradients of both dtypes: aligned (offset multiple of 8, aligned address),
    an odd-sized one that pushes the next offset off the multiple of 8, and a misaligned address at an aligned
    offset. Returns (buffer, grads, offsets, the indices that must take the vector path)."""
    buffer = (torch.rand(200_000, generator=g) * 0.2 - 0.1).to(torch.bfloat16)
    assert buffer.data_ptr() % 16 == 0
    misaligned = big_grad((5001,), torch.bfloat16, g)
    misaligned = torch.cat([torch.zeros(1, dtype=torch.bfloat16), misaligned])[1:]  # address 2 mod 16
    grads = [
        big_grad((40_000,), torch.bfloat16, g),  # offset 0: vector
        big_grad((16_391,), torch.float32, g),  # offset 40_000: vector (fp32 launch), odd size
        big_grad((1029,), torch.bfloat16, g),  # offset 56_391: scalar (offset not a multiple of 8)
        big_grad((17_000,), torch.bfloat16, g),  # offset 57_424: vector
        misaligned,  # offset 74_424: scalar (address)
        big_grad((33,), torch.float32, g),  # offset 79_429: scalar (fp32 launch)
        big_grad((16_384,), torch.float32, g),  # offset 80_000: vector (fp32 launch)
    ]
    offsets = [0, 40_000, 56_391, 57_424, 74_424, 79_429, 80_000]
    return buffer, grads, offsets, {0, 1, 3, 6}


def test_launch_plan_splits_aligned_from_unaligned():
    buffer, grads, offsets, vector = mixed_alignment_case(gen("plan"))
    assert grads[4].data_ptr() % 16 != 0
    plan = accumulate.launch_plan(buffer, grads, offsets)
    assert [(d, a) for d, a, _ in plan] == [
        (torch.float32, True),
        (torch.float32, False),
        (torch.bfloat16, True),
        (torch.bfloat16, False),
    ]
    by_class = {(d, a): ids for d, a, ids in plan}
    assert by_class[(torch.float32, True)] == [1, 6] and by_class[(torch.bfloat16, True)] == [0, 3]
    assert {i for _, a, ids in plan if a for i in ids} == vector
    assert sorted(i for _, _, ids in plan for i in ids) == list(range(len(grads)))
    # a misaligned buffer puts everything on the scalar path; empty gradients are left out
    odd_buffer = torch.zeros(200_001, dtype=torch.bfloat16)[1:]
    assert all(not a for _, a, _ in accumulate.launch_plan(odd_buffer, grads, offsets))
    assert accumulate.launch_plan(buffer, [torch.zeros(0)], [0]) == []


class _BuildCounter:
    """Counts the chunk-table builds (``accumulate._chunk_table`` calls) while active."""

    def __init__(self):
        self.builds = 0
        self._orig = accumulate._chunk_table

    def __enter__(self):
        def counted(*a, **k):
            self.builds += 1
            return self._orig(*a, **k)

        accumulate._chunk_table = counted
        accumulate._clear_table_cache()
        return self

    def __exit__(self, *exc):
        accumulate._chunk_table = self._orig
        accumulate._clear_table_cache()


def fold_micro_batches(n_params: int, micro_batches: int, offsets, call, dtype=torch.float32, seed=0) -> set:
    """What mixed-dtype fold hooks do: per micro-batch, every parameter's gradient freshly allocated (held in a
    list with the previous ones, so the addresses move) and passed alone, ``call(grad, offset)``. Returns the
    set of gradient addresses seen."""
    g = gen("fold", n_params, seed)
    sizes = [int(o2 - o1) - 3 for o1, o2 in zip(offsets, offsets[1:])]
    addresses, keep = set(), []
    for mb in range(micro_batches):
        keep.append(torch.zeros(17 * (mb + 1)))  # shifts the allocator's next addresses
        for i in range(n_params):
            grad = big_grad((sizes[i],), dtype, g)
            keep.append(grad)
            addresses.add(grad.data_ptr())
            call(grad, offsets[i])
    return addresses


def fold_offsets(n_params: int, start: int = 5) -> list:
    """n_params + 1 offsets: parameter i of 1 + 37*i elements at offsets[i], a gap of 3 after each."""
    offsets, off = [], start
    for i in range(n_params + 1):
        offsets.append(off)
        off += 1 + 37 * i + 3
    return offsets


def test_chunk_table_built_once_per_layout():
    """40 parameters folded one by one over 6 micro-batches at moving addresses: one table per parameter, built
    at the first micro-batch only; a new layout (other offsets) builds new ones; two gradients at a fixed
    distance share a table wherever they are."""
    n = 40
    offsets = fold_offsets(n)
    with _BuildCounter() as count:
        seen = fold_micro_batches(
            n, 6, offsets, lambda g, off: accumulate._device_table([g], [off], g.device)
        )
        assert len(seen) > n, (
            "the addresses did not move between micro-batches: the check would prove nothing"
        )
        assert count.builds == n
        assert len(accumulate._table_cache) == n
        fold_micro_batches(
            n, 2, fold_offsets(n, start=9), lambda g, o: accumulate._device_table([g], [o], g.device)
        )
        assert count.builds == 2 * n
        for shift in (0, 64, 4096):
            flat = torch.zeros(10_000 + shift)[shift:]
            t = accumulate._device_table([flat[:100], flat[200:300]], [0, 128], flat.device)
            assert t[:, 0].tolist() == [0, 200] and t[:, 1].tolist() == [0, 128]
        assert count.builds == 2 * n + 1


def test_chunk_table_cache_bounded_by_rows(monkeypatch):
    """The cache keeps at most ``_TABLE_CACHE_ROWS`` rows (least recently used out, the newest always kept)."""
    monkeypatch.setattr(accumulate, "_TABLE_CACHE_ROWS", 10)
    with _BuildCounter() as count:
        grad = torch.zeros(3)
        for off in range(12):
            accumulate._device_table([grad], [off], grad.device)
        assert len(accumulate._table_cache) == 10 and accumulate._table_rows == 10
        accumulate._device_table([grad], [11], grad.device)  # still cached
        accumulate._device_table([grad], [0], grad.device)  # evicted: built again
        assert count.builds == 13
        big = torch.zeros(accumulate._CHUNK * 20)
        accumulate._device_table([big], [0], big.device)  # 20 rows alone: kept, every other entry out
        assert len(accumulate._table_cache) == 1 and accumulate._table_rows == 20


def assert_prints_ok(code: str, timeout: int) -> None:
    """``code`` run by a fresh interpreter in the repository root exits 0, its last line (after the
    ``print('ok')`` appended here) ``ok``."""
    code += "print('ok')\n"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_import_needs_no_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "import acco_ds.ops.accumulate as a\n"
        "b = torch.zeros(8); a.accumulate_grads(b, [torch.ones(4)], [2]); assert b.sum() == 4\n"
        "assert not a._build.triton_available()\n"
    )
    assert_prints_ok(code, timeout=120)


def test_importing_acco_ds_does_not_import_triton():
    """Triton is imported at the first Triton launch only (acco_ds.ops.triton_kernels), even where it is
    installed: ``import acco_ds`` and the ops fronts leave it out of sys.modules."""
    code = (
        "import sys\n"
        "import acco_ds, acco_ds.ops, acco_ds.ops.accumulate, acco_ds.ops.adamw\n"
        "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if m.startswith('triton'))\n"
        "assert 'acco_ds.ops.triton_kernels' not in sys.modules\n"
    )
    assert_prints_ok(code, timeout=300)


def test_triton_kernel_under_interpreter():
    """Runs this file's Triton checks in a subprocess with TRITON_INTERPRET=1 (set before triton is imported)."""
    out = run_this_file_interpreted(__file__, timeout=1800)
    assert "triton interpret checks: 54 passed" in out, out[-2000:]
    assert "mixed alignment: 4 launches, vector path for [0, 1, 3, 6]" in out, out[-2000:]
    assert "fold: 40 parameters x 4 micro-batches, 40 chunk tables built" in out, out[-2000:]


class _LaunchSpy:
    """Wraps the Triton kernel; records ALIGNED and the gradient addresses of every launch's table rows (the
    first gradient's address + each row's element offset from it)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(table, grad, *args, **kw):
            rows = [grad.data_ptr() + d * grad.element_size() for d in table[:, 0].tolist()]
            self.launches.append((kw["ALIGNED"], rows))
            return self.kernel[grid](table, grad, *args, **kw)

        return launch


def _mixed_alignment_interpret_check() -> None:
    buffer, grads, offsets, vector = mixed_alignment_case(gen("mixed-alignment"))
    ref, ours = buffer.clone(), buffer.clone()
    accumulate_grads_ref(ref, grads, offsets, 0.37)
    from acco_ds.ops.triton_kernels import accumulate as kernels

    spy = _LaunchSpy(kernels.accumulate_chunks)
    kernels.accumulate_chunks = spy
    try:
        accumulate_grads(ours, grads, offsets, 0.37, backend="triton")
    finally:
        kernels.accumulate_chunks = spy.kernel
    assert torch.equal(ours, ref)
    vec_ptrs = {grads[i].data_ptr() for i in vector}
    for aligned, rows in spy.launches:
        assert set(rows) <= vec_ptrs if aligned else not set(rows) & vec_ptrs, (aligned, rows)
    covered = {p for _, rows in spy.launches for p in rows}
    assert covered == {g.data_ptr() for g in grads}
    print(f"mixed alignment: {len(spy.launches)} launches, vector path for {sorted(vector)}")


def _fold_interpret_check() -> None:
    """Fold hooks' calls through the Triton kernel (one bf16 gradient at a time, into an fp32 buffer): the
    reference's bits, and the chunk tables built once per parameter over the micro-batches."""
    n = 40
    offsets = fold_offsets(n)
    ours, ref = torch.zeros(offsets[-1]), torch.zeros(offsets[-1])

    def both(grad, off):
        accumulate_grads(ours, [grad], [off], 1.0, backend="triton")
        accumulate_grads_ref(ref, [grad], [off], 1.0)

    with _BuildCounter() as count:
        fold_micro_batches(n, 4, offsets, both, dtype=torch.bfloat16)
    assert torch.equal(ours, ref)
    print(f"fold: {n} parameters x 4 micro-batches, {count.builds} chunk tables built")


def _triton_interpret_checks() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    count = 0
    for n in INTERPRETED_SIZES:
        for bdtype in DTYPES:
            for gdtype in DTYPES:
                for scale in (1.0, 0.37):
                    check_accumulate("triton", bdtype, gdtype, n, scale)
                    if n == INTERPRETED_SIZES[-1] and scale != 1.0:
                        check_flat("triton", bdtype, gdtype, n, scale)
                    count += 1
    # mixed gradient dtypes in one call (one launch per dtype)
    g = gen("mixed")
    buffer = (torch.rand(100, generator=g) * 0.2 - 0.1).to(torch.bfloat16)
    grads = [
        big_grad((10,), torch.float32, g),
        big_grad((20,), torch.bfloat16, g),
        big_grad((9,), torch.float16, g),
    ]
    ref, ours = buffer.clone(), buffer.clone()
    accumulate_grads_ref(ref, grads, [3, 40, 70], 0.5)
    accumulate_grads(ours, grads, [3, 40, 70], 0.5, backend="triton")
    assert torch.equal(ref, ours)
    print(f"triton interpret checks: {count} passed")
    _mixed_alignment_interpret_check()
    _fold_interpret_check()
    return 0


if __name__ == "__main__" and "--triton-interpret" in sys.argv:
    raise SystemExit(_triton_interpret_checks())
