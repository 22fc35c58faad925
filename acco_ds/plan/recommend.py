"""``acco-plan``'s recommendation: which mode, accumulation and GAS, and why.

Contract: ``recommend(plan, inputs, quality=None) -> dict`` with ``mode`` (``zero1``, ``zero1-overlap`` or
``acco``), ``accumulation`` (``fixed`` / ``adaptive``, None for DeepSpeed), ``gas``, ``reason`` (one
paragraph with the figures) and ``alternative`` (or None). The rules (docs/PLAN.md, "Recommendation"):

1. The baseline is the faster of ZeRO-1 with and without ``overlap_comm``.
2. ACCO is recommended only where it fits in ``--gpu-memory`` (when given) and gains at least
   ``MIN_GAIN`` over the baseline; otherwise the baseline, with the figure that decided. The gain is in time to
   ZeRO-1's final loss, samples/s / ``f``, where ``quality`` (``acco_ds.plan.quality.choose``'s regime) holds a
   measured samples-to-loss factor ``f``; in samples/s where it does not (no regime, or ACCO never reached ZeRO-1's
   loss there: the reason then says that its time to the loss is not known).
3. When one round's communication fits in half a step's compute, fixed ACCO at the user's GAS hides it
   (same batch, same math as ZeRO-1 at that GAS). When it does not, adaptive ACCO keeps the GPUs busy
   and its steps grow; the fixed alternative is the smallest even GAS whose half covers the round.
4. Compression (``compression``: the ``optimizer.params.compression`` to add, or None): only where the
   uncompressed round does not fit in half a step's compute (the link is the bottleneck). If the int8 round
   fits, fixed ACCO with compression hides it at the user's GAS; otherwise adaptive ACCO with compression,
   whose steps grow less. With ``--accelerator gpu`` the reason gives the figure and says why not
   (``GPU_COMPRESSION_NOTE``: the GPU path has run on one GPU only, never across ranks), and ``compression`` stays None.
DPU is never recommended: it is the stale-gradient baseline ACCO corrects (docs/ALGORITHM.md).

The answer is among the contenders without offload whatever ``inputs.offload`` says, and its ``offload`` is None:
``planner.recommend`` passes it through ``recommend_offload.with_offload`` with ``inputs.offload``.
"""

from __future__ import annotations

import math

from acco_ds.plan import quality as samples_to_loss
from acco_ds.plan.model import COMPRESSION_CONFIG, GPU_COMPRESSION_NOTE, Plan, PlanInputs
from acco_ds.plan.primitives import MIN_GAIN


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def recommend(plan: Plan, i: PlanInputs, quality: dict | None = None) -> dict:
    """The recommendation among ``plan``'s contenders without offload (``offload`` None); ``quality``: the quality
    study's regime (``acco_ds.plan.quality.choose``), or None to decide on samples/s alone."""
    return _without_offload(plan, i, quality) | {"offload": None}


def factor(quality: dict | None) -> float | None:
    """The regime's measured samples-to-loss factor (mean over its seeds); None without a regime or where ACCO
    never reached ZeRO-1's final loss in it (only a lower bound then)."""
    return quality["factor"]["mean"] if quality and quality["reached"] else None


def _to_loss(gain: float, quality: dict | None, adaptive: bool = False) -> str:
    """The sentence on ACCO's speed-up in time to ZeRO-1's final loss, '' without a regime."""
    if not quality:
        return ""
    f = factor(quality)
    if f is None:
        why = samples_to_loss.unknown_why(quality)
        if quality.get("bound") == "upper":
            least = gain / quality["factor"]["mean"]
            return f" (That is samples/s: {why}, so in time to that loss ACCO gains at least {least:.2f}x.)"
        return f" (That is samples/s: {why}, so its time to that loss is not known.)"
    how = " (the study ran fixed accumulation: its factor applied to adaptive's samples)" if adaptive else ""
    return (
        f" In time to ZeRO-1's final loss: {gain / f:.2f}x ({gain:.2f}x over the {f:.2f}x the steps ACCO needs in "
        f"the quality study's setting {quality['setting']}{samples_to_loss.basis_note(quality)}{how})."
    )


def _without_offload(plan: Plan, i: PlanInputs, quality: dict | None = None) -> dict:
    d = plan.derived
    z1, z1o = plan.row("zero1"), plan.row("zero1-overlap")
    base = z1o if z1o.samples_per_s > z1.samples_per_s * (1 + 1e-9) else z1
    base_name = "ZeRO-1 with overlap_comm" if base is z1o else "ZeRO-1"
    keep = {
        "mode": base.contender,
        "accumulation": None,
        "gas": i.gas,
        "alternative": None,
        "compression": None,
    }
    acco, adaptive = plan.row("acco"), plan.row("acco-adaptive")
    ratio = d["comm_compute_ratio"]
    share = 1 - (d["compute_step_s"] / base.step_s)
    if acco.step_s is None:
        k = i.gas + 1
        return keep | {
            "reason": f"ACCO needs an even GAS (two rounds of GAS/2 per step); with --gas {k} it could be "
            f"compared: run acco-plan again with --gas {k}.",
        }
    if acco.fits is False:
        return keep | {
            "reason": f"ACCO's model states need {_gib(acco.memory_bytes)} per GPU, more than --gpu-memory "
            f"{_gib(i.gpu_memory)} ({base_name}: {_gib(base.memory_bytes)}); activations come on top.",
        }
    best_gain = max(acco.samples_per_s, adaptive.samples_per_s) / base.samples_per_s
    f = factor(quality)
    if f is not None and best_gain >= MIN_GAIN > best_gain / f:
        return keep | {
            "reason": f"communication is {100 * share:.1f}% of a {base_name} step (comm/compute {ratio:.3f}): ACCO "
            f"would gain {100 * (best_gain - 1):.1f}% samples/s, but it needs {f:.2f}x the steps of ZeRO-1 to reach "
            f"its final validation loss (the quality study's setting {quality['setting']}"
            f"{samples_to_loss.basis_note(quality)}): "
            f"{100 * (best_gain / f - 1):+.1f}% in time to the same loss, below the {100 * (MIN_GAIN - 1):.0f}% "
            "worth a switch. Stay with DeepSpeed.",
        }
    if best_gain < MIN_GAIN:
        diff = acco.memory_bytes - base.memory_bytes
        mem = (
            f"it would need {_gib(diff)} more memory per GPU"
            if diff > 0
            else f"its memory per GPU would be {_gib(-diff)} lower"
        )
        return keep | {
            "reason": f"communication is {100 * share:.1f}% of a {base_name} step (comm/compute "
            f"{ratio:.3f}): ACCO would gain {100 * (best_gain - 1):.1f}% samples/s, below the "
            f"{100 * (MIN_GAIN - 1):.0f}% worth a switch ({mem}). Stay with DeepSpeed.",
        }
    gain_fixed = acco.samples_per_s / base.samples_per_s
    half = d["compute_step_s"] / 2
    if d["comm_round_s"] <= half:
        return {
            "mode": "acco",
            "accumulation": "fixed",
            "gas": i.gas,
            "reason": f"one round's communication ({1e3 * d['comm_round_s']:.1f} ms) fits in half a step's "
            f"compute ({1e3 * half:.1f} ms): fixed ACCO hides it at the same batch, "
            f"{gain_fixed:.2f}x the samples/s of {base_name}." + _to_loss(gain_fixed, quality),
            "alternative": None,
            "compression": None,
        }
    slow = (
        f"one round's communication ({1e3 * d['comm_round_s']:.1f} ms) is longer than half a step's compute "
        f"({1e3 * half:.1f} ms), so fixed ACCO at GAS {i.gas} waits ({gain_fixed:.2f}x {base_name})."
    )
    c8 = d["comm_round_int8_s"]
    on_cpu = i.accelerator == "cpu"
    if c8 <= half:
        fixed8 = plan.row("acco-int8")
        packed = (
            f" With int8 compression (commit, peek and all-gather) a round takes {1e3 * c8:.1f} ms and fits: "
            f"fixed ACCO would hide it at the same batch, {fixed8.samples_per_s / base.samples_per_s:.2f}x "
            f"{base_name}."
        )
        if on_cpu:
            return {
                "mode": "acco",
                "accumulation": "fixed",
                "gas": i.gas,
                "reason": slow + packed + _to_loss(fixed8.samples_per_s / base.samples_per_s, quality),
                "alternative": "adaptive ACCO without compression (exact communication, larger steps)",
                "compression": dict(COMPRESSION_CONFIG),
            }
        packed += f" Not recommended on GPUs: {GPU_COMPRESSION_NOTE}."
    else:
        ad8 = plan.row("acco-adaptive-int8")
        c8 = d["comm_round_int8_unfused_s"]  # adaptive rounds quantize in their job
        packed = (
            f" int8 compression would shorten a round to {1e3 * c8:.1f} ms: adaptive steps of about "
            f"{ad8.micro_batches_per_step:g} micro-batches instead of {adaptive.micro_batches_per_step:g}."
        )
        if not on_cpu:
            packed += f" Not recommended on GPUs: {GPU_COMPRESSION_NOTE}."
    steps, round_s = adaptive, d["comm_round_s"]
    c8_adaptive = d["comm_round_int8_unfused_s"]
    if on_cpu and c8_adaptive < d["comm_round_s"]:
        steps, round_s = plan.row("acco-adaptive-int8"), c8_adaptive
    gas_fixed = 2 * math.ceil(round_s / i.t_micro_batch - 1e-9)
    grow = steps.micro_batches_per_step / i.gas
    return {
        "mode": "acco",
        "accumulation": "adaptive",
        "gas": i.gas,
        "reason": slow + f" Adaptive ACCO keeps computing while it communicates: "
        f"{steps.samples_per_s / base.samples_per_s:.2f}x the samples/s of {base_name}, "
        f"with steps of about {steps.micro_batches_per_step:g} micro-batches per GPU instead of "
        f"{i.gas} ({grow:.1f}x the batch: check the learning rate and schedule, which follow steps)."
        + packed
        + _to_loss(steps.samples_per_s / base.samples_per_s, quality, adaptive=True),
        "alternative": f"fixed ACCO with --gas {gas_fixed}"
        + (" and the same compression" if steps is not adaptive else "")
        + " (deterministic, the same samples/s, "
        f"{gas_fixed / i.gas:.1f}x the batch)",
        "compression": dict(COMPRESSION_CONFIG) if steps is not adaptive else None,
    }
