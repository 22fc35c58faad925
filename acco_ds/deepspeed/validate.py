"""Refuse, with the key and the fix, the DeepSpeed configurations ACCO does not support."""

from __future__ import annotations

from acco_ds.config import ACCOConfig, ACCOConfigError
from acco_ds.core.schedule import micro_batches_per_round


def _offload_device(cfg) -> str:
    if cfg is None:
        return "none"
    return str(getattr(getattr(cfg, "device", None), "value", getattr(cfg, "device", "none")))


def check_engine_config(engine, client_optimizer, cfg: ACCOConfig) -> None:
    """Raise ACCOConfigError for an engine config that "type": "ACCO" cannot run."""
    if client_optimizer is not None:
        raise ACCOConfigError(
            'optimizer.type="ACCO" builds its own optimizer, but deepspeed.initialize was also given a client '
            "optimizer (optimizer=...). Pass one or the other: drop optimizer=... to use ACCO, or remove the "
            '"optimizer" section of the config to use yours.'
        )
    stage = engine.zero_optimization_stage()
    if stage != 1:
        raise ACCOConfigError(
            f"zero_optimization.stage={stage}: ACCO is a ZeRO stage 1 optimizer (sharded optimizer state, "
            'full parameters and gradients on every rank). Set "zero_optimization": {"stage": 1}.'
        )
    if engine.fp16_enabled():
        raise ACCOConfigError(
            'fp16.enabled=true: ACCO does not implement fp16 loss scaling. Use "bf16": {"enabled": true} '
            "(or fp32) instead."
        )
    for key, sub in (
        ("offload_optimizer", engine.zero_offload_optimizer()),
        ("offload_param", engine.zero_offload_param()),
    ):
        device = _offload_device(sub)
        if device not in ("none", "OffloadDeviceEnum.none"):
            raise ACCOConfigError(
                f"zero_optimization.{key}.device={device}: ACCO keeps its sharded state on the training "
                f'device and overlaps its own communication; remove "{key}" (or set its device to "none").'
            )
    if getattr(engine, "pipeline_parallelism", False):
        raise ACCOConfigError(
            "pipeline parallelism (a PipelineModule / PipelineEngine) is not supported by ACCO: it drives the "
            "optimizer per micro-batch on its own schedule. Use a plain module with data parallelism."
        )
    if getattr(engine, "has_moe_layers", False):
        raise ACCOConfigError(
            "MoE layers are not supported by ACCO (expert parameters need expert-parallel groups). "
            "Use DeepSpeed's ZeRO optimizers for MoE models."
        )
    try:
        micro_batches_per_round(cfg.mode, engine.gradient_accumulation_steps())
    except ValueError as err:
        raise ACCOConfigError(
            f"gradient_accumulation_steps={engine.gradient_accumulation_steps()}: {err}"
        ) from None
