"""Run DeepSpeed's own unit tests of the engine's accumulation boundary, coalesced reduction and optimizer state
with ``"type": "ACCO", "mode": "sync"`` in place of their Adam optimizer (ZeRO stage 1), beside the originals.

DeepSpeed's tests folder is not in its wheel: pass a DeepSpeed source tree (a clone of the DeepSpeed
repository; its ``tests/`` is read, never written). The tests are copied into a scratch folder; in the copies
every ``"type": "Adam"`` optimizer becomes ``"type": "ACCO"`` with ``"mode": "sync"`` in its params (the
``torch_adam`` key, which ACCO does not take, is dropped), and ``unit/common.py`` imports acco_ds (which
registers the optimizer type in every rank process). The installed DeepSpeed and torch are used. DeepSpeed pins
pytest < 8.4 for its test harness: that pytest is installed into the scratch folder (``pip --target``), not
into the environment.

    python scripts/deepspeed_tests_with_acco.py --deepspeed-src ~/src/DeepSpeed [--only acco|adam]

Prints pytest's summary line per variant; exit status 0 when every selected test passed in every variant.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the tests where ACCO must behave as ZeRO-1 + AdamW, at ZeRO stage 1 (pytest node ids). test_multiple_ctxts's
# dtype1/dtype2 are bf16/fp32; its dtype0, fp16, is left out: ACCO refuses fp16 (no loss scaling) with an
# ACCOConfigError naming fp16.enabled (README, "Limits")
_NO_SYNC = "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::test_multiple_ctxts"
_COALESCE = "unit/v1/zero/test_zero_coalesce_grad_reduction.py"
TESTS = [
    *(f"{_NO_SYNC}[1-dtype{i}]" for i in (1, 2)),
    *(
        f"{_COALESCE}::TestCoalesceCombinations::test_multi_backward_bit_exact[{a}-{b}-1]"
        for a in ("False", "True")
        for b in ("False", "True")
    ),
    f"{_COALESCE}::TestCoalesceCorrectness::test_multi_step_no_state_leak[1]",
    f"{_COALESCE}::TestCoalesceCorrectness::test_gradient_clipping[1]",
    "unit/v1/zero/test_zero.py::TestZeroAdamOptimizerStepCount::test[1]",
]
REWRITTEN = sorted({t.split("::")[0] for t in TESTS})
ADAM = re.compile(r'"type": "Adam",(\s*)"params": \{')


def to_acco(source: str) -> str:
    """The test source with every Adam optimizer config replaced by ACCO sync."""
    out, n = ADAM.subn(r'"type": "ACCO",\1"params": {\1    "mode": "sync",', source)
    if n == 0:
        raise SystemExit('no "type": "Adam" optimizer config found: the DeepSpeed tests changed shape')
    return re.sub(r'"torch_adam":\s*True,?', "", out)


def prepare(src: Path, dst: Path, acco: bool) -> None:
    shutil.copytree(src / "tests", dst / "tests")
    if acco:
        for rel in REWRITTEN:
            path = dst / "tests" / rel
            path.write_text(to_acco(path.read_text()))
        common = dst / "tests" / "unit" / "common.py"
        common.write_text(
            "import acco_ds  # noqa: F401  (registers ACCO in every rank)\n" + common.read_text()
        )


def pytest_target(scratch: Path) -> Path:
    target = scratch / "pytest_lt_8_4"
    if not target.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target), "pytest<8.4"],
            check=True,
        )
    return target


def run_variant(src: Path, scratch: Path, acco: bool, pytest_path: Path) -> tuple[int, str]:
    work = scratch / ("acco" if acco else "adam")
    prepare(src, work, acco)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pytest_path), str(REPO), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed's CPU accelerator counts its "devices" from LOCAL_SIZE: without it the two-rank tests skip
    env.setdefault("LOCAL_SIZE", "2")
    # DeepSpeed JIT-builds its CPU Adam: in the environment's own cache, as scripts/run_tests.sh does
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", "-rA", *TESTS]
    proc = subprocess.run(cmd, cwd=work / "tests", env=env, capture_output=True, text=True)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout).splitlines()  # DeepSpeed's conftest forces colour
    results = [ln for ln in out if re.match(r"(PASSED|FAILED|ERROR|SKIPPED) ", ln)]
    summary = [ln for ln in out if re.search(r"\d+ (passed|failed|error|skipped)", ln)]
    report = results + summary[-1:]
    if proc.returncode != 0:
        report.append(proc.stdout[-6000:] + proc.stderr[-2000:])
    return proc.returncode, "\n".join("  " + ln for ln in report)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed-src", required=True, type=Path, help="a DeepSpeed source tree (with tests/)")
    ap.add_argument("--only", choices=("acco", "adam"), help="run one variant (default: both)")
    a = ap.parse_args(argv)
    if not (a.deepspeed_src / "tests" / "unit" / "common.py").is_file():
        ap.error(
            f"--deepspeed-src {a.deepspeed_src}: no tests/unit/common.py there (a DeepSpeed source tree?)"
        )
    status = 0
    with tempfile.TemporaryDirectory(prefix="ds_tests_") as tmp:
        scratch = Path(tmp)
        pytest_path = pytest_target(scratch)
        for acco in (False, True):
            if a.only and a.only != ("acco" if acco else "adam"):
                continue
            rc, report = run_variant(a.deepspeed_src, scratch, acco, pytest_path)
            print(("ACCO sync" if acco else "DeepSpeed Adam") + ":\n" + report, flush=True)
            status |= rc
    return status


if __name__ == "__main__":
    sys.exit(main())
