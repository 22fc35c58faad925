"""The AVX2 variant's software-pipelined AdamW loop (csrc/adamw/adamw_cpu_range.h, adamw_range_avx2_bf16: bf16 `out`
from an fp32 or bf16 gradient, blocks of 16, each block's cast stored one block late, the rest by the plain loops)
gives the bits of the baseline variant and of the CUDA body's CPU harness: special values (NaN with assorted
payloads, infinities, signed zeros, subnormals, huge), sizes around the blocks, shards at odd offsets (the
non-temporal stores need a 32-byte aligned `out`), `out` on the gradient itself, two threads, and a shard large
enough for the streaming stores. Its bf16 cast is checked on every high half and the rounding's ties.

Where two NaNs meet in one commutative operation (m and the gradient both NaN, say), which payload the fp32 state
keeps depends on the order the compiler gives the operands, which no variant fixes (the AVX2 and baseline loops
already differed there before this loop): a NaN of the state only has to be a NaN. Everything else, `out` included
(every NaN is 0x7FC0 in bf16), bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from acco_ds.ops import _build
from acco_ds.ops.adamw import adamw_step, adamw_step_cuda_body_on_cpu

ROOT = Path(__file__).resolve().parents[2]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
SIZES = [1, 15, 16, 17, 31, 33, 257, 4111]


def require_cpu_ext():
    if _build.load("adamw_cpu") is None:
        pytest.skip(f"CPU extension missing: {_build.why_missing('adamw_cpu')}")


def special(n: int, seed: int) -> torch.Tensor:
    """fp32 values of every kind: normal, then a tenth of them special, a twentieth random bit patterns."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    values = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-40, 3e38, 1e-30, 2.0**-133, 65504.0]
    )
    nans = torch.tensor([0x7FC00000, 0xFFC00000, 0x7FA00001, 0x7F800001, 0xFFFFFFFF], dtype=torch.int64)
    values = torch.cat([values, nans.to(torch.int32).view(torch.float32)])
    where = torch.randperm(n, generator=g)  # distinct positions: a deterministic fill, whatever the threads
    idx, at = where[: max(1, n // 10)], where[n // 10 : n // 10 + n // 20]
    x[idx] = values[torch.randint(0, len(values), idx.shape, generator=g)]
    bits = torch.randint(-(2**31), 2**31 - 1, at.shape, generator=g, dtype=torch.int64).to(torch.int32)
    x[at] = bits.view(torch.float32)
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any two fp32 NaNs are the same (see the module docstring)."""
    if a.dtype == torch.float32:
        both = a.isnan() & b.isnan()
        a, b = a.masked_fill(both, 0.0), b.masked_fill(both, 0.0)
    return torch.equal(bits(a), bits(b))


def bf16_rule(x: torch.Tensor) -> torch.Tensor:
    """csrc/common/bf16.h's f32_to_bf16 in int64 arithmetic: round to nearest even, every NaN 0x7FC0."""
    b = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    r = torch.where(x.isnan(), torch.full_like(r, 0x7FC0), r)
    return torch.where(r >= 0x8000, r - 0x10000, r).to(torch.int16)


def cases():
    """(name, n, grad dtype, out dtype, commit, offset in elements, out on the gradient, threads)"""
    for n in SIZES:
        for gdt in (torch.float32, torch.bfloat16):
            for commit in (True, False):
                for off in (0, 1, 8):
                    yield (f"n{n}-{gdt}-{commit}-{off}", n, gdt, torch.bfloat16, commit, off, False, 1)
            yield (f"n{n}-{gdt}-inplace", n, gdt, gdt, True, 0, gdt == torch.bfloat16, 1)
    for off in (0, 8):  # >= 16 MiB of bf16 out: streaming stores (aligned or not), two threads
        yield (f"large-{off}", 8_388_619, torch.bfloat16, torch.bfloat16, True, off, False, 2)
    yield ("threads", 100_003, torch.float32, torch.bfloat16, False, 0, False, 2)


def run_case(step, case) -> dict:
    """The case's state, gradient and out after one step of ``step`` (adamw_step or the CUDA body's harness)."""
    name, n, gdt, odt, commit, off, inplace, threads = case
    seed = sum(map(ord, name))
    state = [special(n + off, seed + i)[off:] for i in range(3)]
    state[2] = state[2].abs() * 0.01
    grad = special(n + off, seed + 3).to(gdt)[off:]
    out = grad if inplace else torch.full((n + off,), float("nan"), dtype=odt)[off:]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step(
            *state, grad, out, step=7, commit=commit, grad_scale=0.37, scale_tensor=torch.tensor([0.5]), **HP
        )
    finally:
        torch.set_num_threads(old)
    return {"p": state[0], "m": state[1], "v": state[2], "grad": grad, "out": out}


def cast_table() -> torch.Tensor:
    """fp32 values with every high half (sign, exponent, the 7 mantissa bits bf16 keeps) and the low halves the
    rounding turns on: 0, the ties 0x8000 (lsb 0 and 1), one below and above them, all ones."""
    high = torch.arange(0, 1 << 16, dtype=torch.int64) << 16
    low = torch.tensor([0, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234], dtype=torch.int64)
    return (high[:, None] | low[None, :]).flatten().to(torch.int32).view(torch.float32)


def run_cast() -> torch.Tensor:
    """out = the bf16 of the parameters, through the step: lr 0 (decay 1, step size 0) on zero moments and gradient."""
    p = cast_table()
    n = p.numel()
    out = torch.empty(n, dtype=torch.bfloat16)
    adamw_step(p.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), out, step=1,
               lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)  # fmt: skip
    return out


_SCRIPT = """
import sys, torch
from acco_ds.ops import _build
from acco_ds.ops.adamw import adamw_step
from tests.ops import test_adamw_cpu_pipelined as t
res = {case[0]: t.run_case(adamw_step, case) for case in t.cases()}
res["cast"] = {"out": t.run_cast()}
torch.save(res, sys.argv[1])
print(_build.load("adamw_cpu").ISA)
"""


def _under_isa(isa: str, path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ACCO_DS_CPU_ISA"}
    env["ACCO_DS_CPU_ISA"] = isa
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH", "")) if x)
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ran = r.stdout.split()[-1]
    if ran != isa:
        pytest.skip(f"this CPU does not run the {isa} variant (ran {ran})")
    return torch.load(path, weights_only=False)


def test_avx2_loop_gives_the_baseline_variants_bits(tmp_path):
    require_cpu_ext()
    avx2 = _under_isa("avx2", tmp_path / "avx2.pt")
    base = _under_isa("base", tmp_path / "base.pt")
    for name, tensors in base.items():
        for what, b in tensors.items():
            assert same(avx2[name][what], b), f"{name}: {what} differs between avx2 and base"


@pytest.mark.parametrize("case", [c for c in cases() if c[1] < 1_000_000], ids=lambda c: c[0])
def test_cpu_ext_matches_the_cuda_body_harness(case):
    """The default variant (the AVX2 loop on an AVX2 CPU) against the CUDA kernel body run on the CPU."""
    require_cpu_ext()
    ours = run_case(adamw_step, case)
    theirs = run_case(lambda *a, **k: adamw_step_cuda_body_on_cpu(*a, grid_dim=0, **k), case)
    for what in ours:
        assert same(ours[what], theirs[what]), f"{case[0]}: {what}"


def test_bf16_cast_is_the_rule():
    """bf16.h's rounding on every high half and the ties; on the non-NaN values that is torch's cast too."""
    require_cpu_ext()
    out, x = bits(run_cast()), cast_table()
    assert torch.equal(out, bf16_rule(x))
    assert torch.equal(out[~x.isnan()], bits(x[~x.isnan()].to(torch.bfloat16)))
