"""``acco-train`` started by torchrun (its elastic agent included): every process is one rank of one run.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 8 --max-restarts 3 \
        --rdzv-backend c10d --rdzv-endpoint nodeA:29400 --rdzv-id job1 \
        -m acco_ds.train --mode acco --save-every 50 --out /shared/run

Contract: ``started_by_torchrun()`` is True inside a process torchrun started (``TORCHELASTIC_RUN_ID`` set).
``run_rank(args)`` builds the run's spec from the options (the same on every rank, the world size the
launcher's), trains this rank (``acco_ds.cli.worker.run``): resuming from the last complete save in the
checkpoint folder when there is one, at the world size of this start, and saving every ``--save-every``
steps. When a node is lost, the ranks that are left fail their round (a lost peer), exit, and the agents
restart them at the new world size: the restarted ranks resume from the last save. Rank 0 appends one line
per completed start to the run folder's ``starts.jsonl`` (world size, resume step, first step's time, val
loss, the engine's skipped steps and the loss scale (fp16; None otherwise), save times, checkpoint bytes, training
seconds and CPU seconds (also by thread name, ``cli.thread_cpu``, and the training thread's in the evaluations),
rank 0's bytes sent by its rounds and by its memory_state copies, its seconds in each of ``PHASE_KEYS``) and warns when torchrun shares its rendezvous store with the workers (``SHARED_STORE_WARNING``).
Returns 0.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from acco_ds.core.overlap import JOB_PHASES

# where rank 0's time went (the optimizer's stats, core.pipeline.PipelineStats): the training thread's waits for the
# round jobs, its own work in the round ends, and the jobs' phases
PHASE_KEYS = ("comm_wait_s", "round_end_host_s", *JOB_PHASES)

SHARED_STORE_WARNING = (
    "acco-train: torchrun hands the workers its rendezvous store, the same one after every restart: a restart "
    "that keeps two or more nodes then reads the dead round's gloo addresses from it and fails to connect "
    "(connectFullMesh: connection refused). Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its "
    "environment on every node (docs/MULTINODE.md, 'When a node dies')."
)


def started_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def run_rank(a) -> int:
    from acco_ds.cli.job import _model_cfg, _num_params, make_spec, plan_runs
    from acco_ds.cli.worker import run

    model_cfg = _model_cfg(a)
    runs = plan_runs(a, model_cfg, _num_params(model_cfg))
    label, mode, acc, cfg = runs[0]
    run_dir = Path(a.out) / "runs" / label
    spec = make_spec(a, label, mode, acc, cfg, model_cfg, run_dir)
    if a.save_every and not a.checkpoint_dir:
        spec.checkpoint_dir = str(Path(a.out) / "checkpoints")
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        spec.save()
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            print(SHARED_STORE_WARNING, file=sys.stderr, flush=True)
    summary = run(spec)
    if rank == 0:
        starts = run_dir / "starts.jsonl"
        with open(starts, "a") as f:  # one line per start of the ranks (restarts included)
            f.write(
                json.dumps(
                    {
                        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                        "world": summary["world"],
                        "resumed_at_step": summary["resumed_at_step"],
                        "steps": summary["steps"],
                        "val_loss": summary["val_loss"],
                        "skipped_steps": summary["skipped_steps"],
                        "loss_scale": summary["loss_scale"],
                        "save_s": summary["save_s"],
                        "checkpoint_bytes": summary["checkpoint_bytes"],
                        "first_step_unix": summary["first_step_unix"],
                        "train_s": summary["train_s"],
                        "train_cpu_s": summary["train_cpu_s"],
                        "thread_cpu_s": summary["thread_cpu_s"],
                        "eval_cpu_s": summary["eval_cpu_s"],
                        "peer_copy_bytes_sent": summary["stats"].get("peer_copy_bytes_sent"),
                        "memory_state_s": {
                            k: v
                            for k, v in summary["stats"].items()
                            if k.startswith(("memory_", "peer_copy_")) and "_bytes_" not in k
                        },
                        "bytes_sent": summary["stats"].get("bytes_sent"),
                        "phases_s": {k: summary["stats"].get(k) for k in PHASE_KEYS},
                    }
                )
                + "\n"
            )
    return 0
