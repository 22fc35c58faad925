"""Build the ACCO optimizer inside ``DeepSpeedEngine._configure_optimizer`` (register.py calls it), and turn off
what in the engine would synchronise the device every micro-batch (the throughput timer's syncs)."""

from __future__ import annotations

import logging
import threading

import deepspeed
import torch

from acco_ds.config import ACCOConfig
from acco_ds.deepspeed.checkpoint import memory
from acco_ds.deepspeed.optimizer import ACCOZeroOptimizer
from acco_ds.deepspeed.validate import (
    check_engine_config,
    loss_scale_spec,
    model_parallel_group,
    offload_spec,
)
from acco_ds.deepspeed.version import check_deepspeed_version
from acco_ds.ops.adamw import host_threads, set_host_threads

logger = logging.getLogger("acco_ds")


def configure_acco(engine, client_optimizer, model_parameters) -> None:
    """Set ``engine.optimizer`` (the ACCO ZeRO optimizer), ``engine.basic_optimizer`` (a real
    torch Optimizer over the fp32 master shards, for LR schedulers) and switch off the engine's
    own gradient all-reduce: ACCO reduces the gradients on its communication stream."""
    check_deepspeed_version(deepspeed.__version__)
    cfg = ACCOConfig.from_params(engine.optimizer_params())
    check_engine_config(engine, client_optimizer, cfg)
    # materialized: read here for the dtype, then by the optimizer
    model_parameters = [
        {**g, "params": g["params"] if isinstance(g["params"], torch.Tensor) else list(g["params"])}
        if isinstance(g, dict) and "params" in g
        else g
        for g in model_parameters
    ]
    optimizer = ACCOZeroOptimizer(
        model_parameters,
        cfg,
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
        gradient_clipping=engine.gradient_clipping(),
        dp_process_group=engine.seq_data_parallel_group,
        tp_group=model_parallel_group(engine) if int(getattr(engine, "mp_world_size", 1) or 1) > 1 else None,
        loss_scale=loss_scale_spec(engine, trainable_dtype(model_parameters)),
        offload=offload_spec(engine),
    )
    optimizer.attach_engine(engine)
    memory.attach(optimizer, cfg)
    engine.basic_optimizer = optimizer.optimizer
    engine.optimizer = optimizer
    engine.enable_backward_allreduce = False
    unsync_throughput_timer(engine)
    threads = configure_host_threads(optimizer.pipeline, cfg)
    offload = optimizer.pipeline.offload
    if offload is not None and engine.global_rank == 0:
        if offload.staged:
            logger.info(
                "acco_ds: zero_optimization.offload_optimizer.device=cpu: ACCO's optimizer state (fp32 master shard, "
                "exp_avg, exp_avg_sq) lives in host memory and each round's job steps it there with %d threads "
                "(optimizer.params.host_threads=%r), its copies %s",
                threads,
                cfg.host_threads,
                "pinned" if offload.pin_memory else "in pageable memory (pin_memory false)",
            )
        else:
            logger.info(
                "acco_ds: zero_optimization.offload_optimizer.device=cpu: this rank trains on the CPU, so ACCO's "
                "optimizer state (fp32 master shard, exp_avg, exp_avg_sq) is in host memory already; nothing is moved"
            )
    if engine.global_rank == 0:
        logger.info(
            "acco_ds: ACCO optimizer (mode=%s, accumulation=%s, comm_dtype=%s, %d parameters in %d groups, "
            "the round job's CPU kernels on %d threads: host_threads=%r)",
            cfg.mode,
            cfg.accumulation,
            optimizer.pipeline.groups[0].comm_dtype,
            sum(b.layout.numel for b in optimizer.pipeline.groups),
            len(optimizer.pipeline.groups),
            threads,
            cfg.host_threads,
        )


def configure_host_threads(pipeline, cfg: ACCOConfig) -> int:
    """Give the pipeline's communication worker thread, which runs every round's job (and the host step of
    offload), ``cfg.host_threads``'s OpenMP threads for the CPU kernels (``acco_ds.ops.adamw.set_host_threads``,
    thread-local: the training thread keeps ``torch.get_num_threads()``). Runs one job on the executor, before any
    round is launched; returns the count the worker thread uses from then on."""
    count = cfg.host_thread_count(pipeline.device.type)

    def apply() -> int:
        set_host_threads(count)
        return host_threads()

    executor = pipeline.executor
    return executor.wait(executor.launch("host threads", apply))


def trainable_dtype(model_parameters: list):
    """The dtype of the first trainable parameter of ``deepspeed.initialize``'s ``model_parameters`` (parameters or
    param-group dicts), or None."""
    for item in model_parameters:
        params = item.get("params", []) if isinstance(item, dict) else [item]
        params = [params] if isinstance(params, torch.Tensor) else params
        for p in params:
            if p.requires_grad:
                return p.dtype
    return None


_said: set = set()
_said_lock = threading.Lock()


def _once(key: str) -> bool:
    with _said_lock:
        if key in _said:
            return False
        _said.add(key)
        return True


def unsync_throughput_timer(engine) -> bool:
    """Turn off the synchronisation of DeepSpeed's throughput timer; True when it was turned off here.

    DeepSpeed 0.19.8's throughput timer (``engine.tput_timer``, config ``timers.throughput``) is on by default
    with ``synchronized: true``: when ``deepspeed.initialize`` got no ``training_data`` it calls the accelerator's
    ``synchronize()`` (``torch.cuda.synchronize()``, device-wide) in ``engine.forward`` and ``engine.step`` of
    every micro-batch. A device-wide sync also waits for ACCO's communication stream, so nothing overlaps. With
    ``synchronized: false`` the timer reads the host clock only (what it reports is then the host's time).
    A config that sets ``synchronized: true`` explicitly keeps it, with a warning. Both are said once per
    process, on global rank 0.
    """
    cfg = getattr(getattr(engine, "tput_timer", None), "config", None)
    if cfg is None or not getattr(cfg, "enabled", False) or not getattr(cfg, "synchronized", False):
        return False
    rank0 = getattr(engine, "global_rank", 0) == 0
    if "synchronized" in cfg.model_fields_set:
        if rank0 and _once("user-sync"):
            logger.warning(
                "acco_ds: the DeepSpeed config sets timers.throughput.synchronized=true: DeepSpeed's throughput "
                "timer then synchronises the whole device in every engine.forward() and engine.step(), which "
                "waits for ACCO's communication stream too, so communication no longer overlaps computation on "
                'GPUs. Remove it or set "timers": {"throughput": {"synchronized": false}}.'
            )
        return False
    cfg.synchronized = False
    if rank0 and _once("unsync"):
        logger.info(
            "acco_ds: DeepSpeed's throughput timer set to synchronized=false (its device-wide syncs in "
            "engine.forward()/engine.step() would wait for ACCO's communication stream)."
        )
    return True
