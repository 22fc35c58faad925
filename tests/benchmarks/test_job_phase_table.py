"""The benchmarks' "where acco_ds's rounds spend their time" figures: each phase's ``stats()['job_<phase>_s']``
over the rank's rounds, in ms, mean over the ranks (``analysis.job_phase_ms_per_round``), rendered beside the
round's time (``tables.job_phase_table``); DeepSpeed's contenders and results that predate the figures give
none."""

from __future__ import annotations

import pytest

from benchmarks.harness.analysis import JOB_PHASES, job_phase_ms_per_round
from benchmarks.harness.tables import job_phase_table


def _stats(rounds: int, seconds: dict) -> dict:
    return {"rounds": rounds, **{f"job_{p}_s": seconds[p] for p in JOB_PHASES}}


def test_phases_per_round_are_the_mean_over_the_ranks():
    run = {
        "acco_stats": [
            _stats(10, {"reduce_scatter": 1.0, "norm": 0.2, "step": 0.1, "all_gather": 0.5}),
            _stats(20, {"reduce_scatter": 1.0, "norm": 0.6, "step": 0.2, "all_gather": 1.0}),
        ]
    }
    got = job_phase_ms_per_round(run)
    assert got == pytest.approx({"reduce_scatter": 75.0, "norm": 25.0, "step": 10.0, "all_gather": 50.0})
    assert job_phase_ms_per_round({"acco_stats": [{}, {}]}) is None  # DeepSpeed's contenders
    assert (
        job_phase_ms_per_round({"acco_stats": [{"rounds": 3, "comm_wait_s": 0.1}]}) is None
    )  # older results


def test_the_table_shows_each_phase_and_the_round():
    phases = {"reduce_scatter": 116.0, "norm": 33.0, "step": 15.0, "all_gather": 22.0}
    an = {
        "tables": {
            "50mbit": {
                "zero1": {"job_phase_ms_per_round": None, "t_round_s": 2.0},
                "acco-int4": {"job_phase_ms_per_round": phases, "t_round_s": 0.215},
            }
        }
    }
    lines = job_phase_table(an)
    assert "| 50mbit | acco-int4 | 116.0 | 33.0 | 15.0 | 22.0 | 186.0 | 215.0 |" in lines
    assert not any("zero1" in line for line in lines)
    assert job_phase_table({"tables": {"50mbit": {"zero1": an["tables"]["50mbit"]["zero1"]}}}) == []
