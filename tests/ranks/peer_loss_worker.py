"""Per-rank worker for tests/reliability/test_peer_loss.py: trains the toy model with ACCO until
one rank (``--victim``) sends itself ``--signal`` (KILL: dies; STOP: freezes) right after the backward
of micro-batch ``--kill_at``, in the middle of a round. The other ranks must fail with an error
naming the lost rank within the configured ``comm_timeout_s``.

Until the signal the ranks go in lockstep: a barrier on the default group (DeepSpeed's, 30 min timeout)
before each micro-batch up to ``--kill_at``. On a loaded machine a rank that falls seconds behind the
others (start-up, a starved process) would otherwise time out a healthy round (``comm_timeout_s``)
before the signal, and the test would see that failure instead of the one it provokes. After the
signal nothing synchronises the survivors but ACCO's own collectives.

Started either directly (one process per rank, env:// variables RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT set by the test, as a multi-node launcher would) or by the ``deepspeed``
launcher. Prints ``ACCO_SIGNAL <unix time>`` (victim) and ``ACCO_FAILED <unix time> <type>`` (a
rank whose training raised) on stdout, then lets the exception end the process.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

import acco_ds  # noqa: E402,F401
from tests.ranks import rank_start, toy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--victim", type=int, required=True)
    ap.add_argument("--kill_at", type=int, required=True)
    ap.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    ap.add_argument("--mode", default="acco")
    ap.add_argument("--accumulation", default="fixed")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tag", default="", help="marks the test's processes (psutil looks for leftovers)")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    rank = rank_start.init_rank()
    gas = 4
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": "ACCO",
            "params": {
                "lr": 0.01,
                "mode": args.mode,
                "accumulation": args.accumulation,
                "comm_timeout_s": args.timeout,
            },
        },
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    model = toy.build()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    print(f"ACCO_READY {rank}", flush=True)
    index = 0
    try:
        for _ in range(args.steps):
            for _ in range(gas):
                if index <= args.kill_at:
                    dist.barrier()
                loss = engine(*toy.micro_batch(rank, index))
                engine.backward(loss)
                engine.step()
                if rank == args.victim and index == args.kill_at:
                    print(f"ACCO_SIGNAL {time.time():.3f}", flush=True)
                    os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))
                index += 1
        engine.optimizer.finish()  # collective: a rank done early (adaptive) waits for the others here
    except BaseException as err:
        print(f"ACCO_FAILED {time.time():.3f} {type(err).__name__}", flush=True)
        raise
    print(f"ACCO_FINISHED {rank}", flush=True)  # not reached by a survivor when the test passes


if __name__ == "__main__":
    main()
