"""Per-rank worker of the checkpoint re-sharding and universal-checkpoint tests
(tests/checkpoint/test_reshard.py, tests/checkpoint/test_universal.py, runs in tests/ranks/ckpt_runs.py),
started by the ``deepspeed`` launcher on W ranks. It runs the jobs of the JSON list whose ``launch`` is
``--launch_index``, in order, on the toy model (``optimizer``: "ACCO" or DeepSpeed's own ZeRO-1 "AdamW").

``"kind": "save"``: a run of ``steps`` optimizer steps from the toy's seed 0 that saves a checkpoint
(``ckpt``/``tag``) after ``save_micro`` micro-batches and goes on to the end (saving does not perturb a
run, tests/checkpoint/test_resume.py). Records the committed state at the save (fp32 master, both moments,
step count), and after every step the committed parameters, both moments, the eval loss of the
committed model and, at each step start, the LR. Inside a step (``save_micro`` not a multiple of GAS)
it also exports the model with ``engine.save_16bit_model`` just before saving: the file must hold the
committed weights, not those the model computes at.

``"kind": "resume"``: a model built from another seed loads ``ckpt`` (``tag``, or the ``latest`` /
``latest_universal`` file; ``universal``: ``"checkpoint": {"load_universal": true}``), records the state
right after the load, then trains from micro-batch ``start_micro`` (a resume from the committed state
starts a new step there) until the engine has done ``steps`` steps, recording as above and ACCO's
counters; ``save_to`` [ckpt, tag]: then it saves there (recording the state at that save). The model is
built from seed 1 (``seed``: another one), so all it resumes with comes from the checkpoint.

Rank 0 writes ``<out>/launch<N>.pt``: every rank's ``{job name: record}``, in rank order.
"""

from __future__ import annotations

import argparse
import json
import os

import deepspeed  # noqa: E402
import torch

import acco_ds  # noqa: E402,F401
from acco_ds.core import snapshot  # noqa: E402
from tests.ranks import rank_start, readback, toy  # noqa: E402

EVAL_RANK, EVAL_BATCHES = 97, 4
LR, WD, CLIP = 0.02, 0.1, 0.5


def config(job: dict) -> dict:
    params = {"lr": LR, "weight_decay": WD}
    if job["optimizer"] == "ACCO":
        params.update(mode=job["mode"], accumulation=job.get("accumulation", "fixed"))
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": job["gas"],
        "optimizer": {"type": job["optimizer"], "params": params},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": LR / 4, "warmup_max_lr": LR, "warmup_num_steps": 5},
        },
        "zero_optimization": {"stage": 1},
        "gradient_clipping": CLIP,
        "bf16": {"enabled": job.get("dtype") == "bf16"},
        "steps_per_print": 10**9,
    }
    if job.get("universal"):
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def make_engine(job: dict, seed: int):
    model = toy.build(seed)
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=config(job), model_parameters=model.parameters()
    )
    return engine


def is_acco(engine) -> bool:
    return hasattr(engine.optimizer, "pipeline")


def step_count(engine) -> int:
    """The AdamW step count of the committed state (ACCO: the save's commit in flight included)."""
    if is_acco(engine):
        pipe = engine.optimizer.pipeline
        snapshot.drain(pipe)
        return pipe.state_step + snapshot.pending_applied_commits(pipe)
    base = engine.optimizer.optimizer  # DeepSpeed ZeRO-1's optimizer over the fp32 partition
    return int(base.state[base.param_groups[0]["params"][0]]["step"])


def state(engine) -> dict:
    """The committed fp32 master and both moments (``readback.full_state``: collectives), and the step count."""
    params = toy.trainable(engine.module)
    out = {"master": readback.full_state(engine, params)}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = readback.full_state(engine, params, key)
    out["step"] = step_count(engine)
    return out


def fast_state(engine) -> dict:
    """ACCO: the same values from its shards with one all-gather per key (the toy has one group)."""
    if not is_acco(engine):
        return state(engine)
    pipe = engine.optimizer.pipeline
    snapshot.drain(pipe)
    (b,) = pipe.groups
    out = {}
    for key, shard in (("master", b.master), ("exp_avg", b.exp_avg), ("exp_avg_sq", b.exp_avg_sq)):
        full = torch.empty(b.layout.padded_numel, dtype=torch.float32)
        torch.distributed.all_gather_into_tensor(
            full, shard.detach().cpu(), group=engine.optimizer.dp_process_group
        )
        out[key] = full[: b.layout.numel].clone()
    return out


_EVAL = [toy.micro_batch(EVAL_RANK, j) for j in range(EVAL_BATCHES)]


def eval_loss(master: torch.Tensor) -> float:
    """The mean loss of fixed held-out micro-batches at the committed weights (fp32)."""
    model = toy.build()
    off = 0
    with torch.no_grad():
        for p in toy.trainable(model):
            p.copy_(master[off : off + p.numel()].view_as(p))
            off += p.numel()
        return sum(float(model(x, y)) for x, y in _EVAL) / len(_EVAL)


def new_record() -> dict:
    return {"lrs": [], "traj": [], "exp_avg": [], "exp_avg_sq": [], "evals": []}


def feed(engine, rank: int, start: int, stop: int, gas: int, rec: dict, origin: int = 0) -> None:
    """Micro-batches [start, stop), steps starting at ``origin`` + a multiple of ``gas`` (see the module
    docstring for what is recorded)."""
    for i in range(start, stop):
        if (i - origin) % gas == 0:
            rec["lrs"].append(engine.get_lr()[0])
        loss = engine(*toy.micro_batch(rank, i))
        engine.backward(loss)
        engine.step()
        if (i + 1 - origin) % gas == 0:
            s = fast_state(engine)
            rec["traj"].append(s["master"])
            rec["exp_avg"].append(s["exp_avg"])
            rec["exp_avg_sq"].append(s["exp_avg_sq"])
            rec["evals"].append(eval_loss(s["master"]))


def export_16bit(engine, folder: str, rec: dict) -> None:
    engine.save_16bit_model(folder)  # every rank calls it; rank 0 writes the file
    torch.distributed.barrier()
    sd = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=False)
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    rec["export"] = toy.flat(sd[n] for n in names)
    rec["model_at_export"] = toy.flat(toy.trainable(engine.module))
    rec["export_dtype"] = str(sd[names[0]].dtype)


def close(engine, rec: dict) -> None:
    if is_acco(engine):
        engine.optimizer.finish()
        rec["stats"] = engine.optimizer.stats()
        engine.optimizer.pipeline.close()


def run_save(job: dict, rank: int, out: str) -> dict:
    gas = job["gas"]
    engine = make_engine(job, seed=0)
    rec = new_record()
    feed(engine, rank, 0, job["save_micro"], gas, rec)
    if job["save_micro"] % gas:
        export_16bit(engine, os.path.join(out, "export16", job["name"]), rec)
    rec["at_save"] = state(engine)
    engine.save_checkpoint(job["ckpt"], tag=job["tag"])
    feed(engine, rank, job["save_micro"], job["steps"] * gas, gas, rec)
    close(engine, rec)
    return rec


def run_resume(job: dict, rank: int) -> dict:
    gas = job["gas"]
    engine = make_engine(job, seed=job.get("seed", 1))  # seed 1: everything must come from the checkpoint
    path, client = engine.load_checkpoint(job["ckpt"], tag=job.get("tag"))
    assert path is not None, f"no checkpoint loaded from {job['ckpt']}"
    rec = new_record()
    rec["client_keys"] = sorted(client)
    rec["reload"] = state(engine)
    rec["global_steps"] = engine.global_steps
    if is_acco(engine):
        rec["stats_at_load"] = engine.optimizer.stats()
    start = job["start_micro"]
    feed(engine, rank, start, start + (job["steps"] - engine.global_steps) * gas, gas, rec, origin=start)
    if job.get("save_to"):
        rec["at_save"] = state(engine)
        engine.save_checkpoint(job["save_to"][0], tag=job["save_to"][1])
    close(engine, rec)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--launch_index", type=int, required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    rank = rank_start.init_rank()
    with open(args.jobs) as f:
        jobs = [j for j in json.load(f) if j["launch"] == args.launch_index]
    results = {}
    for job in jobs:
        results[job["name"]] = (
            run_save(job, rank, args.out) if job["kind"] == "save" else run_resume(job, rank)
        )
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, os.path.join(args.out, f"launch{args.launch_index}.pt"))


if __name__ == "__main__":
    main()
