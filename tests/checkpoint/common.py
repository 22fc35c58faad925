"""The one-rank, in-process pieces shared by the checkpoint tests: the ACCO engine on the toy model, the
state a refused load must leave untouched, and a checkpoint folder's content digest."""

from __future__ import annotations

import hashlib

import deepspeed

from tests.ranks import readback, toy


def acco_engine(model, **config):
    """A DeepSpeed engine of ``model`` under ACCO (lr 0.02, ZeRO-1, the toy's micro-batch, GAS 2) on the
    current process group; ``config``: more top-level config keys."""
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "ACCO", "params": {"lr": 0.02}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        **config,
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def full_state(engine) -> list:
    """The engine's state as flat tensors: committed fp32 parameters, the module's parameters, exp_avg,
    exp_avg_sq (over the toy's trainable parameters)."""
    ps = toy.trainable(engine.module)
    return [readback.full_state(engine, ps), toy.flat(p.detach() for p in ps)] + [
        readback.full_state(engine, ps, k) for k in ("exp_avg", "exp_avg_sq")
    ]


def digest(folder) -> dict:
    """``{relative path: sha256}`` of every file below ``folder``."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file()
    }
