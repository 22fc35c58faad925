"""benchmarks.e2e.goals.compression_goals and quality_goals: each goal of the compressed rounds from the analysed
rows (and, for the loss, the seeds' runs), met or MISSED by its own bound, left out where its contenders did not
run."""

from __future__ import annotations

from benchmarks.e2e.goals import compression_goals, quality_goals
from benchmarks.harness import seeds as sd


def _row(step_s: float, samples_s: float, wire: float | None, x_loss: float | None = None) -> dict:
    spread = (
        None
        if x_loss is None
        else {"mean": x_loss, "min": x_loss, "max": x_loss, "n": 3, "values": [x_loss] * 3}
    )
    return {
        "step_time_s": step_s,
        "samples_per_s": samples_s,
        "wire_bytes_per_step": wire,
        "paired": {"x_time_to_base_loss": spread, "x_time_to_base_val": spread},
    }


def _verdicts(goals: list) -> dict:
    return {g["goal"]: g for g in goals}


def test_goals_met_and_missed():
    an = {
        "slowest_rate": "50mbit",
        "tables": {
            "50mbit": {
                "zero1": _row(2.0, 100.0, 12e6),
                "sync-int8": _row(1.4, 150.0, 2.1e6),
                "acco-int8": _row(1.0, 200.0, 4.2e6, x_loss=0.45),
            },
            "none": {
                "zero1": _row(0.5, 400.0, 12e6),
                "acco": _row(0.4, 500.0, 16e6),
                "acco-int8": _row(0.45, 440.0, 4.2e6),
            },
        },
    }
    g = _verdicts(compression_goals(an))
    bytes50 = g["acco-int8 bytes on the wire per step <= 1/3 of ZeRO-1 fp32's (50mbit)"]
    assert "0.350x" in str(bytes50) and "MISSED" in str(bytes50)
    ttl = g["acco-int8 time to ZeRO-1's final loss <= 0.5x ZeRO-1's (50mbit)"]
    assert "MISSED" not in str(ttl)
    overlap = g["compressed ACCO >= 1.3x the steps/s of acco_ds sync with the same compression (50mbit)"]
    assert "1.40x" in str(overlap) and "MISSED" not in str(overlap)
    hidden = g["acco-int8 no more than 5% slower than acco (none)"]
    assert "0.880x" in str(hidden) and "MISSED" in str(hidden)
    # nothing compressed ran: no goal
    plain = {"slowest_rate": "50mbit", "tables": {"50mbit": {"zero1": _row(2.0, 100.0, 12e6)}}}
    assert compression_goals(plain) == []


def test_each_compressed_acco_is_judged_against_the_sync_compressed_as_its_commit():
    rows = {
        "zero1": _row(2.0, 100.0, 12e6),
        "sync-int8": _row(1.4, 150.0, 2.1e6),
        "sync-int4": _row(1.2, 170.0, 1.6e6),
        "acco-int4": _row(0.8, 250.0, 2.6e6),
    }
    g = _verdicts(compression_goals({"slowest_rate": "50mbit", "tables": {"50mbit": rows}}))
    title = (
        "compressed ACCO >= 1.3x the steps/s of acco_ds sync with the same compression (50mbit), acco-int4"
    )
    assert "1.50x the optimizer steps/s of sync-int4" in str(g[title]) and "MISSED" not in str(g[title])
    # no sync-int4 run: no verdict for acco-int4 (sync-int8 compresses the parameters differently)
    del rows["sync-int4"]
    assert title not in _verdicts(compression_goals({"slowest_rate": "50mbit", "tables": {"50mbit": rows}}))


def _quality(vals: dict, steps: int = 400):
    """quality_goals over unthrottled runs with these final val losses per contender (one per seed)."""
    block = {"seeds": {c: [{"seed": i, "val_loss": v} for i, v in enumerate(vs)] for c, vs in vals.items()}}
    tables = {"none": {c: {"val": sd.spread(vs)} for c, vs in vals.items()}}
    an = {"slowest_rate": "none", "tables": tables}
    return _verdicts(quality_goals(an, {"rates": {"none": block}, "setup": {"steps": steps}}))


def test_quality_goal_paired_against_acco_inside_zero1_spread():
    name = "acco-int8 val loss within 1% of acco's and inside ZeRO-1's seed spread (unthrottled)"
    base = {"zero1": [3.00, 3.10, 3.20], "acco": [3.00, 3.10, 3.20]}
    met = _quality({**base, "acco-int8": [3.01, 3.11, 3.19], "acco-int8-noef": [3.1, 3.2, 3.3]})[name]
    assert met["a"][1] == "met", met
    assert "acco-int8-noef +3." in met["a"][0]  # the ablation's gap stated beside
    # one seed 1.5% above its pair: outside the 1% bound, the mean inside: not shown; all seeds above: MISSED
    assert "not shown" in _quality({**base, "acco-int8": [3.045, 3.10, 3.20]})[name]["a"][1]
    assert "MISSED" in _quality({**base, "acco-int8": [3.05, 3.15, 3.25]})[name]["a"][1]
    # within 1% of acco but outside ZeRO-1's spread (its seeds nearly equal): MISSED
    tight = {"zero1": [3.0, 3.001, 3.002], "acco": [3.0, 3.0, 3.0], "acco-int8": [3.02, 3.02, 3.02]}
    assert "MISSED" in _quality(tight)[name]["a"][1]
    # shorter runs: indicative only; no acco run: no goal; the slow-link goals are not judged at rate none
    assert _quality({**base, "acco-int8": [3.0, 3.1, 3.2]}, steps=100)[name]["a"][1].startswith("indicative")
    assert _quality({"zero1": [3.0] * 3, "acco-int8": [3.0] * 3}) == {}
    an = {
        "slowest_rate": "none",
        "tables": {"none": {"zero1": _row(0.5, 400.0, 12e6), "acco-int8": _row(0.4, 500.0, 4e6, 0.3)}},
    }
    assert not [g for g in compression_goals(an) if "time to ZeRO-1" in g["goal"]]
