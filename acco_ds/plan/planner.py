"""acco-plan's answer for any inputs: the base model's plan and recommendation, with the offload model's rows and
recommendation composed in when ``inputs.offload``.

Contract: ``predict(inputs) -> Plan`` is ``model.predict``'s plan, followed with ``inputs.offload`` by the rows of
``offload.CONTENDERS`` (``offload.add_rows``); ``recommend(plan, inputs) -> dict`` is ``recommend.recommend``'s
answer, passed with ``inputs.offload`` through ``recommend_offload.with_offload`` (``offload`` None without it).
The base modules know nothing of offload; the offload modules build on them; this module alone joins the two.
"""

from __future__ import annotations

from acco_ds.plan import model, offload, recommend_offload
from acco_ds.plan import recommend as base_recommend
from acco_ds.plan.model import Plan, PlanInputs


def predict(i: PlanInputs) -> Plan:
    """The plan of every contender for ``i``: those without offload, then, with ``i.offload``, the offload ones."""
    plan = model.predict(i)
    if i.offload:
        offload.add_rows(plan, i)
    return plan


def recommend(plan: Plan, i: PlanInputs) -> dict:
    """The recommendation for ``predict(i)``'s ``plan``: whether to offload too with ``i.offload``."""
    rec = base_recommend.recommend(plan, i)
    return recommend_offload.with_offload(plan, i, rec) if i.offload else rec
