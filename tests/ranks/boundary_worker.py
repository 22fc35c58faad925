"""Per-rank worker of tests/deepspeed/test_engine_boundary.py: loops that let the ENGINE end optimizer steps
(docs/ALGORITHM.md, "When the engine ends a step early"), on the toy model, started by the ``deepspeed``
launcher. One launch runs every scenario of a JSON list; each says its DeepSpeed config, ``sizes`` (the
micro-batches of each optimizer step, as the loop marks them) and ``style``, how the loop marks them:

- ``manual``: ``engine.set_gradient_accumulation_boundary(j == last)`` before every backward and
  ``engine.step()`` after the last (accelerate's and the HF Trainer's way);
- ``no_sync``: the flag set True before EVERY backward, all but the last backward inside ``engine.no_sync()``
  (no step may end there: the flag is ignored; acco's peek round still ends by count), then ``engine.step()``;
- ``coalesce``: the ``manual`` loop inside ``engine.coalesce_grad_reduction()`` (DeepSpeed's manual-boundary
  mode: the context's exit is the boundary), ``engine.step()`` after it;
- ``late``: the flag False for every backward, set True only before ``engine.step()`` (the optimizer's
  step ends the accumulation).

Rank 0 saves per scenario, after every step: the lr the step used, the committed fp32 parameters and Adam
moments (``readback.full_state``, collectives) and the reported
gradient norm; ``moved_before_boundary``: how many backwards that the engine did not mark as a boundary
changed the module's weights, in sync/dpu (acco's PEEK rounds change them mid-step by design, inside
``no_sync`` too). ``probe: true`` adds, after the steps: the keys of
``engine.optimizer.state`` and whether its moments are ACCO's own shards (or, for DeepSpeed's ZeRO-1, just
the keys), and a refused ``engine.step()`` (no backward since the last step) with the state before and
after it.
"""

from __future__ import annotations

import contextlib
import os

import deepspeed  # noqa: E402
import torch

import acco_ds  # noqa: E402,F401
from acco_ds.deepspeed.checkpoint import memory as memory_records
from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu
from tests.ranks import rank_start, readback, toy  # noqa: E402


def committed(engine, params) -> dict:
    return {
        "params": readback.full_state(engine, params),
        **{k: readback.full_state(engine, params, k) for k in ("exp_avg", "exp_avg_sq")},
    }


def one_step(engine, rank: int, first: int, size: int, style: str, watch: bool, params) -> int:
    """Run one optimizer step of ``size`` micro-batches marked the ``style`` way; returns how many backwards
    before the boundary changed the module's weights (counted only where ``watch``)."""
    moved = 0
    outer = engine.coalesce_grad_reduction() if style == "coalesce" else contextlib.nullcontext()
    with outer:
        for j in range(size):
            last = j == size - 1
            flag = {"manual": last, "coalesce": last, "no_sync": True, "late": False}[style]
            held = style == "no_sync" and not last
            before = toy.flat(params).clone() if watch and not last else None
            x, y = toy.micro_batch(rank, first + j)
            with engine.no_sync() if held else contextlib.nullcontext():
                loss = engine(x.to(engine.device), y.to(engine.device))
                engine.set_gradient_accumulation_boundary(flag)
                engine.backward(loss)
            if before is not None and not torch.equal(before, toy.flat(params)):
                moved += 1
    engine.set_gradient_accumulation_boundary(True)
    engine.step()
    return moved


def probe_state(engine) -> dict:
    """What ``engine.optimizer.state`` holds, per flat fp32 shard."""
    opt = engine.optimizer
    state = opt.state
    keys = [sorted(state[m].keys()) for m in opt.single_partition_of_fp32_groups]
    out = {"keys": keys, "step": [float(state[m]["step"]) for m in opt.single_partition_of_fp32_groups]}
    if hasattr(opt, "pipeline"):
        out["views"] = [
            state[b.master]["exp_avg"].data_ptr() == b.exp_avg.data_ptr()
            and state[b.master]["exp_avg_sq"].data_ptr() == b.exp_avg_sq.data_ptr()
            for b in opt.pipeline.groups
        ]
    return out


def refused_step(engine, params) -> dict:
    """``engine.step()`` at a boundary with no backward since the last step: the error and the state
    before and after (weights, committed state, counters, LR)."""
    opt = engine.optimizer

    def snapshot():
        pipe = opt.pipeline
        return {
            "module": toy.flat(params).clone(),
            "committed": committed(engine, params),
            "counts": (
                pipe.committed_steps,
                pipe.state_step,
                pipe.round_index,
                pipe.stats.micro_batches_local,
            ),
            "lr": float(engine.get_lr()[0]),
            "engine": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
        }

    before = snapshot()
    engine.set_gradient_accumulation_boundary(True)
    try:
        engine.step()
        error = None
    except RuntimeError as err:
        error = str(err)
    return {"error": error, "before": before, "after": snapshot()}


def run_scenario(sc: dict, rank: int) -> dict:
    model = toy.build()
    cfg = sc["config"]
    if cfg.get("fp16", {}).get("enabled"):
        allow_fp16_on_cpu()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    params = toy.trainable(engine.module)
    mode = cfg["optimizer"].get("params", {}).get("mode", "zero1")
    watch = mode in ("sync", "dpu", "zero1")
    lrs, steps, norms, moved, first = [], [], [], 0, 0
    for size in sc["sizes"]:
        lrs.append(float(engine.get_lr()[0]))
        moved += one_step(engine, rank, first, size, sc["style"], watch, params)
        first += size
        if sc.get("record_steps"):
            memory_records.record_step(engine, len(lrs), {"step": len(lrs)})
        steps.append(committed(engine, params))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    out = {"lrs": lrs, "steps": steps, "norms": norms, "moved_before_boundary": moved}
    if sc.get("probe"):
        out["state"] = probe_state(engine)
        if hasattr(engine.optimizer, "pipeline"):
            out["refused"] = refused_step(engine, params)
            one_step(engine, rank, first, 4, "manual", False, params)  # training goes on after the refusal
            out["after_refusal"] = committed(engine, params)
    if hasattr(engine.optimizer, "pipeline"):
        engine.optimizer.finish()
        out["final_norm"] = float(engine.optimizer.pipeline.last_grad_norm)
        out["stats"] = engine.optimizer.stats()
        out["overlap_notice"] = engine.optimizer.overlap_notice
        out["memory_notice"] = engine.optimizer.memory_notice
        engine.optimizer.pipeline.close()
    return out


def main() -> None:
    args = rank_start.scenario_parser().parse_args()
    rank = rank_start.init_rank("gloo")
    results = {sc["name"]: run_scenario(sc, rank) for sc in rank_start.load_scenarios(args.scenarios)}
    if rank == 0:
        torch.save(results, os.path.join(args.out, "results.pt"))


if __name__ == "__main__":
    main()
