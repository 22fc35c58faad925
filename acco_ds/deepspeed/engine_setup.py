"""Build the ACCO optimizer inside ``DeepSpeedEngine._configure_optimizer`` (see register.py)."""

from __future__ import annotations

import logging

import deepspeed

from acco_ds.config import ACCOConfig
from acco_ds.deepspeed.register import check_deepspeed_version
from acco_ds.deepspeed.validate import check_engine_config

logger = logging.getLogger("acco_ds")


def configure_acco(engine, client_optimizer, model_parameters) -> None:
    """Set ``engine.optimizer`` (the ACCO ZeRO optimizer), ``engine.basic_optimizer`` (a real
    torch Optimizer over the fp32 master shards, for LR schedulers) and switch off the engine's
    own gradient all-reduce: ACCO reduces the gradients on its communication stream."""
    from acco_ds.deepspeed.optimizer import ACCOZeroOptimizer

    check_deepspeed_version(deepspeed.__version__)
    cfg = ACCOConfig.from_params(engine.optimizer_params())
    check_engine_config(engine, client_optimizer, cfg)
    optimizer = ACCOZeroOptimizer(
        model_parameters,
        cfg,
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
        gradient_clipping=engine.gradient_clipping(),
        dp_process_group=engine.seq_data_parallel_group,
    )
    optimizer.attach_engine(engine)
    engine.basic_optimizer = optimizer.optimizer
    engine.optimizer = optimizer
    engine.enable_backward_allreduce = False
    if engine.global_rank == 0:
        logger.info(
            "acco_ds: ACCO optimizer (mode=%s, accumulation=%s, comm_dtype=%s, %d parameters in %d groups)",
            cfg.mode,
            cfg.accumulation,
            optimizer.pipeline.groups[0].comm_dtype,
            sum(b.layout.numel for b in optimizer.pipeline.groups),
            len(optimizer.pipeline.groups),
        )
