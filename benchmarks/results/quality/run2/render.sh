#!/usr/bin/env bash
# The command that rendered quality.md / quality.json from the per-run records in WORK (default: the folder the
# runs wrote, /work/qwork on the machine that ran them); OUT must be a new folder. Without --no-new-runs, and with an
# empty WORK, the same command computes every record itself (deterministic runs; a few hours on 2 cores).
#   bash benchmarks/results/quality/run2/render.sh [WORK] [OUT]
set -euo pipefail
WORK=${1:-/work/qwork}
OUT=${2:-benchmarks/results/quality/run2}
python -m benchmarks.quality \
  --settings base,lr_x0.5,lr_x0.75,lr_x1.5,lr_x2,warmup5,warmup50,gas2,gas8,gas8_mb4,mb16,ranks4,steps300,steps600,steps2000 \
  --setting-seeds base=0,1,2,3 --variants peek_lr_x1.5 \
  --setting-variants base=est_x0.5,est_x1.5,probe,peek_m0.5,peek_lr_x0.5,peek_lr_x1.5,commit_w0.5,split_q,curv_1e6,adaptive_1_0 \
  --setting-variants lr_x0.5=peek_lr_x1.5,split_q --setting-variants lr_x2=peek_lr_x1.5,split_q \
  --setting-variants warmup5=peek_lr_x1.5,split_q --setting-variants warmup50=peek_lr_x1.5,split_q \
  --setting-variants steps2000=peek_lr_x1.5,split_q \
  --no-new-runs --work "$WORK" --out "$OUT"
