"""Tests of the benchmarks (``benchmarks/``): their pure parts, short real runs, and re-rendering from JSON."""

from __future__ import annotations

import subprocess

QUICK_RUN_HANG_S = 1500
"""How long a benchmark's ``--quick`` run may take before its test calls it hung, kills it and fails. A hang guard,
not a timing: alone on 2 cores a quick run takes 1-4 minutes, but with the whole suite on the same cores (three test
workers, each launching ranks) a topology quick run once took over 600 s and failed a run that was not hung."""


def communicate_or_kill(proc: subprocess.Popen, what: str) -> tuple:
    """``proc.communicate()`` within :data:`QUICK_RUN_HANG_S`; past it, kill the run and raise AssertionError with
    the end of its output (``what`` names the run). Returns (stdout, stderr)."""
    try:
        return proc.communicate(timeout=QUICK_RUN_HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"{what} ran over {QUICK_RUN_HANG_S} s: {((stdout or '') + (stderr or ''))[-5000:]}"
        ) from None
