"""The soak run's options, shared by the driver (``benchmarks.soak.cli``) and its ranks
(``benchmarks.ranks.soak``, which the driver starts with the driver's own options plus ``--out``):
``parse(argv)`` returns them."""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESCRIPTION = (
    "Soak run: ACCO in adaptive accumulation for thousands of optimizer steps while the ranks' speeds "
    "keep changing, then check that no micro-batch was lost or counted twice and that memory stayed flat."
)


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=DESCRIPTION)
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps (commits) to reach")
    ap.add_argument(
        "--max-engine-steps", type=int, default=20000, help="stop there even if --steps is not reached"
    )
    ap.add_argument("--cap", type=int, default=4, help="max_micro_batches_per_round (null: 0)")
    ap.add_argument("--check-every", type=int, default=50, help="engine steps between two stop checks")
    ap.add_argument("--world", type=int, default=2, help="ranks")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch per rank")
    ap.add_argument("--small", action="store_true", help="a 2-layer d_model 64 context 64 model (tests)")
    ap.add_argument("--phase", type=int, default=50, help="steps between two changes of the ranks' speeds")
    ap.add_argument("--max-slow", type=float, default=2.0, help="largest slowdown factor drawn")
    ap.add_argument("--sample-every", type=int, default=10, help="steps between two RSS samples")
    ap.add_argument(
        "--warmup", type=float, default=0.2, help="fraction of the run before memory must be flat"
    )
    ap.add_argument("--rss-tol-mb", type=float, default=16.0, help="allowed peak-RSS growth after warm-up")
    ap.add_argument("--out", default=str(REPO / "acco_out" / "soak"), help="folder for soak.json")
    ap.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/soak/")
    ap.add_argument(
        "--from-json", default=None, help="re-check and re-render a soak.json of an earlier run beside it"
    )
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)
