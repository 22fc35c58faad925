"""Per-rank worker for the non-finite-gradient tests (tests/reliability/test_nonfinite.py), started by
the ``deepspeed`` launcher.

Each scenario of the JSON list trains the toy model with a DeepSpeed config for ``steps`` engine
steps and may:

- ``fault``: ``{"rank", "step", "micro", "kind"}``: on that rank, at micro-batch ``micro`` of engine
  step ``step``, make the gradient non-finite: ``"nan"`` multiplies the loss by NaN (every gradient
  element NaN), ``"inf"`` sets one element of one parameter's gradient to +Inf (a backward hook).
- ``skip_steps``: engine steps whose micro-batches are never fed (the data of those steps is left
  out, on every rank: "a run that never saw them"); ``restart_after``: after the engine step of this
  (0-based) index, call ``optimizer.finish()`` (drain, load theta; the pipeline restarts with a
  prologue), as the run that never saw the skipped step would have to.
- ``defer_host_reads``: read each job's host summary one job later, as the pipeline does on CUDA
  (the AdamW step count and LR of the next job are then decided on the device).

Rank 0 saves per step: the lr the step used, the committed fp32 parameters and Adam moments read
(``readback.full_state``), ``optimizer.overflow`` and ``engine.skipped_steps``; at the
end every rank's final model parameters and ACCO stats.
"""

from __future__ import annotations

import math
import os

import deepspeed  # noqa: E402
import torch

import acco_ds  # noqa: E402,F401
from tests.ranks import rank_start, readback, toy  # noqa: E402


def _inf_hook(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[grad.numel() // 2] = math.inf
    return grad


def run_scenario(sc: dict, rank: int) -> dict:
    cfg = sc["config"]
    gas = cfg["gradient_accumulation_steps"]
    model = toy.build()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    params = toy.trainable(engine.module)
    if sc.get("defer_host_reads"):
        engine.optimizer.pipeline.defer_host_reads = True
    fault = sc.get("fault")
    skip = set(sc.get("skip_steps", []))
    keys = ("lrs", "traj", "exp_avg", "exp_avg_sq", "overflow", "skipped_steps", "data_steps", "norms")
    out = {k: [] for k in keys}
    for data_step in range(sc["steps"]):
        if data_step in skip:
            continue
        out["lrs"].append(float(engine.get_lr()[0]))
        for j in range(gas):
            x, y = toy.micro_batch(rank, data_step * gas + j)
            hit = fault is not None and (fault["rank"], fault["step"], fault["micro"]) == (rank, data_step, j)
            handle = params[1].register_hook(_inf_hook) if hit and fault["kind"] == "inf" else None
            loss = engine(x, y)
            if hit and fault["kind"] == "nan":
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
            if handle is not None:
                handle.remove()
        out["overflow"].append(bool(engine.optimizer.overflow))
        out["skipped_steps"].append(int(engine.skipped_steps))
        norm = engine.get_global_grad_norm()
        out["norms"].append(None if norm is None else float(norm))
        out["data_steps"].append(data_step)
        out["traj"].append(readback.full_state(engine, params))
        for key in ("exp_avg", "exp_avg_sq"):
            out[key].append(readback.full_state(engine, params, key))
        if sc.get("restart_after") == data_step:
            engine.optimizer.finish()
    opt = engine.optimizer
    opt.finish()
    out["final_model"] = toy.flat(params)
    out["stats"] = opt.stats()
    out["engine_skipped_steps"] = int(engine.skipped_steps)
    opt.pipeline.close()
    return out


def main() -> None:
    args = rank_start.scenario_parser().parse_args()
    rank = rank_start.init_rank()
    results = {sc["name"]: run_scenario(sc, rank) for sc in rank_start.load_scenarios(args.scenarios)}
    rank_start.attach_per_rank(
        results, "per_rank", lambda r: {"final_model": r["final_model"], "stats": r["stats"]}
    )
    if rank == 0:
        torch.save(results, os.path.join(args.out, "results.pt"))


if __name__ == "__main__":
    main()
