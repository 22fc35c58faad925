"""Kernels behind plain Python functions.

- :mod:`acco_ds.ops.adamw`: fused sharded AdamW (commit / peek) on flat fp32 shards, dispatched to the
  CUDA extension, the CPU extension, or the pure-torch reference ``adamw_step_ref``.
- :mod:`acco_ds.ops.adamw_settings`: ``AdamWSettings``, the one AdamW settings type from the config to the
  kernels, and ``KERNEL_FIELDS``, the scalars the kernels read.
- :mod:`acco_ds.ops.accumulate`: accumulate / cast gradients into the flat communication buffer (Triton on
  CUDA, the CPU extension on CPU) with pure-torch ``*_ref`` references.
- :mod:`acco_ds.ops.quantize`: blockwise int8 quantization with an error-feedback residual (compressed rounds),
  the CPU extension or the pure-torch ``*_ref`` reference, the same bits.
- :mod:`acco_ds.ops.triton_kernels`: the Triton kernels (imported at the first Triton launch only).
- :mod:`acco_ds.ops._build`: loading of the compiled modules (csrc/).

Importing this package imports neither triton nor the compiled extensions and never touches ``torch.cuda``.
"""

from acco_ds.ops.accumulate import accumulate_flat, accumulate_grads, copy_flat
from acco_ds.ops.adamw import adamw_step, adamw_step_ref
from acco_ds.ops.adamw_settings import AdamWSettings

__all__ = [
    "AdamWSettings",
    "accumulate_flat",
    "accumulate_grads",
    "adamw_step",
    "adamw_step_ref",
    "copy_flat",
]
