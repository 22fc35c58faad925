#!/usr/bin/env bash
# Builds .gpu_bundle/ (ignored by git): the wheels the lent GPU machine lacks, for its Python 3.12 (x86-64,
# no package index there). Run here, where pip reaches an index; the device call then names the folder in
# `carry` and scripts/gpu/checks.sh installs from it offline (pip --no-index --find-links .gpu_bundle).
#
#   - deepspeed 0.19.8, built into a wheel here (PyPI has only its sdist; the wheel is pure Python,
#     py3-none-any: DeepSpeed builds its CUDA ops just in time where they are used);
#   - what DeepSpeed and acco_ds need that the GPU image has not (the image's package list in the device
#     tool's KINDS.md has no pydantic, pydantic-core, annotated-types, typing-inspection, hjson), as CPython 3.12
#     manylinux x86_64 or pure-Python wheels;
#   - fallbacks for the rest of DeepSpeed's requirements (the list says the image has them; pip installs one of
#     these only where the image's copy is missing or too old, and keeps the image's otherwise).
#
# Writes .gpu_bundle/requirements.txt (what checks.sh installs) and .gpu_bundle/SHA256SUMS; prints the
# folder's size (it travels with the working tree: 64 MiB in all). Environment: PYTHON (default python3),
# BUNDLE_DIR (default .gpu_bundle). Safe to run again (the folder is rebuilt from scratch).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DIR=${BUNDLE_DIR:-.gpu_bundle}

DEEPSPEED=deepspeed==0.19.8
# Pinned to the versions this project is tested with here (pydantic 2.13.4 needs pydantic-core 2.46.4 exactly,
# typing-extensions >= 4.14.1, typing-inspection >= 0.4.2, annotated-types >= 0.6).
MISSING=(
  hjson==3.1.0
  pydantic==2.13.4
  pydantic-core==2.46.4
  annotated-types==0.7.0
  typing-inspection==0.4.2
)
FALLBACKS=(
  typing-extensions==4.16.0
  py-cpuinfo==9.0.0
  msgpack==1.2.4
  einops==0.8.2
  ninja==1.13.2
  psutil==7.2.2
  packaging==26.2
  tqdm==4.70.1
)

rm -rf "$DIR"
mkdir -p "$DIR"
echo "== deepspeed: wheel built here from the sdist"
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation "$DEEPSPEED" -w "$DIR"

echo "== wheels for CPython 3.12, manylinux x86_64 (or pure Python)"
platforms=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64; do
  platforms+=(--platform "$p")
done
for req in "${MISSING[@]}" "${FALLBACKS[@]}"; do
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${platforms[@]}" --platform any -d "$DIR" "$req"
done

printf '%s\n' "# installed by scripts/gpu/checks.sh: pip install --no-index --find-links $DIR -r this file" \
  "$DEEPSPEED" "${MISSING[@]}" >"$DIR/requirements.txt"
(cd "$DIR" && sha256sum ./*.whl >SHA256SUMS)
ls -l "$DIR"
echo "bundle: $(du -sh "$DIR" | cut -f1) in $DIR ($(ls "$DIR"/*.whl | wc -l) wheels)"
