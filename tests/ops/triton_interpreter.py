"""Running Triton kernels' checks under the Triton interpreter, from a test: ``TRITON_INTERPRET=1`` must be in the
environment before triton is first imported, so the checks run in a fresh Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str, timeout: float) -> str:
    """Runs ``code`` (Python source) in a new interpreter with TRITON_INTERPRET=1 and the repository first on the
    path, from the repository's root; skips without triton; fails with the output's tail unless it exits 0.
    Returns its standard output."""
    pytest.importorskip("triton")
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def run_this_file_interpreted(file: str, timeout: float) -> str:
    """:func:`run_interpreted` of the test file ``file`` as ``__main__`` with ``--triton-interpret`` in argv (runpy,
    not ``python <file>``: a script's folder goes first on sys.path, and tests/ has packages named like installed
    ones, tests/deepspeed)."""
    code = (
        f"import runpy, sys; sys.argv = [{file!r}, '--triton-interpret']; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    return run_interpreted(code, timeout)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what) -> None:
    """``a`` (a kernel's) has the bits of ``b`` (the reference's or the composition's), a NaN matching any NaN: a
    NaN's payload is the processor's, and torch's vectorised bf16 cast stores one as 0xFFFF where the kernels store
    0x7FC0 (:mod:`acco_ds.ops.triton_kernels.bf16`, checked here)."""
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.is_floating_point():
        nan = a.isnan()
        assert torch.equal(nan, b.isnan()), f"NaNs differ: {what}"
        if a.dtype == torch.bfloat16:
            assert (a.view(torch.int16)[nan] == 0x7FC0).all(), f"a bf16 NaN is not 0x7FC0: {what}"
        a, b = a[~nan], b[~nan]
    if not torch.equal(a.view(torch.int8), b.view(torch.int8)):
        bad = (a.view(torch.int8) != b.view(torch.int8)).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"bits differ: {what}; first byte positions {bad}")
