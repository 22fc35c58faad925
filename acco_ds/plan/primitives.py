"""The arithmetic and the threshold that acco-plan's base model, its offload model and their recommendations
share: bytes per element, bytes an AdamW step streams per parameter, an adaptive round's length, and the gain
worth a switch.

Contract: pure functions and constants, importing no other module of acco_ds; ``model``, ``offload``,
``recommend`` and ``recommend_offload`` build on them, so that none of those needs another only for these.
"""

from __future__ import annotations

import math

DTYPE_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element. fp16 (with loss scaling) moves and holds what bf16 does; the loss scaler's state is a few
scalars, and DeepSpeed's overflow check (an amax and an amin over the gradient partition) is not modelled."""
FP32_ADAM = 12  # fp32 master, exp_avg, exp_avg_sq: bytes per parameter, read or written
MIN_GAIN = 1.05
"""The samples/s ratio over the baseline below which a recommendation keeps the baseline (5%)."""


def opt_bytes_per_param(kind: str, D: int, C: int) -> int:
    """Bytes one AdamW step streams per parameter of the shard: ``commit`` (acco_ds's fused kernel:
    read fp32 master/m/v + the reduced gradient, write master/m/v + the new parameter), ``peek``
    (read the same, write only the parameter), ``deepspeed`` (the gradient partition copied to fp32,
    a fused AdamW on fp32, the fp32 master copied back to the parameter dtype)."""
    if kind == "commit":
        return 2 * FP32_ADAM + C + D
    if kind == "peek":
        return FP32_ADAM + C + D
    if kind == "deepspeed":
        return (C + 4) + (4 + 2 * FP32_ADAM) + (4 + D)
    raise ValueError(f"unknown optimizer step kind {kind!r}")


def adaptive_round_micro_batches(k: int, comm_s: float, t_mb: float) -> int:
    """Micro-batches of an adaptive round: at least ``k``; the round ends at the first micro-batch
    boundary at or after its communication's end."""
    return max(k, math.ceil(comm_s / t_mb - 1e-9))
