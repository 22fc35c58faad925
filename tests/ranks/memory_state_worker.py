"""Per-rank worker of tests/checkpoint/test_memory_state.py: resuming from the committed state kept in node memory
(``optimizer.params.memory_state``), started as DeepSpeed's per-node launcher starts ranks. Runs the jobs of the
JSON list whose ``launch`` is ``--launch_index``, in order, on the toy model.

``"kind": "train"``: from the toy's seed 0, as the first start of a run (restart count 0), ``save_step`` optimizer
steps, each recorded in memory once done (``memory.record_step``, what acco-train does every step), then a disk
checkpoint of the same step (client state ``{"acco_train_step": step}``), the committed state at that save, and
the run stops without ``finish()``: its record files stay, as a crashed process leaves them.

``"kind": "resume"``: as a restart (restart count 1) of the same run id, loads step ``save_step`` from
``"source"``: ``"memory"`` (``memory.newest_step`` then ``memory.resume``; the model built from seed 0, as the
restarted process builds it: frozen parameters are not recorded) or ``"disk"`` (the train job's checkpoint, into a
model built from seed 1; memory_state off); records the state right after the load, then trains ``more`` steps on
micro-batches numbered from the resumed step, recording after each the committed state, the LR, the loss scale
and the skipped steps.

``cuda_paths``: every engine of the job (train and both resumes) runs the paths only a GPU rank takes, on CPU
(``tests.ranks.worker.initialize``: the CUDA executor on emulated streams, each job's host summary read one job
late). fp16 jobs poison the loss of a few micro-batches (times inf), so the loss scaler moves before and after the
save.
``offload``: the optimizer state offloaded (``zero_optimization.offload_optimizer``, the host step's staged path
as a GPU rank runs it: ``ACCO_DS_HOST_STEP_STAGING=1`` for its engines).
``peer_copy_form``: the copies' form (default: the config's, the inputs); ``plant_mismatch``: every holder's first
step of a ward's inputs gives a state one bit off (the pair must switch to sending the state).
``node_size``: the ranks are on nodes of that many ranks (torchrun's ``GROUP_RANK``), so that each rank's records
are also copied to a rank on another node; a resume with ``expect_lost`` must find no complete state in memory
(the test removed a node and the holder of its copies) and loads the disk checkpoint instead.
``"kind": "kill"``: a reference run recording the committed state after every step, then the same run with
memory_state on, in which rank ``killer`` SIGKILLs itself ``kill_micro`` micro-batches after step ``save_step`` is
recorded (``run_kill``; the launch ends there).
Rank 0 writes ``<out>/launch<N>.pt``: every rank's ``{job name: record}``, in rank order.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch

import acco_ds  # noqa: F401
from acco_ds.core import peer_copies
from acco_ds.core.host_step import STAGING_ENV
from acco_ds.deepspeed.checkpoint import memory
from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu
from tests.ranks import rank_start, toy
from tests.ranks.ckpt_reshard_worker import fast_state
from tests.ranks.worker import initialize

LR, WD, CLIP = 0.02, 0.1, 0.5
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}


def config(job: dict, memory_on: bool) -> dict:
    params = {"lr": LR, "weight_decay": WD, "mode": job["mode"]}
    if job.get("compression"):
        params["compression"] = {"commit": "int8", **({"peek": "int8"} if job["mode"] == "acco" else {})}
    if memory_on:
        params["memory_state"] = {"enabled": True, "dir": job["dir"], "run_id": job["run_id"]}
        if job.get("peer_copy_form"):
            params["memory_state"]["peer_copy_form"] = job["peer_copy_form"]
    if job.get("comm_timeout_s"):
        params["comm_timeout_s"] = job["comm_timeout_s"]
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": job["gas"],
        "optimizer": {"type": "ACCO", "params": params},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": LR / 4, "warmup_max_lr": LR, "warmup_num_steps": 5},
        },
        "zero_optimization": {
            "stage": 1,
            **({"offload_optimizer": {"device": "cpu"}} if job.get("offload") else {}),
        },
        "gradient_clipping": CLIP,
        "bf16": {"enabled": job["dtype"] == "bf16"},
        "steps_per_print": 10**9,
    }
    if job["dtype"] == "fp16":
        cfg["fp16"] = FP16
    return cfg


def make_engine(job: dict, seed: int, memory_on: bool, restart: int):
    os.environ[memory.RESTART_COUNT] = str(restart)
    rank = torch.distributed.get_rank()
    os.environ["GROUP_RANK"] = str(rank // job["node_size"]) if job.get("node_size") else "0"
    os.environ[STAGING_ENV] = "1" if job.get("offload") else "0"
    model = toy.build(seed)
    return initialize(model, config(job, memory_on), bool(job.get("cuda_paths")))


def poisoned(job: dict, rank: int, i: int) -> bool:
    return job["dtype"] == "fp16" and (rank, i % 11) in {(0, 3), (1, 8)}


def micro(engine, job: dict, rank: int, i: int) -> None:
    loss = engine(*toy.micro_batch(rank, i))
    if poisoned(job, rank, i):
        loss = loss * float("inf")
    engine.backward(loss)
    engine.step()


def state(engine) -> dict:
    s = fast_state(engine)
    opt = engine.optimizer
    s["step"] = opt.pipeline.state_step
    s["lr"] = engine.get_lr()[0]
    s["scale"] = float(opt.cur_scale)
    s["skipped"] = int(engine.skipped_steps)
    s["global_steps"] = int(engine.global_steps)
    return s


def planted_mismatch():
    """``peer_copies.step_copy`` whose first call flips the last bit of the copy's first element: the holder's step
    of a ward's inputs then does not give the ward's state (what a host AdamW with other bits would do)."""
    real, calls = peer_copies.step_copy, []

    def step_copy(state, inputs, layout):
        real(state, inputs, layout)
        if not calls:
            state.view(torch.int32)[0] ^= 1
        calls.append(1)

    return step_copy


def run_train(job: dict, rank: int) -> dict:
    real_step_copy = peer_copies.step_copy
    if job.get("plant_mismatch"):
        peer_copies.step_copy = planted_mismatch()
    try:
        return _run_train(job, rank)
    finally:
        peer_copies.step_copy = real_step_copy


def _run_train(job: dict, rank: int) -> dict:
    engine = make_engine(job, seed=0, memory_on=True, restart=0)
    opt = engine.optimizer
    done, i, rounds = 0, 0, []
    while done < job["save_step"]:
        micro(engine, job, rank, i)
        i += 1
        if int(opt.committed_steps) > done:
            done = int(opt.committed_steps)
            memory.record_step(engine, done, {"acco_train_step": done})
            rounds.append(int(opt.stats()["rounds"]))
    rec = {"at_save": state(engine), "rounds": rounds}
    rec["executor"] = (type(opt.pipeline.executor).__name__, bool(opt.pipeline.defer_host_reads))
    engine.save_checkpoint(job["ckpt"], tag=f"step{done}", client_state={"acco_train_step": done})
    opt.pipeline.close()  # no finish(): the records stay as a crashed process leaves them
    # after close: the copies' thread has sent every step queued (while training it may be one commit behind)
    rec["copies"] = opt.pipeline.memory_state.stats()
    copies = opt.pipeline.memory_state.copies
    rec["copies_group_released"] = None if copies is None else copies.group is None
    return rec


def run_kill(job: dict, rank: int, out: str) -> dict:
    """The reference (memory_state off): the committed state after each step, drained, to ``<out>/<name>.ref.pt``;
    then the same run with memory_state on until step ``save_step`` is recorded, and ``kill_micro`` micro-batches
    later rank ``killer`` SIGKILLs itself (its peers fail their round and exit)."""
    ref = make_engine(job, seed=0, memory_on=False, restart=0)
    states, done, i = {}, 0, 0
    while done < job["save_step"] + 1:
        micro(ref, job, rank, i)
        i += 1
        if int(ref.optimizer.committed_steps) > done:
            done = int(ref.optimizer.committed_steps)
            states[done] = state(ref)
    ref.optimizer.finish()
    ref.optimizer.pipeline.close()
    if rank == 0:
        torch.save(states, os.path.join(out, f"{job['name'].replace('/', '_')}.ref.pt"))
    torch.distributed.barrier()
    engine = make_engine(job, seed=0, memory_on=True, restart=0)
    opt = engine.optimizer
    done, i, since = 0, 0, 0
    while True:
        micro(engine, job, rank, i)
        i += 1
        if int(opt.committed_steps) > done:
            done = int(opt.committed_steps)
            memory.record_step(engine, done, {"acco_train_step": done})
        if done >= job["save_step"]:
            if rank == job["killer"] and since == job["kill_micro"]:
                os.kill(os.getpid(), signal.SIGKILL)
            since += 1


def run_resume(job: dict, rank: int) -> dict:
    from_memory = job["source"] == "memory"
    # memory: the model as the restarted process builds it (the first start's seed: frozen parameters and buffers
    # are not recorded); disk: seed 1, everything comes from the checkpoint
    engine = make_engine(job, seed=0 if from_memory else 1, memory_on=from_memory, restart=1)
    lost = None
    if from_memory:
        found = memory.newest_step(engine)
        if job.get("expect_lost"):  # the fall back: the newest disk checkpoint
            assert found is None, (
                f"resumable from memory although rank(s) {job['expect_lost']} are lost: {found}"
            )
            lost = True
            _, client = engine.load_checkpoint(job["ckpt"], tag=f"step{job['save_step']}")
        else:
            assert found is not None, "nothing to resume from memory"
            client = memory.resume(engine, found)
    else:
        _, client = engine.load_checkpoint(job["ckpt"], tag=f"step{job['save_step']}")
    step = int(client["acco_train_step"])
    rec = {"client_step": step, "reload": state(engine), "traj": [], "fell_back": lost}
    ms = engine.optimizer.pipeline.memory_state
    rec["copies"] = None if ms is None else ms.stats()
    gas = job["gas"]
    for i in range(step * gas, (step + job["more"]) * gas):
        micro(engine, job, rank, 1000 + i)
        if (i + 1) % gas == 0:
            rec["traj"].append(state(engine))
    engine.optimizer.finish()
    rec["final"] = state(engine)
    engine.optimizer.pipeline.close()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--launch_index", type=int, required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    rank = rank_start.init_rank()
    allow_fp16_on_cpu()
    with open(args.jobs) as f:
        jobs = [j for j in json.load(f) if j["launch"] == args.launch_index]
    results = {}
    for job in jobs:
        if job["kind"] == "kill":
            run_kill(job, rank, args.out)
        results[job["name"]] = run_train(job, rank) if job["kind"] == "train" else run_resume(job, rank)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, os.path.join(args.out, f"launch{args.launch_index}.pt"))


if __name__ == "__main__":
    main()
