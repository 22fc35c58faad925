"""benchmarks.e2e.goals.compression_goals: each goal of the compressed rounds from the analysed rows, met or
MISSED by its own bound, left out where its contenders did not run."""

from __future__ import annotations

from benchmarks.e2e.goals import compression_goals


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
