"""``acco-train`` / ``python -m acco_ds.train``: the main job.

With no arguments: trains a small GPT-style byte-level decoder on the Python standard library
sources, once with ACCO and once with plain DeepSpeed ZeRO-1 AdamW, on 2 CPU ranks (gloo) or all
GPUs (NCCL), and writes per-step metrics (JSONL), a summary (JSON) and loss plots to
``./acco_out/<timestamp>``. ``acco-train --help`` lists the options; see docs/MAIN_JOB.md. Started by
torchrun (``torchrun ... -m acco_ds.train``), each process is one rank of one run instead
(``acco_ds.cli.in_launcher``; elastic restarts resume from the last save, docs/MULTINODE.md).
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    """Entry point; returns the process exit status (0 on success)."""
    from acco_ds.cli.args import parse
    from acco_ds.cli.job import run_job
    from acco_ds.cli.launch import LaunchError

    args = parse(argv)
    if args.in_launcher:  # torchrun started this process as one rank
        from acco_ds.cli.in_launcher import run_rank

        return run_rank(args)
    try:
        run_job(args)
    except LaunchError as err:
        print(f"acco-train: a run failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
