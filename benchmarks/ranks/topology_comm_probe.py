"""Comm-only probe of the topology benchmark (one rank of it): one round's data-parallel communication
across the two nodes.

Launched like a contender (one DeepSpeed launcher per node, inside its namespace, W ranks in all):
``... --module benchmarks.ranks.topology_comm_probe --model JSON --tp T --dtype fp32 --reps 5 --out FILE``.
Each rank first builds the run's model with DeepSpeed AutoTP (``tensor_parallel.autotp_size`` T,
ZeRO-1, the contenders' engine) to count the parameters of its tensor-parallel slice: what its
data-parallel buffers hold and what one round moves. Then, on the data-parallel groups (ranks
j, j+T, ...: consecutive ranks form a tensor-parallel group, so each data-parallel group spans
the nodes), all groups at once as in training (they share the link), it times back to back,
barrier to barrier (``benchmarks.harness.timing``), a gradient reduction and a parameter all-gather of the
slice: the backend's reduce-scatter, all-reduce, and acco_ds's point-to-point reduce-scatter.
Rank 0 writes ``{"numel", "slice_numel" (per rank), "rs_ag_s", "ar_ag_s", "p2p_ag_s", "rs_s",
"ar_s", "p2p_s", "ag_s", ...}`` (seconds per call) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
import torch.distributed as dist

from benchmarks.harness.timing import probe_options, probe_round, write_on_rank0


def _slice_numel(model_cfg: dict, tp: int, world: int, dtype: str) -> int:
    """Parameters of this rank's slice of the model under AutoTP (the contenders' engine)."""
    import deepspeed

    from acco_ds.models import build_model

    torch.manual_seed(0)
    model = build_model(model_cfg)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": tp},
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return sum(p.numel() for p in engine.module.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="the run's model dict (acco_ds.models.build_model), JSON")
    ap.add_argument("--tp", type=int, required=True)
    probe_options(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed

    deepspeed.init_distributed(verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = _slice_numel(json.loads(args.model), args.tp, world, args.dtype)
    groups = [dist.new_group(list(range(j, world, args.tp))) for j in range(args.tp)]
    group = groups[rank % args.tp]
    res = probe_round(numel, args.dtype, torch.device("cpu"), group, args.reps)
    sizes = [None] * world
    dist.all_gather_object(sizes, numel)
    res.update(world=world, tp=args.tp, dp_world=world // args.tp, slice_numel=sizes)
    write_on_rank0(res, args.out)


if __name__ == "__main__":
    main()
