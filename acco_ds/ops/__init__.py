"""Kernels behind plain Python functions.

- :mod:`acco_ds.ops.adamw`: fused sharded AdamW (commit / peek) on flat fp32 shards, dispatched to the
  CUDA extension, the CPU extension, or the pure-torch reference ``adamw_step_ref``.
- :mod:`acco_ds.ops.accumulate`: accumulate / cast gradients into the flat communication buffer (Triton on
  CUDA, torch on CPU) with pure-torch ``*_ref`` references.

Importing this package imports neither triton nor the compiled extensions and never touches ``torch.cuda``.
"""

from acco_ds.ops.accumulate import accumulate_flat, accumulate_grads, copy_flat
from acco_ds.ops.adamw import adamw_step, adamw_step_ref

__all__ = ["accumulate_flat", "accumulate_grads", "adamw_step", "adamw_step_ref", "copy_flat"]
