#!/usr/bin/env bash
# Every GPU check of acco_ds in one call, on a machine with one CUDA GPU and no package index (the lent
# machine: Python 3.12, a CUDA build of torch, nvcc, Triton). docs/GPU.md explains the steps and the results.
#
#   here, first:  bash scripts/gpu_bundle.sh          (wheels the GPU machine lacks -> .gpu_bundle/, ignored)
#   there:        bash scripts/gpu_checks.sh          (the device tool's run, carry [".gpu_bundle"])
#
# Steps: the table STEPS below (name, limit in seconds, function), run in its order, each bounded in time (its
# limit and what is left of the total budget), each run whatever the previous ones did; the log says which
# failed and why. The order follows what the verdicts need: the set-up, then the kernel tests and the kernel
# benchmark (three of the five goals), the pipeline tests, the overlap benchmark, the stress tests last. The
# limits add up to at most the budget minus 30 s (tests/gpu/test_checks_script.py checks both); then the goals
# (scripts/gpu_goals.py) are written, unbounded but seconds.
#
# Results in $OUT (else $RESULTS_DIR, else /tmp/acco_ds_gpu_checks), at most 8 files: gpu_checks.log,
# summary.md (steps + goals), pytest_gpu.xml, kernels_cuda.md/.json, gpu_overlap.md/.json.
# Environment: PYTHON (default python3), BUNDLE_DIR (.gpu_bundle), GPU_CHECKS_BUDGET_S (total seconds,
# default 530: the device tool's 10-minute limit minus margin), ACCO_DS_CUDA_ARCHS (default: this GPU's),
# GPU_CHECKS_ONLY (the names of the steps to run, space-separated, in the table's order; default all: a rerun
# of some steps, e.g. "versions gpu bundle install build overlap", keeps the set-up steps they need), BENCH_KERNELS_ARGS (default "--sizes 1e7,1e8 --reps 9 --no-deepspeed": the goals judge sizes >= 10M; DeepSpeed's
# FusedAdam anchor is built just in time, about a minute), BENCH_OVERLAP_ARGS (default "--quick --steps 3 --factors
# 0,0.5,1,2").
# Exit status: 0 when every step passed, 3 without a usable GPU, 1 otherwise.
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${OUT:-${RESULTS_DIR:-/tmp/acco_ds_gpu_checks}}
BUNDLE=${BUNDLE_DIR:-.gpu_bundle}
BUDGET=${GPU_CHECKS_BUDGET_S:-530}

# run_step NAME LIMIT_S COMMAND...: runs COMMAND with at most min(LIMIT_S, time left) seconds (SIGINT first, so
# pytest still writes its report, then SIGKILL 20 s later, to the whole process group); records the result.
run_step() {
  local name=$1 limit=$2
  shift 2
  local now left
  now=$(date +%s)
  left=$((START + BUDGET - now - 25))
  if ((left < 15)); then
    echo "=== $name: SKIPPED (only ${left}s of the ${BUDGET}s budget left)"
    SUMMARY+=("| $name | skipped: out of time | 0 |")
    FAILED+=("$name")
    return 1
  fi
  if ((left < limit)); then limit=$left; fi
  echo
  echo "=== $name (limit ${limit}s, $(date -Is))"
  local t0=$SECONDS rc
  timeout -s INT -k 20 "$limit" bash "$SELF" --step "$@"  # a step: a function of this file or a command
  rc=$?
  local dt=$((SECONDS - t0)) result
  if ((rc == 0)); then
    result="ok"
  elif ((rc == 124 || rc == 137)); then
    result="TIMEOUT after ${limit}s"
  else
    result="FAILED (exit status $rc)"
  fi
  echo "=== $name: $result (${dt}s)"
  SUMMARY+=("| $name | $result | $dt |")
  if ((rc != 0)); then FAILED+=("$name"); fi
  return "$rc"
}

write_summary() {
  {
    echo "# GPU checks ($(date -Is))"
    echo
    printf '%s\n' "${SUMMARY[@]}"
    echo
    if [ -n "${1:-}" ]; then echo "$1"; echo; fi
    if [ -f "$WORK/goals.md" ]; then cat "$WORK/goals.md"; fi
  } >"$RESULTS/summary.md"
}

versions() {
  "$PY" - <<'PYEOF'
import importlib, os, platform, sys, sysconfig
print("python", sys.version.split()[0], sys.executable, "|", platform.platform())
inc = sysconfig.get_paths()["include"]
print("Python.h (the extensions' build needs it):", inc, "present" if os.path.exists(os.path.join(inc, "Python.h")) else "MISSING")
try:
    import torch
    print("torch", torch.__version__, "| torch CUDA", torch.version.cuda, "| cuda available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
              "| memory %.1f GiB" % (torch.cuda.get_device_properties(0).total_memory / 2**30))
except Exception as e:  # noqa: BLE001
    print("torch not importable:", e)
for mod in ("triton", "deepspeed", "pydantic", "hjson", "transformers", "pybind11", "ninja"):
    try:
        print(mod, getattr(importlib.import_module(mod), "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(mod, "not importable:", type(e).__name__, str(e)[:200])
PYEOF
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || echo "nvidia-smi failed"
  nvcc --version | tail -2 || echo "nvcc not on PATH (set CUDA_HOME or NVCC)"
  # the host launches every kernel: its CPU, the cores this job may use and what else runs there
  grep -m1 "model name" /proc/cpuinfo
  echo "usable cores $(nproc), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  top -bn1 -o %CPU 2>/dev/null | sed -n '7,12p'
}

gpu_present() {
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)"
}

bundle_install() {
  if "$PY" - <<'PYEOF'
import sys
try:
    import deepspeed, hjson, pydantic  # noqa: F401
except Exception as e:  # noqa: BLE001
    print("not installed yet:", type(e).__name__, e)
    sys.exit(1)
sys.exit(0 if deepspeed.__version__ == "0.19.8" else 1)
PYEOF
  then
    echo "deepspeed 0.19.8, hjson, pydantic already installed: nothing to install"
    return 0
  fi
  if [ ! -f "$BUNDLE/requirements.txt" ]; then
    echo "no $BUNDLE/requirements.txt: run 'bash scripts/gpu_bundle.sh' on the development machine and name" \
      "$BUNDLE in the device call's carry" >&2
    return 1
  fi
  "$PY" -m pip install --no-index --find-links "$BUNDLE" --no-warn-script-location -r "$BUNDLE/requirements.txt" &&
    "$PY" -c "import deepspeed, pydantic; print('deepspeed', deepspeed.__version__, 'pydantic', pydantic.VERSION)"
}

build() {
  local archs=${ACCO_DS_CUDA_ARCHS:-$("$PY" -c "import torch; print(''.join(map(str, torch.cuda.get_device_capability())))")}
  echo "ACCO_DS_CUDA_ARCHS=$archs"
  ACCO_DS_BUILD_EXT=1 ACCO_DS_BUILD_CUDA=1 ACCO_DS_CUDA_ARCHS=$archs "$PY" setup.py build_ext --inplace &&
    "$PY" - <<'PYEOF'
from acco_ds.ops import _build
for kind in ("cpu", "cuda"):
    assert _build.available(kind), f"{kind} extension: {_build.why_missing(kind)}"
mod = _build.load("cuda")
print("CUDA extension loads: driver/runtime", mod.cuda_versions()[:2], "| CPU ISA", _build.load("cpu").ISA)
PYEOF
}

pytest_step() {  # pytest_step SUITE FILE...
  local suite=$1
  shift
  "$PY" -m pytest -q -rs --durations=5 -p no:cacheprovider -o junit_suite_name="$suite" \
    --junitxml="$ACCO_GPU_CHECKS_WORK/junit_$suite.xml" "$@"
}

step_install() {
  env ACCO_DS_BUILD_EXT=0 "$PY" -m pip install --no-index --no-deps --no-build-isolation --no-warn-script-location -e .
}
step_kernels() { pytest_step kernels tests/gpu/test_kernels_gpu.py tests/gpu/test_quantize_gpu.py tests/gpu/test_norm_gpu.py tests/gpu/test_adamw_difference_gpu.py; }
step_fused_sum() { pytest_step fused_sum tests/gpu/test_quantized_sum_step_gpu.py; }
step_fold_quantize() { pytest_step fold_quantize tests/gpu/test_fold_quantize_gpu.py; }
step_pipeline() { pytest_step pipeline tests/gpu/test_pipeline_gpu.py; }
step_stress() { pytest_step stress tests/gpu/test_stress_gpu.py; }
step_bench_kernels() {
  # shellcheck disable=SC2086
  "$PY" -m benchmarks.kernels --device cuda --out-dir "$RESULTS" ${BENCH_KERNELS_ARGS:---sizes 1e7,1e8 --reps 9 --no-deepspeed}
}
step_overlap() {
  # shellcheck disable=SC2086
  "$PY" -m benchmarks.gpu_overlap --out "$RESULTS" ${BENCH_OVERLAP_ARGS:---quick --steps 3 --factors 0,0.5,1,2}
}

# name limit_s function: the run order (see the header); the limits add up to at most the budget minus 30 s.
# Measured on the second H100 run (2026-11-28): versions 11 s, gpu 6, bundle 12, install 4, build 22, kernels 70,
# bench_kernels 13, pipeline 62, overlap 44; stress three launches of the toy scenarios of about 35 s each (the
# third was cut at 100 s). The fourth (H200): kernels 120+ (cut), pipeline 57, overlap 45, stress 108; fused_sum
# (the Triton passes that read the quantized chunks, about 25 compilations) has not run yet, nor has fold_quantize
# (the fused round end's fold + quantize kernels against the CPU reference, 10M elements; about 9 compilations),
# whose 20 s were taken from stress (the last, optional step, already cut at 90 s).
STEPS=(
  "versions 15 versions"
  "gpu 10 gpu_present"
  "bundle 15 bundle_install"
  "install 10 step_install"
  "build 30 build"
  "kernels 155 step_kernels"
  "fused_sum 30 step_fused_sum"
  "fold_quantize 20 step_fold_quantize"
  "bench_kernels 25 step_bench_kernels"
  "pipeline 70 step_pipeline"
  "overlap 50 step_overlap"
  "stress 70 step_stress"
)

if [ "${1:-}" = "--step" ]; then  # run_step's child: one step, in its own time limit
  shift
  "$@"
  exit $?
fi

main() {
  START=$(date +%s)
  WORK=$(mktemp -d /tmp/acco_gpu_checks.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
  export ACCO_GPU_CHECKS_WORK=$WORK
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
  SUMMARY=("| step | result | seconds |" "|---|---|---:|")
  FAILED=()
  echo "acco_ds GPU checks: results in $RESULTS, budget ${BUDGET}s, git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  local entry name limit fn
  for entry in "${STEPS[@]}"; do
    read -r name limit fn <<<"$entry"
    if [ -n "${GPU_CHECKS_ONLY:-}" ] && [[ " $GPU_CHECKS_ONLY " != *" $name "* ]]; then
      SUMMARY+=("| $name | not selected (GPU_CHECKS_ONLY) | 0 |")
      continue
    fi
    if ! run_step "$name" "$limit" "$fn" && [ "$name" = gpu ]; then
      why="no usable CUDA GPU: torch.cuda.is_available() is False or no device (see versions above); nothing was checked"
      echo "$why" >&2
      write_summary "$why"
      return 3
    fi
  done

  "$PY" scripts/gpu_goals.py merge-junit "$RESULTS/pytest_gpu.xml" "$WORK"/junit_*.xml
  "$PY" scripts/gpu_goals.py goals "$RESULTS" >"$WORK/goals.md" && cat "$WORK/goals.md"
  if ((${#FAILED[@]})); then
    write_summary "FAILED: ${FAILED[*]}"
    echo "=== done in $((SECONDS))s: FAILED: ${FAILED[*]}"
    ls -la "$RESULTS"
    return 1
  fi
  write_summary "all steps passed"
  echo "=== done in $((SECONDS))s: all steps passed"
  ls -la "$RESULTS"
  return 0
}

mkdir -p "$RESULTS"
# The log through a plain pipeline, not a process substitution: bash waits for tee, so the last lines are
# written before the script exits.
main 2>&1 | tee "$RESULTS/gpu_checks.log"
exit "${PIPESTATUS[0]}"
