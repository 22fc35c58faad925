#!/usr/bin/env bash
# All GPU checks of the kernels in one call, for a machine with a CUDA GPU (run from anywhere, after the
# environment is set up with a CUDA build of torch): prints versions and nvidia-smi, builds the extensions
# (CUDA forced), runs the GPU tests and the compile-only tests, then the kernel benchmark on the GPU.
# Results go to $OUT if set (else benchmarks/results/): gpu_checks.log, pytest_gpu.xml, kernels_cuda.md.
# Environment: PYTHON (default python3), BENCH_ARGS (extra arguments for bench_kernels.py, e.g. "--quick").
# Exit status: non-zero if the build, a test or the benchmark failed (all steps run regardless).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${OUT:-benchmarks/results}
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/gpu_checks.log") 2>&1

status=0
step() { echo; echo "=== $* ($(date -Is))"; }

step "versions"
"$PY" - <<'PYEOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch CUDA", torch.version.cuda)
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for mod in ("triton", "deepspeed", "pybind11"):
    try:
        print(mod, __import__(mod).__version__)
    except Exception as e:  # noqa: BLE001
        print(mod, "not importable:", e)
PYEOF
nvidia-smi || echo "nvidia-smi failed"
nvcc --version || echo "nvcc not on PATH (set CUDA_HOME or NVCC)"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no usable CUDA GPU for torch: nothing to check here" >&2
  exit 1
fi

step "build (ACCO_DS_BUILD_EXT=1 ACCO_DS_BUILD_CUDA=1)"
if ACCO_DS_BUILD_EXT=1 ACCO_DS_BUILD_CUDA=1 "$PY" setup.py build_ext --inplace; then
  "$PY" -c "from acco_ds.ops import _build as b; assert b.available('cuda'), b.why_missing('cuda'); print('CUDA extension loads')" || status=1
else
  echo "BUILD FAILED" >&2
  status=1
fi

step "GPU tests (kernels, ACCO pipeline on NCCL + side stream) + compile-only tests"
"$PY" -m pytest -q -rs --durations=10 --junitxml="$RESULTS/pytest_gpu.xml" \
  tests/test_ops_gpu.py tests/test_ops_cuda_compile.py tests/test_gpu_pipeline.py || status=1

step "kernel benchmark on the GPU"
# shellcheck disable=SC2086
"$PY" benchmarks/bench_kernels.py --device cuda --out-dir "$RESULTS" ${BENCH_ARGS:-} || status=1

step "done: status $status; results in $RESULTS"
ls -la "$RESULTS"
exit "$status"
