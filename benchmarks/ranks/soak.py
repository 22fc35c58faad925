"""One rank of the soak run (``benchmarks.soak``), started by the DeepSpeed launcher:

    python -m deepspeed.launcher.launch --world_info=<W ranks> ... --module benchmarks.ranks.soak <the driver's options> --out DIR

Trains the soak's model with ACCO in adaptive accumulation (``worker``), its speed changed every
``--phase`` steps by real extra compute, until every rank has ``--steps`` commits; samples its RSS,
threads and open files; rank 0 writes every rank's counters, losses and samples to
``DIR/soak.json`` (what the driver checks and renders).
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import threading
import time
from pathlib import Path

from benchmarks.soak.options import parse


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _open_files() -> int:
    import psutil

    return psutil.Process().num_fds()


def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    import acco_ds  # noqa: F401
    from acco_ds.cli.slowdown import Spinner
    from acco_ds.core.snapshot import drain
    from acco_ds.data.batches import micro_batch
    from acco_ds.data.corpus import load_corpus
    from acco_ds.models.gpt import GPTConfig, TinyGPT

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gcfg = GPTConfig(n_layer=2, d_model=64, n_head=4, context=64) if args.small else GPTConfig()
    torch.manual_seed(0)
    model = TinyGPT(gcfg)
    gas = 2
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": "ACCO",
            "params": {
                "lr": 2e-3,
                "weight_decay": 0.1,
                "mode": "acco",
                "accumulation": "adaptive",
                "max_micro_batches_per_round": args.cap or None,
            },
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 2e-4,
                "warmup_max_lr": 2e-3,
                "warmup_num_steps": max(1, args.steps // 20),
                "total_num_steps": args.max_engine_steps,
            },
        },
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    data = load_corpus().train
    spinner = Spinner(0.0)
    rng = random.Random(1000 + rank)
    compute_s, computed = 0.0, 0
    factors, losses, samples = [], [], []
    threads0 = files0 = None
    index, max_round, shapes = 0, 0, {}
    t_start = time.perf_counter()
    step = 0
    while True:
        if step % args.phase == 0:
            factors.append(round(rng.uniform(1.0, args.max_slow), 3))
        step_loss = 0.0
        for _ in range(gas):
            x, y = micro_batch(data, gcfg.context, args.micro_batch, 0, rank, index)
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            compute_s += time.perf_counter() - t0
            computed += 1
            index += 1
            step_loss += float(loss.detach()) / gas
            spinner.extra_s = (factors[-1] - 1.0) * compute_s / computed
            spinner.spin()
        losses.append(step_loss)
        counts = tuple(engine.optimizer.pipeline.stats.last_round_counts)
        max_round = max(max_round, sum(counts))
        shapes[counts] = shapes.get(counts, 0) + 1
        if step == 0:
            threads0, files0 = threading.active_count(), _open_files()
        if step % args.sample_every == 0:
            samples.append((step, _rss_mb()))
        step += 1
        if step % args.check_every == 0 or step >= args.max_engine_steps:
            # stop together: when every rank has swapped in args.steps commits (a collective decision,
            # taken at the same engine step everywhere). In adaptive accumulation a rank may be one round
            # ahead and, at max_micro_batches_per_round, wait for a job its peer has not launched yet: a
            # collective of the script would then block both. drain() first makes the ranks agree on the
            # round count and finishes the job in flight (docs/RELIABILITY.md).
            drain(engine.optimizer.pipeline)
            done = torch.tensor([float(engine.optimizer.committed_steps)])
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item() >= args.steps or step >= args.max_engine_steps:
                break
    samples.append((step, _rss_mb()))
    wall = time.perf_counter() - t_start
    opt = engine.optimizer
    opt.finish()
    stats = opt.stats()
    mine = {
        "rank": rank,
        "stats": stats,
        "factors": factors,
        "losses": losses,
        "rss": samples,
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": [threads0, threading.active_count()],
        "open_files": [files0, _open_files()],
        "wall_s": wall,
        "spin_s": spinner.total_s,
        "compute_s": compute_s,
        "engine_skipped_steps": int(engine.skipped_steps),
        "global_steps": int(engine.global_steps),
        "max_round_global": max_round,
        "round_shapes": sorted([list(k), v] for k, v in shapes.items()),
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    opt.pipeline.close()
    if rank == 0:
        out = {
            "args": vars(args),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
            "versions": f"python {platform.python_version()}, torch {torch.__version__}, "
            f"deepspeed {deepspeed.__version__}",
            "model": gcfg.to_dict(),
            "params": sum(p.numel() for p in model.parameters()),
            "ranks": everyone,
        }
        Path(args.out, "soak.json").write_text(json.dumps(out))


def main(argv=None) -> int:
    worker(parse(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
