"""Run DeepSpeed's own unit tests of the engine's accumulation boundary, coalesced reduction, optimizer state and
universal checkpoints with ``"type": "ACCO", "mode": "sync"`` in place of their Adam optimizer (ZeRO stage 1),
beside the originals.

DeepSpeed's tests folder is not in its wheel: pass a DeepSpeed source tree (a clone of the DeepSpeed
repository; its ``tests/`` is read, never written). The tests are copied into a scratch folder; in the copies of
the selected tests' files every ``"type": "Adam"`` or ``"AdamW"`` optimizer config becomes ``"type": "ACCO"``
with ``"mode": "sync"`` in its params (added when the config has none; the ``torch_adam`` key, which ACCO does
not take, is dropped), and ``unit/common.py`` imports acco_ds (which registers the optimizer type in every rank
process). The installed DeepSpeed and torch are used. DeepSpeed pins pytest < 8.4 for its test harness: that
pytest is installed into the scratch folder (``pip --target``), not into the environment.

    python scripts/deepspeed_tests_with_acco.py --deepspeed-src ~/src/DeepSpeed [--only acco|adam] [--with-fp16]
        [-k TEXT ...]

The selection is ``TESTS``; ``--with-fp16`` adds ``FP16_TESTS`` (fp16 models), for an ACCO that takes them (one
that refuses an fp16 model fails them); ``-k TEXT`` keeps the selected tests whose
node id contains TEXT. Prints each variant's results, test count and duration; exit status 0 when every selected
test passed in every variant. Both variants of ``TESTS`` took 6.5 minutes on 2 shared CPU cores (the DeepSpeed
variant 4.3, ACCO's 2.2); a failing multi-rank test can add ACCO's ``comm_timeout_s`` (300 s): its other ranks wait
for the failed one until then.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the tests where ACCO must behave as ZeRO-1 + AdamW, at ZeRO stage 1 (pytest node ids). test_multiple_ctxts's
# dtype1/dtype2 are bf16/fp32 (its dtype0, fp16: see FP16_TESTS)
_NO_SYNC = "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::test_multiple_ctxts"
_COALESCE = "unit/v1/zero/test_zero_coalesce_grad_reduction.py"
# universal checkpoint round trip, fp32, optimizer state loaded, DeepSpeed's "Adam" config (not a client torch
# Adam): the inner optimizer's state_dict() gathered after the load must equal the one gathered at the save
_UNIVERSAL = "unit/checkpoint/test_universal_checkpoint.py::TestZeROUniversalCheckpointDP"
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
    *(f"{_UNIVERSAL}::test_dp_world_size_{w}[-1-True-False-1-dtype2]" for w in ("2to2", "4to2")),
    # several engines in one process, each called through engine.module(...) (the wrapped module directly), bf16
    *(
        f"unit/runtime/test_multiple_models.py::TestMultipleModels::test_bf16_optimizer[{shared}-{n}]"
        for shared in ("False", "True")
        for n in (1, 2, 3)
    ),
]
# fp16 tests, selected with --with-fp16 only, for an ACCO that takes fp16 models: TestSaveTensorClone builds its
# engine from a .half() model ("type": "AdamW", no "fp16" section, which DeepSpeed's ZeRO-1 accepts) and compares
# the clones of the module's state_dict() with the model's weights; an ACCO that refuses an fp16 model (an
# ACCOConfigError at deepspeed.initialize) fails them.
# test_multiple_ctxts[1-dtype0] (fp16) is in neither list: DeepSpeed's CPU accelerator refuses fp16 ("Type fp16 is
# not supported on your device") in the Adam variant already
_CLONE = "unit/checkpoint/test_zero_optimizer.py::TestSaveTensorClone::test_save_tensor_clone"
FP16_TESTS = [f"{_CLONE}[{cpu}-1]" for cpu in ("True", "False")]
# an optimizer config {"type": "Adam"|"AdamW" ...} in a test source, in either quote style: with a "params" dict
# right after the type, or nothing else before the dict closes
ADAM = re.compile(
    r"""["']type["']:\s*["']AdamW?["'](?P<params>,(?P<ws>\s*)["']params["']:\s*\{)?(?P<end>,?\s*\})?"""
)


def to_acco(source: str) -> str:
    """The test source with every Adam / AdamW optimizer config replaced by ACCO sync ("mode": "sync" first in its
    params; a config without params gets {"mode": "sync"}). Raises SystemExit when there is none, or one of
    another shape (keys between the type and its params) that this rewrite would get wrong."""

    def sub(m: re.Match) -> str:
        if m["params"]:
            ws = m["ws"]
            return f'"type": "ACCO",{ws}"params": {{{ws}    "mode": "sync",' + (m["end"] or "")
        if m["end"] is not None:
            return '"type": "ACCO", "params": {"mode": "sync"}' + m["end"]
        raise SystemExit(
            f"an Adam optimizer config of an unknown shape: {m.string[m.start() : m.start() + 120]!r}"
        )

    out, n = ADAM.subn(sub, source)
    if n == 0:
        raise SystemExit('no "type": "Adam" optimizer config found: the DeepSpeed tests changed shape')
    return re.sub(r'"torch_adam":\s*True,?', "", out)


def prepare(src: Path, dst: Path, acco: bool, tests: list[str]) -> None:
    shutil.copytree(src / "tests", dst / "tests")
    if acco:
        for rel in sorted({t.split("::")[0] for t in tests}):
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


def run_variant(src: Path, scratch: Path, acco: bool, pytest_path: Path, tests: list[str]) -> tuple[int, str]:
    work = scratch / ("acco" if acco else "adam")
    prepare(src, work, acco, tests)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pytest_path), str(REPO), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed's CPU accelerator counts its "devices" from LOCAL_SIZE: a test (or fixture) of more ranks skips;
    # 4 for the fixture of test_dp_world_size_4to2 (each rank process sets its own to its world size)
    env.setdefault("LOCAL_SIZE", "4")
    # DeepSpeed JIT-builds its CPU Adam: in the environment's own cache, as scripts/run_tests.sh does
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", "-rA", *tests]
    proc = subprocess.run(cmd, cwd=work / "tests", env=env, capture_output=True, text=True)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout).splitlines()  # DeepSpeed's conftest forces colour
    results = [ln for ln in out if re.match(r"(PASSED|FAILED|ERROR|SKIPPED) ", ln)]
    summary = [ln for ln in out if re.search(r"\d+ (passed|failed|error|skipped)", ln)]
    report = results + summary[-1:]
    if proc.returncode != 0:
        report.append(proc.stdout[-6000:] + proc.stderr[-2000:])
    return proc.returncode, "\n".join("  " + ln for ln in report)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--deepspeed-src", required=True, type=Path, help="a DeepSpeed source tree (with tests/)")
    ap.add_argument("--only", choices=("acco", "adam"), help="run one variant (default: both)")
    ap.add_argument(
        "--with-fp16",
        action="store_true",
        help="also run FP16_TESTS (fp16 models: for an ACCO that takes them)",
    )
    ap.add_argument(
        "-k",
        "--select",
        action="append",
        metavar="TEXT",
        help="run only the selected tests whose node id contains TEXT (repeatable: any of them)",
    )
    a = ap.parse_args(argv)
    tests = TESTS + (FP16_TESTS if a.with_fp16 else [])
    if a.select:
        tests = [t for t in tests if any(text in t for text in a.select)]
        if not tests:
            ap.error(f"--select {a.select}: no test of the selection matches")
    if not (a.deepspeed_src / "tests" / "unit" / "common.py").is_file():
        ap.error(
            f"--deepspeed-src {a.deepspeed_src}: no tests/unit/common.py there (a DeepSpeed source tree?)"
        )
    if not a.with_fp16:
        print(f"({len(FP16_TESTS)} fp16 tests left out: --with-fp16 runs them)", flush=True)
    status = 0
    with tempfile.TemporaryDirectory(prefix="ds_tests_") as tmp:
        scratch = Path(tmp)
        pytest_path = pytest_target(scratch)
        for acco in (False, True):
            if a.only and a.only != ("acco" if acco else "adam"):
                continue
            start = time.monotonic()
            rc, report = run_variant(a.deepspeed_src, scratch, acco, pytest_path, tests)
            took = time.monotonic() - start
            name = "ACCO sync" if acco else "DeepSpeed Adam"
            print(f"{name} ({len(tests)} tests, {took:.0f} s):\n{report}", flush=True)
            status |= rc
    return status


if __name__ == "__main__":
    sys.exit(main())
