"""The benchmarks' "time to ZeRO-1's final val loss" column (benchmarks.harness.analysis.x_time_to_val, from
acco_ds.cli.time_to_loss): in the e2e / topology loss table and in the fidelity report, only for runs that recorded
validation curves, on hand-made runs."""

from __future__ import annotations

import math

import pytest

from benchmarks.fidelity import cli as fidelity
from benchmarks.harness import seeds as sd
from benchmarks.harness.analysis import x_time_to_val
from benchmarks.harness.tables import steps_table


def _run(losses, times, steps=(0, 10, 20)):
    return {"val_curve": {"step": list(steps), "time_s": list(times), "val_loss": list(losses)}}


ZERO1 = _run([5.0, 3.0, 2.0], [0.0, 10.0, 20.0])


def test_x_time_to_val_reached_never_and_not_recorded():
    assert x_time_to_val(_run([5.0, 2.5, 1.5], [0.0, 5.0, 10.0]), ZERO1) == pytest.approx(7.5 / 20.0)
    assert x_time_to_val(_run([5.0, 3.0, 2.1], [0.0, 5.0, 10.0]), ZERO1) == math.inf
    assert x_time_to_val({"val_curve": None}, ZERO1) is None
    assert x_time_to_val(_run([2.0], [9.0], steps=[20]), _run([2.0], [10.0], steps=[20])) is None  # end only


def _row(x_curve):
    one = sd.spread([0.01])
    paired = {
        "val_gap": one,
        "loss_at_base_samples": sd.spread([2.5]),
        "x_time_to_base_loss": sd.spread([0.8]),
        "x_time_to_base_val": sd.spread([math.inf]),
        "x_time_to_val_curve": sd.spread(x_curve),
    }
    return {"seeds": [0, 1], "samples": 100, "val": sd.spread([2.0, 2.1]), "paired": paired}


def test_steps_table_has_the_column_only_with_curves():
    # the mean of seeds one of which never got there is "not reached" (benchmarks.harness.seeds.spread)
    with_curve = steps_table({"tables": {"200mbit": {"acco": _row([0.5, math.inf])}}})
    assert with_curve[4].endswith("| time to ZeRO-1's final val loss (x ZeRO-1) |")
    assert with_curve[6].endswith("| not reached [0.50x, not reached] (2 seeds) |")
    without = steps_table({"tables": {"200mbit": {"acco": _row([])}}})
    assert "final val loss (x ZeRO-1)" not in "\n".join(without)


def _fidelity_results(curves: bool) -> dict:
    def run(val, losses, times):
        r = dict.fromkeys(fidelity.RUN_FIGURES)
        r.update(
            val_loss=val, final_train_loss=val, samples_per_s=100.0, train_s=times[-1], steps=20, samples=640
        )
        r["val_curve"] = _run(losses, times)["val_curve"] if curves else None
        return r

    seeds = {
        "0": {
            "runs": {
                "acco": run(2.0, [5.0, 2.5, 1.9], [0, 5, 10]),
                "zero1": run(2.0, [5.0, 3.0, 2.0], [0, 10, 20]),
            }
        },
        "1": {
            "runs": {
                "acco": run(2.1, [5.0, 3.0, 2.1], [0, 5, 10]),
                "zero1": run(2.0, [5.0, 3.0, 2.0], [0, 10, 20]),
            }
        },
    }
    setup = {"dtype": "fp32", "modes": ["acco", "zero1"], "seeds": [0, 1], **fidelity.SHARED}
    return {
        "machine": {},
        "date": "today",
        "command": "python -m benchmarks.fidelity",
        "setup": setup,
        "seed_commands": ["python -m acco_ds.train ..."],
        "model_params": 1e5,
        "seeds": seeds,
    }


def test_fidelity_report_gives_each_seeds_time_to_zero1s_final_val_loss():
    md = fidelity.render(_fidelity_results(curves=True))
    assert "time to zero1's final val loss (x zero1) |" in md
    # seed 0: acco reaches 2.0 five sixths of the way from step 10 (2.5, 5 s) to 20 (1.9, 10 s): 5 + 25/6 s against
    # zero1's 20 s
    assert f"| 0 | acco | 2.0000 | 2.0000 | 100.0 | 10.0 | {(5 + 25 / 6) / 20:.2f}x |" in md
    assert "| 1 | acco | 2.1000 | 2.1000 | 100.0 | 10.0 | not reached |" in md
    assert "| 0 | zero1 | 2.0000 | 2.0000 | 100.0 | 20.0 | (reference) |" in md
    assert "| not reached [0.46x, not reached] (2 seeds) |" in md
    assert "final val loss (x zero1)" not in fidelity.render(_fidelity_results(curves=False))
