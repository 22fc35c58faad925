"""The optimizer-offload model of ``acco-plan --offload``: the host passes, the PCIe copies and the rows of the
contenders that keep the fp32 master and Adam's moments in host memory (``zero_optimization.offload_optimizer``
device cpu). Equations and assumptions: docs/PLAN.md, "Optimizer offload".

Contract: ``add_rows(plan, inputs)`` appends the rows of ``CONTENDERS`` to ``model.predict``'s plan (their
``host_memory_bytes`` and ``x_zero1`` set) and merges ``derived`` into its derived dict; it is ``planner.predict``'s
with ``inputs.offload``. Its parts: ``derived(inputs, d) -> dict`` (the offload figures) and
``rows(inputs, d) -> {contender: {"step", "mbs", "exposed", "note"}}`` for ``CONTENDERS``, both pure arithmetic on
the inputs; ``memory(contender, inputs, d) -> (gpu, host)`` the buffers of ``memory_model.offloaded``. Per GPU,
with ``s = N/W`` the parameters of its shard (``N`` per GPU, ``W`` data-parallel ranks):

- ``zero1-offload``: DeepSpeed ZeRO-1 with offload (ZeRO-Offload): after the step's compute the GPU waits while
  the gradients are all-reduced, this rank's partition goes to the host in fp32 (DeepSpeed casts it on the GPU
  first), DeepSpeedCPUAdam steps it, the new parameters come back and are all-gathered, one after another:
  ``T = t_c + T_ar + 4 s/pcie + H_ds + D s/pcie + T_ag`` with ``H_ds = (32 + D) s / host_ds``.
- ``sync-offload``: acco_ds sync with offload, the round's job waited for at once: ``T = t_c + J_commit``.
- ``acco-offload``: fixed ACCO, two rounds per step, each job overlapped with the next round's GAS/2 micro-batches:
  ``T = max(t_c/2, J_peek) + max(t_c/2, J_commit)`` (GAS even).
- ``acco-adaptive-offload``: rounds of ``k = max(GAS/2, ceil(J / t_mb))`` micro-batches; the GPU never waits.

with a round's job (``acco_ds/core/host_step.py``) ``J = T_rs + C s/pcie + H + D s/pcie + T_ag``: the reduced
gradient shard down (comm dtype), the host AdamW pass ``H`` (commit ``(24 + C + D) s / host``, peek
``(12 + C + D) s / host``: ``primitives.opt_bytes_per_param``), the new parameter shard up (parameter dtype).
"""

from __future__ import annotations

from acco_ds.plan import memory_model
from acco_ds.plan.model import Plan, PlanInputs, Row
from acco_ds.plan.primitives import DTYPE_SIZE, FP32_ADAM, adaptive_round_micro_batches, opt_bytes_per_param

CONTENDERS = ("zero1-offload", "sync-offload", "acco-offload", "acco-adaptive-offload")
PCIE_BW = 25e9
"""Default bytes/s of one GPU's host copies, each direction: a PCIe 4.0 x16 link (32 GB/s raw) moves about
25 GB/s between pinned host memory and the GPU; PCIe 5.0 x16 about twice that. An assumption: measure yours
(``nvbandwidth``, or a timed ``tensor.to("cuda", non_blocking=True)`` from pinned memory) and pass ``--pcie-bw``."""
HOST_ADAM_BW = 49e9
"""Default bytes/s of acco_ds's C++ AdamW on the host: its commit at 100M parameters, 28 B each in 57.006 ms
(49.1 GB/s, rounded to 49), on the 2 cores of this project's machine (``python -m benchmarks.kernels --threads 2
--sizes 1e7,1e8``, benchmarks/results/kernels/host_2threads, the host rows' medians over 61 interleaved rounds). The
peek measured 45.157 ms there where 16 B at this rate is 32.7 ms: the model's peek is about 28% too short."""
HOST_ADAM_BW_DEEPSPEED = 47e9
"""Default bytes/s of DeepSpeedCPUAdam: 28 B per parameter in 59.511 ms at 100M parameters in the same run
(47.0 GB/s, rounded to 47)."""
DEEPSPEED_D2H_BYTES = 4
"""DeepSpeed 0.19.8 casts the gradient partition to fp32 on the GPU before copying it to the host
(``async_inplace_copy_grad_to_fp32_buffer_from_gpu``)."""
OFFLOAD_CONFIG = {"device": "cpu", "pin_memory": True}
"""``zero_optimization.offload_optimizer`` as the plan assumes it (pinned: the copies run at ``--pcie-bw``)."""


def host_bytes_per_param(kind: str, D: int, C: int) -> int:
    """Bytes one host optimizer pass streams per parameter of the shard: acco_ds's ``commit`` and ``peek``
    (``opt_bytes_per_param``: the reduced gradient in, the parameter out, the state read, and written by a commit);
    ``deepspeed``: DeepSpeedCPUAdam on fp32 (the fp32 gradient read, master, exp_avg, exp_avg_sq read and written:
    ``4 + 24``) then the master copied into the parameter-dtype buffer the GPU copies from (``4 + D``)."""
    if kind in ("commit", "peek"):
        return opt_bytes_per_param(kind, D, C)
    if kind == "deepspeed":
        return 4 + 2 * FP32_ADAM + 4 + D
    raise ValueError(f"unknown host pass {kind!r}; choose from commit, peek, deepspeed")


def derived(i, d: dict) -> dict:
    """The offload figures for inputs ``i`` and the plan's derived dict ``d`` (seconds, per GPU)."""
    D, C = DTYPE_SIZE[i.param_dtype], DTYPE_SIZE[i.comm_dtype]
    s = d["params_per_gpu"] / d["dp_world"]
    rs, ag = d["reduce_scatter_s"], d["all_gather_s"]
    to_host, to_device = C * s / i.pcie_bw, D * s / i.pcie_bw
    peek = host_bytes_per_param("peek", D, C) * s / i.host_adam_bw
    commit = host_bytes_per_param("commit", D, C) * s / i.host_adam_bw
    ds_to_host = DEEPSPEED_D2H_BYTES * s / i.pcie_bw
    ds_host = host_bytes_per_param("deepspeed", D, C) * s / i.host_adam_bw_deepspeed
    job_commit = rs + to_host + commit + to_device + ag
    return {
        "offload_to_host_s": to_host,
        "offload_to_device_s": to_device,
        "offload_host_peek_s": peek,
        "offload_host_commit_s": commit,
        "offload_job_peek_s": rs + to_host + peek + to_device + ag,
        "offload_job_commit_s": job_commit,
        "offload_job_compute_ratio": job_commit / d["compute_step_s"],
        "offload_deepspeed_to_host_s": ds_to_host,
        "offload_deepspeed_host_s": ds_host,
        "offload_deepspeed_serial_s": d["all_reduce_s"] + ds_to_host + ds_host + to_device + ag,
    }


def rows(i, d: dict) -> dict:
    """Step time, micro-batches per step and exposed time of each of ``CONTENDERS`` (``d`` holds ``derived``'s)."""
    t_mb, t_c, G = i.t_micro_batch, d["compute_step_s"], i.gas
    serial, j_peek, j_commit = (
        d["offload_deepspeed_serial_s"],
        d["offload_job_peek_s"],
        d["offload_job_commit_s"],
    )
    out = {
        "zero1-offload": {
            "step": t_c + serial,
            "mbs": G,
            "exposed": serial,
            "note": "after the compute, one after another: all-reduce, fp32 gradients to the host, "
            "DeepSpeedCPUAdam, parameters back, all-gather",
        },
        "sync-offload": {
            "step": t_c + j_commit,
            "mbs": G,
            "exposed": j_commit,
            "note": "one host pass, waited for",
        },
    }
    if G % 2:
        na = {"step": None, "mbs": None, "exposed": None, "note": f"needs an even GAS (got {G})"}
        return out | {"acco-offload": dict(na), "acco-adaptive-offload": dict(na)}
    step = max(t_c / 2, j_peek) + max(t_c / 2, j_commit)
    out["acco-offload"] = {
        "step": step,
        "mbs": G,
        "exposed": step - t_c,
        "note": "two host passes (peek, commit) per step, each behind GAS/2 micro-batches",
    }
    k = G // 2
    k1, k2 = adaptive_round_micro_batches(k, j_peek, t_mb), adaptive_round_micro_batches(k, j_commit, t_mb)
    out["acco-adaptive-offload"] = {
        "step": (k1 + k2) * t_mb,
        "mbs": k1 + k2,
        "exposed": 0.0,
        "note": f"rounds of {k1} + {k2} micro-batches (at least {k} each)",
    }
    return out


def memory(contender: str, i, d: dict) -> tuple:
    """``(gpu, host)`` buffers of an offload contender (``memory_model.offloaded``), per parameter of the GPU."""
    D, C = DTYPE_SIZE[i.param_dtype], DTYPE_SIZE[i.comm_dtype]
    name = contender.removesuffix("-offload").replace("acco-adaptive", "acco")
    bucket = d["bucket_frac"] if name == "zero1" else None
    return memory_model.offloaded(name, D, d["dp_world"], i.largest_frac, C, bucket_frac=bucket)


def add_rows(plan: Plan, i: PlanInputs) -> None:
    """Append the rows of ``CONTENDERS`` to ``plan`` (``model.predict(i)``'s, its ``zero1`` row included), each
    with its GPU and host memory and ``x_zero1`` over that row, and merge ``derived`` into ``plan.derived``."""
    d = plan.derived
    d.update(derived(i, d))
    base = plan.row("zero1").samples_per_s
    for name, r in rows(i, d).items():
        gpu, host = memory(name, i, d)
        per_param = memory_model.peak(gpu, cpu=False)
        mem = per_param * d["params_per_gpu"]
        sps = d["dp_world"] * i.micro_batch * r["mbs"] / r["step"] if r["step"] else None
        plan.rows.append(
            Row(
                contender=name,
                step_s=r["step"],
                samples_per_s=sps,
                micro_batches_per_step=r["mbs"],
                memory_bytes=mem,
                memory_bytes_per_param=per_param,
                memory_held_bytes_per_param=memory_model.held(gpu),
                x_zero1=sps / base if sps else None,
                exposed_comm_s=r["exposed"],
                fits=None if i.gpu_memory is None else mem <= i.gpu_memory,
                note=r["note"],
                host_memory_bytes=memory_model.held(host) * d["params_per_gpu"],
            )
        )
