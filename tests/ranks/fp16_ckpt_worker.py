"""Per-rank worker of tests/checkpoint/test_fp16_checkpoints.py: fp16 checkpoints, started as the deepspeed launcher
starts ranks (``--phase first|resume|other_world``, ``--ckpt`` folder, ``--out`` folder for rank 0's results).

``first`` (2 ranks), per mode (sync, dpu, acco; fp16 with planted overflows, so the loss scaler moves): run A
trains ``STEPS`` steps uninterrupted; run B trains ``save_micro`` micro-batches, saves (tag = the scenario's name)
and goes on to ``STEPS``. DeepSpeed's ZeRO-1 fp16 AdamW trains ``Z1_STEPS`` steps and saves tag "z1".
``resume`` (2 ranks, new processes): run C loads each tag and trains to ``STEPS``; ACCO sync loads "z1" (another
optimizer's checkpoint: its loss scaler goes on), trains ``Z1_STEPS`` steps and saves "acco_to_z1". ``back`` (2 ranks,
after ``ds_to_universal.py``): DeepSpeed's ZeRO-1 fp16 loads "acco_to_z1" and ACCO "z1" as universal checkpoints.
``other_world`` (1 rank): ACCO acco loads "z1" (saved on 2 ranks).
Each records, per step: the committed fp32 parameters, ``engine.optimizer.cur_scale`` and ``engine.skipped_steps``;
and the scaler states around each load (DeepSpeed's ``loss_scaler`` fields)."""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch

import acco_ds  # noqa: F401
from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu
from tests.ranks import rank_start, readback, toy

STEPS, GAS, Z1_STEPS = 8, 4, 3
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}
POISON = {(0, 2 * GAS + 1), (1, 5 * GAS + 3), (0, 6 * GAS + 0)}  # (rank, micro-batch): loss times inf


def config(optimizer: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "optimizer": optimizer,
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.005, "warmup_max_lr": 0.02, "warmup_num_steps": 5},
        },
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 0.5,
        "fp16": FP16,
        "steps_per_print": 10**9,
    }


def acco_config(mode: str) -> dict:
    return config({"type": "ACCO", "params": {"lr": 0.02, "weight_decay": 0.1, "mode": mode}})


ZERO1 = config({"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1}})
# the saves: at a boundary in every mode; inside a step in acco (its peek in flight, a micro-batch accumulated)
SAVES = {"sync": 4 * GAS, "dpu": 4 * GAS, "acco": 4 * GAS, "acco_inside": 4 * GAS + GAS // 2 + 1}


def engine_for(cfg: dict, seed: int = 0):
    model = toy.build(seed)
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def scaler_fields(engine) -> dict:
    """DeepSpeed's loss_scaler fields of what ``engine`` would save (ACCO: the object its checkpoint holds)."""
    opt = engine.optimizer
    if hasattr(opt, "pipeline"):
        from acco_ds.deepspeed.checkpoint.loss_scale import to_deepspeed

        s = to_deepspeed(opt.pipeline.scaler)
    else:
        s = opt.loss_scaler
    return {
        k: float(getattr(s, k)) for k in ("cur_scale", "cur_hysteresis", "cur_iter", "last_overflow_iter")
    }


def feed(engine, rank: int, start: int, stop: int, log: dict) -> None:
    for i in range(start, stop):
        loss = engine(*toy.micro_batch(rank, i))
        if (rank, i) in POISON:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        if (i + 1) % GAS == 0:
            log["traj"].append(readback.full_state(engine, toy.trainable(engine.module)))
            log["scales"].append(float(engine.optimizer.cur_scale))
            log["skipped"].append(int(engine.skipped_steps))


def new_log() -> dict:
    return {"traj": [], "scales": [], "skipped": []}


def close(engine, log: dict) -> dict:
    opt = engine.optimizer
    if hasattr(opt, "pipeline"):
        opt.finish()
        log["final"] = toy.flat(toy.trainable(engine.module)).cpu()
        log["final_scale"] = float(opt.cur_scale)
        opt.pipeline.close()
    return log


def first(rank: int, ckpt: str) -> dict:
    out = {}
    for name, save_micro in SAVES.items():
        mode = name.split("_")[0]
        a = engine_for(acco_config(mode))
        log = new_log()
        feed(a, rank, 0, STEPS * GAS, log)
        out[f"{name}/A"] = close(a, log)
        b = engine_for(acco_config(mode))
        log = new_log()
        feed(b, rank, 0, save_micro, log)
        b.save_checkpoint(ckpt, tag=name, client_state={"micro_steps": b.micro_steps})
        feed(b, rank, save_micro, STEPS * GAS, log)
        out[f"{name}/B"] = close(b, log)
    z = engine_for(ZERO1)
    log = new_log()
    feed(z, rank, 0, Z1_STEPS * GAS, log)
    z.save_checkpoint(ckpt, tag="z1")
    out["z1"] = {**log, "scaler": scaler_fields(z)}
    return out


def resume(rank: int, ckpt: str) -> dict:
    out = {}
    for name, save_micro in SAVES.items():
        c = engine_for(acco_config(name.split("_")[0]), seed=1)
        _, client = c.load_checkpoint(ckpt, tag=name)
        c.micro_steps = client["micro_steps"]
        log = new_log()
        feed(c, rank, save_micro, STEPS * GAS, log)
        out[f"{name}/C"] = close(c, log)
    s = engine_for(acco_config("sync"), seed=1)
    s.load_checkpoint(ckpt, tag="z1")
    loaded = scaler_fields(s)
    log = new_log()
    feed(s, rank, Z1_STEPS * GAS, 2 * Z1_STEPS * GAS, log)
    at_save = scaler_fields(s)
    s.save_checkpoint(ckpt, tag="acco_to_z1")
    out["sync_from_z1"] = {**close(s, log), "loaded": loaded, "at_save": at_save}
    return out


def back(rank: int, ckpt: str) -> dict:
    """Through DeepSpeed's universal checkpoints (``ds_to_universal.py`` between the launches): ZeRO-1 fp16 loads
    ACCO's "acco_to_z1", ACCO loads ZeRO-1's "z1"; both train on."""
    out = {}
    for name, cfg, tag in (
        ("z1_from_acco", ZERO1, "acco_to_z1"),
        ("acco_from_z1_universal", acco_config("acco"), "z1"),
    ):
        e = engine_for({**cfg, "checkpoint": {"load_universal": True}}, seed=1)
        e.load_checkpoint(ckpt, tag=f"{tag}_universal")
        log = new_log()
        loaded = scaler_fields(e)
        feed(e, rank, 0, 2 * GAS, log)
        out[name] = {**close(e, log), "loaded": loaded}
    return out


def other_world(rank: int, ckpt: str) -> dict:
    e = engine_for(acco_config("acco"), seed=1)
    e.load_checkpoint(ckpt, tag="z1")
    out = {"acco_w1_from_z1": {"loaded": scaler_fields(e)}}
    log = new_log()
    feed(e, rank, Z1_STEPS * GAS, (Z1_STEPS + 2) * GAS, log)
    out["acco_w1_from_z1"].update(close(e, log))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", required=True, choices=("first", "resume", "back", "other_world"))
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    allow_fp16_on_cpu()
    rank = rank_start.init_rank()
    phases = {"first": first, "resume": resume, "back": back, "other_world": other_world}
    results = phases[args.phase](rank, args.ckpt)
    if rank == 0:
        torch.save(results, os.path.join(args.out, f"{args.phase}.pt"))


if __name__ == "__main__":
    main()
