"""Per-rank worker of tests/deepspeed/test_module_direct.py: several engines trained alternately in one process,
each loop calling either the wrapped module directly (``loss = engine.module(x, y)``, as programs training several
engines do: RLHF actor and critic, teacher and student) or the engine (``loss = engine(x, y)``), then
``engine.backward(loss)`` and ``engine.step()`` after every micro-batch. Started by ``run_local``; one launch runs
every scenario of a JSON list.

A scenario: ``name``, ``configs`` (one DeepSpeed config per engine), ``seeds`` (engine e is the toy model built with
seed ``seeds[e]`` and fed the micro-batches ``toy.micro_batch(rank, 1000 * seeds[e] + i)``: two engines of one seed
see the same model and data), ``call`` ("module", "engine", or "shared": the modules' losses summed and run
backward by torch, then each engine's ``_backward_epilogue()`` and ``step()``), ``steps`` (optimizer steps per engine), ``poison``
(steps whose first micro-batch has its loss multiplied by inf on rank 0, in every engine: a planted fp16 overflow,
which every rank sees). The engines take turns micro-batch by micro-batch.

Rank 0 saves per scenario and engine, after every optimizer step: the committed fp32 parameters and Adam moments
(``readback.full_state``, collectives), the reported gradient norm,
``engine.skipped_steps``, and the loss-scale attributes users read (``optimizer.loss_scaler``'s fields, read from the
object taken before training as DeepSpeed's own tests keep it, ``optimizer.dynamic_loss_scale``, ``cur_scale`` and
``loss_scale``); at the end the module's own parameters.
"""

from __future__ import annotations

import os

import deepspeed  # noqa: E402
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

import acco_ds  # noqa: E402,F401
from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu
from tests.ranks import rank_start, readback, toy  # noqa: E402

DYNAMIC_FIELDS = (
    "cur_scale",
    "loss_scale",
    "cur_iter",
    "last_overflow_iter",
    "cur_hysteresis",
    "scale_factor",
    "scale_window",
    "min_scale",
    "delayed_shift",
    "consecutive_hysteresis",
    "raise_error_at_min_scale",
    "dynamic",
)


def scaler_attributes(optimizer, held) -> dict:
    """What users' logging reads: ``held`` is ``optimizer.loss_scaler`` as taken before training."""
    out = {
        "dynamic_loss_scale": optimizer.dynamic_loss_scale,
        "cur_scale": float(optimizer.cur_scale),
        "loss_scale": float(optimizer.loss_scale),
        "is_dynamic_scaler": isinstance(held, DynamicLossScaler),
        "is_static_scaler": isinstance(held, LossScaler),
        "same_object": optimizer.loss_scaler is held,
    }
    fields = DYNAMIC_FIELDS if held.dynamic else ("cur_scale", "loss_scale", "dynamic")
    out.update({f"loss_scaler.{k}": getattr(held, k) for k in fields})
    return out


def committed(engine) -> dict:
    params = toy.trainable(engine.module)
    out = {"params": readback.full_state(engine, params)}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = readback.full_state(engine, params, key)
    norm = engine.get_global_grad_norm()
    out["norm"] = None if norm is None else float(norm)
    out["skipped_steps"] = int(engine.skipped_steps)
    return out


def shared_loss_micro_batch(engines, seeds, step: int, j: int, gas: int, rank: int) -> None:
    """One micro-batch of every engine under one loss, as programs training several models on a shared objective do
    (and DeepSpeed's own multiple-models test): the modules called directly, the sum of their losses run backward
    by torch (no ``engine.backward``), then each engine's backward epilogue and optimizer step."""
    losses = []
    for e, engine in enumerate(engines):
        x, y = toy.micro_batch(rank, 1000 * seeds[e] + step * gas + j)
        losses.append(engine.module(x.to(engine.device), y.to(engine.device)))
    sum(losses).backward()
    for engine in engines:
        engine._backward_epilogue()
    for engine in engines:
        engine.step()


def run_scenario(sc: dict, rank: int) -> dict:
    engines = []
    seeds = sc["seeds"]
    for cfg, seed in zip(sc["configs"], seeds):
        model = toy.build(seed=seed)
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        engines.append(engine)
    held = [engine.optimizer.loss_scaler for engine in engines]
    poison = set(sc.get("poison", []))
    gas = [cfg["gradient_accumulation_steps"] for cfg in sc["configs"]]
    steps = [[] for _ in engines]
    for step in range(sc["steps"]):
        for j in range(max(gas)):
            if sc["call"] == "shared":
                shared_loss_micro_batch(engines, seeds, step, j, gas[0], rank)
                continue
            for e, engine in enumerate(engines):
                if j >= gas[e]:
                    continue
                x, y = toy.micro_batch(rank, 1000 * seeds[e] + step * gas[e] + j)
                x, y = x.to(engine.device), y.to(engine.device)
                loss = engine.module(x, y) if sc["call"] == "module" else engine(x, y)
                if rank == 0 and j == 0 and step in poison:
                    loss = loss * float("inf")
                engine.backward(loss)
                engine.step()
        for e, engine in enumerate(engines):
            record = committed(engine)
            record.update(scaler_attributes(engine.optimizer, held[e]))
            steps[e].append(record)
    out = {"engines": []}
    for e, engine in enumerate(engines):
        opt = engine.optimizer
        if hasattr(opt, "pipeline"):
            opt.finish()
        out["engines"].append(
            {"steps": steps[e], "final_model": toy.flat(toy.trainable(engine.module)).cpu()}
        )
        if hasattr(opt, "pipeline"):
            opt.pipeline.close()
    return out


def main() -> None:
    args = rank_start.scenario_parser().parse_args()
    rank = rank_start.init_rank("gloo")
    allow_fp16_on_cpu()
    results = {sc["name"]: run_scenario(sc, rank) for sc in rank_start.load_scenarios(args.scenarios)}
    if rank == 0:
        torch.save(results, os.path.join(args.out, "results.pt"))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
