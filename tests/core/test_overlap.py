"""``core.overlap``: the overlap figures and the causes the no-overlap notice names, one case per cause, on the
counters a run would leave (``PipelineStats``); the launched runs of tests/deepspeed/test_engine_boundary.py check
that the optimizer says the notice where a cause holds and not where none does."""

from __future__ import annotations

import pytest

from acco_ds.core.overlap import Setting, inert_causes, notice, overlap_figures
from acco_ds.core.pipeline import PipelineStats


def stats(rounds: int, micro_batches: int, wait_s: float = 0.0, job_s: float = 1.0) -> PipelineStats:
    s = PipelineStats(rounds=rounds, micro_batches_local=micro_batches, comm_wait_s=wait_s)
    s.job_reduce_scatter_s, s.job_step_s, s.job_all_gather_s = job_s / 2, job_s / 4, job_s / 4
    return s


ACCO = Setting(mode="acco", adaptive=False, gas=4, share=2, cap=None, held_micro_batches=0)


def test_figures():
    f = overlap_figures(stats(rounds=8, micro_batches=16, wait_s=0.25, job_s=1.0), 4)
    assert f == {"rounds_per_step": 2.0, "comm_wait_share": 0.25}
    assert overlap_figures(stats(8, 16, wait_s=3.0), 4)["comm_wait_share"] == 1.0
    assert overlap_figures(PipelineStats(), 0) == {"rounds_per_step": None, "comm_wait_share": None}


def test_overlapping_run_says_nothing():
    assert inert_causes(stats(8, 16, wait_s=0.1), 4, ACCO) == []
    dpu = Setting("dpu", False, 4, 4, None, 0)
    assert inert_causes(stats(4, 16, wait_s=0.1), 4, dpu) == []


def test_sync_never_overlaps_by_design():
    assert inert_causes(stats(4, 16, wait_s=1.0), 4, Setting("sync", False, 4, 4, None, 0)) == []


def test_short_steps():
    causes = inert_causes(stats(4, 8), 4, ACCO)
    assert (
        len(causes) == 1
        and "at most 2 micro-batches" in causes[0]
        and "set_gradient_accumulation_boundary" in causes[0]
    )


def test_one_round_per_full_step_names_no_sync():
    held = Setting("acco", False, 4, 2, None, held_micro_batches=12)
    (cause,) = inert_causes(stats(4, 16), 4, held)
    assert "one round per optimizer step" in cause and "12 micro-batches ended inside no_sync()" in cause


def test_gas_one():
    (cause,) = inert_causes(stats(4, 4, wait_s=0.1), 4, Setting("dpu", False, 1, 1, None, 0))
    assert "gradient_accumulation_steps=1" in cause and "adaptive" in cause


def test_slow_link():
    (cause,) = inert_causes(stats(8, 16, wait_s=0.8), 4, ACCO)
    assert "waited 80%" in cause and "int8" in cause


def test_adaptive_with_nothing_to_accumulate():
    capped = Setting("acco", True, 4, 2, cap=2, held_micro_batches=0)
    (cause,) = inert_causes(stats(8, 16, wait_s=0.9), 4, capped)
    assert "max_micro_batches_per_round=2" in cause and "nothing to accumulate" in cause
    uncapped = Setting("acco", True, 4, 2, cap=None, held_micro_batches=0)
    assert inert_causes(stats(8, 16, wait_s=0.1), 4, uncapped) == []


@pytest.mark.parametrize("n", [1, 2])
def test_notice_names_every_cause(n):
    causes = [f"cause {i}" for i in range(n)]
    text = notice(causes)
    assert text.startswith("acco_ds:") and all(c in text for c in causes)
