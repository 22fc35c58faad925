"""Test-environment shim: let accelerate (used by the HF Trainer) count DeepSpeed ranks on a CPU-only machine.

accelerate 1.15's ``PartialState`` picks its backend from the accelerator it finds (nccl on CUDA, ...);
with DeepSpeed on a machine without one it finds none, sets ``backend=None`` and concludes that there is
a single process, although DeepSpeed started 2 ranks on gloo. The HF Trainer then fills
``train_batch_size: "auto"`` for one process and DeepSpeed rejects the config. This is accelerate's CPU
limitation with any DeepSpeed optimizer, not ACCO's; on GPU machines nothing here is needed and
``import acco_ds`` stays the only change to a training script.

``apply()`` makes ``_prepare_backend`` answer gloo / MULTI_CPU when it found no accelerator and the
process was started by a distributed launcher; accelerate then initialises DeepSpeed's process group
on gloo and switches the state to DEEPSPEED as it does on GPU.
"""

from __future__ import annotations

import os

import torch


def apply() -> None:
    if torch.cuda.is_available():
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if getattr(PartialState, "_acco_test_cpu_shim", False):  # applied already (idempotent)
        return
    original = PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        got_backend, got_type = original(self, cpu, sagemaker_dp, backend)
        if got_backend is None and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return got_backend, got_type

    PartialState._prepare_backend = _prepare_backend
    PartialState._acco_test_cpu_shim = True
