"""acco-plan's answer for any inputs: the base model's plan and recommendation, with the offload model's rows and
recommendation composed in when ``inputs.offload``, and the verdict in time to ZeRO-1's final loss.

Contract: ``predict(inputs) -> Plan`` is ``model.predict``'s plan, followed with ``inputs.offload`` by the rows of
``offload.CONTENDERS`` (``offload.add_rows``); ``recommend(plan, inputs, factors=None) -> dict`` is
``recommend.recommend``'s answer, given the quality study's regime closest to the inputs (``regime``), passed with
``inputs.offload`` through ``recommend_offload.with_offload`` (``offload`` None without it), with ``time_to_loss``
added (``time_to_loss``). ``factors``: a loaded factors file (``quality.load``; default the package's).
The base modules know nothing of offload; the offload modules build on them; this module alone joins the two and
the quality study's factor.
"""

from __future__ import annotations

from acco_ds.plan import model, offload, quality, recommend_offload
from acco_ds.plan import recommend as base_recommend
from acco_ds.plan.model import Plan, PlanInputs


def predict(i: PlanInputs) -> Plan:
    """The plan of every contender for ``i``: those without offload, then, with ``i.offload``, the offload ones."""
    plan = model.predict(i)
    if i.offload:
        offload.add_rows(plan, i)
    return plan


def regime(i: PlanInputs, factors: dict | None = None) -> dict:
    """The quality study's regime closest to ``i`` (``quality.choose``: by its tokens per step and run length; the
    study's variant with ``i.peek_lr_scale`` where it ran one)."""
    return quality.choose(
        factors or quality.load(), i.tokens_per_step, i.train_steps, peek_lr_scale=i.peek_lr_scale
    )


def time_to_loss(plan: Plan, rec: dict, r: dict) -> dict:
    """ACCO's speed-up in time to ZeRO-1's final loss (``quality.verdict``): the recommended ACCO contender's, or
    fixed ACCO's when DeepSpeed is recommended, over the recommendation's baseline (ZeRO-Offload with offload, else
    the faster of ZeRO-1 with and without overlap_comm); the regime with it, in words too."""
    offloaded = bool(rec.get("offload"))
    if offloaded:
        against = plan.row("zero1-offload")
    else:
        z1, z1o = plan.row("zero1"), plan.row("zero1-overlap")
        against = z1o if z1o.samples_per_s > z1.samples_per_s * (1 + 1e-9) else z1
    name = recommend_offload._row_of(rec) if rec["mode"] == "acco" else "acco"
    if offloaded and rec["mode"] == "acco":
        name = "acco-offload" if rec["accumulation"] == "fixed" else "acco-adaptive-offload"
    row = plan.row(name)
    speedup = row.samples_per_s / against.samples_per_s if row.step_s is not None else None
    return {
        "contender": name,
        "against": against.contender,
        **quality.verdict(speedup, r),
        "regime": r,
        "regime_text": quality.describe(r),
    }


def recommend(plan: Plan, i: PlanInputs, factors: dict | None = None) -> dict:
    """The recommendation for ``predict(i)``'s ``plan``: whether to offload too with ``i.offload``, and the verdict in
    time to the same loss."""
    r = regime(i, factors)
    rec = base_recommend.recommend(plan, i, r)
    rec = recommend_offload.with_offload(plan, i, rec, base_recommend.factor(r)) if i.offload else rec
    return rec | {"time_to_loss": time_to_loss(plan, rec, r)}
