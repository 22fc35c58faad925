"""The goals' building blocks shared by the e2e and topology benchmarks: a goal is
``{"goal": name, "a": [measured, verdict], "b": [measured, verdict]}``, its figure and verdict
under framing (a) (same optimizer steps) and framing (b) (same token budget; ``SAME`` when the
runs are the same in both). Verdicts of figures over seeds come from ``seeds`` (against the spread);
``verdict`` judges a single yes-no figure."""

from __future__ import annotations

from benchmarks.harness import seeds as sd


def verdict(ok) -> str:
    """met / MISSED of a yes-no figure; n/a without one."""
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def pct(s: dict | None) -> str:
    """A spread of fractions as signed percentages, 'mean [min, max] (n seeds)'."""
    return sd.fmt(s, ".2f", 100, "%", sign=True)


SAME = "the same runs: fixed accumulation makes the budget's samples in the run's steps"


def goal(name: str, a: tuple, b: tuple | None = None) -> dict:
    """A goal with its measured figure and verdict under framing (a) and (b)."""
    return {"goal": name, "a": list(a), "b": list(b) if b else [SAME, a[1]]}


def fmt_x(s: dict | None) -> str:
    """A spread of ratios, 'mean [min, max] (n seeds)' with an x."""
    return sd.fmt(s, ".2f", suffix="x")


def val_goal(tables: dict, label: str, name: str) -> list:
    """Val loss within 2% of ZeRO-1's at every rate, seed by seed; the worst rate is quoted."""
    per_rate = {
        r: t[label]["paired"].get("val_gap") for r, t in tables.items() if label in t and "zero1" in t
    }
    per_rate = {r: s for r, s in per_rate.items() if s}
    if not per_rate:
        return []
    verdicts = {r: sd.verdict_within(s, -0.02, 0.02) for r, s in per_rate.items()}
    worst = max(per_rate, key=lambda r: max(abs(per_rate[r]["min"]), abs(per_rate[r]["max"])))
    z1 = [tables[r]["zero1"]["val"] for r in per_rate if tables[r]["zero1"].get("val")]
    noise = f"; ZeRO-1's own val loss over seeds: {sd.fmt_sd(z1[0])}" if z1 else ""
    dpu = ""
    dg = [t["dpu"]["paired"].get("val_gap") for t in tables.values() if "dpu" in t and "zero1" in t]
    if dg and dg[0]:
        dpu = f"; dpu: {pct(max(dg, key=lambda s: abs(s['mean'])))}"
    measured = f"paired gap, worst rate ({worst}): {pct(per_rate[worst])}{dpu}{noise}"
    return [goal(name, (measured, sd.combine(*verdicts.values())))]


def adaptive_rate_goal(tables: dict, budget: dict) -> list:
    adapt = [(r, t["acco-adaptive"]["vs_compute_only"]) for r, t in tables.items() if "acco-adaptive" in t]
    if not adapt:
        return []
    worst_rate, worst = min(adapt, key=lambda x: x[1])
    b = [
        (r, bb["rows"]["acco-adaptive"]["samples_per_s"]["max"])
        for r, bb in budget.items()
        if "acco-adaptive" in bb["rows"] and bb["rows"]["acco-adaptive"]["samples_per_s"]
    ]
    return [
        goal(
            "acco adaptive samples/s >= 90% of compute-only at every rate",
            (f"min {100 * worst:.0f}% (at {worst_rate}), best-of seeds", verdict(worst >= 0.9)),
            _budget_rate(b, tables),
        )
    ]


def _budget_rate(b: list, tables: dict) -> tuple:
    if not b:
        return ("no budget run", "n/a")
    comp = {
        r: t["acco-adaptive"]["samples_per_s"] / t["acco-adaptive"]["vs_compute_only"]
        for r, t in tables.items()
        if "acco-adaptive" in t
    }
    fr = [(r, v / comp[r]) for r, v in b if r in comp]
    r, v = min(fr, key=lambda x: x[1])
    return (f"budget runs (shorter): min {100 * v:.0f}% (at {r}), best-of seeds", verdict(v >= 0.9))


def ahead_goal(
    name: str, rate: str, row: dict, other: dict, wall: dict | None, other_wall: dict | None
) -> dict:
    """acco fixed ahead of another contender (``name``) at ``rate``: its steps/s ratio to ZeRO-1's
    against the other's (best-of and median seeds), and under framing (b) its paired wall-clock
    ratio to ZeRO-1's at the budget (``wall``) against the other's (``other_wall``)."""
    return goal(
        f"acco fixed ahead of {name} ({rate})",
        (
            f"{row['x_steps']:.2f}x vs {other['x_steps']:.2f}x ZeRO-1's steps/s (median {row['x_steps_median']:.2f}x "
            f"vs {other['x_steps_median']:.2f}x)",
            verdict(row["x_steps"] > other["x_steps"]),
        ),
        (
            f"x ZeRO-1 wall-clock to the budget: {fmt_x(wall)} vs {fmt_x(other_wall)}",
            verdict(wall["mean"] > other_wall["mean"]) if wall and other_wall else "n/a",
        ),
    )


def ran_goal(results: dict) -> list:
    """The goal "every contender and reference run ran", MISSED naming the labels of the runs that
    could not run; none when every run ran."""
    failed = results.get("failed") or []
    if not failed:
        return []
    what = f"{len(failed)} could not: {', '.join(sorted({f['label'] for f in failed}))}"
    return [goal("every contender and reference run ran", (what, "MISSED"), (what, "MISSED"))]
