"""Let DeepSpeed's CPU accelerator run fp16 where it refuses it only for want of fast kernels.

DeepSpeed 0.19.8's ``CPU_Accelerator.is_fp16_supported()`` is ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: True
only on CPUs with AVX512-FP16 / AMX-FP16, and ``DeepSpeedEngine._do_sanity_check`` then raises "Type fp16 is not
supported on your device." elsewhere. torch computes fp16 on any CPU (without those kernels it is slower, not
wrong), so the CPU ranks of the tests and of ``acco-train --dtype fp16`` (which runs DeepSpeed's own ZeRO-1 fp16 as
its baseline on the same ranks) lift that check with :func:`allow_fp16_on_cpu`. Nothing changes on GPUs."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("acco_ds")


def allow_fp16_on_cpu() -> bool:
    """Make the CPU accelerator report fp16 support (idempotent); True when it did not before."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    if getattr(CPU_Accelerator, "_acco_fp16_allowed", False):
        return False
    native = CPU_Accelerator.is_fp16_supported
    dtypes = CPU_Accelerator.supported_dtypes

    def is_fp16_supported(self):
        return True

    def supported_dtypes(self):
        out = list(dtypes(self))
        return out if torch.float16 in out else [*out, torch.float16]

    CPU_Accelerator.is_fp16_supported = is_fp16_supported
    CPU_Accelerator.supported_dtypes = supported_dtypes
    CPU_Accelerator._acco_fp16_allowed = True
    try:
        had = bool(native(CPU_Accelerator.__new__(CPU_Accelerator)))
    except Exception:  # the probe is DeepSpeed's; any failure means no native fp16 kernels
        had = False
    if not had:
        logger.info(
            "acco_ds: this CPU has no mkldnn fp16 kernels (AVX512-FP16/AMX), so DeepSpeed's CPU accelerator would "
            "refuse fp16; torch computes fp16 on the CPU without them (slower): fp16 allowed on the CPU accelerator."
        )
    return not had
