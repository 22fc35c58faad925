"""Per-rank worker for the evaluation tests (tests/deepspeed/test_evaluation.py), started as the deepspeed launcher starts ranks.

Each scenario trains the toy model for ``steps`` engine steps of GAS micro-batches and, after the
micro-batches listed in ``eval_at`` (``[step, micro]`` pairs; a pair listed twice evaluates twice in a
row), evaluates on a fixed batch the way ``how`` says:

- ``engine_eval``: ``engine.eval()``, a forward through the engine under ``torch.no_grad()``,
  ``engine.train()`` (what most loops do);
- ``optimizer_eval``: ``model.eval()`` + ``optimizer.eval()`` then, after the forward, ``optimizer.train()``
  + ``model.train()`` (what the HF Trainer does);
- ``context``: a forward of ``engine.module`` left in training mode, inside
  ``engine.optimizer.committed_weights()`` (generation, hand-written no_grad loops);
- ``none``: no evaluation (the run the others must equal).

At each evaluation rank 0 records: the loss the path gave, the weights the module showed during it, the
committed weights (``safe_get_full_fp32_param``, the fp32 masters) cast to the model's dtype and the loss of a
fresh toy model loaded with them, and the loss of a fresh toy model loaded with the weights the model held just
before (what an evaluation that ignores ACCO would measure). At the end: the committed weights after ``finish()``,
the stats, and with fp16 the loss scale and skipped steps after every engine step.

fp16 (``"fp16": {"enabled": true}``): the rank first lifts the CPU accelerator's fp16 refusal
(``allow_fp16_on_cpu``); a scenario's ``poison``, ``[step, micro]`` pairs, multiplies that micro-batch's loss by inf
on rank 0 (a planted overflow: a skipped step and a halved scale, which an evaluation must not disturb).
"""

from __future__ import annotations

import os

import deepspeed  # noqa: E402
import torch
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

import acco_ds  # noqa: E402,F401
from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu
from tests.ranks import rank_start, toy  # noqa: E402

EVAL_BATCH = toy.micro_batch(99, 12345)


def loss_of(flat: torch.Tensor, dtype: torch.dtype) -> float:
    model = toy.build().to(dtype)
    off = 0
    with torch.no_grad():
        for p in toy.trainable(model):
            p.copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()
        return float(model(*EVAL_BATCH))


def evaluate(engine, how: str, dtype: torch.dtype) -> dict:
    params = toy.trainable(engine.module)
    held = toy.flat(params).clone()
    committed = toy.flat(safe_get_full_fp32_param(p) for p in params)
    with torch.no_grad():
        if how == "engine_eval":
            engine.eval()
            got = float(engine(*EVAL_BATCH))
            shown = toy.flat(params).clone()
            engine.train()
        elif how == "optimizer_eval":
            engine.module.eval()
            engine.optimizer.eval()
            got = float(engine(*EVAL_BATCH))
            shown = toy.flat(params).clone()
            engine.optimizer.train()
            engine.module.train()
        elif how == "context":
            with engine.optimizer.committed_weights():
                got = float(engine.module(*EVAL_BATCH))
                shown = toy.flat(params).clone()
        else:
            raise ValueError(how)
    after = toy.flat(params)
    return {
        "got": got,
        "shown": shown,
        "committed_cast": committed.to(dtype).float(),  # what the module holds, flat (toy.flat is fp32)
        "committed": loss_of(committed.to(dtype), dtype),
        "held": loss_of(held, dtype),
        "restored": bool(torch.equal(after, held)),
    }


def run_scenario(sc: dict, rank: int) -> dict:
    cfg = sc["config"]
    gas = cfg["gradient_accumulation_steps"]
    dtype = torch.float32
    if cfg.get("bf16", {}).get("enabled"):
        dtype = torch.bfloat16
    if cfg.get("fp16", {}).get("enabled"):
        dtype = torch.float16
        allow_fp16_on_cpu()
    poison = [tuple(p) for p in sc.get("poison", [])]
    model = toy.build()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    params = toy.trainable(engine.module)
    evals, scales = [], []
    eval_at = [tuple(p) for p in sc.get("eval_at", [])]
    for step in range(sc["steps"]):
        for j in range(gas):
            x, y = toy.micro_batch(rank, step * gas + j)
            loss = engine(x, y)
            if rank == 0 and (step, j) in poison:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            if dtype == torch.float16 and j == gas - 1:
                scales.append((float(engine.optimizer.cur_scale), int(engine.skipped_steps)))
            for _ in range(eval_at.count((step, j))):
                evals.append({"at": (step, j), **evaluate(engine, sc["how"], dtype)})
    opt = engine.optimizer
    opt.finish()
    out = {
        "evals": evals,
        "final": toy.flat(safe_get_full_fp32_param(p) for p in params),
        "stats": opt.stats(),
        "scales": scales,
        "model_dtype": str(params[0].dtype),
    }
    opt.pipeline.close()
    return out


def main() -> None:
    args = rank_start.scenario_parser().parse_args()
    rank = rank_start.init_rank()
    results = {sc["name"]: run_scenario(sc, rank) for sc in rank_start.load_scenarios(args.scenarios)}
    if rank == 0:
        torch.save(results, os.path.join(args.out, "results.pt"))


if __name__ == "__main__":
    main()
