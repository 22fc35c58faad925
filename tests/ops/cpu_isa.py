"""Running a CPU kernel's check under one instruction-set variant of the compiled modules (csrc/common/cpu.h):
``ACCO_DS_CPU_ISA`` picks a variant below the CPU's best, and must be set before the module loads, so the check
runs in a fresh Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_under_isa(script: str, isa: str) -> None:
    """Runs ``script`` (Python source whose last printed word is the variant that ran) with ``ACCO_DS_CPU_ISA=isa``
    and the repository first on the path; fails with the output's tail unless it exits 0, and skips when this CPU
    does not run ``isa``."""
    env = {k: v for k, v in os.environ.items() if k != "ACCO_DS_CPU_ISA"}
    env["ACCO_DS_CPU_ISA"] = isa
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH", "")) if x)
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ran = r.stdout.split()[-1]
    if ran != isa:
        pytest.skip(f"this CPU does not run the {isa} variant (ran {ran})")
