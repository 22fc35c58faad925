"""What the offload benchmark runs, and why at that size (pure arithmetic, no torch).

The contenders (``CONTENDERS``, in run order: what the goals need first), each a DeepSpeed config of the same
bf16 Llama, micro-batch, accumulation, AdamW settings and clipping, at W = 1:

- ``compute-only``: acco_ds ``dpu`` with fixed accumulation and NO offload: the project's compute-only bound
  (benchmarks/harness/runs.py ``BOUND_LOOP``, docs/BENCHMARKS.md "The compute-only bound"): the contenders'
  engine, loop and gradient buffers, the fp32 master and moments on the GPU, the AdamW step in the round's job on
  the side stream (a few ms of a step at W = 1), no communication (a one-rank group's collectives move no byte).
  The model alone (plain PyTorch forward + backward, no engine, no optimizer) is measured in the same process and
  reported beside it.
- ``zero1-offload``: DeepSpeed ZeRO-1 + ``offload_optimizer`` cpu, pinned (ZeRO-Offload: DeepSpeedCPUAdam), the
  config the issue names, DeepSpeed's defaults otherwise (overlap_comm false at stages 1-2);
- ``zero2-offload``: the same at stage 2;
- ``zenflow``: DeepSpeed ZeRO-2 + offload + ``zenflow: {"overlap_step": true, "update_interval": gas}``, ZenFlow's
  defaults otherwise (topk_ratio 0.1, select_strategy and select_interval "auto", half the cores kept for PyTorch)
  as DeepSpeed 0.19.8 ships them (``deepspeed/runtime/zenflow/zenflow_config.py``). Not its default update_interval
  "auto": with it the loss was NaN from the second micro-batch on here (CPU, W = 1, bf16 and fp32 alike; the cause
  not found; ``--zenflow-update-interval auto`` tries it). ZenFlow sets the engine's accumulation to its
  update_interval, so the other contenders' accumulation gives it one host step per the same samples;
- ``acco-offload-fixed`` / ``acco-offload-adaptive``: ``"optimizer": {"type": "ACCO", "params": {"mode": "acco",
  "accumulation": "fixed" | "adaptive"}}`` + the same ``offload_optimizer`` section, stage 1.

Sizing (``predict``): a step's compute is 6 x (N - V d) FLOPs per token (the input embedding is a lookup, the
lm_head a matmul) plus causal attention's 6 L s d per token, at ``ASSUMED_TFLOPS``; the host step is DeepSpeedCPUAdam's
28 bytes per parameter (fp32 gradient in; master, exp_avg, exp_avg_sq read and written) at ``ASSUMED_HOST_BW``.
Their ratio, host / compute = 28 F / (6 tokens-per-step BW), does not depend on N: the tokens per optimizer step set
it. ``--gas auto`` measures both in the compute-only process (the model alone's micro-batch, DeepSpeedCPUAdam's
host rate) and picks the even accumulation that puts the host step nearest ``RATIO_TARGET`` x a step's compute.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from benchmarks.gpu_overlap.cli import ModelSize, llama_param_count

CONTENDERS = (
    "compute-only",
    "zero1-offload",
    "acco-offload-fixed",
    "acco-offload-adaptive",
    "zenflow",
    "zero2-offload",
)
OFFLOADED = tuple(c for c in CONTENDERS if c != "compute-only")
ACCO_OFFLOAD = ("acco-offload-fixed", "acco-offload-adaptive")

SIZES = {
    # 0.95B: TinyLlama's width (2048, intermediate 5632, 32000 tokens) at 16 layers, multi-head attention
    "1b": ModelSize(hidden=2048, intermediate=5632, layers=16, heads=16, kv_heads=16, vocab=32000),
    "0.5b": ModelSize(hidden=1536, intermediate=4096, layers=16, heads=12, kv_heads=12, vocab=32000),
    "tiny": ModelSize(hidden=64, intermediate=176, layers=2, heads=4, kv_heads=4, vocab=512),
}

HP = {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
CLIP = 1.0
OFFLOAD = {"device": "cpu", "pin_memory": True}

RATIO_TARGET = 0.5
"""``--gas auto`` aims the host step at this fraction of a step's compute: the fixed-ACCO goal's regime ("where the
host step is about half the compute"), inside the adaptive goal's (up to one step's compute)."""
GAS_RANGE = (2, 64)

ASSUMED_TFLOPS = 300e12
"""Achieved bf16 FLOP/s of a transformers Llama's forward + backward on an H200: 38% of the 790 TFLOP/s its 8192^3
matmul measured here (the device tool's KINDS.md); the gpu_overlap runs on H200s measured 32 ms per micro-batch of
8 x 1024 tokens for the 168M model (222 TFLOP/s at 6 x its 136M non-embedding parameters per token, narrower
matmuls than these sizes). A prediction only: the run measures the micro-batch."""
ASSUMED_HOST_BW = 80e9
"""Bytes/s DeepSpeedCPUAdam streams on the 16 host cores of the lent H200 machine (an Intel Xeon VM): an assumption
between the 47-49 GB/s two cores of this project's EPYC measured (docs/OFFLOAD.md) and a socket's DDR5 bandwidth
shared by other tenants. The run measures it (the host rows)."""
ASSUMED_PCIE_BW = 40e9
"""Bytes/s of a pinned host <-> H200 copy each way (PCIe 5.0 x16: 64 GB/s raw)."""
HOST_STEP_BYTES = 28
"""DeepSpeedCPUAdam's bytes per parameter: fp32 gradient read, master and both moments read and written."""


@dataclass(frozen=True)
class Steps:
    """Optimizer steps per contender: ``warmup`` untimed, ``timed`` in the measured window, then ``profile`` steps on
    the profiler's kernel timeline after one unrecorded step (0: no profile, the idle fraction n/a)."""

    warmup: int = 2
    timed: int = 5
    profile: int = 1

    def micro_batches(self, gas: int) -> int:
        return gas * (self.warmup + self.timed + (self.profile + 1 if self.profile else 0))


GPU_STEPS = Steps(2, 5, 1)
TINY_STEPS = Steps(1, 2, 0)


def ds_config(label: str, micro_batch: int, gas: int, zenflow_update_interval="gas") -> dict:
    """The DeepSpeed config of contender ``label`` (W = 1, bf16, clipping 1.0, the throughput timer unsynchronised
    so that no contender syncs the device per micro-batch); ZenFlow's update_interval: ``"gas"`` (the accumulation),
    ``"auto"`` or an integer."""
    base = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "bf16": {"enabled": True},
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "timers": {"throughput": {"synchronized": False}},
    }
    adamw = {"type": "AdamW", "params": dict(HP)}
    if label == "compute-only":
        opt = {"type": "ACCO", "params": {**HP, "mode": "dpu", "accumulation": "fixed"}}
        return {**base, "optimizer": opt, "zero_optimization": {"stage": 1}}
    if label in ("zero1-offload", "zero2-offload"):
        stage = int(label[4])
        return {
            **base,
            "optimizer": adamw,
            "zero_optimization": {"stage": stage, "offload_optimizer": dict(OFFLOAD)},
        }
    if label == "zenflow":
        interval = gas if zenflow_update_interval == "gas" else zenflow_update_interval
        zenflow = {"overlap_step": True, "update_interval": interval}
        zero = {"stage": 2, "offload_optimizer": dict(OFFLOAD), "zenflow": zenflow}
        return {**base, "optimizer": adamw, "zero_optimization": zero}
    if label in ACCO_OFFLOAD:
        acc = label.rsplit("-", 1)[1]
        opt = {"type": "ACCO", "params": {**HP, "mode": "acco", "accumulation": acc}}
        return {
            **base,
            "optimizer": opt,
            "zero_optimization": {"stage": 1, "offload_optimizer": dict(OFFLOAD)},
        }
    raise ValueError(f"unknown contender {label!r}; choose from {', '.join(CONTENDERS)}")


def flops_per_token(size: ModelSize, seq: int) -> float:
    """Forward + backward FLOPs per token: 6 x the parameters a token multiplies through (all but the input
    embedding) + causal attention (QK^T and AV over s/2 keys on average: 2 s d forward per layer, x 3)."""
    n = llama_param_count(size) - size.vocab * size.hidden
    return 6.0 * n + 6.0 * size.layers * seq * size.hidden


def predict(size: ModelSize, seq: int, micro_batch: int, gas: int, tflops: float = ASSUMED_TFLOPS,
            host_bw: float = ASSUMED_HOST_BW, pcie_bw: float = ASSUMED_PCIE_BW) -> dict:  # fmt: skip
    """The sizing figures under the stated assumptions (seconds): a micro-batch's and a step's compute, the host
    step, their ratio, and the ZeRO-Offload step (compute + fp32 gradient down + host step + bf16 parameters up)."""
    n = llama_param_count(size)
    t_mb = flops_per_token(size, seq) * seq * micro_batch / tflops
    host = HOST_STEP_BYTES * n / host_bw
    copies = (4 + 2) * n / pcie_bw
    return {
        "params": n,
        "tokens_per_step": seq * micro_batch * gas,
        "compute_mb_s": t_mb,
        "compute_step_s": t_mb * gas,
        "host_step_s": host,
        "host_over_compute": host / (t_mb * gas),
        "zero_offload_step_s": t_mb * gas + copies + host,
        "assumed": {
            "tflops": tflops,
            "host_bw": host_bw,
            "pcie_bw": pcie_bw,
            "host_bytes_per_param": HOST_STEP_BYTES,
        },
    }


def choose_gas(host_step_s: float, t_mb_s: float, target: float = RATIO_TARGET, bounds=GAS_RANGE) -> int:
    """The even accumulation whose step compute (gas x t_mb) puts host_step / compute nearest ``target`` (ratios
    compared on a log scale), within ``bounds``."""
    lo, hi = bounds
    best, best_err = lo, float("inf")
    for gas in range(lo, hi + 1, 2):
        err = abs(math.log(host_step_s / (gas * t_mb_s) / target))
        if err < best_err:
            best, best_err = gas, err
    return best


def size_dict(size: ModelSize) -> dict:
    return asdict(size)
