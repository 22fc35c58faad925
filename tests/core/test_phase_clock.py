"""Where a round's job spends its time (``acco_ds.core.phase_clock``, ``stats()['job_*_s']``): each phase's time
goes to that phase, summed over the marks and the rounds. The engine test slows one collective or the step of
every round by a known sleep (one gloo rank in this process, the job on the worker thread) and finds that time
in its phase's figure, and not in the others'."""

from __future__ import annotations

import time

import deepspeed
import pytest
import torch

import acco_ds  # noqa: F401  (registers "ACCO")
from acco_ds.core import round_job
from acco_ds.core.phase_clock import PHASES, PhaseClock
from tests.ranks.inproc import ensure_single_rank_group

SLEEP = 0.04


def test_time_between_marks_goes_to_the_later_mark_and_adds_up():
    clock = PhaseClock(torch.device("cpu"))
    time.sleep(SLEEP)
    clock.mark("a")
    for _ in range(2):
        time.sleep(SLEEP / 2)
        clock.mark("b")
    got = clock.seconds()
    assert set(got) == {"a", "b"}
    assert SLEEP <= got["a"] < SLEEP + 0.03 and SLEEP <= got["b"] < SLEEP + 0.03


def _slowed(fn):
    def slow(*args, **kwargs):
        time.sleep(SLEEP)
        return fn(*args, **kwargs)

    return slow


@pytest.mark.parametrize(
    ("patched", "phase"),
    [
        ("reduce_scatter_inplace", "reduce_scatter"),
        ("dist.all_reduce", "norm"),  # the norm's all-reduce (the job's only all-reduce at W = 1)
        ("adamw_step", "step"),
        ("all_gather_inplace", "all_gather"),
    ],
)
def test_the_engine_reports_each_phase_where_it_was_spent(monkeypatch, patched, phase):
    ensure_single_rank_group()
    owner, name = (round_job.dist, "all_reduce") if patched == "dist.all_reduce" else (round_job, patched)
    monkeypatch.setattr(owner, name, _slowed(getattr(owner, name)))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "ACCO", "params": {"mode": "acco", "lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    try:
        for _ in range(4 * 2):
            engine.backward(engine(torch.randn(1, 8)).square().sum())
            engine.step()
        engine.optimizer.finish()
        stats = engine.optimizer.stats()
    finally:
        engine.optimizer.pipeline.close()
    rounds = stats["rounds"]
    assert rounds >= 8
    figures = {p: stats[f"job_{p}_s"] for p in PHASES}
    assert figures[phase] >= rounds * SLEEP, figures
    for other in PHASES:
        if other != phase:  # a few ms of real work per round at most
            assert figures[other] < rounds * SLEEP / 2, (other, figures)
