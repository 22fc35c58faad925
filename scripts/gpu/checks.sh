#!/usr/bin/env bash
# Every GPU check of acco_ds in one call, on a machine with one CUDA GPU and no package index (the lent
# machine: Python 3.12, a CUDA build of torch, nvcc, Triton). docs/GPU.md explains the steps and the results.
#
#   here, first:  bash scripts/gpu/bundle.sh          (wheels the GPU machine lacks -> .gpu_bundle/, ignored)
#   there:        bash scripts/gpu/checks.sh          (the device tool's run, carry [".gpu_bundle"], timeout_s 600)
#   here, after:  python scripts/gpu/results.py import FILES_AT/RUN   (the run's folder into benchmarks/results)
#
# Steps: scripts/gpu/steps.py's table (name, limit, function, group; each limit's basis is written there). First
# the freshness listing (scripts/gpu/freshness.py: each GPU-path source and GPU test, its last GPU pass, changed
# since or not), whose stale units also set the order: the set-up, then the units whose code changed since their
# last GPU pass, then the others. Each step runs in its own time limit, bounded by what is left of the budget; the
# steps of one group (the kernel tests) run at the same time. Every step runs whatever the previous ones did.
# Then the goals (scripts/gpu/goals.py: one verdict; a step that timed out, was skipped or is missing, or a test
# collected but not run, is NOT met).
#
# Results: one folder per run, RUN = <device>_<YYYY-MM-DD>_<short commit> (never an existing one: _2, _3, ...
# appended), in $OUT (else $RESULTS_DIR, else /tmp/acco_ds_gpu_checks): RUN/gpu_checks.log (written as it runs),
# RUN/summary.md (steps, freshness, goals, verdict) and RUN/details.tar.gz (run.json, steps.tsv, freshness.md,
# pytest_gpu.xml and each step's JUnit and collected node ids, kernels_cuda.md/.json, gpu_overlap.md/.json,
# offload.md/.json): three files, two folders down, as the device tool returns them (at most 8). A call stopped
# from outside leaves the log and the loose files.
# Environment: PYTHON (default python3), BUNDLE_DIR (.gpu_bundle), GPU_CHECKS_BUDGET_S (total seconds, default 540),
# ACCO_DS_CUDA_ARCHS (default: this GPU's), GPU_CHECKS_ONLY (names of the steps to run, space-separated; the others
# are "not selected" and the verdict is NOT met), GPU_CHECKS_ORDER=static (the table's order, not freshness's),
# GPU_CHECKS_SERIAL=1 (a group's steps one after another), BENCH_KERNELS_ARGS (default "--sizes 1e7,1e8 --reps 9
# --no-deepspeed": the goals judge sizes >= 10M; DeepSpeed's FusedAdam anchor is built just in time, about a
# minute), BENCH_OVERLAP_ARGS (default "--quick --steps 3 --factors 0,0.5,1,2"), BENCH_OFFLOAD_ARGS (more arguments of
# python -m benchmarks.offload; its deadline is the step's limit less 15 s). The offload steps (tests and benchmark)
# do not fit one call with the others (scripts/gpu/steps.py OWN_CALL): run them in a call of their own,
# GPU_CHECKS_ONLY="versions gpu bundle install build offload bench_offload".
# Exit status: 0 when every step passed and every goal is met, 3 without a usable GPU, 1 otherwise.
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
RESULTS_ROOT=${OUT:-${RESULTS_DIR:-/tmp/acco_ds_gpu_checks}}
BUNDLE=${BUNDLE_DIR:-.gpu_bundle}
BUDGET=${GPU_CHECKS_BUDGET_S:-540}
KILL_GRACE_S=10

# record NAME LIMIT RESULT RC SECONDS: one line of steps.tsv (RESULT: ok, failed, timeout, skipped, not_selected)
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$RUN_DIR/steps.tsv"; }

# run_step NAME LIMIT FUNCTION: FUNCTION with at most min(LIMIT, time left) seconds (SIGINT first, so pytest still
# writes its report, then SIGKILL KILL_GRACE_S later, to the whole process group); records the result.
run_step() {
  local name=$1 limit=$2 fn=$3
  local now left
  now=$(date +%s)
  left=$((START + BUDGET - now - 25))
  if ((left < 15)); then
    echo "=== $name: SKIPPED (only ${left}s of the ${BUDGET}s budget left)"
    record "$name" "$limit" skipped 0 0
    return 1
  fi
  if ((left < limit)); then limit=$left; fi
  echo
  echo "=== $name (limit ${limit}s, $(date -Is))"
  local t0=$SECONDS rc
  ACCO_GPU_STEP=$name ACCO_GPU_STEP_LIMIT_S=$limit timeout -s INT -k "$KILL_GRACE_S" "$limit" bash "$SELF" --step "$fn"
  rc=$?
  local dt=$((SECONDS - t0)) result word
  if ((rc == 0)); then
    result="ok" word=ok
  elif ((rc == 124 || rc == 137)); then
    result="TIMEOUT after ${limit}s" word=timeout
  else
    result="FAILED (exit status $rc)" word=failed
  fi
  echo "=== $name: $result (${dt}s)"
  record "$name" "$limit" "$word" "$rc" "$dt"
  return "$rc"
}

# run_group NAME...: the named steps at the same time, each with its own limit and log, the logs then in order.
run_group() {
  local entry name limit fn pids=()
  for entry in "$@"; do
    read -r name limit fn <<<"$entry"
    run_step "$name" "$limit" "$fn" >"$WORK/log_$name.txt" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  for entry in "$@"; do
    read -r name _ <<<"$entry"
    cat "$WORK/log_$name.txt"
  done
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
    echo "no $BUNDLE/requirements.txt: run 'bash scripts/gpu/bundle.sh' on the development machine and name" \
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

pytest_step() {  # pytest_step FILE...: the step's tests, its JUnit and its collected node ids
  local suite=$ACCO_GPU_STEP
  PYTHONPATH="$PWD/scripts/gpu${PYTHONPATH:+:$PYTHONPATH}" ACCO_GPU_COLLECTED="$RUN_DIR/collected_$suite.txt" \
    "$PY" -m pytest -q -rs --durations=5 -p no:cacheprovider -p collected -o junit_suite_name="$suite" \
    --junitxml="$RUN_DIR/junit_$suite.xml" "$@"
}

step_install() {
  env ACCO_DS_BUILD_EXT=0 "$PY" -m pip install --no-index --no-deps --no-build-isolation --no-warn-script-location -e .
}
step_kernels() { pytest_step tests/gpu/test_kernels_gpu.py; }
step_quantize() { pytest_step tests/gpu/test_quantize_gpu.py; }
step_norm() { pytest_step tests/gpu/test_norm_gpu.py; }
step_adamw_difference() { pytest_step tests/gpu/test_adamw_difference_gpu.py; }
step_fused_sum() { pytest_step tests/gpu/test_quantized_sum_step_gpu.py; }
step_fold_quantize() { pytest_step tests/gpu/test_fold_quantize_gpu.py; }
step_pipeline() { pytest_step tests/gpu/test_pipeline_gpu.py; }
step_stress() { pytest_step tests/gpu/test_stress_gpu.py; }
step_offload() { pytest_step tests/gpu/test_offload_gpu.py; }
step_bench_kernels() {
  # shellcheck disable=SC2086
  "$PY" -m benchmarks.kernels --device cuda --out-dir "$RUN_DIR" ${BENCH_KERNELS_ARGS:---sizes 1e7,1e8 --reps 9 --no-deepspeed}
}
step_overlap() {
  # shellcheck disable=SC2086
  "$PY" -m benchmarks.gpu_overlap --out "$RUN_DIR" ${BENCH_OVERLAP_ARGS:---quick --steps 3 --factors 0,0.5,1,2}
}
step_bench_offload() {  # DeepSpeedCPUAdam's JIT build (about a minute, the first time) is part of it
  local deadline=$((${ACCO_GPU_STEP_LIMIT_S:-300} - 15))
  # shellcheck disable=SC2086
  "$PY" -m benchmarks.offload --out "$RUN_DIR" --deadline-s "$deadline" ${BENCH_OFFLOAD_ARGS:-}
}

if [ "${1:-}" = "--step" ]; then  # run_step's child: one step, in its own time limit
  shift
  "$@"
  exit $?
fi

# The run's folder name: <device>_<YYYY-MM-DD>_<short commit>, letters, digits, '-', '_' only; never an existing one.
run_name() {
  local dev sha base name n=1
  dev=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  dev=$(echo "${dev:-nogpu}" | tr '[:upper:]' '[:lower:]' | sed -e 's/nvidia//g' -e 's/[^a-z0-9]\+/-/g' -e 's/^-//' -e 's/-$//')
  sha=$(git rev-parse --short=7 HEAD 2>/dev/null || echo nogit)
  base="${dev:-nogpu}_$(date -u +%F)_$sha"
  name=$base
  while [ -e "$RESULTS_ROOT/$name" ]; do n=$((n + 1)); name="${base}_$n"; done
  echo "$name"
}

write_summary() {  # write_summary VERDICT_LINE
  {
    echo "# GPU checks: $RUN_NAME ($(date -Is))"
    echo
    echo "| step | limit s | result | seconds |"
    echo "|---|---:|---|---:|"
    awk -F'\t' '{printf "| %s | %s | %s | %s |\n", $1, $2, $3, $5}' "$RUN_DIR/steps.tsv"
    echo
    echo "$1"
    echo
    if [ -f "$RUN_DIR/goals.md" ]; then cat "$RUN_DIR/goals.md"; echo; fi
    if [ -f "$RUN_DIR/freshness.md" ]; then echo "## Freshness at the start"; echo; cat "$RUN_DIR/freshness.md"; fi
  } >"$RUN_DIR/summary.md"
}

# pack: every file of the run but the log and summary.md into details.tar.gz (the device tool returns 8 files)
pack() {
  local files
  files=$(cd "$RUN_DIR" && ls | grep -v -x -e gpu_checks.log -e summary.md -e details.tar.gz)
  if [ -n "$files" ]; then
    # shellcheck disable=SC2086
    (cd "$RUN_DIR" && tar -czf details.tar.gz $files && rm -f $files)
  fi
}

main() {
  START=$(date +%s)
  WORK=$(mktemp -d /tmp/acco_gpu_checks.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
  export RUN_DIR RUN_NAME
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
  : >"$RUN_DIR/steps.tsv"
  echo "acco_ds GPU checks: $RUN_NAME in $RESULTS_ROOT, budget ${BUDGET}s, git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  "$PY" scripts/gpu/results.py manifest "$RUN_DIR" start "$BUDGET" || echo "run.json: not written"

  # freshness: what changed since its last GPU pass (printed), and the units to run first
  local order_args=() stale=""
  if "$PY" scripts/gpu/freshness.py --markdown "$RUN_DIR/freshness.md" && cat "$RUN_DIR/freshness.md"; then
    stale=$("$PY" scripts/gpu/freshness.py --stale-units) || stale=""
  else
    echo "freshness: not available (no git history here?); the table's order"
  fi
  if [ "${GPU_CHECKS_ORDER:-}" != static ]; then read -r -a order_args <<<"$stale"; fi
  local table
  if ! table=$("$PY" scripts/gpu/steps.py table "${order_args[@]}"); then
    echo "scripts/gpu/steps.py table failed: nothing was run" >&2
    write_summary "NOT MET: the step table could not be read"
    return 1
  fi
  echo "run order: $(echo "$table" | awk '{printf "%s ", $1}')"

  local line name limit fn group pending=() pending_group=""
  flush_group() {
    if ((${#pending[@]})); then
      if [ "${GPU_CHECKS_SERIAL:-}" = 1 ] || ((${#pending[@]} == 1)); then
        local e n l f
        for e in "${pending[@]}"; do read -r n l f <<<"$e"; run_step "$n" "$l" "$f"; done
      else
        run_group "${pending[@]}"
      fi
    fi
    pending=()
    pending_group=""
  }
  while read -r name limit fn group; do
    if [ -n "${GPU_CHECKS_ONLY:-}" ] && [[ " $GPU_CHECKS_ONLY " != *" $name "* ]]; then
      record "$name" "$limit" not_selected 0 0
      continue
    fi
    if [ "$group" != - ] && [ "$group" = "$pending_group" ]; then
      pending+=("$name $limit $fn")
      continue
    fi
    flush_group
    if [ "$group" != - ]; then
      pending_group=$group
      pending+=("$name $limit $fn")
      continue
    fi
    if ! run_step "$name" "$limit" "$fn" && [ "$name" = gpu ]; then
      why="no usable CUDA GPU: torch.cuda.is_available() is False or no device (see versions above); nothing was checked"
      "$PY" scripts/gpu/results.py manifest "$RUN_DIR" end 3 || true
      write_summary "NOT MET: $why"
      pack
      echo "$why"
      return 3
    fi
  done <<<"$table"
  flush_group

  "$PY" scripts/gpu/goals.py merge-junit "$RUN_DIR/pytest_gpu.xml" "$RUN_DIR"/junit_*.xml
  local verdict rc
  "$PY" scripts/gpu/goals.py goals "$RUN_DIR" >"$RUN_DIR/goals.md"
  rc=$?
  cat "$RUN_DIR/goals.md"
  if ((rc == 0)); then verdict="ALL MET: every step passed, every collected test passed, every goal met"; else
    verdict="NOT MET (scripts/gpu/goals.py: see the goals below)"; fi
  "$PY" scripts/gpu/results.py manifest "$RUN_DIR" end "$rc" || true
  write_summary "$verdict"
  pack
  echo "=== done in $((SECONDS))s: $verdict"
  ls -la "$RUN_DIR"
  return $((rc == 0 ? 0 : 1))
}

RUN_NAME=$(run_name)
RUN_DIR="$RESULTS_ROOT/$RUN_NAME"
mkdir -p "$RUN_DIR"
# The log through a plain pipeline, not a process substitution: bash waits for tee, so the last lines are
# written before the script exits.
main 2>&1 | tee "$RUN_DIR/gpu_checks.log"
exit "${PIPESTATUS[0]}"
