"""Analytic memory per rank, in bytes per parameter, of acco_ds's modes and DeepSpeed ZeRO-1/ZeRO-2.

The one home of these formulas: the memory benchmark (``python -m benchmarks.memory``) prints them
beside its measured peaks, and ``acco-plan`` predicts memory per GPU with them.

Contract: ``buffers(contender, D, W, largest_frac, comm_D=None, bucket_frac=None)`` lists what one rank
holds at its peak, one ``Buffer(name, bytes_per_param, kind)`` per buffer; ``kind`` is ``held``
(allocated for the whole run), ``transient`` (alive at the peak moment only) or ``cpu-heap`` (freed,
but kept resident by glibc's heap on CPU; not on GPU). ``D`` is the parameter (= communication) dtype
size, ``W`` the world size, ``largest_frac`` the largest parameter's share of all parameters,
``bucket_frac`` DeepSpeed's ``reduce_bucket_size`` over the rank's parameter count (default: the
buckets of ``acco_ds.cli.dsconfig``, which bench_memory runs: zero1 one bucket of the whole model,
zero2 buckets of a quarter). The ACCO modes follow ``acco_ds/core/buffers.py`` (``acco_held_bytes``
gives the exact bytes of ``GroupBuffers.held_bytes()`` for a padded element count: a test compares the
two); the DeepSpeed ones follow DeepSpeed 0.19.8's ``runtime/zero/stage_1_and_2.py``.
``zero1-overlap`` (ZeRO-1 with ``overlap_comm``, which bench_memory does not run) is zero1 plus the
second reduce bucket ``setup_buckets`` allocates for ``overlap_comm``.

``offloaded(...)`` splits the same lists for ``zero_optimization.offload_optimizer`` (device cpu): what stays on
the GPU and what the rank's process holds in host memory (``acco-plan --offload``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

CONTENDERS = ("zero1", "zero2", "sync", "dpu", "acco")
COMPRESSED = ("acco-int8",)
"""ACCO with every exchange int8 (``optimizer.params.compression`` commit, peek and all-gather int8)."""
COMPRESSION_BLOCK = 256  # the default block_size: one fp32 scale per block of int8 values
ACCO_MODES = ("sync", "dpu", "acco")
DTYPE_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}  # fp16 holds what bf16 does (its loss scaler: a few scalars)
FP32 = 4
ADAM_SHARD = 3 * FP32  # fp32 master + exp_avg + exp_avg_sq, per parameter of the shard
ACCO_STATE = "fp32 master + exp_avg + exp_avg_sq shards"
ZERO_MASTER = "fp32 master partition (single_partition_of_fp32_groups)"
ZERO_MOMENTS = "Adam exp_avg + exp_avg_sq of the partition"
OPTIMIZER_STATE = (ACCO_STATE, ZERO_MASTER, ZERO_MOMENTS)
"""The buffers optimizer offload moves from the GPU to host memory (``offloaded``)."""
OFFLOADABLE = ("zero1",) + ACCO_MODES


@dataclass(frozen=True)
class Buffer:
    name: str
    bytes_per_param: float
    kind: str  # held | transient | cpu-heap
    formula: (
        str  # in D (param/comm dtype size), C (comm dtype size when it differs), W, L (largest param / N)
    )


HOST_STEP_SCALARS = 8 * FP32 + FP32 + 4
"""Bytes of the staged host step's per-group scalars: the AdamW scalars' row (8 fp32), the scale (fp32) and the skip
flag (int32), staged beside the shards (``acco_ds.core.round_job.host_staging``)."""


def acco_held_bytes(
    mode: str, param_D: int, comm_D: int, world: int, padded_numel: int, offloaded: bool = False
) -> dict:
    """The bytes ``GroupBuffers.held_bytes()`` reports for one group of ``padded_numel`` elements; ``offloaded``: the
    optimizer state is in host memory (a GPU rank with optimizer offload), counted in ``host_shards``, and then (only
    then: the key is absent without offload, as in ``held_bytes()``) the staged host step's buffers of uncompressed
    rounds, allocated at set-up, in ``host_staging``: the reduced gradient shard
    (comm dtype; the step writes the new parameters over it where the dtypes match), a parameter shard of its own
    where they differ, and the scalars (:data:`HOST_STEP_SCALARS`). Compressed rounds stage other inputs
    (``acco_ds.core.round_job.host_staging``)."""
    n, s = padded_numel, padded_numel // world
    overlapped = mode != "sync"
    if param_D == comm_D:
        full = (3 if overlapped else 2) * n * param_D
    else:
        full = (2 if overlapped else 1) * n * (param_D + comm_D)
    tilde = comm_D * s if mode == "acco" else 0
    state = ADAM_SHARD * s
    held = {
        "full": full,
        "shards": tilde + (0 if offloaded else state),
        "host_shards": state if offloaded else 0,
    }
    if offloaded:
        held["host_staging"] = comm_D * s + (0 if param_D == comm_D else param_D * s) + HOST_STEP_SCALARS
    return held


def _acco(mode: str, D: int, W: int, largest_frac: float, comm_D: int) -> List[Buffer]:
    overlapped = mode != "sync"
    if comm_D == D:
        k = 3 if overlapped else 2
        out = [Buffer(f"{k} full buffers (param = comm dtype, rotating)", k * D, "held", f"{k} D")]
    else:
        k = 2 if overlapped else 1
        out = [
            Buffer(f"{k} full param buffer(s)", k * D, "held", f"{k} D"),
            Buffer(f"{k} full grad buffer(s) (comm dtype)", k * comm_D, "held", f"{k} C"),
        ]
    c = "D" if comm_D == D else "C"
    out.append(Buffer(ACCO_STATE, ADAM_SHARD / W, "held", "12/W"))
    if mode == "acco":
        out.append(Buffer("kept g~ shard (comm dtype)", comm_D / W, "held", f"{c}/W"))
    out.append(Buffer("gloo reduce-scatter receive buffer (one shard)", comm_D / W, "transient", f"{c}/W"))
    out.append(Buffer("autograd gradient of the largest parameter", D * largest_frac, "transient", "D L"))
    return out


def _zero1(D: int, W: int, bucket_frac: float = 1.0, overlap_comm: bool = False) -> List[Buffer]:
    """Peak at the gradient reduction of a step (engine.step -> reduce_gradients -> average_tensor ->
    allreduce_and_scatter -> allreduce_bucket), stage 1, contiguous_gradients. DeepSpeed allocates
    each reduce bucket at ``reduce_bucket_size`` elements (``setup_buckets``), however small the
    model; the flattened copy is of the gradients in one bucket; with a bucket smaller than the
    model, the ``.grad`` tensors not yet copied into it are still alive at the first reduction."""
    b = bucket_frac
    f = min(b, 1.0)
    c = "D" if b == 1.0 else f"{b:g} D"
    fD = D if f == 1.0 else D * f  # an int where the formula is a whole D, as it always was
    out = [
        Buffer("flat parameters (bit16_groups_flat)", D, "held", "D"),
        Buffer(ZERO_MASTER, FP32 / W, "held", "4/W"),
        Buffer(ZERO_MOMENTS, 2 * FP32 / W, "held", "8/W"),
    ]
    if b == 1.0:
        out.append(Buffer("contiguous reduce bucket (ipg buffer, all gradients)", D, "transient", "D"))
    else:
        out.append(Buffer("contiguous reduce bucket (ipg buffer)", D * b, "transient", c))
    if overlap_comm:
        out.append(Buffer("second reduce bucket (overlap_comm double buffer)", D * b, "transient", c))
    out.append(
        Buffer(
            "flattened copy of the bucket for the all-reduce (allreduce_bucket)",
            fD,
            "transient",
            "D" if f == 1.0 else f"{f:g} D",
        )
    )
    if f < 1.0:
        out.append(
            Buffer(
                "per-parameter .grad tensors not yet in the bucket", D * (1 - f), "transient", f"{1 - f:g} D"
            )
        )
    out.append(
        Buffer(
            "per-parameter .grad tensors, freed into the bucket",
            fD,
            "cpu-heap",
            "D" if f == 1.0 else f"{f:g} D",
        )
    )
    return out


def _zero2(D: int, W: int, bucket_frac: float = 0.25) -> List[Buffer]:
    """Peak during a backward, stage 2, overlap_comm (two reduce buckets), contiguous_gradients."""
    b = bucket_frac
    f = min(b, 1.0)
    return [
        Buffer("flat parameters (bit16_groups_flat)", D, "held", "D"),
        Buffer("fp32 master partition (single_partition_of_fp32_groups)", FP32 / W, "held", "4/W"),
        Buffer("Adam exp_avg + exp_avg_sq of the partition", 2 * FP32 / W, "held", "8/W"),
        Buffer(
            "gradient partition (grads_in_partition), old + new during the copy",
            2 * D / W,
            "transient",
            "2 D/W",
        ),
        Buffer(
            "two reduce buckets of N/4 (overlap_comm)" if b == 0.25 else "two reduce buckets (overlap_comm)",
            2 * D * b,
            "transient",
            "D/2" if b == 0.25 else f"{2 * b:g} D",
        ),
        Buffer(
            "flattened copy of one bucket for the all-reduce",
            D * f,
            "transient",
            "D/4" if b == 0.25 else f"{f:g} D",
        ),
    ]


def buffers(
    contender: str,
    D: int,
    W: int,
    largest_frac: float = 0.0,
    comm_D: int | None = None,
    bucket_frac: float | None = None,
) -> List[Buffer]:
    if bucket_frac is not None and not bucket_frac > 0:
        raise ValueError(f"bucket_frac must be > 0, got {bucket_frac}")
    if contender == "zero1":
        return _zero1(D, W, 1.0 if bucket_frac is None else bucket_frac)
    if contender == "zero1-overlap":
        return _zero1(D, W, 1.0 if bucket_frac is None else bucket_frac, overlap_comm=True)
    if contender == "zero2":
        return _zero2(D, W, 0.25 if bucket_frac is None else bucket_frac)
    if contender in ACCO_MODES:
        return _acco(contender, D, W, largest_frac, comm_D or D)
    if contender.endswith("-int8") and contender.removesuffix("-int8") in ACCO_MODES:
        mode = contender.removesuffix("-int8")
        return _acco(mode, D, W, largest_frac, comm_D or D) + compression_buffers(D, comm_D or D, W)
    allowed = ", ".join(CONTENDERS + ("zero1-overlap",) + COMPRESSED)
    raise ValueError(f"unknown contender {contender!r}; choose from {allowed}")


def offloaded(
    contender: str,
    D: int,
    W: int,
    largest_frac: float = 0.0,
    comm_D: int | None = None,
    bucket_frac: float | None = None,
) -> tuple:
    """``(gpu, host)``: the buffers of ``buffers(contender, ...)`` with the optimizer offloaded to the host
    (``zero_optimization.offload_optimizer`` device cpu), per parameter of the GPU. The fp32 master and both
    moments (``OPTIMIZER_STATE``) move to ``host``; nothing else leaves the GPU. acco_ds (``acco_ds/core/host_step.py``)
    adds host staging buffers, reused every round: one reduced gradient shard (comm dtype) and one parameter shard;
    every other buffer, the kept g~ included, stays on the GPU. DeepSpeed ZeRO-1 (0.19.8, ``stage_1_and_2.py`` with
    ``cpu_offload``) adds the gradient partition in fp32 on the host (``single_partition_of_fp32_groups[i].grad``),
    a parameter-dtype copy of the partition (``param_buffer_of_bit16_for_cpu_offload_groups``) and a buffer of the
    largest parameter on each side (``temp_grad_buffer_for_gpu_offload``, ``temp_grad_buffer_for_cpu_offload``).
    Every host buffer is held (pinned with ``pin_memory``). ``contender``: one of ``OFFLOADABLE``."""
    if contender not in OFFLOADABLE:
        raise ValueError(f"no offload model for {contender!r}; choose from {', '.join(OFFLOADABLE)}")
    every = buffers(contender, D, W, largest_frac, comm_D, bucket_frac)
    gpu = [b for b in every if b.name not in OPTIMIZER_STATE]
    host = [b for b in every if b.name in OPTIMIZER_STATE]
    if contender == "zero1":
        gpu.append(Buffer("GPU staging of the largest parameter's gradient", D * largest_frac, "held", "D L"))
        host += [
            Buffer("fp32 gradient partition (the host step's input)", FP32 / W, "held", "4/W"),
            Buffer("parameter-dtype copy of the partition (copied to the GPU)", D / W, "held", "D/W"),
            Buffer("host buffer of the largest parameter's gradient", D * largest_frac, "held", "D L"),
        ]
    else:
        C = comm_D or D
        host += [
            Buffer(
                "staging: the reduced gradient shard (comm dtype)", C / W, "held", "C/W" if C != D else "D/W"
            ),
            Buffer("staging: the new parameter shard", D / W, "held", "D/W"),
        ]
    return gpu, host


def compression_buffers(D: int, comm_D: int, W: int, block: int = COMPRESSION_BLOCK) -> List[Buffer]:
    """What int8 compression adds to an acco_ds mode (``acco_ds.core.compressed_comm``): the error-feedback
    residual, held (one full buffer in the comm dtype: the most compression may cost over the same mode
    uncompressed, in held memory); while a round exchanges, the whole buffer's int8 values and fp32 scales (sent)
    and every rank's chunk of this rank's shard (received: W shards of int8 and scales, which the norm and the
    step read unsummed; no fp32 temporary)."""
    c = "D" if comm_D == D else "C"
    return [
        Buffer("error-feedback residual (full, comm dtype)", comm_D, "held", c),
        Buffer(
            "int8 values + fp32 scales of the buffer (a round's exchange)",
            1 + 4 / block,
            "transient",
            "1 + 4/B",
        ),
        Buffer(
            "the W ranks' int8 chunks + scales of this rank's shard (received)",
            1 + 4 / block,
            "transient",
            "1 + 4/B",
        ),
    ]


def held(bufs: List[Buffer]) -> float:
    return sum(b.bytes_per_param for b in bufs if b.kind == "held")


def peak(bufs: List[Buffer], cpu: bool = True) -> float:
    """Bytes per parameter alive at the peak (the CPU heap's retained bytes counted on CPU only)."""
    return sum(b.bytes_per_param for b in bufs if b.kind != "cpu-heap" or cpu)


def goal_bound(D: int, W: int) -> float:
    """The memory goal's bound on ACCO's extra peak over ZeRO-1: 1.10 x (one full buffer + the g~ shard)."""
    return 1.10 * (D + D / W)


def estimate_rank_bytes(
    contender: str, D: int, W: int, n_params: int, largest_frac: float, baseline: float
) -> float:
    """A rank's expected peak, for deciding whether a run fits: the baseline, the analytic peak,
    plus D per parameter (the model as built before it is flattened, activations, allocator slack)."""
    return baseline + n_params * (peak(buffers(contender, D, W, largest_frac)) + D)
