"""The performance model of ``acco-plan``: step time, samples/s and memory per GPU of every contender.

Contract: ``predict(PlanInputs) -> Plan``. Pure arithmetic on the inputs (no torch, no DeepSpeed);
the equations are written down in docs/PLAN.md and each contender's rule is in ``_rows``:

- ``zero1``: DeepSpeed ZeRO-1; the gradients are ALL-REDUCED (DeepSpeed's default
  ``use_multi_rank_bucket_allreduce``) after the step's compute, then the optimizer step, then the
  all-gather: ``T = t_c + T_ar + T_opt_ds + T_ag``.
- ``zero1-overlap``: ZeRO-1 with ``overlap_comm``: stage 1 reduces only in the backward of the last
  micro-batch of the step, bucket by bucket as buckets fill, on a side stream; the exposed part of the
  all-reduce is ``max(T_ar/n_b, T_ar - t_bwd (1 - 1/n_b))`` with ``n_b`` buckets and ``t_bwd`` that
  micro-batch's backward. On the CPU accelerator DeepSpeed's streams are no-ops: nothing overlaps.
- ``zero2``: ZeRO-2 with ``overlap_comm``: the same overlapped all-reduce after EVERY micro-batch.
- ``sync``: acco_ds sync: ``T = t_c + T_rs + T_commit + T_ag`` (a reduce-scatter, not an all-reduce).
- ``dpu``: one round per step overlapped with the previous step's communication: ``max(t_c, C)``.
- ``acco``: two rounds per step, each ``max(t_c/2, C_round)`` (the first round's job is a peek).
- ``acco-adaptive``: each round runs at least GAS/2 micro-batches and ends at the first micro-batch
  boundary after its communication: ``k' = max(GAS/2, ceil(C_round / t_mb))``; the compute never
  waits, so samples/s is the compute-only rate and a step holds ``k'_1 + k'_2`` micro-batches.

with ``t_c = GAS t_mb`` and ``C_round = T_rs + T_opt + T_ag`` (acco_ds's fused AdamW over the shard).

Compressed rounds (``optimizer.params.compression``, every exchange int8: commit, peek and all-gather;
docs/ALGORITHM.md "Compressed rounds"): the rows ``sync-int8``, ``acco-int8`` and ``acco-adaptive-int8`` are
the rules above with ``C_round8 = T_rs(n (1 + 4/B)) + T_opt + T_ag(n (1 + 4/B)) + T_q`` (int8 plus one fp32
scale per block of B; ``T_q`` the job's quantize / dequantize passes at ``hbm_bw``, ``quant_bytes_per_param``:
with fixed accumulation the gradients are quantized in each round's last backward, ``fold_extra_bytes_per_param``
more on the compute per round and that pass out of ``T_q``; adaptive rounds quantize them in their job) and
one more full buffer held (the error-feedback residual, in the comm dtype) plus a round's int8 values and one fp32
chunk while it exchanges (``memory_model.compression_buffers``).

The rows are those without offload whatever ``inputs.offload`` says: ``planner.predict`` adds the rows of
``offload.CONTENDERS`` after them (the optimizer state in host memory: ``offload.add_rows``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List

from acco_ds.plan import memory_model
from acco_ds.plan.comm import Topology
from acco_ds.plan.primitives import DTYPE_SIZE, adaptive_round_micro_batches, opt_bytes_per_param
from acco_ds.plan.quality import MAX_PEEK_LR_SCALE

MIXED_HALVES = {"bf16", "fp16"}
"""The parameter / communication dtype pair the plan refuses: fp16 and bf16 do not mix (acco_ds's optimizer refuses
it)."""
CONTENDERS = ("zero1", "zero1-overlap", "zero2", "sync", "dpu", "acco", "acco-adaptive")
COMPRESSED_CONTENDERS = ("sync-int8", "acco-int8", "acco-adaptive-int8")
"""acco_ds with every exchange int8 (commit, peek, all-gather)."""
GPU_COMPRESSION_NOTE = (
    "acco_ds's GPU compression has run on one GPU only (no NCCL all-to-all across ranks yet), where its quantize "
    "kernels moved 53-102% of the copy bandwidth at 10M and 100M elements (H200, run h200_2026-11-28_9524805 of "
    "benchmarks/results/gpu_checks: docs/GPU.md)"
)
"""Why acco-plan does not recommend compression with ``--accelerator gpu`` (its rows are still modelled)."""
COMPRESSION_CONFIG = {"commit": "int8", "peek": "int8", "all_gather": "int8"}
BACKWARD_SHARE = 2.0 / 3.0  # of a micro-batch's compute: backward ~ 2x forward
DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the model needs, in SI units (bytes, bytes/s, seconds); a value out of range raises
    ValueError naming the field (the CLI checks its options before, with their names)."""

    params: float  # the model's trainable parameters (all tensor-parallel ranks together)
    t_micro_batch: float  # seconds of compute of one micro-batch on one GPU (forward + backward)
    micro_batch: int
    gas: int  # micro-batches per optimizer step per data-parallel rank
    nodes: int = 1
    gpus_per_node: int = 8
    tp: int = 1
    param_dtype: str = "bf16"
    comm_dtype: str = "bf16"
    intra_bw: float = 0.0  # bytes/s per rank (bus bandwidth)
    intra_latency: float = 5e-6
    inter_bw: float = 0.0  # bytes/s per node
    inter_latency: float = 10e-6
    hbm_bw: float = 2e12  # bytes/s the optimizer step streams at
    accelerator: str = "gpu"  # "cpu": DeepSpeed's side streams are no-ops (overlap_comm overlaps nothing)
    reduce_bucket: float = DEEPSPEED_BUCKET  # DeepSpeed's reduce_bucket_size, elements
    largest_frac: float = 0.0  # the largest parameter tensor / all parameters (an autograd transient)
    tokens_per_micro_batch: float | None = None
    gpu_memory: float | None = None  # bytes; None: no fit check
    block_size: int = 256  # compressed rounds: elements per int8 block (one fp32 scale each)
    offload: bool = False  # planner.predict adds the optimizer-offload rows (offload.add_rows)
    pcie_bw: float = 25e9  # bytes/s of one GPU's host copies, each direction (offload.PCIE_BW)
    host_adam_bw: float = 49e9  # bytes/s of acco_ds's host AdamW per GPU (offload.HOST_ADAM_BW)
    host_adam_bw_deepspeed: float = (
        47e9  # bytes/s of DeepSpeedCPUAdam per GPU (offload.HOST_ADAM_BW_DEEPSPEED)
    )
    train_steps: int | None = None  # the run's optimizer steps, when known (picks the quality study's regime)
    peek_lr_scale: float = 1.0  # the ACCO config's optimizer.params.peek_lr_scale (picks the study's variant)

    def __post_init__(self) -> None:
        def bad(name, allowed):
            raise ValueError(f"PlanInputs.{name}={getattr(self, name)!r}: must be {allowed}")

        for name in ("params", "t_micro_batch", "hbm_bw", "reduce_bucket", "pcie_bw", "host_adam_bw",
                     "host_adam_bw_deepspeed"):  # fmt: skip
            if not getattr(self, name) > 0:
                bad(name, "> 0")
        for name in ("micro_batch", "gas", "nodes", "gpus_per_node", "tp", "block_size"):
            if getattr(self, name) < 1:
                bad(name, "an integer >= 1")
        if self.gpus_per_node % self.tp:
            bad("tp", f"a divisor of gpus_per_node={self.gpus_per_node}")
        for name in ("param_dtype", "comm_dtype"):
            if getattr(self, name) not in DTYPE_SIZE:
                bad(name, f"one of {', '.join(DTYPE_SIZE)}")
        if {self.param_dtype, self.comm_dtype} == MIXED_HALVES:
            bad(
                "comm_dtype",
                f"{self.param_dtype} or fp32 with param_dtype={self.param_dtype!r} (fp16 and bf16 do not mix)",
            )
        if self.accelerator not in ("gpu", "cpu"):
            bad("accelerator", "'gpu' or 'cpu'")
        if self.offload and self.accelerator != "gpu":
            bad(
                "offload",
                "False with accelerator='cpu' (a CPU rank's optimizer state is in host memory already)",
            )
        if self.gpus_per_node // self.tp > 1 and not self.intra_bw > 0:
            bad("intra_bw", "> 0 when a node holds more than one data-parallel rank")
        if self.nodes > 1 and not self.inter_bw > 0:
            bad("inter_bw", "> 0 with more than one node")
        for name in ("intra_latency", "inter_latency"):
            if getattr(self, name) < 0:
                bad(name, ">= 0")
        if not 0 <= self.largest_frac <= 1:
            bad("largest_frac", "in [0, 1]")
        if self.train_steps is not None and self.train_steps < 1:
            bad("train_steps", "None or an integer >= 1")
        if not 0 < self.peek_lr_scale <= MAX_PEEK_LR_SCALE:
            bad("peek_lr_scale", f"in (0, {MAX_PEEK_LR_SCALE:g}]")

    @property
    def dp_world(self) -> int:
        return self.nodes * self.gpus_per_node // self.tp

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens of one optimizer step over all data-parallel ranks (None when the tokens per micro-batch are not
        known)."""
        if not self.tokens_per_micro_batch:
            return None
        return self.tokens_per_micro_batch * self.gas * self.dp_world

    @property
    def params_per_gpu(self) -> float:
        return self.params / self.tp


@dataclass
class Row:
    contender: str
    step_s: float | None  # None: not available with these inputs (reason in note)
    samples_per_s: float | None
    micro_batches_per_step: float | None  # per data-parallel rank
    memory_bytes: float  # per GPU: model states and communication buffers, no activations
    memory_bytes_per_param: float  # at the peak (memory_model.peak)
    memory_held_bytes_per_param: float  # allocated for the whole run (memory_model.held)
    x_zero1: float | None = None  # samples/s over ZeRO-1's
    exposed_comm_s: float | None = None  # per step, time the compute waits for communication
    fits: bool | None = None
    note: str = ""
    host_memory_bytes: float | None = None  # offload rows: per GPU, what its process holds in host memory


@dataclass
class Plan:
    inputs: dict
    derived: dict
    rows: List[Row] = field(default_factory=list)

    def row(self, contender: str) -> Row:
        return next(r for r in self.rows if r.contender == contender)

    def to_dict(self) -> dict:
        return {"inputs": self.inputs, "derived": self.derived, "rows": [asdict(r) for r in self.rows]}


UNSTORED_SUM_MAX_WORLD = 3
"""``acco_ds.core.round_job.UNSTORED_SUM_MAX_WORLD`` (the planner stands alone; a test keeps the two equal)."""


def quant_bytes_per_param(D: int, C: int, W: int, fused_round_end: bool = False) -> float:
    """Bytes a compressed round's job streams in its quantize / dequantize passes per parameter of the full buffer
    (all int8): the gradients quantized with the residual (read the gradient and the residual, write q and the
    residual: ``3 C + 1``; none with ``fused_round_end``: the round's last backward quantized them,
    :func:`fold_extra_bytes_per_param`), the owner's W chunks of its shard read by the norm's and the step's passes
    (``2``, up to :data:`UNSTORED_SUM_MAX_WORLD` ranks; beyond, summed once into the shard: ``(W + C) / W``), the
    parameter difference of the shard quantized (``(2 D + 1) / W``) and applied to every chunk (read the
    base and q, write the parameter: ``2 D + 1``). The scales are left out (4/B of the values), and so is the
    step's and the norm's read of a stored sum (counted with the step)."""
    owner_sum = 2 if W <= UNSTORED_SUM_MAX_WORLD else (W + C) / W
    quantize = 0 if fused_round_end else 3 * C + 1
    return quantize + owner_sum + (2 * D + 1) / W + 2 * D + 1


def fold_extra_bytes_per_param(C: int) -> int:
    """What the fused round end (``acco_ds.core.fused_round_end``, fixed accumulation) adds to the compute side per
    parameter of the buffer, per round: its fold reads the buffer and the gradient, reads and writes the residual
    and writes q (``3 C + D + 1``) where the last accumulation read the buffer and the gradient and wrote the
    buffer (``2 C + D``): ``C + 1``."""
    return C + 1


def exposed_overlapped_reduce(t_reduce: float, t_backward: float, n_buckets: int, can_overlap: bool) -> float:
    """The part of an all-reduce of ``n_buckets`` equal buckets that outlasts the backward producing
    them: bucket j is ready at ``t_backward j/n``, the reductions run one after another on one stream,
    so the last ends ``max_j (t_backward j/n + (n - j + 1) t_reduce/n)`` after the backward starts."""
    if not can_overlap or n_buckets <= 1:
        return t_reduce
    return max(t_reduce / n_buckets, t_reduce - t_backward * (1 - 1 / n_buckets))


def _derived(i: PlanInputs) -> dict:
    D, C = DTYPE_SIZE[i.param_dtype], DTYPE_SIZE[i.comm_dtype]
    W = i.dp_world
    # the tp tensor-parallel ranks of a node each run their own data-parallel collectives at the
    # same time, through the same network: each data-parallel group gets bw_node / tp of it
    topo = Topology(
        i.nodes, i.gpus_per_node // i.tp, i.intra_bw, i.intra_latency, i.inter_bw / i.tp, i.inter_latency
    )
    n_g = i.params_per_gpu
    nbytes = n_g * C
    shard = n_g / W
    rs, ag, ar = topo.reduce_scatter(nbytes), topo.all_gather(nbytes), topo.all_reduce(nbytes)
    t_commit = opt_bytes_per_param("commit", D, C) * shard / i.hbm_bw
    t_peek = opt_bytes_per_param("peek", D, C) * shard / i.hbm_bw
    t_ds_opt = opt_bytes_per_param("deepspeed", D, C) * shard / i.hbm_bw
    t_c = i.gas * i.t_micro_batch
    comm_commit = rs + t_commit + ag
    packed = n_g * (1 + 4 / i.block_size)  # int8 values + one fp32 scale per block
    rs8, ag8 = topo.reduce_scatter(packed), topo.all_gather(packed)
    t_q = quant_bytes_per_param(D, C, W) * n_g / i.hbm_bw
    t_q_fused = quant_bytes_per_param(D, C, W, fused_round_end=True) * n_g / i.hbm_bw
    t_fold = fold_extra_bytes_per_param(C) * n_g / i.hbm_bw
    return {
        "dp_world": W,
        "ranks_per_node": i.gpus_per_node // i.tp,
        "params_per_gpu": n_g,
        "comm_bytes": nbytes,
        "reduce_scatter_s": rs,
        "all_gather_s": ag,
        "all_reduce_s": ar,
        "rs_phases": topo.phases(nbytes),
        "opt_commit_s": t_commit,
        "opt_peek_s": t_peek,
        "opt_deepspeed_s": t_ds_opt,
        "compute_step_s": t_c,
        "comm_round_s": comm_commit,  # acco_ds: reduce-scatter + commit + all-gather
        "comm_round_peek_s": rs + t_peek + ag,
        "int8_bytes": packed,
        "int8_reduce_scatter_s": rs8,
        "int8_all_gather_s": ag8,
        "quantize_s": t_q,
        # fixed accumulation: the rounds quantized in their last backward (the job's passes t_q_fused, the compute's
        # fold_s more per round); adaptive rounds: by their jobs (t_q)
        "quantize_fused_s": t_q_fused,
        "fold_s": t_fold,
        "comm_round_int8_s": rs8 + t_commit + ag8 + t_q_fused,
        "comm_round_peek_int8_s": rs8 + t_peek + ag8 + t_q_fused,
        "comm_round_int8_unfused_s": rs8 + t_commit + ag8 + t_q,
        "comm_round_peek_int8_unfused_s": rs8 + t_peek + ag8 + t_q,
        "comm_compute_ratio": comm_commit / t_c,
        "reduce_buckets": max(1, math.ceil(n_g / i.reduce_bucket)),
        "bucket_frac": i.reduce_bucket / n_g,
        "tokens_per_micro_batch": i.tokens_per_micro_batch,
        # optimizer.params.memory_state (acco_ds.core.commit_records, core.peer_copies): per rank and step, to the
        # copy's holder on another node (one node: none), the commit's inputs (peer_copy_form 'inputs', the
        # default: the reduced gradient shard in the communication dtype, core.commit_inputs) or its state (fp32
        # master shard and both moments); in host memory the rank's two records and the two of the rank it holds
        # the copies of, and with inputs the rank's two slots of them and the one of its ward's it receives
        "memory_state_bytes_per_step": C * shard if i.nodes > 1 else 0.0,
        "memory_state_state_bytes_per_step": STATE_COPY_BYTES * shard if i.nodes > 1 else 0.0,
        # every rank of a node sends its copy through the node's link at the same time
        "memory_state_inter_s": C * shard * i.gpus_per_node / i.inter_bw if i.nodes > 1 else 0.0,
        "memory_state_state_inter_s": STATE_COPY_BYTES * shard * i.gpus_per_node / i.inter_bw
        if i.nodes > 1
        else 0.0,
        "memory_state_host_bytes": STATE_COPY_BYTES * shard * (4 if i.nodes > 1 else 2)
        + (3 * C * shard if i.nodes > 1 else 0.0),
    }


STATE_COPY_BYTES = 12
"""Bytes per element of a rank's shard in one record of its committed state: fp32 master, exp_avg, exp_avg_sq."""


def memory_buffers(contender: str, i: PlanInputs, d: dict) -> list:
    """What one GPU holds at its peak (memory_model, the formulas bench_memory prints), per parameter
    of the GPU: DeepSpeed's buckets at ``--reduce-bucket-size``, the world the data-parallel one."""
    D, C = DTYPE_SIZE[i.param_dtype], DTYPE_SIZE[i.comm_dtype]
    name = contender.replace("acco-adaptive", "acco")
    bucket = d["bucket_frac"] if name.startswith("zero") else None
    return memory_model.buffers(name, D, d["dp_world"], i.largest_frac, C, bucket_frac=bucket)


def _rows(i: PlanInputs, d: dict) -> Dict[str, dict]:
    t_mb, t_c, G = i.t_micro_batch, d["compute_step_s"], i.gas
    ag, ar = d["all_gather_s"], d["all_reduce_s"]
    c_commit, c_peek = d["comm_round_s"], d["comm_round_peek_s"]
    gpu = i.accelerator == "gpu"
    nb = d["reduce_buckets"]
    t_bwd = BACKWARD_SHARE * t_mb
    out: Dict[str, dict] = {}

    tail = d["opt_deepspeed_s"] + ag  # DeepSpeed's step after the reduction: AdamW, then all-gather
    bucket = f"reduce bucket {i.reduce_bucket:.3g} elements = {d['bucket_frac']:.2g} x the parameters"
    out["zero1"] = {"step": t_c + ar + tail, "mbs": G, "exposed": ar + tail, "note": bucket}
    x1 = exposed_overlapped_reduce(ar, t_bwd, nb, gpu)
    out["zero1-overlap"] = {
        "step": t_c + x1 + tail,
        "mbs": G,
        "exposed": x1 + tail,
        "note": (
            f"{nb} bucket(s); reduces in the last micro-batch's backward"
            if gpu
            else "CPU accelerator: DeepSpeed's streams are no-ops, nothing overlaps"
        ),
    }
    x2 = exposed_overlapped_reduce(ar, t_bwd, nb, gpu)
    out["zero2"] = {
        "step": G * (t_mb + x2) + tail,
        "mbs": G,
        "exposed": G * x2 + tail,
        "note": f"an all-reduce after each of the {G} micro-batches",
    }
    out["sync"] = {"step": t_c + c_commit, "mbs": G, "exposed": c_commit}
    out["dpu"] = {"step": max(t_c, c_commit), "mbs": G, "exposed": max(0.0, c_commit - t_c)}
    fold = d["fold_s"]  # a fused round end's extra compute, per round (fixed accumulation)
    if G % 2:
        c8 = d["comm_round_int8_s"]
        out["sync-int8"] = {"step": t_c + fold + c8, "mbs": G, "exposed": c8}
        na = {"step": None, "mbs": None, "exposed": None, "note": f"needs an even GAS (got {G})"}
        for name in ("acco", "acco-adaptive", "acco-int8", "acco-adaptive-int8"):
            out[name] = dict(na)
        return {k: out[k] for k in CONTENDERS + COMPRESSED_CONTENDERS}
    c8_commit, c8_peek = d["comm_round_int8_s"], d["comm_round_peek_int8_s"]
    out["sync-int8"] = {"step": t_c + fold + c8_commit, "mbs": G, "exposed": c8_commit}
    unfused = (d["comm_round_peek_int8_unfused_s"], d["comm_round_int8_unfused_s"])
    for tag, peek, commit, extra, (a_peek, a_commit) in (
        ("", c_peek, c_commit, 0.0, (c_peek, c_commit)),
        ("-int8", c8_peek, c8_commit, fold, unfused),
    ):
        half = t_c / 2 + extra
        step = max(half, peek) + max(half, commit)
        out["acco" + tag] = {"step": step, "mbs": G, "exposed": step - t_c - 2 * extra}
        k = G // 2
        k1 = adaptive_round_micro_batches(k, a_peek, t_mb)
        k2 = adaptive_round_micro_batches(k, a_commit, t_mb)
        out["acco-adaptive" + tag] = {
            "step": (k1 + k2) * t_mb,
            "mbs": k1 + k2,
            "exposed": 0.0,
            "note": f"rounds of {k1} + {k2} micro-batches (at least {k} each)",
        }
    return {k: out[k] for k in CONTENDERS + COMPRESSED_CONTENDERS}


def predict(i: PlanInputs) -> Plan:
    """The plan of every contender without offload (``CONTENDERS + COMPRESSED_CONTENDERS``, in that order),
    ``x_zero1`` set on each; ``inputs.offload`` is left to ``planner.predict``."""
    d = _derived(i)
    W = d["dp_world"]
    plan = Plan(inputs=asdict(i), derived=d)
    for name, r in _rows(i, d).items():
        bufs = memory_buffers(name, i, d)
        per_param = memory_model.peak(bufs, cpu=i.accelerator == "cpu")
        mem = per_param * d["params_per_gpu"]
        sps = W * i.micro_batch * r["mbs"] / r["step"] if r["step"] else None
        plan.rows.append(
            Row(
                contender=name,
                step_s=r["step"],
                samples_per_s=sps,
                micro_batches_per_step=r["mbs"],
                memory_bytes=mem,
                memory_bytes_per_param=per_param,
                memory_held_bytes_per_param=memory_model.held(bufs),
                exposed_comm_s=r["exposed"],
                fits=None if i.gpu_memory is None else mem <= i.gpu_memory,
                note=r.get("note", ""),
            )
        )
    if i.accelerator == "gpu":
        for r in plan.rows:
            if r.contender in COMPRESSED_CONTENDERS:
                r.note = "; ".join(x for x in (r.note, GPU_COMPRESSION_NOTE) if x)
    base = plan.row("zero1").samples_per_s
    for r in plan.rows:
        r.x_zero1 = r.samples_per_s / base if r.samples_per_s else None
    return plan
