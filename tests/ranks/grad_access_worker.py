"""Per-rank worker of tests/deepspeed/test_grad_accessors.py and tests/deepspeed/test_param_group_settings.py: the
toy model trained by DeepSpeed's ZeRO-1 AdamW (``"type": "AdamW"``) or by ACCO, the loop DeepSpeed documents
(``engine.backward(loss)``, ``engine.step()`` after every micro-batch). Also run in the test process itself
(one gloo rank) through :func:`run_scenario`.

A scenario (a dict, JSON in the launched runs) says ``optimizer`` (the config's section), ``bf16``, ``steps``,
``gas`` and what to do:

- ``groups``: None for one group of every parameter, else ``[[first, stop, {settings}], ...]``: parameters
  ``first .. stop-1`` of ``toy.trainable`` with those AdamW settings (lr, betas, weight_decay), given to
  ``deepspeed.initialize(model_parameters=...)``; with ``lr_decay`` a LambdaLR (lr / (1 + step)) of each group's
  own lr is the engine's scheduler, else DeepSpeed's WarmupLR from the config;
- ``edits``: ``{step: kind}``, what the loop does to the step's gradient between the boundary's
  ``engine.backward`` and ``engine.step()``: ``"mask"`` (every parameter's gradient times a fixed 0/1/2/-1
  pattern, ``safe_set_full_grad``), ``"vectorized"`` (the same through ``safe_update_full_grad_vectorized``),
  ``"nan"`` (one element of the first parameter NaN: the step must be skipped);
- ``probe_modes``: after every backward, ``safe_get_full_grad``'s error (None where it read) and, where it
  raised, ``safe_set_full_grad``'s;
- ``bf16_extra``: more keys of the ``bf16`` section (``check_grad_overflow``).

What comes back, per step: ``grads`` (every parameter's ``safe_get_full_grad`` at the boundary, before any edit,
flat fp32), ``edited`` (the same after the step's edit), ``local`` (the same after the step's first backward
when the step has more than one: this rank's sum so far), ``after`` (the error ``safe_get_full_grad`` raises
after ``engine.step()``; ACCO, or ZeRO-1 on one rank), the committed fp32 parameters and Adam moments
(:func:`committed`), each group's lr before and after the step,
the engine's ``skipped_steps`` and ``global_steps``; ``local_grad_error``: what ``safe_get_local_grad`` raises.
"""

from __future__ import annotations

import json

import deepspeed
import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_local_grad,
    safe_set_full_grad,
    safe_update_full_grad_vectorized,
)

import acco_ds  # noqa: F401  (registers "ACCO")
from tests.ranks import rank_start, toy

LR, WD = 0.02, 0.1


def config(sc: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": sc["gas"],
        "optimizer": sc["optimizer"],
        "zero_optimization": {"stage": 1},
        "gradient_clipping": sc.get("clip", 0.0),
        "bf16": {"enabled": bool(sc.get("bf16")), **sc.get("bf16_extra", {})},
        "steps_per_print": 10**9,
    }
    if not sc.get("lr_decay"):
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": LR / 4, "warmup_max_lr": LR, "warmup_num_steps": 4},
        }
    return cfg


def model_parameters(params: list, groups) -> list:
    if groups is None:
        return params
    out = []
    for first, stop, settings in groups:
        group = {"params": params[first:stop], **settings}
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        out.append(group)
    return out


def mask_like(p: torch.Tensor) -> torch.Tensor:
    """A fixed pattern of factors 0, 1, 2, -1 over the parameter's elements."""
    return torch.tensor([0.0, 1.0, 2.0, -1.0]).repeat(p.numel() // 4 + 1)[: p.numel()].view(p.shape)


def read_grads(params) -> list:
    """Every parameter's safe_get_full_grad (a collective), flat fp32 on the CPU."""
    return [safe_get_full_grad(p).detach().float().reshape(-1).cpu().clone() for p in params]


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001  (what is raised is the result)
        return f"{type(err).__name__}: {err}"
    return None


def edit(kind: str, params) -> None:
    if kind == "mask":
        for p in params:
            g = safe_get_full_grad(p)
            safe_set_full_grad(p, g * mask_like(p).to(g.device, g.dtype))
    elif kind == "vectorized":
        safe_update_full_grad_vectorized(params, lambda g, p: g * mask_like(p).to(g.device, g.dtype))
    elif kind == "nan":
        g = safe_get_full_grad(params[0]).clone()
        g.view(-1)[3] = float("nan")
        safe_set_full_grad(params[0], g)
    else:
        raise ValueError(f"unknown edit {kind!r}")


def committed(engine, params) -> dict:
    """The committed fp32 weights (``safe_get_full_fp32_param``) and Adam moments, flat in parameter order. The
    moments are read per group from the optimizer's ``state`` of its fp32 partition and all-gathered (ZeRO-1's
    ``safe_get_full_optimizer_state`` finds no moments beyond its first parameter group)."""
    opt = engine.optimizer
    out = {"params": toy.flat(safe_get_full_fp32_param(p) for p in params).cpu()}
    world = torch.distributed.get_world_size()
    for key in ("exp_avg", "exp_avg_sq"):
        flats = []
        for part, group in zip(opt.single_partition_of_fp32_groups, opt.bit16_groups):
            mine = opt.state[part][key].detach().float().contiguous()
            gathered = [torch.empty_like(mine) for _ in range(world)]
            torch.distributed.all_gather(gathered, mine)
            flats.append(torch.cat(gathered)[: sum(p.numel() for p in group)].cpu())
        out[key] = torch.cat(flats)
    return out


def run_scenario(sc: dict, rank: int) -> dict:
    model = toy.build()
    if sc.get("bf16"):
        model = model.to(torch.bfloat16)
    params = toy.trainable(model)
    kwargs = {}
    if sc.get("lr_decay"):
        kwargs["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine, *_ = deepspeed.initialize(
        model=model, config=config(sc), model_parameters=model_parameters(params, sc.get("groups")), **kwargs
    )
    params = toy.trainable(engine.module)
    edits = {int(k): v for k, v in sc.get("edits", {}).items()}
    gas, steps, index = sc["gas"], [], 0
    for t in range(sc["steps"]):
        record = {"lrs": [float(g["lr"]) for g in engine.optimizer.param_groups], "probes": []}
        for j in range(gas):
            x, y = toy.micro_batch(rank, index)
            index += 1
            engine.backward(engine(x.to(engine.device), y.to(engine.device)))
            if j == 0 and gas > 1:
                record["local"] = read_grads(params)  # not a collective: this rank's sum so far
            if sc.get(
                "probe_modes"
            ):  # a write only where the read raised (elsewhere it would change the step)
                got = error_of(lambda: safe_get_full_grad(params[0]))
                wrote = got and error_of(lambda: safe_set_full_grad(params[0], torch.zeros(params[0].shape)))
                record["probes"].append((got, wrote))
            if j == gas - 1 and not sc.get("probe_modes"):
                record["grads"] = read_grads(params)
                if t in edits:
                    edit(edits[t], params)
                    record["edited"] = read_grads(params)
            engine.step()
        # ZeRO-1 after its step raises on the ranks owning part of the parameter and all-reduces on the others (a
        # collective mismatch from W = 2): asked only of ACCO, or of one rank
        if hasattr(engine.optimizer, "pipeline") or torch.distributed.get_world_size() == 1:
            record["after"] = error_of(lambda: safe_get_full_grad(params[0]))
        record.update(committed(engine, params))
        record["skipped_steps"] = int(engine.skipped_steps)
        record["global_steps"] = int(engine.global_steps)
        record["lr_after"] = [float(g["lr"]) for g in engine.optimizer.param_groups]
        steps.append(record)
    out = {"steps": steps, "local_grad_error": error_of(lambda: safe_get_local_grad(params[0]))}
    if hasattr(engine.optimizer, "pipeline"):
        engine.optimizer.finish()
        out["stats"] = engine.optimizer.stats()
        engine.optimizer.pipeline.close()
    return out


def main() -> None:
    args = rank_start.scenario_parser().parse_args()
    rank = rank_start.init_rank("gloo")
    results = {sc["name"]: run_scenario(sc, rank) for sc in rank_start.load_scenarios(args.scenarios)}
    if rank == 0:
        torch.save(results, f"{args.out}/results.pt")
    print(json.dumps({"rank": rank, "scenarios": len(results)}))


if __name__ == "__main__":
    main()
