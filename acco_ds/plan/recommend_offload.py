"""``acco-plan --offload``'s recommendation: whether to offload the optimizer to the host, with which mode, and why.

Contract: ``with_offload(plan, inputs, rec) -> dict`` takes ``rec``, ``recommend``'s answer among the contenders
without offload, and returns it with ``offload`` (None: do not offload; else the ``zero_optimization.
offload_optimizer`` section to add) and its reason extended, or a new answer of the same keys. The rules
(docs/PLAN.md, "Optimizer offload"):

1. The recommendation without offload fits in ``--gpu-memory``, or no ``--gpu-memory`` is given: no offload, it
   only costs (the copies and the host passes are added to a step or to a round's job, nothing is taken off); the
   reason gives the best offload contender's samples/s against it. Only where ACCO with offload fits and gains
   at least ``MIN_GAIN`` over it (a DeepSpeed recommendation whose communication is exposed) is ACCO with offload
   recommended instead.
2. It does not fit: among the offload contenders that fit, ZeRO-Offload (``zero1-offload``) is the baseline; ACCO
   with offload is recommended where it fits and gains at least ``MIN_GAIN`` over it (or ZeRO-Offload does not
   fit): fixed accumulation where a round's job (collectives, copies, host pass) fits in half a step's compute,
   else adaptive, whose rounds grow until the job is done (the alternative: the smallest even GAS whose half
   covers the commit's job).
3. Nothing fits, even offloaded: the offload contender that needs least, and that it does not fit.
"""

from __future__ import annotations

import math

from acco_ds.plan.model import Plan, PlanInputs, Row
from acco_ds.plan.offload import OFFLOAD_CONFIG
from acco_ds.plan.primitives import MIN_GAIN


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f} ms"


def _row_of(rec: dict) -> str:
    """The plan row of a recommendation without offload."""
    if rec["mode"] != "acco":
        return rec["mode"]
    name = "acco" if rec["accumulation"] == "fixed" else "acco-adaptive"
    return name + ("-int8" if rec.get("compression") else "")


def _acco(plan: Plan, i: PlanInputs, against, against_name: str, why: str) -> dict:
    """ACCO with offload, fixed or adaptive (rule 2), ``why`` opening the reason."""
    d = plan.derived
    half, job = d["compute_step_s"] / 2, d["offload_job_commit_s"]
    job_text = (
        f"A round's job with offload (the gradient shard to the host {_ms(d['offload_to_host_s'])}, the host AdamW "
        f"commit {_ms(d['offload_host_commit_s'])} / peek {_ms(d['offload_host_peek_s'])}, the parameters back "
        f"{_ms(d['offload_to_device_s'])}, with the collectives: commit {_ms(job)}, peek "
        f"{_ms(d['offload_job_peek_s'])})"
    )
    fixed, adaptive = plan.row("acco-offload"), plan.row("acco-adaptive-offload")
    versus = f"{against_name}'s ({against.samples_per_s:,.1f} samples/s)"
    if job <= half:
        return {
            "mode": "acco",
            "accumulation": "fixed",
            "gas": i.gas,
            "reason": why + f" {job_text} fits in half a step's compute ({_ms(half)}): fixed "
            f"ACCO runs both host passes behind the compute at the same batch, {fixed.samples_per_s:,.1f} samples/s, "
            f"{fixed.samples_per_s / against.samples_per_s:.2f}x {versus}.",
            "alternative": None,
            "compression": None,
            "offload": dict(OFFLOAD_CONFIG),
        }
    gas_fixed = 2 * math.ceil(job / i.t_micro_batch - 1e-9)
    return {
        "mode": "acco",
        "accumulation": "adaptive",
        "gas": i.gas,
        "reason": why + f" {job_text} is longer than half a step's compute ({_ms(half)}): fixed "
        f"ACCO would wait for its two host passes ({fixed.samples_per_s / against.samples_per_s:.2f}x {versus}). "
        f"Adaptive ACCO keeps the GPU computing while the host steps: {adaptive.samples_per_s:,.1f} samples/s, "
        f"{adaptive.samples_per_s / against.samples_per_s:.2f}x, with steps of about "
        f"{adaptive.micro_batches_per_step:g} micro-batches per GPU instead of {i.gas} "
        f"({adaptive.micro_batches_per_step / i.gas:.1f}x the batch: check the learning rate and schedule).",
        "alternative": f"fixed ACCO with offload and --gas {gas_fixed} (deterministic, the same samples/s, "
        f"{gas_fixed / i.gas:.1f}x the batch)",
        "compression": None,
        "offload": dict(OFFLOAD_CONFIG),
    }


def _best_acco(plan: Plan) -> Row | None:
    """The faster of fixed and adaptive ACCO with offload where they run (an even GAS) and fit."""
    rows = [plan.row(n) for n in ("acco-offload", "acco-adaptive-offload")]
    rows = [r for r in rows if r.step_s is not None and r.fits is not False]
    return max(rows, key=lambda r: r.samples_per_s) if rows else None


def with_offload(plan: Plan, i: PlanInputs, rec: dict, factor: float | None = None) -> dict:
    """``rec`` (the recommendation without offload) with offload where it pays; ``factor``: the quality study's
    samples-to-loss factor of ACCO (``recommend.factor``), which divides ACCO's samples/s where it is weighed against a
    DeepSpeed contender, as the recommendation without offload does (None: samples/s alone)."""
    here = plan.row(_row_of(rec))
    zo = plan.row("zero1-offload")
    acco = _best_acco(plan)
    acco_row = plan.row("acco-offload")
    host = (
        f"host memory per GPU {_gib(zo.host_memory_bytes)} for ZeRO-Offload, "
        f"{_gib(acco_row.host_memory_bytes)} for ACCO"
    )
    if here.fits is not False:
        weigh = factor if factor and not here.contender.startswith("acco") else 1.0
        if acco is not None and acco.samples_per_s / weigh >= MIN_GAIN * here.samples_per_s:
            gain = 100 * (acco.samples_per_s / weigh / here.samples_per_s - 1)
            why = (
                f"{here.contender} fits ({_gib(here.memory_bytes)} per GPU) but waits for its communication; "
                f"ACCO with offload gains {gain:.0f}% over it"
                + (
                    f" in time to the same loss (samples/s / {weigh:.2f}x the steps)."
                    if weigh != 1.0
                    else "."
                )
            )
            return _acco(plan, i, here, here.contender, why)
        fitting = [
            r for r in plan.rows if r.contender.endswith("-offload") and r.step_s and r.fits is not False
        ]
        best = max(fitting or [zo], key=lambda r: r.samples_per_s)
        fit = (
            f"the model states fit without offload ({here.contender}: {_gib(here.memory_bytes)} per GPU of "
            f"--gpu-memory {_gib(i.gpu_memory)})"
            if i.gpu_memory is not None
            else f"without --gpu-memory the plan cannot tell whether {here.contender}'s {_gib(here.memory_bytes)} "
            f"per GPU fit (with offload: from {_gib(zo.memory_bytes)}, ZeRO-Offload)"
        )
        ratio = best.samples_per_s / here.samples_per_s
        then = (
            f"offload only adds the copies and the host passes to a step or to a round's job (the best with it, "
            f"{best.contender}, {best.samples_per_s:,.1f} samples/s: {ratio:.2f}x"
            + (
                f", with steps of about {best.micro_batches_per_step:g} micro-batches instead of {i.gas})"
                if best.micro_batches_per_step > i.gas
                else ")"
            )
            if ratio < 1 + 1e-9
            else f"the best with offload, {best.contender}, would gain {100 * (ratio - 1):.1f}% samples/s, below "
            f"the {100 * (MIN_GAIN - 1):.0f}% worth a switch"
        )
        return rec | {"reason": rec["reason"] + f" No optimizer offload: {fit}; {then}.", "offload": None}
    miss = (
        f"Without offload {here.contender} needs {_gib(here.memory_bytes)} per GPU, more than --gpu-memory "
        f"{_gib(i.gpu_memory)}: offload the optimizer (fp32 master and moments to the host; {host})."
    )
    keep = {"mode": "zero1", "accumulation": None, "gas": i.gas, "alternative": None, "compression": None}
    odd = acco_row.step_s is None
    if zo.fits is False and acco is None:
        if odd and acco_row.fits:
            return keep | {
                "mode": "acco",
                "reason": miss
                + f" ZeRO-Offload ({_gib(zo.memory_bytes)} per GPU) does not fit; ACCO with offload "
                f"({_gib(acco_row.memory_bytes)}) would, with an even GAS: run acco-plan again with --gas {i.gas + 1}.",
                "offload": dict(OFFLOAD_CONFIG),
            }
        small = min((r for r in plan.rows if r.contender.endswith("-offload")), key=lambda r: r.memory_bytes)
        return keep | {
            "mode": "acco" if small.contender.startswith("acco") else "zero1",
            "reason": f"Nothing fits in --gpu-memory {_gib(i.gpu_memory)}, even with the optimizer offloaded: the "
            f"least, {small.contender}, needs {_gib(small.memory_bytes)} per GPU (model states; activations on top). "
            "The parameters too would have to leave the GPU (ZeRO-3, which ACCO does not run), or more GPUs or "
            "tensor parallelism shard them.",
            "offload": dict(OFFLOAD_CONFIG),
        }
    if acco is None:
        return keep | {
            "reason": miss
            + (
                f" ACCO needs an even GAS: run acco-plan again with --gas {i.gas + 1}."
                if odd
                else f" ACCO with offload needs {_gib(acco_row.memory_bytes)} per GPU: it does not "
                f"fit; ZeRO-Offload ({_gib(zo.memory_bytes)}) does."
            ),
            "offload": dict(OFFLOAD_CONFIG),
        }
    if zo.fits is False:
        return _acco(
            plan,
            i,
            zo,
            "ZeRO-Offload",
            miss + f" ZeRO-Offload ({_gib(zo.memory_bytes)} per GPU) does not fit either.",
        )
    gain = acco.samples_per_s / zo.samples_per_s
    if gain < MIN_GAIN:
        return keep | {
            "reason": miss
            + f" ZeRO-Offload waits {_ms(zo.exposed_comm_s)} per step for its collectives, copies and host pass; "
            f"ACCO with offload would gain {100 * (gain - 1):.1f}%, below the {100 * (MIN_GAIN - 1):.0f}% worth a "
            "switch. Stay with DeepSpeed.",
            "offload": dict(OFFLOAD_CONFIG),
        }
    return _acco(
        plan,
        i,
        zo,
        "ZeRO-Offload",
        miss
        + f" ZeRO-Offload waits {_ms(zo.exposed_comm_s)} per step for its collectives, copies and host pass.",
    )
