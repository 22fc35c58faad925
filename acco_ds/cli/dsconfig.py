"""DeepSpeed configs of the contenders, built from one set of training knobs.

Contract: ``build_config(contender, knobs)`` returns a plain dict that ``deepspeed.initialize``
accepts. Every contender gets the same micro-batch, gradient accumulation, total batch, dtype,
learning-rate schedule, AdamW hyper-parameters and gradient clipping; they differ only in the
optimizer/ZeRO section. With ``knobs.fp16`` every contender gets the same ``fp16`` section: fp16 parameters
with DeepSpeed's dynamic loss scaling (``loss_scale`` 0, the first scale ``2 ** initial_scale_power``, doubled
after ``loss_scale_window`` steps without overflow, hysteresis 2, minimum scale 1: DeepSpeed's defaults but for
the two knobs), which ACCO follows with its own scaler and the ZeRO baselines with DeepSpeed's:

- ``zero1``: DeepSpeed ZeRO-1 with its AdamW, buckets as large as the model (one reduce and one
  all-gather per step: the fewest collectives, what DeepSpeed's docs advise for ZeRO-1).
- ``zero1-overlap``: DeepSpeed ZeRO-1 with ``overlap_comm`` (allowed for stage 1 since DeepSpeed
  0.13): the gradients are reduced bucket by bucket from the backward hooks of the step's last
  micro-batch, on DeepSpeed's reduction stream, while the rest of that backward runs. Buckets as
  DeepSpeed's docs advise for overlap: ``overlap_comm`` with reduce buckets smaller than the
  gradients (communication "in parcels of smaller buffers"), here a quarter of the model, so the
  first buckets are reduced while the backward still produces the others; one all-gather bucket
  as large as the model (the all-gather follows the optimizer step: nothing to overlap it with).
  On DeepSpeed's CPU accelerator its streams are no-ops, so the reductions run inside the
  backward but do not overlap it.
- ``zero2``: DeepSpeed ZeRO-2 with ``overlap_comm`` and ``contiguous_gradients`` on and a reduce
  bucket of a quarter of the model, so the gradient reduction overlaps the backward pass.
- ``sync`` | ``dpu`` | ``acco``: the ACCO optimizer type on ZeRO-1 with that mode and
  ``knobs.accumulation`` (sync is always fixed).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

ACCO_MODES = ("acco", "dpu", "sync")
DS_MODES = ("zero1", "zero1-overlap", "zero2")
ALL_MODES = ACCO_MODES + DS_MODES


@dataclass(frozen=True)
class Knobs:
    """The training knobs shared by every contender."""

    micro_batch: int
    grad_accum: int
    world_size: int
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    total_steps: int = 200
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16: bool = False
    fp16: bool = False  # fp16 parameters with dynamic loss scaling (see fp16_section)
    initial_scale_power: int = 16  # fp16: the first loss scale is 2 ** this
    loss_scale_window: int = 1000  # fp16: steps without overflow before the scale doubles
    accumulation: str = "fixed"
    peek_lr_scale: float = 1.0  # acco's optimizer.params.peek_lr_scale (the other contenders have no peek)
    memory_state: bool = (
        False  # ACCO's optimizer.params.memory_state.enabled (the committed state in node memory)
    )
    memory_state_form: str | None = None  # its peer_copy_form (None: the config's default)
    num_params: int = 0  # sizes the DeepSpeed buckets
    tp: int = 1  # tensor-parallel size (AutoTP); the data-parallel world is world_size / tp


def _bucket(n: int, parts: int) -> int:
    return max(50_000, -(-max(n, 1) // parts))


def _scheduler(k: Knobs) -> dict:
    return {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": max(k.total_steps, k.warmup_steps + 1),
            "warmup_num_steps": k.warmup_steps,
            "warmup_type": "linear",
            "cos_min_ratio": k.min_lr / k.lr if k.lr > 0 else 0.0,
        },
    }


def fp16_section(k: Knobs) -> dict:
    """DeepSpeed's ``fp16`` section of the knobs: dynamic loss scaling (see the module docstring)."""
    return {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": k.initial_scale_power,
        "loss_scale_window": k.loss_scale_window,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }


def fp16_enabled(cfg: dict) -> bool:
    """Whether a DeepSpeed config dict trains in fp16 (``"fp16": {"enabled": true}``)."""
    section = cfg.get("fp16") or {}
    return isinstance(section, dict) and section.get("enabled") is True


def build_config(contender: str, k: Knobs) -> dict:
    """The DeepSpeed config dict of ``contender`` (one of ALL_MODES)."""
    if contender not in ALL_MODES:
        raise ValueError(f"unknown mode {contender!r}; choose from {', '.join(ALL_MODES)}")
    if contender == "acco" and k.grad_accum % 2:
        raise ValueError(
            f"mode acco needs an even --grad-accum (each step is two rounds of GAS/2 micro-batches), got {k.grad_accum}"
        )
    cfg: dict = {
        "train_micro_batch_size_per_gpu": k.micro_batch,
        "gradient_accumulation_steps": k.grad_accum,
        "train_batch_size": k.micro_batch * k.grad_accum * k.world_size,
        "gradient_clipping": k.grad_clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer would synchronise the device in every forward/step (no overlap on GPUs);
        # every contender gets the same (host-clock) timer
        "timers": {"throughput": {"synchronized": False}},
        "scheduler": _scheduler(k),
    }
    if k.bf16 and k.fp16:
        raise ValueError("Knobs: bf16 and fp16 are both set; one mixed precision at a time")
    if k.bf16:
        cfg["bf16"] = {"enabled": True}
    if k.fp16:
        cfg["fp16"] = fp16_section(k)
    if k.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": k.tp}
        # DeepSpeed checks train_batch_size against all ranks before AutoTP sets its groups up; the batch of a
        # step is micro_batch x grad_accum x (world_size / tp): leave the key to DeepSpeed
        del cfg["train_batch_size"]
    adam = {"lr": k.lr, "betas": list(k.betas), "eps": k.eps, "weight_decay": k.weight_decay}
    if contender in ACCO_MODES:
        accumulation = "fixed" if contender == "sync" else k.accumulation
        params = dict(adam, mode=contender, accumulation=accumulation, comm_dtype="auto")
        if contender == "acco" and k.peek_lr_scale != 1.0:
            params["peek_lr_scale"] = k.peek_lr_scale
        if k.memory_state:
            params["memory_state"] = {"enabled": True}
            if k.memory_state_form is not None:
                params["memory_state"]["peer_copy_form"] = k.memory_state_form
        cfg["optimizer"] = {"type": "ACCO", "params": params}
        cfg["zero_optimization"] = {"stage": 1}
        return cfg
    cfg["optimizer"] = {"type": "AdamW", "params": adam}
    whole = _bucket(k.num_params, 1)
    if contender == "zero1":
        cfg["zero_optimization"] = {
            "stage": 1,
            "reduce_scatter": True,
            "contiguous_gradients": True,
            "overlap_comm": False,
            "reduce_bucket_size": whole,
            "allgather_bucket_size": whole,
        }
    elif contender == "zero1-overlap":
        cfg["zero_optimization"] = {
            "stage": 1,
            "reduce_scatter": True,
            "contiguous_gradients": True,
            "overlap_comm": True,
            "reduce_bucket_size": _bucket(k.num_params, 4),
            "allgather_bucket_size": whole,
        }
    else:
        cfg["zero_optimization"] = {
            "stage": 2,
            "reduce_scatter": True,
            "contiguous_gradients": True,
            "overlap_comm": True,
            "reduce_bucket_size": _bucket(k.num_params, 4),
            "allgather_bucket_size": whole,
        }
    return cfg


def label(contender: str, accumulation: str) -> str:
    """Display name of a run: 'acco-adaptive', 'dpu', 'zero1', ..."""
    if contender in ("acco", "dpu") and accumulation == "adaptive":
        return f"{contender}-adaptive"
    return contender


def load_user_config(path: str | None, k: Knobs) -> dict | None:
    """A user's DeepSpeed JSON (``--config``), with its batch keys checked against the knobs' world
    size: ``train_batch_size`` is recomputed from micro-batch x accumulation x world size when the
    user left it out. Returns None when no path is given."""
    if not path:
        return None
    cfg = json.loads(Path(path).read_text())
    cfg = copy.deepcopy(cfg)
    mb = cfg.setdefault("train_micro_batch_size_per_gpu", k.micro_batch)
    gas = cfg.setdefault("gradient_accumulation_steps", k.grad_accum)
    want = mb * gas * k.world_size
    if cfg.setdefault("train_batch_size", want) != want:
        raise ValueError(
            f"{path}: train_batch_size={cfg['train_batch_size']} != micro-batch {mb} x accumulation {gas} x "
            f"world size {k.world_size} = {want}; fix the file or drop train_batch_size."
        )
    return cfg


def config_mode(cfg: dict) -> tuple:
    """(contender, accumulation) a DeepSpeed config trains with: an ACCO config gives its mode;
    anything else gives 'zero<stage>' ('zero1-overlap' for stage 1 with ``overlap_comm``; 'ddp' without
    ZeRO)."""
    opt = cfg.get("optimizer") or {}
    if str(opt.get("type", "")).lower() == "acco":
        p = opt.get("params") or {}
        return p.get("mode", "acco"), p.get("accumulation", "fixed")
    zero = cfg.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    if stage == 1 and zero.get("overlap_comm") is True:
        return "zero1-overlap", "fixed"
    return (f"zero{stage}" if stage else "ddp"), "fixed"
