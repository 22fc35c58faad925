"""Adaptive accumulation with one slow rank (started as the deepspeed launcher starts ranks).

The model is linear, loss = <w, c>, so a micro-batch's gradient is its own vector c, whatever w
is: the gradient of every peek and commit can be rebuilt exactly from which micro-batches entered
which round on which rank. Rank 1 sleeps ``--slow-ms`` per micro-batch; the loop runs until
``--steps`` commits, as an adaptive training loop must. For each gradient clipping value of
``--clips`` (one engine each), and with ``--cap`` one more run whose fast rank blocks at its
``max_micro_batches_per_round`` (the drain at the end must not deadlock), rank 0 saves, for the test: every micro-batch's (rank, index, round)
and the parameters the model computed it at; every finished job's (kind, commit index, count, grad
norm); after every commit swapped in, every rank's shard of the fp32 master and both Adam moments;
and the stats of both ranks.
"""

from __future__ import annotations

import argparse
import os
import time

import deepspeed  # noqa: E402
import torch

import acco_ds  # noqa: E402,F401
from acco_ds.core.schedule import Job  # noqa: E402
from tests.ranks import rank_start  # noqa: E402

DIM = 37
LR, WD = 0.01, 0.01


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(DIM))

    def forward(self, c):
        return (self.w * c).sum()


def vector(rank: int, index: int) -> torch.Tensor:
    return torch.randn(DIM, generator=torch.Generator().manual_seed(1_000_003 * rank + index))


def spy_on_jobs(pipe, jobs: list, states: list) -> None:
    """Record every finished job and, after each commit is swapped in, this rank's state shards."""
    finish_in_flight = pipe._finish_in_flight

    def spy():
        result = finish_in_flight()
        if result is not None:
            jobs.append((result.job.value, result.commit_index, float(result.count), float(result.grad_norm)))
            if result.job is Job.COMMIT:
                b = pipe.groups[0]
                shard = b.layout.real_shard_range(pipe.rank)
                n = len(shard)
                states.append(
                    {
                        "commit": result.commit_index,
                        "start": shard.start,
                        **{
                            k: getattr(b, k)[:n].detach().clone() for k in ("master", "exp_avg", "exp_avg_sq")
                        },
                    }
                )
        return result

    pipe._finish_in_flight = spy


def run(args, rank: int, clip: float, cap: int | None = None) -> dict:
    params = {"lr": LR, "weight_decay": WD, "mode": args.mode, "accumulation": "adaptive"}
    if cap is not None:
        params["max_micro_batches_per_round"] = cap
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "ACCO", "params": params},
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    model = Linear()
    engine, opt, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    pipe = opt.pipeline
    jobs, states, micro = [], [], []
    spy_on_jobs(pipe, jobs, states)
    index = 0
    while opt.committed_steps < args.steps:
        if rank == 1:
            time.sleep(args.slow_ms / 1000)
        micro.append((rank, index, pipe.round_index, model.w.detach().clone()))
        loss = engine(vector(rank, index))
        engine.backward(loss)
        engine.step()
        index += 1
    opt.finish()
    world = torch.distributed.get_world_size()
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, {"micro": micro, "stats": opt.stats(), "states": states})
    opt.pipeline.close()
    return {"jobs": jobs, "ranks": gathered, "clip": clip, "cap": cap}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", default="acco")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--slow-ms", type=float, default=40.0)
    ap.add_argument("--clips", default="0.0", help="comma-separated gradient_clipping values, one run each")
    ap.add_argument("--cap", type=int, default=0, help="also one run with this max_micro_batches_per_round")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    rank = rank_start.init_rank()
    results = [run(args, rank, float(c)) for c in args.clips.split(",")]
    if args.cap:
        results.append(run(args, rank, 0.0, args.cap))
    if rank == 0:
        torch.save(results, os.path.join(args.out, "adaptive.pt"))


if __name__ == "__main__":
    main()
