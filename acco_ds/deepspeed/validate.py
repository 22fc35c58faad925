"""Refuse, with the key and the fix, the DeepSpeed configurations ACCO does not support."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from acco_ds.config import ACCOConfig, ACCOConfigError
from acco_ds.core.host_step import OffloadSpec
from acco_ds.core.schedule import micro_batches_per_round


def _offload_device(cfg) -> str:
    if cfg is None:
        return "none"
    return str(getattr(getattr(cfg, "device", None), "value", getattr(cfg, "device", "none")))


def check_offload_config(engine) -> None:
    """``zero_optimization.offload_optimizer`` with ``device`` "cpu" (``pin_memory`` either way) is accepted
    (``offload_spec``): on CUDA ranks the optimizer state lives in host memory and the round's job steps it there
    (``core.host_step``); on CPU ranks it is in host memory already. Refused, by key: ``device`` "nvme", ``ratio``
    < 1 (a partial offload), ``super_offload``, and any ``offload_param`` (ZeRO-3's)."""
    param = engine.zero_offload_param()
    if _offload_device(param) not in ("none", "OffloadDeviceEnum.none"):
        raise ACCOConfigError(
            f"zero_optimization.offload_param.device={_offload_device(param)}: parameter offload is ZeRO-3's; ACCO "
            'keeps full parameters on every rank (ZeRO-1). Allowed: no "offload_param" section, or device "none".'
        )
    sub = engine.zero_offload_optimizer()
    device = _offload_device(sub).replace("OffloadDeviceEnum.", "")
    if device == "none":
        return
    if device != "cpu":
        raise ACCOConfigError(
            f"zero_optimization.offload_optimizer.device={device}: ACCO steps its optimizer state in host memory, not "
            'on NVMe. Allowed: "cpu", or "none" (no offload).'
        )
    ratio = float(getattr(sub, "ratio", 1.0))
    if ratio < 1.0:
        raise ACCOConfigError(
            f"zero_optimization.offload_optimizer.ratio={ratio:g}: ACCO offloads the whole optimizer state of a rank "
            "or none of it. Allowed: ratio 1 (the default)."
        )
    if getattr(sub, "super_offload", False):
        raise ACCOConfigError(
            "zero_optimization.offload_optimizer.super_offload=true: SuperOffload (ZeRO-3, GH200) steps before the "
            "gradient norm is known and rolls back; ACCO hides its host step behind the next round's compute instead. "
            "Allowed: super_offload false (the default)."
        )


def offload_optimizer_device(engine) -> str:
    """'cpu' when the config offloads the optimizer (``check_offload_config`` accepted it), else 'none'."""
    return "cpu" if _offload_device(engine.zero_offload_optimizer()).endswith("cpu") else "none"


def offload_spec(engine) -> OffloadSpec | None:
    """The pipeline's ``offload`` of an accepted ``offload_optimizer`` section (``pin_memory`` read from it), or
    None without one."""
    if offload_optimizer_device(engine) != "cpu":
        return None
    pin = bool(getattr(engine.zero_offload_optimizer(), "pin_memory", False))
    return OffloadSpec.for_device(torch.device(engine.device), pin)


def check_fp16_config(engine) -> None:
    """Refuse, naming the key, the fp16 settings ACCO does not follow; the rest (loss_scale, initial_scale_power,
    loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale, auto_cast) mean what they mean for
    ZeRO-1 (``loss_scale_spec``)."""
    fp16 = engine._config.float16_config
    if getattr(fp16, "fp16_master_weights_and_grads", False):
        raise ACCOConfigError(
            "fp16.fp16_master_weights_and_grads=true: ACCO keeps fp32 master weights and Adam moments (its AdamW "
            "casts the new parameters to fp16). Allowed: fp16.fp16_master_weights_and_grads=false (the default)."
        )
    if engine.bfloat16_enabled():
        raise ACCOConfigError(
            "fp16.enabled=true and bf16.enabled=true: one mixed precision at a time. Allowed: one of the two."
        )
    if engine.dynamic_loss_scale() and fp16.hysteresis < 1:
        raise ACCOConfigError(
            f"fp16.hysteresis={fp16.hysteresis}: the overflows tolerated before the loss scale halves (DeepSpeed's "
            "delayed shift); below 1 DeepSpeed's rule would never lower the scale. Allowed: an integer >= 1 "
            "(default 2)."
        )


def loss_scale_spec(engine, param_dtype: torch.dtype | None = None):
    """The loss scaler's settings from the engine's ``fp16`` section (``core.loss_scale.LossScaleSpec``), or None
    without fp16. ``loss_scale`` 0: dynamic scaling from ``2 ** initial_scale_power``; > 0: that static scale. As
    DeepSpeed's ZeRO-1, a model whose parameters are fp16 (``param_dtype``: the trainable parameters' dtype; a model
    cast with ``.half()``) is loss-scaled by the ``fp16`` section's settings (its defaults without one) even when
    ``fp16.enabled`` is false."""
    from acco_ds.core.loss_scale import LossScaleSpec

    if not engine.fp16_enabled() and param_dtype != torch.float16:
        return None
    if not engine.dynamic_loss_scale():
        return LossScaleSpec(dynamic=False, init_scale=float(engine.loss_scale()))
    args = engine.dynamic_loss_scale_args()
    return LossScaleSpec(
        dynamic=True,
        init_scale=float(args["init_scale"]),
        window=int(args["scale_window"]),
        hysteresis=int(args["delayed_shift"]),
        consecutive_hysteresis=bool(args["consecutive_hysteresis"]),
        min_scale=float(args["min_scale"]),
    )


def model_parallel_group(engine):
    """The engine's tensor-parallel group (AutoTP or a Megatron-style mpu), or None."""
    mpu = getattr(engine, "mpu", None)
    for name in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
        getter = getattr(mpu, name, None)
        if callable(getter):
            return getter()
    return None


def check_engine_config(engine, client_optimizer, cfg: ACCOConfig) -> None:
    """Raise ACCOConfigError for an engine config that "type": "ACCO" cannot run, before any state is
    built. Each message names the DeepSpeed key, the value seen and what is allowed. Checked: client
    optimizer, ZeRO stage, fp16 (``check_fp16_config``), offload, pipeline/sequence parallelism, a model-parallel
    size that does
    not divide the world or comes without a group, MoE, gradient_clipping,
    communication_data_type, fp16 autocast, ZenFlow, gradient_accumulation_steps for the mode and
    max_micro_batches_per_round against a round's share, bf16.check_grad_overflow
    (``check_grad_overflow_setting``)."""
    if client_optimizer is not None:
        raise ACCOConfigError(
            f'optimizer.type="ACCO" builds its own optimizer, but deepspeed.initialize was also given a client '
            f"optimizer (optimizer={type(client_optimizer).__name__}). Allowed: one or the other; drop "
            'optimizer=... to use ACCO, or remove the "optimizer" section of the config to use yours.'
        )
    stage = engine.zero_optimization_stage()
    if stage != 1:
        raise ACCOConfigError(
            f"zero_optimization.stage={stage}: ACCO is a ZeRO stage 1 optimizer (sharded optimizer state, "
            'full parameters and gradients on every rank). Allowed: "zero_optimization": {"stage": 1}.'
        )
    if engine.fp16_enabled():
        check_fp16_config(engine)
    check_offload_config(engine)
    if getattr(engine, "pipeline_parallelism", False):
        raise ACCOConfigError(
            "pipeline parallelism (a PipelineModule / PipelineEngine) is not supported by ACCO: it drives the "
            "optimizer per micro-batch on its own schedule. Allowed: a plain nn.Module with data parallelism."
        )
    if getattr(engine, "has_moe_layers", False):
        raise ACCOConfigError(
            "MoE layers are not supported by ACCO (expert parameters need expert-parallel groups). "
            "Allowed: models without deepspeed.moe layers; use DeepSpeed's ZeRO optimizers for MoE models."
        )
    mp = int(getattr(engine, "mp_world_size", 1) or 1)
    world = int(getattr(engine, "world_size", 0) or dist.get_world_size())
    if mp > 1 and world % mp:
        raise ACCOConfigError(
            f"tensor_parallel.autotp_size (model-parallel world size) = {mp} does not divide the {world} ranks: "
            "ACCO runs data parallelism across the tensor-parallel groups. Allowed: a model-parallel size that "
            f"divides the world size ({[d for d in range(1, world + 1) if world % d == 0]})."
        )
    if mp > 1 and model_parallel_group(engine) is None:
        raise ACCOConfigError(
            f"model-parallel world size {mp}, but the engine's mpu ({type(engine.mpu).__name__}) has no "
            "get_model_parallel_group() / get_tensor_model_parallel_group(). Allowed: DeepSpeed AutoTP "
            '("tensor_parallel": {"autotp_size": N}) or a Megatron-style mpu with those methods.'
        )
    seq_dp, dp = getattr(engine, "seq_dp_world_size", None), getattr(engine, "dp_world_size", None)
    if seq_dp is not None and dp is not None and seq_dp != dp:
        raise ACCOConfigError(
            f"sequence_parallel_size={seq_dp // max(dp, 1)}: ACCO does not support sequence parallelism "
            "(DeepSpeed-Ulysses). Allowed: sequence_parallel_size=1."
        )
    clip = engine.gradient_clipping()
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
        raise ACCOConfigError(
            f"gradient_clipping={clip!r}: ACCO clips the global gradient norm to this value. Allowed: a finite "
            "number >= 0 (0 disables clipping)."
        )
    comm_type = getattr(engine._config, "communication_data_type", None)
    if comm_type is not None:
        raise ACCOConfigError(
            f"communication_data_type={comm_type}: ACCO reduces gradients in the dtype of its own option "
            "optimizer.params.comm_dtype. Allowed: remove communication_data_type and set "
            "optimizer.params.comm_dtype to 'auto', 'bf16', 'fp16' or 'fp32'."
        )
    if engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.float16:
        raise ACCOConfigError(
            "torch_autocast.dtype=torch.float16: ACCO scales fp16 losses with its own loss scaler on an fp16 model, "
            "not with torch autocast's GradScaler. Allowed: fp16.enabled=true (an fp16 model with dynamic loss "
            "scaling), torch_autocast with dtype bfloat16, or bf16.enabled=true."
        )
    if getattr(engine._config.zero_config, "zenflow", None) is not None:
        raise ACCOConfigError(
            "zero_optimization.zenflow: ZenFlow replaces the optimizer step with its own offloaded one; ACCO "
            'runs its own. Allowed: remove "zenflow".'
        )
    gas = engine.gradient_accumulation_steps()
    try:
        share = micro_batches_per_round(cfg.mode, gas)
    except ValueError:
        raise ACCOConfigError(
            f"gradient_accumulation_steps={gas}: mode='{cfg.mode}' splits each optimizer step into two rounds of "
            "gradient_accumulation_steps / 2 micro-batches (the g~ of the peek and the g of the commit). "
            f"Allowed: an even number >= 2 (e.g. {max(2, gas + gas % 2)}, with train_batch_size to match), or "
            "mode='dpu' / 'sync' with any value."
        ) from None
    cap = cfg.max_micro_batches_per_round
    if cap is not None and cap < share:
        raise ACCOConfigError(
            f"optimizer.params.max_micro_batches_per_round={cap}: a round of mode='{cfg.mode}' takes at least "
            f"{share} micro-batches (gradient_accumulation_steps={gas}"
            f"{' / 2' if cfg.mode == 'acco' else ''}), so a cap below that is never reached. Allowed: null or "
            f"an integer >= {share}."
        )
    check_grad_overflow_setting(engine)


def check_grad_overflow_setting(engine) -> None:
    """``bf16.check_grad_overflow``: ACCO skips a step whose global gradient norm is not finite, on every rank (the
    state and weights unchanged, the engine counting it in ``skipped_steps``), which is what ZeRO-1 does with
    ``true`` (DeepSpeed's default) and with fp32. With ``false`` ZeRO-1 steps with the non-finite gradient and
    the NaN reaches the weights; ACCO has no such mode, so that value is refused, by name."""
    if engine.bfloat16_enabled() and not engine._config.bfloat16_config.check_grad_overflow:
        raise ACCOConfigError(
            "bf16.check_grad_overflow=false: ACCO always skips an optimizer step whose gradient holds a NaN or an "
            "Inf, on every rank (DeepSpeed's ZeRO-1 would apply it and the NaN would reach the weights). Allowed: "
            "bf16.check_grad_overflow=true (DeepSpeed's default), or leave the key out."
        )
