"""Comm-only probe of the e2e benchmark (one rank of it): the communication of one round, alone, on
the current link.

Launched like a training run (DeepSpeed launcher, W ranks, inside the throttled namespace):
``python -m deepspeed.launcher.launch --world_info=<W ranks> ... --module benchmarks.ranks.comm_probe --numel N
--dtype fp32 --out FILE``. Every round of every contender moves one full gradient (reduced) and one
full set of parameters (gathered), so T_comm of a round is measured as the time per call of
``--reps`` back-to-back calls (``benchmarks.harness.timing``: barrier to barrier, median of 3
windows, after a warm-up) of a gradient
reduction followed by a parameter all-gather of N elements in the communication dtype, with
torch.distributed on the default backend (gloo on CPU). Three gradient reductions are timed,
since implementations differ: the backend's reduce-scatter, all-reduce, and acco_ds's own
reduce-scatter (``acco_ds.core.round_job.reduce_scatter_inplace``: on gloo a direct point-to-point
exchange of the shards, the fewest bytes). Rank 0 writes ``{"rs_ag_s", "ar_ag_s", "p2p_ag_s",
"rs_s", "ar_s", "p2p_s", "ag_s", ...}`` (seconds per call) to ``--out``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks.harness.timing import probe_options, probe_round, write_on_rank0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--numel", type=int, required=True, help="elements of the flat gradient/parameters")
    probe_options(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", args.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    res = probe_round(args.numel, args.dtype, device, dist.group.WORLD, args.reps)
    write_on_rank0(dict(res, world=world), args.out)


if __name__ == "__main__":
    main()
