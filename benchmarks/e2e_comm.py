"""Comm-only probe of bench_e2e: the communication of one round, alone, on the current link.

Launched like a training run (DeepSpeed launcher, W ranks, inside the throttled namespace):
``python -m deepspeed.launcher.runner --num_gpus W ... benchmarks/e2e_comm.py --numel N --dtype fp32
--out FILE``. Every round of every contender moves one full gradient (reduced) and one full set of
parameters (gathered), so T_comm of a round is measured as the time per call of ``--reps``
back-to-back calls (barrier to barrier, median of 3 windows, after a warm-up) of a gradient
reduction followed by a parameter all-gather of N elements in the communication dtype, with
torch.distributed on the default backend (gloo on CPU). Three gradient reductions are timed,
since implementations differ: the backend's reduce-scatter, all-reduce, and acco_ds's own
reduce-scatter (``acco_ds.core.round_job.reduce_scatter_inplace``: on gloo a direct point-to-point
exchange of the shards, the fewest bytes). Rank 0 writes ``{"rs_ag_s", "ar_ag_s", "p2p_ag_s",
"rs_s", "ar_s", "p2p_s", "ag_s", ...}`` (seconds per call) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def _timed(fn, reps: int) -> float:
    """Seconds per call of ``fn`` back to back, from a barrier to a barrier after ``reps`` calls
    (median of 3 such windows, after a warm-up). A send completes when the kernel has buffered
    the bytes, not when they crossed the link; timing a lone call would under-count them, timing
    a run of calls that ends with a barrier counts every byte."""
    fn()  # warm-up
    dist.barrier()
    windows = []
    for _ in range(3):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        dist.barrier()
        windows.append((time.perf_counter() - t) / reps)
    return statistics.median(windows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--numel", type=int, required=True, help="elements of the flat gradient/parameters")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    n = -(-args.numel // world) * world
    grad = torch.randn(n, dtype=dtype, device=device)
    shard = torch.empty(n // world, dtype=dtype, device=device)
    full = torch.empty(n, dtype=dtype, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def rs() -> None:
        dist.reduce_scatter_tensor(shard, grad)
        sync()

    def ar() -> None:
        dist.all_reduce(grad)
        sync()

    def p2p() -> None:
        from acco_ds.core.round_job import reduce_scatter_inplace

        reduce_scatter_inplace(grad, dist.group.WORLD)  # overwrites this rank's slice: fine for timing
        sync()

    def ag() -> None:
        dist.all_gather_into_tensor(full, shard)
        sync()

    res = {
        "numel": n,
        "dtype": args.dtype,
        "world": world,
        "bytes": n * grad.element_size(),
        "rs_s": _timed(rs, args.reps),
        "ar_s": _timed(ar, args.reps),
        "ag_s": _timed(ag, args.reps),
        "rs_ag_s": _timed(lambda: (rs(), ag()), args.reps),
        "ar_ag_s": _timed(lambda: (ar(), ag()), args.reps),
    }
    try:
        res["p2p_s"] = _timed(p2p, args.reps)
        res["p2p_ag_s"] = _timed(lambda: (p2p(), ag()), args.reps)
    except ImportError as err:  # an acco_ds without that function: the other two still stand
        res["p2p_error"] = str(err)
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=2)
    dist.barrier()


if __name__ == "__main__":
    main()
