"""``scripts/build_deepspeed_cpu_ops.py``, which the set-up runs in the background with a CPU-only torch: it loads
DeepSpeed's fused_adam and cpu_adam ops into ``TORCH_EXTENSIONS_DIR``, and they are the very builds the tests and the
main job load there afterwards (the same sources and flags: nothing is rebuilt). It runs here as the set-up runs it:
without the suite's start-up hook (which answers DeepSpeed's CPU probe from a cached file) on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPS = ("fused_adam", "cpu_adam")


def _setup_env() -> dict:
    hook = str(ROOT / "tests" / "ranks" / "cpu_hook")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != hook]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    for name in ("ACCO_DS_TEST_CPUINFO_CACHE", "ACCO_DS_TEST_NO_SHM_COMM"):
        env.pop(name, None)
    return env


def _built(folder: Path) -> dict:
    """{op: {file name: mtime}} of the ops' modules: a rebuild with other flags adds ``<op>_v1.so`` (torch's
    extension loader versions a build whose sources or flags changed), a rebuild in place changes the time."""
    return {
        op: {p.name: p.stat().st_mtime_ns for p in (folder / op).glob("*.so")}
        for op in OPS
        if (folder / op).is_dir()
    }


@pytest.mark.skipif(
    "TORCH_EXTENSIONS_DIR" not in os.environ, reason="the suite's TORCH_EXTENSIONS_DIR is not set"
)
def test_the_setup_builds_are_the_ones_the_tests_load():
    pytest.importorskip("deepspeed")
    folder = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    script = [sys.executable, str(ROOT / "scripts" / "build_deepspeed_cpu_ops.py")]
    r = subprocess.run(script, cwd=ROOT, env=_setup_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "FusedAdamBuilder ready" in r.stdout and "CPUAdamBuilder ready" in r.stdout, r.stdout
    built = _built(folder)
    assert set(built) == set(OPS) and all(built.values()), built
    # the suite's own processes (start-up hook on) load those builds as they are
    code = (
        "from deepspeed.accelerator import get_accelerator as g\n"
        "for n in ('FusedAdamBuilder', 'CPUAdamBuilder'): g().create_op_builder(n).load(verbose=False)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _built(folder) == built, "the suite rebuilt an op the set-up had built"
    # and the script again finds them built
    r = subprocess.run(script, cwd=ROOT, env=_setup_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and _built(folder) == built, r.stdout[-3000:] + r.stderr[-3000:]
